"""Samples of token ids -> a language-model batch (inputs, labels shifted by one, positions)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

Sample = Mapping[str, Any]


def lm_collate(samples: Sequence[Sample], key: str = "tokens") -> dict[str, torch.Tensor]:
    """Turn MDS samples holding ``seq_len + 1`` tokens into a language-model batch.

    Returns ``input_ids`` and ``labels`` (the same tokens shifted by one), ``position_ids``,
    each of shape ``(batch, seq_len)``, plus ``sample_id`` of shape ``(batch,)`` when the
    samples carry an ``id`` column. This is the place for your own collate: any function from a
    list of samples to a mapping of tensors works.

    >>> import numpy as np
    >>> b = lm_collate([{"tokens": np.arange(5), "id": 7}])
    >>> b["input_ids"].tolist(), b["labels"].tolist(), b["sample_id"].tolist()
    ([[0, 1, 2, 3]], [[1, 2, 3, 4]], [7])
    """
    tokens = torch.stack([torch.tensor(np.asarray(s[key]), dtype=torch.int64) for s in samples])
    seq_len = tokens.shape[1] - 1
    batch = {
        "input_ids": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(seq_len).expand(len(samples), seq_len).contiguous(),
    }
    if all("id" in s for s in samples):
        batch["sample_id"] = torch.tensor([int(s["id"]) for s in samples])
    return batch
