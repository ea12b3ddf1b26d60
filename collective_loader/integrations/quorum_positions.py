"""What a position of :class:`~collective_loader.integrations.torchft.QuorumData`'s global order is,
and how a leader reads positions: a sample of the dataset (:class:`SamplePositions`), or a packed
row of ``seq_len + 1`` tokens cut from the order's documents concatenated (:class:`RowPositions`).
Both keep the part of the state that is theirs and check a loaded one; the cursor is QuorumData's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import torch

from collective_loader.plan.quorum import DocumentStarts, GlobalOrder
from collective_loader.text.layouts import TokenColumn, TokenLayout
from collective_loader.text.packing import Packer, Packing, Row, batch_of
from collective_loader.types import Batch


class Reader(Protocol):
    """A leader's reading of positions of the global order (its dataset read by index)."""

    def read(self, lo: int, hi: int) -> Batch:
        """Positions ``[lo, hi)`` (``hi > lo``) as one micro-batch."""
        ...

    def empty(self) -> Batch:
        """A micro-batch of no rows with the keys of the others."""
        ...

    def stats(self) -> dict[str, float]:
        """What it has read."""
        ...


class Positions(Protocol):
    """What a position of the global order is, on every rank of the group: a sample
    (:class:`SamplePositions`) or a packed row (:class:`RowPositions`). It holds its own part of
    the data state and makes a leader's :class:`Reader`."""

    def state(self) -> dict[str, Any]:
        """Its part of :meth:`QuorumData.state_dict` (``"positions"``: its kind, and its settings)."""
        ...

    def load(self, state: Mapping[str, Any], cursor: int) -> None:
        """Take its part of a state whose committed cursor is ``cursor``; ``ValueError`` for a state
        of another kind or settings."""
        ...

    def committed(self, cursor: int) -> None:
        """A step committed: the cursor is now ``cursor``."""
        ...

    def reader(self, dataset: Any, order: GlobalOrder) -> Reader:
        """On a leader: what reads ``dataset`` in ``order``."""
        ...


def _check_kind(state: Mapping[str, Any], kind: str, settings: Mapping[str, Any]) -> None:
    if state.get("positions") != kind:
        raise ValueError(
            f"the state was saved by a QuorumData over {state.get('positions')}, this one is over {kind}: "
            "give packing= as when it was saved"
        )
    differ = [k for k, v in settings.items() if state.get(k) != v]
    if differ:
        saved = ", ".join(f"{k}={state.get(k)!r}" for k in differ)
        raise ValueError(
            f"the state was saved with {saved}, this QuorumData has {', '.join(f'{k}={settings[k]!r}' for k in differ)}"
        )


class SamplePositions:
    """Positions are samples: a micro-batch is the collate of the samples at its positions.

    >>> from torch.utils.data import default_collate
    >>> reader = SamplePositions(default_collate).reader([{"x": i} for i in range(5)], GlobalOrder(5, shuffle=False))
    >>> reader.read(3, 5), reader.empty()
    ({'x': tensor([3, 4])}, {'x': tensor([], dtype=torch.int64)})
    """

    def __init__(
        self, collate: Callable[[list[Any]], Batch], *, layout: TokenLayout | None = None, document_lengths: Any = None
    ) -> None:
        if layout is not None or document_lengths is not None:
            raise ValueError("layout= and document_lengths= are packing's (a sample's tokens): give them with packing=")
        self.collate = collate

    def state(self) -> dict[str, Any]:
        return {"positions": "samples"}

    def load(self, state: Mapping[str, Any], cursor: int) -> None:
        _check_kind(state, "samples", {})

    def committed(self, cursor: int) -> None:
        pass

    def reader(self, dataset: Any, order: GlobalOrder) -> Reader:
        return _SampleReader(dataset, order, self.collate)


