"""MDS samples as TorchTitan's batches: the collate of rows of token ids, TorchTitan's names for a
packed batch's inputs, and the check of a dataset's columns against the layout the flags ask for.

Used by :class:`~collective_loader.integrations.titan_streaming.TitanStreamingDataLoader`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from collective_loader.text import TextColumn, lm_collate
from collective_loader.text.layouts import ColumnLayout

PACKED_KEYS = {"input_ids": "input", "position_ids": "positions"}  # a packed batch's inputs -> TorchTitan's


def titan_collate(
    samples: Sequence[Mapping[str, Any]], *, seq_len: int, column: str = "tokens", dtype: str | None = None
) -> dict[str, torch.Tensor]:
    """MDS samples of ``seq_len + 1`` tokens -> the batch TorchTitan's text loader yields, labels included.

    ``column`` holds an integer ndarray, or bytes of ``dtype`` (LLM Foundry's ``token_encoding_type``,
    int64 when ``None``). ``positions`` restart at 0 in every sample (one document per sample), as
    TorchTitan's per-document positions do; its attention masks are built from them.

    >>> import numpy as np
    >>> b = titan_collate([{"tokens": np.arange(4)}], seq_len=3)
    >>> b["input"].tolist(), b["positions"].tolist(), b["labels"].tolist()
    ([[0, 1, 2]], [[0, 1, 2]], [[1, 2, 3]])
    """
    batch = lm_collate(samples, key=column, dtype=dtype)
    if batch["input_ids"].shape[1] != seq_len:
        raise ValueError(
            f"the MDS column {column!r} holds {batch['input_ids'].shape[1] + 1} tokens per sample and "
            f"training.seq_len is {seq_len}: write samples of seq_len + 1 tokens, set "
            f"--training.seq_len {batch['input_ids'].shape[1]}, or pack them (--dataloader.pack)"
        )
    return {"input": batch["input_ids"], "positions": batch["position_ids"], "labels": batch["labels"]}


def titan_inputs(input_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A delivered batch's inputs under TorchTitan's names (a packed batch's ``input_ids`` and
    ``position_ids``); other keys, TorchTitan's already, are kept.

    >>> list(titan_inputs({"input_ids": torch.zeros(1), "position_ids": torch.zeros(1)}))
    ['input', 'positions']
    """
    return {PACKED_KEYS.get(key, key): value for key, value in input_dict.items()}


def check_columns(layout: ColumnLayout, columns: Mapping[str, str]) -> None:
    """Refuse a dataset whose columns (name -> MDS encoding) ``layout`` cannot read, naming the
    ``--dataloader`` flag to change. Run on the leaders once the dataset is built.

    >>> from collective_loader.text import TokenColumn
    >>> check_columns(TokenColumn("tokens", "uint16"), {"tokens": "bytes"})
    >>> check_columns(TokenColumn("tokens"), {"text": "str"})
    Traceback (most recent call last):
    ...
    ValueError: the dataset has no column 'tokens' (it has: text (str)): set --dataloader.column to the column of token ids, or --dataloader.text for a column of text
    """
    column = layout.column
    if column not in columns:
        has = ", ".join(f"{name} ({encoding})" for name, encoding in columns.items())
        what = (
            "of text" if isinstance(layout, TextColumn) else "of token ids, or --dataloader.text for a column of text"
        )
        raise ValueError(
            f"the dataset has no column {column!r} (it has: {has}): set --dataloader.column to the column {what}"
        )
    encoding = columns[column]
    if isinstance(layout, TextColumn):
        if encoding != "str":
            raise ValueError(
                f"--dataloader.text: column {column!r} holds {encoding}, not text (str): leave out --dataloader.text to "
                "read token ids (with --dataloader.token_dtype for bytes)"
            )
    elif encoding == "str":
        raise ValueError(
            f"column {column!r} holds text (str): set --dataloader.text to tokenize it on the leaders with the "
            "Trainer's tokenizer (--hf_assets_path)"
        )
    elif encoding.startswith("ndarray"):
        if layout.dtype is not None:
            raise ValueError(
                f"--dataloader.token_dtype reads token ids written as bytes; column {column!r} holds {encoding}, read "
                "as its own type: leave out --dataloader.token_dtype"
            )
    elif encoding != "bytes":
        raise ValueError(
            f"column {column!r} holds {encoding}: token ids are bytes (with --dataloader.token_dtype, LLM Foundry's "
            "token_encoding_type) or an integer ndarray; for text set --dataloader.text"
        )
