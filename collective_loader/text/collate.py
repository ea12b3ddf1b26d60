"""Samples of token ids -> a language-model batch (inputs, labels shifted by one, positions)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from collective_loader.text.layouts import TokenColumn
from collective_loader.types import Sample


def lm_collate(samples: Sequence[Sample], key: str = "tokens", dtype: str | None = None) -> dict[str, torch.Tensor]:
    """Turn MDS samples holding ``seq_len + 1`` tokens each into a language-model batch.

    ``key`` names the token column: an integer ndarray, or bytes of ``dtype`` (LLM Foundry's
    ``token_encoding_type``; see :class:`~collective_loader.text.layouts.TokenColumn`).
    Returns ``input_ids`` and ``labels`` (the same tokens shifted by one), ``position_ids``,
    each of shape ``(batch, seq_len)``, plus ``sample_id`` of shape ``(batch,)`` when the
    samples carry an ``id`` column. This is the place for your own collate: any function from a
    list of samples to a mapping of tensors works. Documents of different lengths are packed
    instead (``StreamingSource(packing=...)``).

    >>> import numpy as np
    >>> b = lm_collate([{"tokens": np.arange(5), "id": 7}])
    >>> b["input_ids"].tolist(), b["labels"].tolist(), b["sample_id"].tolist()
    ([[0, 1, 2, 3]], [[1, 2, 3, 4]], [7])
    """
    column = TokenColumn(key, dtype)
    rows = [column.read(s) for s in samples]
    lengths = sorted({len(r) for r in rows})
    if len(lengths) > 1:
        raise ValueError(
            f"column {key!r} holds rows of different lengths {lengths[:5]}: without packing every sample must hold "
            "seq_len + 1 tokens; to pack documents pass StreamingSource(packing=Packing(seq_len=...))"
        )
    tokens = torch.stack([torch.from_numpy(r) for r in rows])
    seq_len = tokens.shape[1] - 1
    batch = {
        "input_ids": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(seq_len).expand(len(samples), seq_len).contiguous(),
    }
    if all("id" in s for s in samples):
        batch["sample_id"] = torch.tensor([int(s["id"]) for s in samples])
    return batch
