"""Live elasticity under torchft: replica groups leave and join a running job, and over the
committed steps every sample, or every token of packed rows, is trained exactly once, with a
constant global batch.

:class:`QuorumData` holds the job's whole data state, one **cursor** into a fixed global order
(:mod:`collective_loader.plan.quorum`), and registers it with torchft's ``Manager`` so that a
group that heals takes it from a live peer. A position of that order is a sample of the dataset,
or, with ``packing=``, a packed row of ``seq_len + 1`` tokens cut from the documents of the
order concatenated (:class:`~collective_loader.plan.quorum.DocumentStarts`). Each step it reads
the step's quorum (``participating_rank()``, ``num_participants()``), computes this replica's
share of the window ``[cursor, cursor + global_batch)``, and has the replica's leader read those
positions and deliver them as micro-batches with a :class:`~collective_loader.CollectiveLoader`
over the group's own ``DeviceMesh``. The cursor moves only when the step commits, so a step that
does not commit is served again to the next quorum, re-divided over whoever is there. See
docs/fault-tolerance.md.

The training loop, on every rank of a replica group::

    data = QuorumData(dataset, mesh, manager, global_batch=G, micro_batch=m, inputs=..., labels=...)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # a group outside the step all-reduces zeros
    while manager.current_step() < steps:
        manager.start_quorum()
        for batch in data.step():  # this replica's micro-batches (none outside the step)
            loss = loss_fn(model(batch["x"]), batch["y"], reduction="sum") / data.global_samples
            loss.backward()
        for p in model.parameters():
            manager.allreduce(p.grad, reduce_op=ReduceOp.SUM).wait()  # SUM: the loss is global already
        committed = manager.should_commit()
        if committed:
            optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        data.end_step(committed)

torchft is imported by nothing here: ``manager`` is any object with torchft's ``Manager``
methods used above, so importing this module never needs torchft.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import default_collate

from collective_loader.delivery.leader_group import LeaderGroup
from collective_loader.loader import CollectiveLoader
from collective_loader.plan.mesh import DEFAULT_PLACEMENT, MeshLayout, Placement, StageStyle
from collective_loader.plan.quorum import DocumentStarts, GlobalOrder, StepShare, step_share
from collective_loader.streaming.cleanup import release
from collective_loader.streaming.leaders_world import leader_env, leaders_world
from collective_loader.streaming.streams import CLOSE_WAIT
from collective_loader.text.layouts import ColumnLayout, TextColumn, TokenColumn
from collective_loader.text.packing import Packer, Packing, Row, batch_of
from collective_loader.types import Batch

if TYPE_CHECKING:
    from torchft import Manager

__all__ = ["LeaderStreamingDataset", "QuorumData"]

_FORMAT = 2  # 2: the kind of positions (samples or packed rows) and the rows' anchor


class QuorumData:
    """One replica group's data under torchft: each step, this replica's share of a constant
    global batch, split by the step's quorum; a committed cursor torchft hands to healing groups.

    Build it on every rank of the replica group (a collective, like the
    :class:`~collective_loader.CollectiveLoader` it builds), after the ``Manager`` and before
    the first ``start_quorum()``.

    Args:
        dataset: anything with ``__len__`` and ``__getitem__(index)`` returning one sample (a
            list, a map-style ``Dataset``), or a zero-argument callable returning one, called
            on the replicas' leaders only (a :class:`LeaderStreamingDataset`: an MDS dataset).
            Only leaders read it, by index, in this class's own order.
        mesh: the replica group's own ``DeviceMesh`` (every rank of the group's
            ``torch.distributed`` world); its data dims (``dp_shard``, ``dp``, ...) split the
            group's share again, its ``tp`` peers get copies, as in any ``CollectiveLoader``.
        manager: the group's ``torchft.Manager``. Its ``participating_rank()`` and
            ``num_participants()`` choose the share; the state is registered with its
            ``register_state_dict_fn(state_key, ...)``.
        global_batch: samples (or packed rows) per step over the whole job, whatever the quorum (``G``).
        micro_batch: the most samples (rows) one micro-batch holds; a replica delivers its share as
            ``ceil(share / micro_batch)`` micro-batches (the same count on every replica of the group).
        packing: a :class:`~collective_loader.text.Packing`: the positions of the order are rows
            of ``seq_len + 1`` tokens packed from the samples' documents (batches of
            ``input_ids``, ``labels`` and ``packing.boundaries``), every token of every document
            in one row; ``None``: the positions are the samples.
        layout: with ``packing``, where a sample's tokens are (default ``TokenColumn("tokens")``).
        document_lengths: with ``packing``, optionally each sample's token count, by dataset index
            (a list, an array, ``numpy.load(path, mmap_mode="r")``: only the leaders read it).
            Without it a leader learns the lengths by reading the documents: every leader reads
            about every document of every window; with it, only those of its own rows.
        collate: without ``packing``, samples -> one batch (default
            ``torch.utils.data.default_collate``); an empty micro-batch is the collate of one
            sample with every tensor cut to 0 rows.
        shuffle, seed: the global order: a permutation of the dataset per pass, from ``seed``
            and the pass (or the identity without ``shuffle``), the same on every process.
        state_key: the key of the state registered with the manager.
        **loader_options: the :class:`~collective_loader.LoaderConfig` fields (``inputs=``,
            ``labels=``, ``every_stage=``, ``seq_dims=``, ``timeout=``, ...).
    """

    def __init__(
        self,
        dataset: Any,
        mesh: DeviceMesh,
        manager: Manager,
        *,
        global_batch: int,
        micro_batch: int,
        packing: Packing | None = None,
        layout: ColumnLayout | None = None,
        document_lengths: Any = None,
        collate: Callable[[list[Any]], Batch] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        state_key: str = "collective_loader",
        **loader_options: Any,
    ) -> None:
        if global_batch < 1 or micro_batch < 1:
            raise ValueError(f"global_batch and micro_batch must be >= 1, got {global_batch} and {micro_batch}")
        if getattr(manager, "_use_async_quorum", False) and getattr(manager, "_init_sync", False):
            # torchft 0.2 heals group ranks at step 0 from different groups, rank by rank; in the
            # asynchronous mode a healing rank's gradient is zeroed while participating_rank()
            # still counts it, so part of step 0's data would be trained by half a group
            raise ValueError(
                "QuorumData with torchft's asynchronous quorum needs Manager(..., init_sync=False) "
                "(and the same initial weights on every group, e.g. one seed): with init_sync=True some ranks "
                "of a group heal at step 0 and their gradients are dropped while their share of the data is counted"
            )
        self.positions: Positions = (
            SamplePositions(collate or default_collate, layout=layout, document_lengths=document_lengths)
            if packing is None
            else RowPositions(packing, layout=layout, document_lengths=document_lengths, collate=collate)
        )
        self.manager = manager
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.shuffle, self.seed = shuffle, seed
        self.cursor = 0  # positions of the global order the committed steps trained
        self.share: StepShare | None = None  # the current (or last) step's share for this replica
        self._step_number: int | None = None  # the manager's step while a step is open
        positions = self.positions
        self.loader = CollectiveLoader(lambda: _StepSource(dataset, positions, seed, shuffle), mesh, **loader_options)
        manager.register_state_dict_fn(state_key, self._load_live_state, self.state_dict)

    @property
    def global_samples(self) -> int:
        """The loss normaliser: the samples (rows) of the whole step over every participant (the
        global batch). Divide a summed loss by it and all-reduce gradients with ``SUM``; with
        ``packing`` every row is full, so a step holds ``global_samples * seq_len`` label tokens."""
        return self.global_batch

    def step(self) -> Iterator[Batch]:
        """This rank's micro-batches of the current step, after ``manager.start_quorum()``.

        Blocks on the quorum (``participating_rank()``), computes this replica's share
        (:attr:`share`), and returns an iterator of its micro-batches, each delivered by the
        replica's leader (none when the group takes no part in the step: a healing group in
        torchft's asynchronous mode). Iterate it to the end before :meth:`end_step`."""
        if self._step_number is not None:
            raise RuntimeError("QuorumData.step() again before end_step(committed) of the step before")
        participant = self.manager.participating_rank()  # blocks until the quorum is known
        participants = self.manager.num_participants()
        if participant is not None and not self.manager.is_participating():
            raise RuntimeError(
                f"torchft gave this rank participant {participant} of {participants} but is_participating() is False "
                "(a rank that heals in the asynchronous mode): its gradient would be dropped with its share of the data"
            )
        self._step_number = self.manager.current_step()
        loader = self.loader
        share = step_share(
            self.cursor, self.global_batch, participant, participants, loader.dp_rank, loader.dp_size, self.micro_batch
        )
        self.share = share
        if not share.micro_batches:  # the whole group agrees: it saw the same quorum
            return iter(())
        source = loader.source
        if source is not None:  # a leader: read only this step's share, nothing ahead
            assert isinstance(source, _StepSource)
            source.request = share.micro_batches
        return iter(loader)

    def end_step(self, committed: bool) -> None:
        """After ``manager.should_commit()``: pass what it returned. The cursor moves by the
        global batch only on ``True``; otherwise the same window is served to the next quorum."""
        if self._step_number is None:
            raise RuntimeError("QuorumData.end_step() without a step()")
        expected = self._step_number + (1 if committed else 0)
        self._step_number = None
        if self.manager.current_step() != expected:
            raise RuntimeError(
                f"end_step(committed={committed}) but the manager is at step {self.manager.current_step()}, "
                f"expected {expected}: pass what manager.should_commit() returned, once per step"
            )
        if committed:
            self.cursor += self.global_batch
            self.positions.committed(self.cursor)

    # --- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The data state (the committed cursor and what fixes the order): what the manager sends a
        healing group, and what a checkpoint saves beside ``manager.state_dict()``."""
        # the positions' part first: end_step moves the cursor before the anchor, so an anchor
        # read before the cursor is never after it, whichever thread asks when
        positions = self.positions.state()
        return {
            "format": _FORMAT,
            "cursor": self.cursor,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            **positions,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (a checkpoint's). ``ValueError`` for a state of another
        global batch, order or kind of positions (samples, or rows of another ``seq_len``)."""
        if not isinstance(state, Mapping) or state.get("format") != _FORMAT:
            raise ValueError(f"not a QuorumData state (format {_FORMAT}): {str(state)[:200]}")
        mine = self.state_dict()
        differ = [k for k in ("global_batch", "seed", "shuffle") if state[k] != mine[k]]
        if differ:
            raise ValueError(
                "the state was saved with "
                + ", ".join(f"{k}={state[k]!r}" for k in differ)
                + ", this QuorumData has "
                + ", ".join(f"{k}={mine[k]!r}" for k in differ)
            )
        cursor = int(state["cursor"])
        if cursor < 0 or cursor % self.global_batch:
            raise ValueError(f"the state's cursor {cursor} is no whole number of steps of {self.global_batch}")
        self.positions.load(state, cursor)
        self.cursor = cursor

    def _load_live_state(self, state: Mapping[str, Any]) -> None:
        # torchft calls this on a healing group: in synchronous mode inside start_quorum (before
        # step()), in asynchronous mode inside should_commit, when this group trained nothing
        self.load_state_dict(state)

    def close(self) -> None:
        """Close the loader (its threads and groups); on every rank of the group."""
        self.loader.close()

    def __enter__(self) -> QuorumData:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --- what a position of the global order is ------------------------------------------------------


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

    >>> reader = SamplePositions(default_collate).reader([{"x": i} for i in range(5)], GlobalOrder(5, shuffle=False))
    >>> reader.read(3, 5), reader.empty()
    ({'x': tensor([3, 4])}, {'x': tensor([], dtype=torch.int64)})
    """

    def __init__(
        self, collate: Callable[[list[Any]], Batch], *, layout: ColumnLayout | None = None, document_lengths: Any = None
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
        layout: ColumnLayout | None = None,
        document_lengths: Any = None,
        collate: Callable[[list[Any]], Batch] | None = None,
    ) -> None:
        layout = TokenColumn() if layout is None else layout
        if not isinstance(packing, Packing):
            raise TypeError(f"packing must be a collective_loader.text.Packing, got {type(packing).__qualname__}")
        if not isinstance(layout, (TokenColumn, TextColumn)):
            raise TypeError(f"layout must be a TokenColumn or a TextColumn, got {type(layout).__qualname__}")
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
        layout: ColumnLayout,
        starts: DocumentStarts,
        lengths: Any = None,
    ) -> None:
        self.dataset, self.order, self.packing, self.layout, self.starts = dataset, order, packing, layout, starts
        self.lengths = lengths
        self._encoder = layout.encoder() if isinstance(layout, TextColumn) else None  # resolved once
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
        sample = self.dataset[index]
        if isinstance(self.layout, TextColumn):
            tokens = self.layout.documents([sample], self._encoder)[0]
        else:
            tokens = self.layout.read(sample)
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


class _StepSource:
    """A leader's source: one ``iter()`` yields the micro-batches of one step's request (position
    ranges of the global order) and ends, so the loader's transfer thread never reads ahead of
    the step the training loop asked for."""

    elastic = True  # nothing of its own to resume: the state is QuorumData's cursor

    def __init__(self, dataset: Any, positions: Positions, seed: int, shuffle: bool) -> None:
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")) and callable(dataset):
            dataset = dataset()
        self.dataset = dataset
        self.reader = positions.reader(dataset, GlobalOrder(len(dataset), seed, shuffle))
        self.request: Sequence[tuple[int, int]] = ()

    def __iter__(self) -> Iterator[Batch]:
        request, self.request = self.request, ()
        for lo, hi in request:
            yield self.reader.read(lo, hi) if hi > lo else self.reader.empty()

    def state_dict(self) -> Any:
        return None

    def resume(self, state: Any, steps: int) -> None:
        pass

    def checkpoint_state(self, snapshot: Any) -> Any:
        return snapshot

    def stop(self) -> None:
        self.request = ()

    def stats(self) -> dict[str, float]:
        return self.reader.stats()

    def close(self) -> None:
        close = getattr(self.dataset, "close", None)
        if callable(close):
            close()


def _no_rows(value: Any) -> Any:
    """``value`` with every tensor cut to 0 rows (an empty micro-batch of the same keys)."""
    if isinstance(value, torch.Tensor):
        return value[:0] if value.dim() else value
    if isinstance(value, Mapping):
        return {k: _no_rows(v) for k, v in value.items()}
    if isinstance(value, list):
        return []
    return value


# --- an MDS dataset on the leaders ---------------------------------------------------------------

# StreamingDataset's arguments that choose its own order: QuorumData reads by index, in its own
_ORDER_ARGUMENTS = (
    "shuffle",
    "shuffle_seed",
    "shuffle_algo",
    "shuffle_block_size",
    "num_canonical_nodes",
    "partition_algo",
    "epoch_size",
    "replication",
    "sampling_method",
    "sampling_granularity",
    "batching_method",
)


class LeaderStreamingDataset:
    """A mosaicml-streaming ``StreamingDataset`` that the group's replicas' leaders build alone,
    read by index: :class:`QuorumData`'s dataset for MDS shards.

    Construct it on **every** rank of the group, with the mesh and placement options given to
    ``QuorumData`` (it creates the leaders' process group, which every rank joins); ``QuorumData``
    calls it on the leaders, which build the dataset in streaming's world of the leaders only,
    as :class:`~collective_loader.streaming.StreamingSource` does
    (:func:`~collective_loader.streaming.leaders_world.leaders_world`: the leaders' ``RANK`` /
    ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE``, streaming's barriers over their group, a shared-memory
    prefix no other job or group on the node takes). The result reads sample ``i`` of the
    dataset's ``num_samples`` (``len()`` is that, not streaming's per-rank length), downloading
    its shard when it has a ``remote``; closing it releases streaming's shared memory once every
    leader of the group is done.

    Example (every rank of a replica group)::

        docs = LeaderStreamingDataset(mesh, local="/data/mds")
        data = QuorumData(docs, mesh, manager, global_batch=64, micro_batch=4,
                          packing=Packing(seq_len=2048), layout=TokenColumn(dtype="uint16"),
                          inputs=("input_ids", "position_ids"), labels=("labels",))

    Args:
        mesh, roles, placement, stage_style: as given to ``QuorumData``.
        timeout: seconds the leaders wait for each other while building.
        **dataset_kwargs: passed to ``StreamingDataset`` (``local``, ``remote``, ``streams``,
            ``cache_limit``, ...); the arguments of streaming's own sample order (``shuffle``,
            ``num_canonical_nodes``, ``epoch_size``, ...) are refused: ``QuorumData``'s
            ``shuffle=`` and ``seed=`` make the order.
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        *,
        roles: Mapping[str, str] | None = None,
        placement: Placement = DEFAULT_PLACEMENT,
        stage_style: StageStyle = "loop",
        timeout: float = 600.0,
        **dataset_kwargs: Any,
    ) -> None:
        refused = [k for k in _ORDER_ARGUMENTS if k in dataset_kwargs]
        if refused:
            raise ValueError(
                f"{refused}: QuorumData reads the dataset by index in its own global order (its shuffle= and seed=); "
                "leave out streaming's order arguments"
            )
        layout = MeshLayout.from_mesh(mesh, roles, placement, stage_style)
        self.place = layout.place(dist.get_rank())
        leaders = layout.leaders()
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        # on every rank, before any group: a placement streaming cannot express is refused everywhere
        self._env = leader_env(leaders, self.place.dp_rank, local_world_size)
        self._leaders = LeaderGroup.build(leaders, timeout, "quorum_streaming_leaders")
        self._dataset_kwargs = {"batch_size": 1, **dataset_kwargs}  # streaming's batch: unused by index reads

    def __call__(self) -> StreamingByIndex:
        """Build the dataset (leaders only; ``QuorumData`` calls this)."""
        if not self.place.is_leader:
            raise RuntimeError(
                f"rank {self.place.rank} is not a leader of this mesh; give LeaderStreamingDataset the mesh, roles, "
                "placement and stage_style given to QuorumData"
            )
        from collective_loader.streaming.dataset import DownloadFailureRaisingDataset

        with leaders_world(self._env, self._leaders.group):
            dataset = DownloadFailureRaisingDataset(**self._dataset_kwargs)
        return StreamingByIndex(dataset, self._leaders)


class StreamingByIndex:
    """A leader's ``StreamingDataset`` read by sample index (see :class:`LeaderStreamingDataset`)."""

    def __init__(self, dataset: Any, leaders: LeaderGroup) -> None:
        self.dataset: Any = dataset
        self.leaders = leaders

    def __len__(self) -> int:
        return int(self.dataset.num_samples)  # streaming's len() is one rank's share of an epoch

    def __getitem__(self, index: int) -> Any:
        return self.dataset.get_item(int(index))

    def close(self) -> None:
        """Release streaming's shared memory and lock files, once every leader of the group is
        here (they share the node's blocks); at most ``CLOSE_WAIT`` seconds."""
        if self.dataset is None:
            return
        dataset, self.dataset = self.dataset, None
        missing = self.leaders.wait_for_all(CLOSE_WAIT)
        if missing is not None:
            warnings.warn(
                f"not every leader closed its dataset; leaving streaming's files in place: {missing}", stacklevel=3
            )
            return
        release(dataset)
