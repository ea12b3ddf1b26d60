"""Documents packed into rows of ``seq_len + 1`` tokens, with their boundaries in the forms trainers read.

A :class:`Packer` takes documents (token ids, BOS / EOS already in) in order and cuts rows of
exactly ``seq_len + 1`` tokens from their concatenation: no token is dropped or repeated at a row's
edge, the remainder of a document carries into the next row. A row's first ``seq_len`` tokens are
the inputs, its last ``seq_len`` the labels (as TorchTitan's ``HuggingFaceTextDataset`` windows).
At the end of the documents the last partial row is padded or dropped (:class:`Packing`'s
``at_end``). The packer cuts a row only when asked (:meth:`Packer.next_row`), so its position,
:meth:`Packer.cursor`, is exactly what the rows handed out so far used: what a resume needs.

:func:`batch_of` turns rows into a batch of tensors, ``R`` rows of ``S = seq_len`` tokens:

* ``input_ids`` ``(R, S)`` int64; padding holds :data:`PAD_ID`;
* ``labels`` ``(R, S)`` int64: the inputs shifted by one; :data:`IGNORE_INDEX` where the next token
  is padding;

and the boundaries asked for (``Packing.boundaries``; a *segment* is the part of one document in
one row, and the padding of a row is one segment of its own):

* ``position_ids`` ``(R, S)`` int64: 0, 1, ... within each segment, so they restart at 0 at each
  document and at each row (TorchTitan's per-document positions; its block-causal mask reads them);
* ``cu_seqlens`` ``(R, D + 1)`` int32: each row's segment offsets ``0, ..., S`` (varlen attention),
  filled up to the batch's most segments ``D`` by repeating ``S``;
* ``max_seqlen`` ``(R,)`` int32: each row's longest segment;
* ``sequence_id`` ``(R, S)`` int64: each input token's segment in its row, 0, 1, ...; -1 on padding
  (LLM Foundry's ``sequence_id``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from collective_loader.plan.documents import IGNORE_INDEX
from collective_loader.text.balance import Balance

PAD_ID = 0  # input_ids of padding (its labels are ignored and its own segment keeps it apart)
BOUNDARIES = ("position_ids", "cu_seqlens", "max_seqlen", "sequence_id")
AtEnd = Literal["pad", "drop"]


@dataclass(frozen=True)
class Packing:
    """How documents become rows.

    Args:
        seq_len: tokens a row trains on; each row holds ``seq_len + 1`` tokens.
        at_end: the epoch's last partial row and last partial batch: ``"pad"`` (padding tokens,
            labels :data:`IGNORE_INDEX`, and rows of padding filling the batch) or ``"drop"``
            (every delivered label is a real token; those tokens are not trained this epoch).
        boundaries: the per-row document boundaries to add, any of :data:`BOUNDARIES`.
        balance: a :class:`~collective_loader.text.balance.Balance` to place each step's rows
            over the data-parallel replicas by attention cost (a packing ``StreamingSource``'s
            leaders do it together), or ``None``: each leader delivers the rows it packed.
    """

    seq_len: int
    at_end: AtEnd = "pad"
    boundaries: tuple[str, ...] = ("position_ids",)
    balance: Balance | None = None

    def __post_init__(self) -> None:
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ValueError(f"Packing(seq_len=...) must be a positive int, got {self.seq_len!r}")
        if self.at_end not in ("pad", "drop"):
            raise ValueError(f"Packing(at_end=...) must be 'pad' or 'drop', got {self.at_end!r}")
        boundaries = (self.boundaries,) if isinstance(self.boundaries, str) else tuple(self.boundaries)
        unknown = [b for b in boundaries if b not in BOUNDARIES]
        if unknown:
            raise ValueError(f"Packing(boundaries=...): {unknown} unknown; choose from {BOUNDARIES}")
        object.__setattr__(self, "boundaries", boundaries)
        if self.balance is not None and not isinstance(self.balance, Balance):
            raise TypeError(f"Packing(balance=...) must be a Balance or None, got {type(self.balance).__qualname__}")


@dataclass
class Row:
    """One row's real tokens, ``(n,)`` int64 with ``n == seq_len + 1`` except an epoch's last row,
    and the lengths of the document pieces they are made of, in order (summing to ``n``);
    ``continued``: its first piece is the rest of a document begun in an earlier row."""

    tokens: np.ndarray
    pieces: list[int]
    continued: bool = False

    @property
    def documents(self) -> int:
        """The documents this row begins."""
        return len(self.pieces) - self.continued


@dataclass
class Stats:
    """What a packer has done: documents taken, rows cut, tokens in them, and tokens *carried*
    (those of a document begun in an earlier row)."""

    documents: int = 0
    rows: int = 0
    tokens: int = 0
    carried: int = 0


@dataclass
class _Pending:
    ref: Hashable
    tokens: np.ndarray
    offset: int  # tokens of this document already in rows


class Packer:
    """Cuts the concatenation of documents into rows of ``seq_len + 1`` tokens.

    >>> p = Packer(seq_len=3)
    >>> p.add("a", np.array([1, 2, 3])); p.add("b", np.array([4, 5, 6]))
    >>> row = p.next_row()
    >>> row.tokens.tolist(), row.pieces, p.cursor(), p.next_row()
    ([1, 2, 3, 4], [3, 1], ('b', 1), None)
    >>> p.finish().tokens.tolist(), p.stats
    ([5, 6], Stats(documents=2, rows=2, tokens=6, carried=2))
    """

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self.stats = Stats()
        self._pending: deque[_Pending] = deque()
        self._count = 0  # tokens pending

    def add(self, ref: Hashable, tokens: np.ndarray, offset: int = 0) -> None:
        """Queue a document (``ref`` names it in :meth:`cursor`) from its token ``offset`` on."""
        self.stats.documents += 1
        if len(tokens) > offset:
            self._pending.append(_Pending(ref, tokens, offset))
            self._count += len(tokens) - offset

    def next_row(self) -> Row | None:
        """The next full row, or ``None`` until more documents are added."""
        return self._take(self.seq_len + 1) if self._count >= self.seq_len + 1 else None

    def finish(self) -> Row | None:
        """The last, partial row (fewer than ``seq_len + 1`` tokens), or ``None`` if nothing is left."""
        return self._take(self._count) if self._count else None

    def cursor(self) -> tuple[Hashable, int] | None:
        """``(ref, offset)`` of the first document with tokens in no row yet, ``offset`` of them in
        rows; ``None`` when every added document is in rows."""
        return (self._pending[0].ref, self._pending[0].offset) if self._pending else None

    def _take(self, n: int) -> Row:
        parts, pieces = [], []
        continued = bool(self._pending and self._pending[0].offset)
        if continued:
            self.stats.carried += min(n, len(self._pending[0].tokens) - self._pending[0].offset)
        while n:
            doc = self._pending[0]
            k = min(n, len(doc.tokens) - doc.offset)
            parts.append(doc.tokens[doc.offset : doc.offset + k])
            pieces.append(k)
            doc.offset += k
            n -= k
            if doc.offset == len(doc.tokens):
                self._pending.popleft()
        tokens = np.concatenate(parts)
        self._count -= len(tokens)
        self.stats.rows += 1
        self.stats.tokens += len(tokens)
        return Row(tokens, pieces, continued)


def _segments(row: Row, seq_len: int) -> list[int]:
    """Lengths of the row's segments over its ``seq_len`` inputs: its document pieces cut at
    ``seq_len`` (the last token is a label only), then its padding."""
    out, used = [], 0
    for piece in row.pieces:
        k = min(piece, seq_len - used)
        if k:
            out.append(k)
            used += k
    if used < seq_len:
        out.append(seq_len - used)
    return out


def batch_of(rows: Sequence[Row], packing: Packing, batch_rows: int | None = None) -> dict[str, torch.Tensor]:
    """``rows`` as a batch (see the module docstring for the keys and their shapes), padded
    with rows of padding up to ``batch_rows`` rows when given.

    >>> b = batch_of([Row(np.array([5, 6, 7, 8, 9]), [2, 3])], Packing(4, boundaries=("position_ids", "cu_seqlens")))
    >>> b["input_ids"].tolist(), b["labels"].tolist(), b["position_ids"].tolist(), b["cu_seqlens"].tolist()
    ([[5, 6, 7, 8]], [[6, 7, 8, 9]], [[0, 1, 0, 1]], [[0, 2, 4]])
    >>> b = batch_of([Row(np.array([5, 6, 7]), [3])], Packing(4, boundaries=BOUNDARIES), batch_rows=2)
    >>> b["labels"].tolist(), b["sequence_id"][0].tolist(), b["cu_seqlens"].tolist(), b["max_seqlen"].tolist()
    ([[6, 7, -100, -100], [-100, -100, -100, -100]], [0, 0, 0, -1], [[0, 3, 4], [0, 4, 4]], [3, 4])
    """
    seq_len = packing.seq_len
    rows = list(rows) + [Row(np.zeros(0, np.int64), []) for _ in range((batch_rows or 0) - len(rows))]
    n_rows = len(rows)
    tokens = np.full((n_rows, seq_len + 1), PAD_ID, dtype=np.int64)
    labels_real = np.zeros((n_rows, seq_len), dtype=bool)
    segments = []
    for r, row in enumerate(rows):
        n = len(row.tokens)
        tokens[r, :n] = row.tokens
        labels_real[r, : max(n - 1, 0)] = True
        segments.append(_segments(row, seq_len))
    labels = np.where(labels_real, tokens[:, 1:], IGNORE_INDEX)
    batch = {"input_ids": torch.from_numpy(tokens[:, :-1].copy()), "labels": torch.from_numpy(labels)}
    wanted = packing.boundaries
    if "position_ids" in wanted:
        batch["position_ids"] = torch.from_numpy(
            np.stack([np.concatenate([np.arange(k) for k in segs]) for segs in segments])
        )
    if "cu_seqlens" in wanted:
        most = max(len(segs) for segs in segments)
        cu = np.full((n_rows, most + 1), seq_len, dtype=np.int32)
        for r, segs in enumerate(segments):
            cu[r, 0] = 0
            cu[r, 1 : len(segs) + 1] = np.cumsum(segs)
        batch["cu_seqlens"] = torch.from_numpy(cu)
    if "max_seqlen" in wanted:
        batch["max_seqlen"] = torch.tensor([max(segs) for segs in segments], dtype=torch.int32)
    if "sequence_id" in wanted:
        ids = np.full((n_rows, seq_len), -1, dtype=np.int64)
        for r, (row, segs) in enumerate(zip(rows, segments)):
            real = min(len(row.tokens), seq_len)
            ids[r, :real] = np.repeat(np.arange(len(segs)), segs)[:real]
        batch["sequence_id"] = torch.from_numpy(ids)
    return batch
