"""Test configs for TorchTitan's own Trainer (``--module titan_trainer_configs``, run by
``collective_loader.integrations.titan_cpu``, TorchTitan on the CPU).

``ours``: ``collective_loader.integrations.titan_configs.llama3_debugmodel`` on token ids (:class:`NoTokenizer`). ``naive``:
the same, fed the seed issue's way (every rank its own ``StreamingDataset`` with
``replication``). Both record, per rank, the samples behind every micro-batch and which
processes opened the dataset, in files next to ``--dataloader.record``.

The data (:func:`write_dataset`): sample ``i`` counts up from ``i``, so a model learns it fast
when its labels belong to its inputs, and the first input token and first label name the sample.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer

from collective_loader.integrations.titan import split_labels
from collective_loader.integrations.titan_batches import titan_collate
from collective_loader.integrations.titan_configs import llama3_debugmodel
from collective_loader.integrations.titan_streaming import TitanStreamingDataLoader

VOCAB = 2048  # llama3_debugmodel's


def tokens(sample_id: int, seq_len: int) -> np.ndarray:
    """The ``seq_len + 1`` tokens of sample ``sample_id``: counting up from the id."""
    return ((sample_id + np.arange(seq_len + 1)) % VOCAB).astype(np.int32)


def write_dataset(out: str, samples: int, seq_len: int) -> None:
    from streaming import MDSWriter

    assert samples <= VOCAB, "the first token names the sample"
    with MDSWriter(out=out, columns={"tokens": "ndarray:int32"}, size_limit=1 << 14) as writer:
        for i in range(samples):
            writer.write({"tokens": tokens(i, seq_len)})


def watch_opens(dataset: str, log: str) -> None:
    """Append ``rank pid`` to ``log`` the first time this process opens a file of ``dataset``."""
    root, rank, seen = os.path.realpath(dataset) + os.sep, os.environ["RANK"], []

    def hook(event: str, args: tuple) -> None:
        if event == "open" and not seen and isinstance(args[0], str) and os.path.realpath(args[0]).startswith(root):
            seen.append(args[0])
            with open(log, "a") as f:
                f.write(f"{rank} {os.getpid()}\n")

    sys.addaudithook(hook)


def record(pairs: Iterator[tuple[dict, torch.Tensor]], path: str) -> Iterator[tuple[dict, torch.Tensor]]:
    """Pass ``pairs`` on; append each one's sample ids (from inputs and from labels) to ``path``."""
    for input_dict, labels in pairs:
        with open(path, "a") as f:
            f.write(
                json.dumps({"input": input_dict["input"][:, 0].tolist(), "labels": (labels[:, 0] - 1).tolist()}) + "\n"
            )
        yield input_dict, labels


class Recorded(TitanStreamingDataLoader):
    """Ours, recording what every rank gets."""

    @dataclass(kw_only=True, slots=True)
    class Config(TitanStreamingDataLoader.Config):
        record: str = ""
        """Path prefix of the records: ``<record>.rank<r>.jsonl`` and ``<record>.opens``."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        assert config.record, "set --dataloader.record to the path prefix of the records"
        watch_opens(config.dataset_path, f"{config.record}.opens")
        self.record = f"{config.record}.rank{os.environ['RANK']}.jsonl"
        super().__init__(config, **kwargs)

    def __iter__(self) -> Iterator[tuple[dict, torch.Tensor]]:
        return record(super().__iter__(), self.record)


class Naive(BaseDataLoader):
    """The seed's set-up: every rank builds its own StreamingDataset, ``replication = tp * cp``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Recorded.Config):
        replication: int | None = None

    def __init__(self, config: Config, *, seq_len: int, local_batch_size: int, **kwargs: Any) -> None:
        from streaming import StreamingDataset

        watch_opens(config.dataset_path, f"{config.record}.opens")
        self.record = f"{config.record}.rank{os.environ['RANK']}.jsonl"
        dataset = StreamingDataset(
            local=config.dataset_path,
            batch_size=local_batch_size,
            shuffle=config.shuffle,
            shuffle_seed=config.shuffle_seed,
            replication=config.replication,
        )
        self.loader = DataLoader(
            dataset, batch_size=local_batch_size, collate_fn=functools.partial(titan_collate, seq_len=seq_len)
        )

    def __iter__(self) -> Iterator[tuple[dict, torch.Tensor]]:
        epochs = itertools.chain.from_iterable(self.loader for _ in itertools.count())
        return record((split_labels(batch) for batch in epochs), self.record)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class NoTokenizer(BaseTokenizer):
    """The Trainer always builds a tokenizer; these data are token ids already (and the wheel
    ships no tokenizer files for ``--hf_assets_path``'s default)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, *, tokenizer_path: str | None = None) -> None:
        super().__init__()

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise NotImplementedError("the data are token ids already")

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError("the data are token ids already")

    def get_vocab_size(self) -> int:
        raise NotImplementedError("the model config holds the vocabulary size")


def _on_token_ids(config: Any) -> Any:
    config.tokenizer = NoTokenizer.Config()
    return config


class NoData(BaseDataLoader):
    """The seed checkpoint's dataloader: the Trainer builds one, and saving the seed takes no batch."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        pass

    def __init__(self, config: Config, **build: Any) -> None:
        pass

    def __iter__(self) -> Iterator[tuple[dict, torch.Tensor]]:
        return iter(())

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def seed() -> Any:
    """``llama3_debugmodel`` for ``titan_run.llama3_seed``: TorchTitan's seed checkpoint, no data."""
    config = _on_token_ids(llama3_debugmodel())
    config.dataloader = NoData.Config()
    return config


def ours() -> Any:
    config = _on_token_ids(llama3_debugmodel())
    config.dataloader = Recorded.Config()
    return config


def naive() -> Any:
    config = _on_token_ids(llama3_debugmodel())
    config.dataloader = Naive.Config()
    return config
