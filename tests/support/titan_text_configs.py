"""Test configs for TorchTitan's own Trainer on TorchTitan's own dataloaders (``--module titan_text_configs``,
run by ``collective_loader.integrations.titan_cpu``), each unwrapped (``text``, ...) and wrapped by
``load_once_per_replica`` (``text_wrapped``, ...); and ``mds``: ``TitanStreamingDataLoader`` on an
MDS dataset (``--dataloader.*``), tokenizing with the Trainer's tokenizer, without validation.

All are TorchTitan's stock ``llama3_debugmodel`` (the launcher makes its CPU changes),
the tokenizer in ``--hf_assets_path`` (``titan_text.CountingTokenizer``, a BPE trained by the test)
and validation every ``VALIDATION_FREQ`` steps on ``cl_val``. The data come from ``$CL_DATA``
(written by the test: ``text/``, ``text_b/``, ``val/``, ``chat.jsonl``, ``numbered.jsonl``). The
trainer records what every rank's training loop receives in ``$CL_BATCHES.rank<r>.jsonl``; who
opened the data and tokenized goes to ``$CL_TOUCH_LOG`` (see ``titan_text``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import titan_text
import torch
from torchtitan.components.validate import Validator
from torchtitan.hf_datasets.text_datasets import (
    ChatDataLoader,
    HFDataSource,
    HuggingFaceTextDataLoader,
    InterleavedHuggingFaceTextDataLoader,
)
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from collective_loader.integrations.titan_streaming import TitanStreamingDataLoader
from collective_loader.integrations.titan_trainer import load_once_per_replica

VALIDATION_FREQ, VALIDATION_STEPS = 4, 2

titan_text.register_datasets()
titan_text.watch_opens()


class Recording(Trainer):
    """TorchTitan's Trainer, recording each ``(input_dict, labels)`` its training loop takes."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def batch_generator(
        self, data_iterable: Iterable[tuple[dict[str, torch.Tensor], torch.Tensor]]
    ) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        path = f"{os.environ['CL_BATCHES']}.rank{os.environ['RANK']}.jsonl"
        for input_dict, labels in super().batch_generator(data_iterable):
            with open(path, "a") as f:
                record = {k: v.tolist() for k, v in input_dict.items()}
                f.write(json.dumps({**record, "labels": labels.tolist()}) + "\n")
            yield input_dict, labels


def _recording(config: Trainer.Config) -> Recording.Config:
    config.tokenizer = titan_text.CountingTokenizer.Config()
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return Recording.Config(**fields)


def _config(dataloader: Any) -> Recording.Config:
    data = os.environ["CL_DATA"]
    config = _recording(llama3_debugmodel())
    config.dataloader = dataloader
    config.validator = Validator.Config(
        enable=True,
        freq=VALIDATION_FREQ,
        steps=VALIDATION_STEPS,
        dataloader=HuggingFaceTextDataLoader.Config(dataset="cl_val", dataset_path=f"{data}/val"),
    )
    return config


def mds() -> Trainer.Config:
    """``TitanStreamingDataLoader`` (every field from ``--dataloader.*``), no validation."""
    config = _recording(llama3_debugmodel())
    config.dataloader = TitanStreamingDataLoader.Config()
    return load_once_per_replica(config)


def text() -> Recording.Config:
    return _config(HuggingFaceTextDataLoader.Config(dataset="cl_text", dataset_path=f"{os.environ['CL_DATA']}/text"))


def interleaved() -> Recording.Config:
    data = os.environ["CL_DATA"]
    return _config(
        InterleavedHuggingFaceTextDataLoader.Config(
            sources=[
                HFDataSource(dataset="cl_text", dataset_path=f"{data}/text", weight=2.0),
                HFDataSource(dataset="cl_text_b", dataset_path=f"{data}/text_b", weight=1.0),
            ]
        )
    )


def chat() -> Recording.Config:
    return _config(
        ChatDataLoader.Config(
            dataset_path="json",
            sample_processor=titan_text.qa_messages,
            load_dataset_kwargs={"data_files": f"{os.environ['CL_DATA']}/chat.jsonl", "split": "train"},
        )
    )


def numbered() -> Recording.Config:
    return _config(titan_text.Numbered.Config(dataset_path=f"{os.environ['CL_DATA']}/numbered.jsonl"))


def text_wrapped() -> Trainer.Config:
    return load_once_per_replica(text())


def interleaved_wrapped() -> Trainer.Config:
    return load_once_per_replica(interleaved())


def chat_wrapped() -> Trainer.Config:
    return load_once_per_replica(chat())


def numbered_wrapped() -> Trainer.Config:
    return load_once_per_replica(numbered())
