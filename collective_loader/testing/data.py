"""Synthetic token datasets whose every sample is a function of its id, and the batch a leader must
build from given ids: what the demo, the tests and the benchmarks check deliveries against."""

from __future__ import annotations

import math

import numpy as np
import torch

from collective_loader.text.collate import lm_collate

INPUTS = ("input_ids", "position_ids", "sample_id")  # the keys the first stage gets
LABELS = ("labels", "sample_id")  # the keys the last stage gets
SEQ_DIMS = {"input_ids": 1, "position_ids": 1, "labels": 1}
VOCAB = 32000


def tokens(sample_id: int, seq_len: int) -> np.ndarray:
    """The ``seq_len + 1`` tokens of one synthetic sample: a function of its id."""
    return ((sample_id * 7919 + np.arange(seq_len + 1) * 31) % VOCAB).astype(np.int32)


def write_dataset(out: str, samples: int, seq_len: int, shard_bytes: int = 1 << 16) -> None:
    """A tokenized MDS dataset: columns ``tokens`` (int32, seq_len + 1) and ``id``; ``out`` is a
    directory or a remote (``s3://bucket/path``) that streaming's writer uploads to."""
    from streaming import MDSWriter

    with MDSWriter(out=out, columns={"tokens": "ndarray:int32", "id": "int"}, size_limit=shard_bytes) as writer:
        for i in range(samples):
            writer.write({"tokens": tokens(i, seq_len), "id": i})


def shard_bytes_for(samples: int, seq_len: int, shards: int = 8) -> int:
    """A shard size that splits the demo's dataset into about ``shards`` shards (``--remote``: a
    download per shard to watch), each big enough for one sample."""
    per_sample = 4 * (seq_len + 1) + 64  # int32 tokens, the id and MDS's per-sample header, rounded up
    return per_sample * max(1, math.ceil(samples / shards))


def expected(ids: list[int], seq_len: int) -> dict[str, torch.Tensor]:
    """The batch the leader must have built from these samples."""
    return lm_collate([{"tokens": tokens(i, seq_len), "id": i} for i in ids])


# --- LLM data: LLM Foundry's MDS layouts, text, and a tokenizer trained here --------------------

BOS, EOS = "<|bos|>", "<|eos|>"  # the special tokens of train_tokenizer's tokenizers
WORDS = (
    "the of and to in is was for on that with as by at from his her an which were are this be had not or "
    "but their have one all been they would who there more when out so she other into time than some only "
    "river stone market winter letter garden engine signal harbour lantern meadow archive copper violin "
    "quietly rapidly although because whenever beneath beyond within against during"
).split()


def text_documents(count: int, seed: int = 0, max_words: int = 80) -> list[str]:
    """``count`` texts of 0 to ``max_words`` words (some empty), a function of ``seed``."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_words + 1, size=count)
    return [" ".join(rng.choice(WORDS, size=int(n))) + ("." if n else "") for n in lengths]


def train_tokenizer(texts: list[str], out: str, vocab_size: int = 400) -> str:
    """A byte-level BPE tokenizer trained offline on ``texts`` (the ``tokenizers`` package), saved
    as ``out/tokenizer.json`` with a ``tokenizer_config.json`` naming :data:`BOS` and
    :data:`EOS` (as a Hugging Face assets directory does); returns ``out``."""
    import json
    import os

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    os.makedirs(out, exist_ok=True)
    tokenizer.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS}, f)
    return out


def write_text_documents(out: str, texts: list[str], shard_bytes: int = 1 << 16) -> None:
    """LLM Foundry's text layout: ``columns={"text": "str"}`` (as its ``convert_dataset_hf`` without
    ``--concat_tokens``), one document per sample."""
    from streaming import MDSWriter

    with MDSWriter(out=out, columns={"text": "str"}, size_limit=shard_bytes) as writer:
        for text in texts:
            writer.write({"text": text})


def write_token_documents(
    out: str, documents: list[np.ndarray], encoding: str = "bytes", dtype: str = "uint16", shard_bytes: int = 1 << 16
) -> None:
    """LLM Foundry's token layouts, one document per sample: ``encoding="bytes"`` writes
    ``columns={"tokens": "bytes"}`` with ``ids.astype(dtype).tobytes()`` (read back with
    ``token_encoding_type=dtype``); ``"ndarray"`` writes ``columns={"tokens": "ndarray:<dtype>"}``."""
    from streaming import MDSWriter

    if encoding not in ("bytes", "ndarray"):
        raise ValueError(f"encoding must be 'bytes' or 'ndarray', got {encoding!r}")
    column = "bytes" if encoding == "bytes" else f"ndarray:{dtype}"
    with MDSWriter(out=out, columns={"tokens": column}, size_limit=shard_bytes) as writer:
        for doc in documents:
            ids = np.asarray(doc).astype(dtype)
            writer.write({"tokens": ids.tobytes() if encoding == "bytes" else ids})


def numbered_documents(lengths: list[int], stride: int = 1 << 16) -> list[np.ndarray]:
    """Documents whose every token says where it is: token ``k`` of document ``i`` is
    ``i * stride + k`` (int64), so a count over delivered rows finds each token lost or repeated."""
    return [i * stride + np.arange(n, dtype=np.int64) for i, n in enumerate(lengths)]
