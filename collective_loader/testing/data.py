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
