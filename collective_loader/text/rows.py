"""A packing leader's epoch: sample-batches of documents in, batches of rows out, and where it is.

:class:`PackedRows` is what a leader's stream does with what its DataLoader yields (one
:class:`~collective_loader.text.layouts.TokenizedBatch` per sample-batch, tokenized by the workers):
it numbers each sample-batch with its step, passes over what a resume's hand-over says was
trained (:class:`~collective_loader.text.resume.Skips`), packs the rest in order
(:class:`~collective_loader.text.packing.Packer`) and hands out batches of ``batch_rows`` rows.
Between batches it knows its :class:`~collective_loader.text.resume.Cursor` and keeps the
:class:`~collective_loader.text.resume.Log` a hand-over is built from. Pure: no I/O, no
``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import cast

import numpy as np
import torch

from collective_loader.text.layouts import TokenizedBatch
from collective_loader.text.packing import Packer, Packing, Row, Stats, batch_of
from collective_loader.text.resume import FULL, Cursor, Log, Skips, empty


class PackedRows:
    """A packing leader's rows: its DataLoader's :class:`TokenizedBatch` in, batches of rows out, and
    what its state needs: the packer's :class:`Cursor` and the :class:`Log` of documents passed.

    ``world``: the leaders' streaming world, ``(leaders, leaders per node)``; a hand-over from
    the same world restores this leader's own rows, one from another is shared by all.

    >>> rows = PackedRows(Packing(seq_len=3), batch_rows=1, dp_rank=0, world=(1, 1))
    >>> docs = [TokenizedBatch(np.array([7, 8]), [np.array([1, 2, 3]), np.array([4, 5, 6])])]
    >>> batches = rows.rows(iter(docs), first_step=lambda: 0)
    >>> next(batches)["input_ids"].tolist(), rows.cursor()
    ([[1, 2, 3]], Cursor(step=0, index=1, offset=1))
    >>> next(batches)["labels"].tolist(), rows.cursor(), rows.stats["padding"]
    ([[6, -100, -100]], Cursor(step=0, index=2, offset=0), 2)
    """

    def __init__(self, packing: Packing, batch_rows: int, dp_rank: int, world: tuple[int, int]) -> None:
        self.packing, self.batch_rows, self.dp_rank, self.world = packing, batch_rows, dp_rank, world
        self.stats: dict[str, int] = {}
        self.log = Log()
        self.resumed = empty()  # the hand-over this epoch resumed with
        self._skips: Skips | None = None
        self._packer = Packer(packing.seq_len)
        self._after: tuple[int, int] = (0, 0)  # the document after the last one passed

    def resume(self, entries: np.ndarray, world: Sequence[int]) -> None:
        """Pass over the hand-over's documents in the next epoch: this leader's own (and the shared
        ones) in the same leaders' world, every leader's in another."""
        self.resumed = entries
        self._skips = Skips(entries, self.dp_rank, all_leaders=tuple(world) != self.world)

    def cursor(self) -> Cursor:
        """The packer's position after the last batch handed out."""
        pending = self._packer.cursor()
        if pending is None:
            return Cursor(*self._after, 0)
        ref, offset = pending
        step, index = cast(tuple[int, int], ref)  # the refs this class gives its packer
        return Cursor(step, index, offset)

    def rows(
        self, batches: Iterator[TokenizedBatch], first_step: Callable[[], int]
    ) -> Iterator[dict[str, torch.Tensor]]:
        """One epoch: batches of ``batch_rows`` rows packed from ``batches``, sample-batch ``k`` of
        which is step ``first_step() + k`` (asked once the first has arrived)."""
        for rows in self.row_lists(batches, first_step):
            yield batch_of(rows, self.packing, self.batch_rows)

    def row_lists(self, batches: Iterator[TokenizedBatch], first_step: Callable[[], int]) -> Iterator[list[Row]]:
        """:meth:`rows` before they become tensors: each step's rows (at most ``batch_rows``)."""
        skips, self._skips = self._skips, None
        if skips is None:
            self.resumed = empty()
        # a new log (and resumed table), not the old one cleared: a snapshot of the last epoch keeps that one's
        self.log, self._packer, self._after = Log(), Packer(self.packing.seq_len), (0, 0)
        self.stats = dict.fromkeys(("documents", "rows", "tokens", "carried", "padding", "dropped"), 0)
        rows: list[Row] = []
        start: int | None = None
        for number, docs in enumerate(batches):
            start = first_step() if start is None else start
            step = start + number
            self.log.add_batch(step, docs.samples)
            for index, (sample, tokens) in enumerate(zip(docs.samples.tolist(), docs.tokens)):
                skip = skips.take(step, sample) if skips is not None else None
                if skip is not None:
                    self.log.matched(step, index, skip.entry)
                self._after = (step, index + 1)
                offset = 0 if skip is None else skip.offset
                if offset == FULL:
                    continue
                self._packer.add((step, index), tokens, offset)
                while (row := self._packer.next_row()) is not None:
                    rows.append(row)
                    if len(rows) == self.batch_rows:
                        yield self._batch(rows)
                        rows = []
        if self.packing.at_end == "pad":
            last = self._packer.finish()
            rows += [last] if last is not None else []
            if rows:
                yield self._batch(rows)
        else:
            last = self._packer.finish()
            self.stats["dropped"] = sum(len(r.tokens) for r in rows) + (len(last.tokens) if last is not None else 0)
        self._count(self._packer.stats)

    def _batch(self, rows: list[Row]) -> list[Row]:
        tokens = sum(len(r.tokens) for r in rows)
        self.stats["rows"] += self.batch_rows
        self.stats["tokens"] += tokens
        self.stats["padding"] += self.batch_rows * (self.packing.seq_len + 1) - tokens
        self._count(self._packer.stats)
        return rows

    def _count(self, packer: Stats) -> None:
        if packer.documents:
            self.stats["documents"], self.stats["carried"] = packer.documents, packer.carried
