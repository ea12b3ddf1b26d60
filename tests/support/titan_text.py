"""Test-only: text data for TorchTitan's own dataloaders, made offline, and a record of who touched it.

- :func:`write_tokenizer`: a byte-level BPE trained with ``tokenizers`` on the documents, saved as
  ``tokenizer.json`` (+ ``tokenizer_config.json`` naming BOS/EOS and a chat template) in a folder
  that TorchTitan's ``HuggingFaceTokenizer`` loads (``--hf_assets_path``);
- :func:`write_jsonl`: a local dataset that Hugging Face ``datasets`` loads with
  ``load_dataset(path, split="train")`` (a folder) or ``load_dataset("json", data_files=path)``;
- datasets registered in TorchTitan's ``DATASETS`` the way its docs describe for custom ones
  (``DatasetConfig(path, loader, sample_processor)``): ``cl_text``, ``cl_text_b``, ``cl_val``,
  each read from ``--dataloader.dataset_path``;
- :class:`CountingTokenizer` and :class:`Numbered`: TorchTitan's ``HuggingFaceTokenizer`` and a
  user's own ``BaseDataLoader``;
- who touched the data: each process appends ``<event> <rank> <pid>`` once per event to the file
  named by ``$CL_TOUCH_LOG``: ``load <dataset>`` (a DATASETS loader ran), ``encode`` (tokenized),
  ``open`` (opened a file under ``$CL_WATCH_DIR``: the data and the ``datasets`` cache).
"""

from __future__ import annotations

import json
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there one all we their been has when who will more no if out so said what up its about into "
    "than them can only other new some could time these two may then do first any my now such like our over man me "
    "even most made after also did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year off come since against go "
    "came right used take three"
).split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def documents(count: int, seed: int, words: tuple[int, int] = (3, 80)) -> list[str]:
    """``count`` pseudo-English documents of ``words`` words each (a range), each ending with its number."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) + f" ({seed}.{i})." for i in range(count)]


def write_tokenizer(out: str, texts: list[str], vocab_size: int = 1024) -> None:
    """Train a byte-level BPE on ``texts`` and save it in ``out`` for ``HuggingFaceTokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    os.makedirs(out, exist_ok=True)
    tokenizer.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": CHAT_TEMPLATE}, f)


def write_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def qa_rows(count: int, seed: int) -> list[dict[str, str]]:
    """Single-turn question/answer rows for TorchTitan's chat loader."""
    questions, answers = documents(count, seed, (3, 20)), documents(count, seed + 1, (2, 30))
    return [{"question": q, "answer": a} for q, a in zip(questions, answers)]


def qa_messages(sample: dict[str, str]) -> list[dict[str, str]]:
    """The chat loader's ``sample_processor``: a row as ``[user, assistant]`` messages."""
    return [{"role": "user", "content": sample["question"]}, {"role": "assistant", "content": sample["answer"]}]


# --- who touched the data ------------------------------------------------------------------

_LOGGED: set[str] = set()
_WATCHING: list[str] = []


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def touched(event: str) -> None:
    """Append ``<event> <rank> <pid>`` to ``$CL_TOUCH_LOG``, once per event and process."""
    log = os.environ.get("CL_TOUCH_LOG")
    if log and (log, event) not in _LOGGED:
        _LOGGED.add((log, event))  # type: ignore[arg-type]
        with open(log, "a") as f:
            f.write(f"{event} {_rank()} {os.getpid()}\n")


def watch_opens() -> None:
    """From now on, record ``open`` when this process opens a file under ``$CL_WATCH_DIR``."""
    if _WATCHING:
        return
    _WATCHING.append("on")

    def hook(event: str, args: tuple) -> None:
        root = os.environ.get("CL_WATCH_DIR")
        if event == "open" and root and isinstance(args[0], str):
            if os.path.realpath(args[0]).startswith(os.path.realpath(root) + os.sep):
                touched("open")

    sys.addaudithook(hook)


