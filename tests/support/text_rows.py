"""Reading packed batches back in tests: each row's real tokens, and documents that simulate
what streaming deals out to the leaders, step by step."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from collective_loader.text.layouts import TokenizedBatch


def row_tokens(batch: Mapping[str, Any]) -> list[np.ndarray]:
    """The real tokens of each row of a packed batch (it must hold ``sequence_id``): its inputs
    that are not padding, then its last label when that is a token."""
    out = []
    for inputs, labels, seq in zip(batch["input_ids"].numpy(), batch["labels"].numpy(), batch["sequence_id"].numpy()):
        real = inputs[seq >= 0]
        out.append(np.concatenate([real, labels[-1:]]) if labels[-1] != -100 else real)
    return out


def all_tokens(batches: list[Mapping[str, Any]]) -> list[int]:
    return [int(t) for b in batches for row in row_tokens(b) for t in row]


def leader_documents(
    docs: list[np.ndarray], dp: int, rank: int, per_batch: int, start_step: int = 0
) -> Iterator[TokenizedBatch]:
    """Leader ``rank``'s sample-batches from ``start_step`` on, when each step's ``dp * per_batch``
    samples are consecutive sample indices dealt out in rank order (a stand-in for streaming's
    partition: any deal in which step t's samples stay in step t will do)."""
    width = dp * per_batch
    for step in range(start_step, len(docs) // width):
        ids = step * width + rank * per_batch + np.arange(per_batch)
        yield TokenizedBatch(ids.astype(np.int64), [docs[i] for i in ids])