class _SampleReader:
    def __init__(self, dataset: Any, order: GlobalOrder, collate: Callable[[list[Any]], Batch]) -> None:
        self.dataset, self.order, self.collate = dataset, order, collate
        self._empty: Batch | None = None
        self._samples = 0

    def read(self, lo: int, hi: int) -> Batch:
        self._samples += hi - lo
        batch = self.collate([self.dataset[i] for i in self.order.indices(lo, hi)])
        if self._empty is None:
            self._empty = _no_rows(batch)
        return batch

    def empty(self) -> Batch:
        if self._empty is None:  # no batch read yet: the keys and shapes of sample 0
            self._empty = _no_rows(self.collate([self.dataset[0]]))
        return self._empty

    def stats(self) -> dict[str, float]:
        return {"quorum_samples_read": float(self._samples)}


class RowPositions:
    """Positions are packed rows: row ``r`` holds tokens ``[r * (seq_len + 1), (r + 1) * (seq_len
    + 1))`` of the documents of the global order concatenated (every row full: the order never
    ends), cut by :class:`~collective_loader.text.packing.Packer` and batched by
    :func:`~collective_loader.text.packing.batch_of`, so ``position_ids`` (and the other
    boundaries) restart at each document and at each row.

    The state adds the anchor of :class:`~collective_loader.plan.quorum.DocumentStarts`: where
    the leaders start reading document lengths to find the cursor's rows. A leader's anchor is
    the document start it last passed at or before the committed cursor; another rank's is the
    one it last loaded (it reads nothing), which is never after the cursor either.

    >>> docs = [{"tokens": np.arange(10 * i, 10 * i + n)} for i, n in enumerate([3, 5, 2, 4])]
    >>> rows = RowPositions(Packing(seq_len=3))
    >>> reader = rows.reader(docs, GlobalOrder(4, shuffle=False))
    >>> b = reader.read(1, 3)  # rows 1 and 2: tokens 4..11 of the stream
    >>> b["input_ids"].tolist(), b["labels"].tolist(), b["position_ids"].tolist()
    ([[11, 12, 13], [20, 21, 30]], [[12, 13, 14], [21, 30, 31]], [[0, 1, 2], [0, 1, 0]])
    >>> rows.committed(2); rows.state()["anchor"]  # rows 0 and 1 done: token 8 is document 2's first
    [2, 8]
    """

    def __init__(
        self,
        packing: Packing,
        *,
        layout: TokenLayout | None = None,
        document_lengths: Any = None,
        collate: Callable[[list[Any]], Batch] | None = None,
    ) -> None:
        layout = TokenColumn() if layout is None else layout
        if not isinstance(packing, Packing):
            raise TypeError(f"packing must be a collective_loader.text.Packing, got {type(packing).__qualname__}")
        if not isinstance(layout, TokenLayout):
            raise TypeError(
                "layout must be a TokenColumn, a TextColumn or another TokenLayout (documents(samples) -> token ids), "
                f"got {type(layout).__qualname__}"
            )
        if collate is not None:
            raise ValueError("with packing=, QuorumData makes the batches itself: leave out collate=")
        if packing.balance is not None:
            raise ValueError(
                "Packing(balance=...) is not supported by QuorumData: each replica trains the rows of its share "
                "of the window, in the order's sequence"
            )
        if packing.at_end != "pad":
            raise ValueError(
                "Packing(at_end=...) does not apply to QuorumData: its order never ends, so every row is full"
            )
        self.packing, self.layout, self.lengths = packing, layout, document_lengths
        self.anchor = (0, 0)  # (document position, its first token in the stream)
        self._starts: DocumentStarts | None = None  # a leader's, shared with its reader

    @property
    def row_tokens(self) -> int:
        return self.packing.seq_len + 1

    def state(self) -> dict[str, Any]:
        return {"positions": "rows", "seq_len": self.packing.seq_len, "anchor": list(self.anchor)}

    def load(self, state: Mapping[str, Any], cursor: int) -> None:
        _check_kind(state, "rows", {"seq_len": self.packing.seq_len})
        position, token = (int(v) for v in state["anchor"])
        if token > cursor * self.row_tokens:
            raise ValueError(f"the state's anchor {[position, token]} is after its cursor's first token")
        starts = self._starts or DocumentStarts()
        starts.reset(position, token)  # ValueError for an anchor no order has
        self.anchor = (position, token)

    def committed(self, cursor: int) -> None:
        if self._starts is not None:  # a leader: the documents before the cursor are done
            self.anchor = self._starts.forget_before(cursor * self.row_tokens)

    def reader(self, dataset: Any, order: GlobalOrder) -> Reader:
        self._starts = DocumentStarts(*self.anchor)
        if self.lengths is not None and len(self.lengths) != order.length:
            raise ValueError(
                f"document_lengths holds {len(self.lengths)} lengths for a dataset of {order.length} samples"
            )
        return _RowReader(dataset, order, self.packing, self.layout, self._starts, self.lengths)