def read_touches(log: str) -> dict[str, set[int]]:
    """``{event: ranks}`` from a touch log (empty if nothing was touched)."""
    out: dict[str, set[int]] = {}
    if os.path.exists(log):
        with open(log) as f:
            for line in f:
                event, rank, _ = line.rsplit(" ", 2)
                out.setdefault(event, set()).add(int(rank))
    return out


# --- TorchTitan's side: registered datasets, a tokenizer and a dataloader of one's own ---------


def _load_local(name: str, path: str) -> Any:
    from datasets import load_dataset

    touched(f"load {name}")
    return load_dataset(path, split="train", cache_dir=os.environ.get("CL_HF_CACHE"))


def _text(sample: dict[str, Any]) -> str:
    return sample["text"]


def register_datasets() -> None:
    """``cl_text``, ``cl_text_b`` and ``cl_val`` in TorchTitan's ``DATASETS``, read from ``dataset_path``."""
    for name in ("cl_text", "cl_text_b", "cl_val"):
        DATASETS[name] = DatasetConfig(
            path="", loader=lambda path, name=name: _load_local(name, path), sample_processor=_text
        )


class CountingTokenizer(HuggingFaceTokenizer):
    """TorchTitan's ``HuggingFaceTokenizer``, recording ``encode`` (see :func:`touched`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTokenizer.Config):
        pass

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        touched("encode")
        return super().encode(*args, **kwargs)


class Numbered(BaseDataLoader):
    """A user's own ``BaseDataLoader`` (not TorchTitan's): the rows of a JSON-lines file of
    ``{"text": ...}`` dealt round-robin over the DP ranks, one row per sample, tokenized with BOS and
    EOS, cut or padded (EOS, label -100) to ``seq_len``. Yields ``({"input", "positions"}, labels)``,
    with ``extra=True`` also ``row`` (int32, ``[batch]``) and ``weights`` (float32, ``[batch, seq_len]``).

    Its state is TorchTitan's per-DP-rank form; the entry is a dict it keeps changing in place
    (``{"row": next row, "epoch": n}``), as a careless loader might.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        extra: bool = False
        infinite: bool = True

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: Any,
        seq_len: int,
        local_batch_size: int,
        **kwargs: Any,
    ) -> None:
        assert config.dataset_path, "set --dataloader.dataset_path to a JSON-lines file of {'text': ...}"
        touched("load numbered")
        with open(config.dataset_path) as f:
            self.rows = [json.loads(line)["text"] for line in f][dp_rank::dp_world_size]
        self.config, self.tokenizer, self.seq_len, self.batch = config, tokenizer, seq_len, local_batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.position = {"row": 0, "epoch": 0}

    def _sample(self, text: str) -> tuple[list[int], list[int]]:
        tokens = self.tokenizer.encode(text, add_bos=True, add_eos=True)[: self.seq_len + 1]
        inputs, labels = tokens[:-1], tokens[1:]
        pad = self.seq_len - len(inputs)
        return inputs + [self.tokenizer.eos_id] * pad, labels + [-100] * pad

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            while self.position["row"] + self.batch <= len(self.rows):
                first = self.position["row"]
                samples = [self._sample(t) for t in self.rows[first : first + self.batch]]
                self.position["row"] += self.batch
                inputs = torch.tensor([s[0] for s in samples])
                input_dict = {"input": inputs, "positions": torch.arange(self.seq_len).expand_as(inputs).clone()}
                if self.config.extra:
                    input_dict["row"] = torch.arange(first, first + self.batch, dtype=torch.int32)
                    input_dict["weights"] = torch.rand(inputs.shape, generator=torch.Generator().manual_seed(first))
                yield input_dict, torch.tensor([s[1] for s in samples])
            if not self.config.infinite:
                return
            self.position["row"], self.position["epoch"] = 0, self.position["epoch"] + 1

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.dp_rank}": self.position, "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            assert state_dict["world_size"] == self.dp_world_size, "another DP degree"
            self.position = dict(state_dict[f"dp_rank_{self.dp_rank}"])