class _RowReader:
    """A leader's rows: it finds the document of a row's first token from the anchor
    (:class:`~collective_loader.plan.quorum.DocumentStarts`, asking the lengths it does not know
    yet), then packs from there. Without ``lengths`` a length is known by reading the document,
    so a leader reads each document of the order about once over the run, its own rows' or not;
    with ``lengths`` (each sample's token count, by dataset index) it reads only the documents of
    its own rows, and checks their lengths. The last document read is kept: the next read is
    often that one."""

    def __init__(
        self,
        dataset: Any,
        order: GlobalOrder,
        packing: Packing,
        layout: TokenLayout,
        starts: DocumentStarts,
        lengths: Any = None,
    ) -> None:
        self.dataset, self.order, self.packing, self.layout, self.starts = dataset, order, packing, layout, starts
        self.lengths = lengths
        self._last: tuple[int, np.ndarray] | None = None
        self._empty_run = 0  # lengths of 0 in a row
        self._figures = dict.fromkeys(("rows", "documents_read", "tokens_read"), 0)

    def length(self, position: int) -> int:
        """How many tokens the document at ``position`` of the order holds."""
        if self.lengths is None:
            n = len(self.document(position))
        else:
            n = int(self.lengths[self.order.indices(position, position + 1)[0]])
        self._empty_run = 0 if n else self._empty_run + 1
        if self._empty_run > self.order.length:  # a whole pass without a token: no row would ever end
            raise ValueError(f"every document of the dataset is empty ({self.layout}): there is nothing to pack")
        return n

    def document(self, position: int) -> np.ndarray:
        """The token ids of the document at ``position`` of the order."""
        if self._last is not None and self._last[0] == position:
            return self._last[1]
        index = self.order.indices(position, position + 1)[0]
        tokens = self.layout.documents([self.dataset[index]])[0]
        if self.lengths is not None and len(tokens) != int(self.lengths[index]):
            # a wrong length would shift every later row: tokens lost or trained twice
            raise ValueError(
                f"document_lengths[{index}] is {int(self.lengths[index])} but sample {index} holds {len(tokens)} "
                f"tokens ({self.layout})"
            )
        self.starts.learn(position, len(tokens))
        self._last = (position, tokens)
        self._figures["documents_read"] += 1
        self._figures["tokens_read"] += len(tokens)
        return tokens

    def rows(self, lo: int, hi: int) -> list[Row]:
        """Rows ``[lo, hi)`` of the order."""
        size = self.packing.seq_len + 1
        position, offset = self.starts.locate(lo * size, self.length)
        packer = Packer(self.packing.seq_len)
        out: list[Row] = []
        while len(out) < hi - lo:
            row = packer.next_row()
            if row is not None:
                out.append(row)
                continue
            packer.add(position, self.document(position), offset)
            position, offset = position + 1, 0
        self._figures["rows"] += hi - lo
        return out

    def read(self, lo: int, hi: int) -> Batch:
        return batch_of(self.rows(lo, hi), self.packing)

    def empty(self) -> Batch:
        return _no_rows(batch_of([], self.packing, batch_rows=1))

    def stats(self) -> dict[str, float]:
        return {f"quorum_{k}": float(v) for k, v in self._figures.items()}


# --- a leader's source ---------------------------------------------------------------------------


def _no_rows(value: Any) -> Any:
    """``value`` with every tensor cut to 0 rows (an empty micro-batch of the same keys)."""
    if isinstance(value, torch.Tensor):
        return value[:0] if value.dim() else value
    if isinstance(value, Mapping):
        return {k: _no_rows(v) for k, v in value.items()}
    if isinstance(value, list):
        return []
    return value
