"""mosaicml-streaming's ``StreamingDataset`` on the data-parallel leaders only.

Streaming assumes every rank builds and iterates the dataset and that ranks which should see the
same samples are adjacent. Under pipeline parallelism neither holds. :class:`StreamingSource`
builds the dataset and its ``DataLoader`` on the leaders alone, showing streaming a world of
exactly the leaders (rank = dp_rank, world = dp_size, local world = leaders on this node: see
:mod:`collective_loader.streaming.leaders`), and :class:`~collective_loader.CollectiveLoader`
delivers its batches to everyone else::

    source = StreamingSource(mesh, local="/data/mds", batch_size=8, shuffle=True, num_workers=2)
    loader = CollectiveLoader(source, mesh, inputs=("input_ids", "position_ids"), labels=("labels",))

Batch sizes: ``batch_size`` is the **per-replica** batch of one step (what one leader's
``DataLoader`` yields, all micro-batches of a pipeline step together). The global batch is
``batch_size * dp_size``; a pipeline schedule splits each replica's batch into micro-batches.
Elastic resume keeps the global batch: at twice the replicas, halve ``batch_size``.

LLM data (:mod:`collective_loader.text`): ``layout=`` says where a sample's tokens are (LLM
Foundry's ``tokens`` bytes with their ``dtype``, an integer ndarray, or ``text`` with a
tokenizer); ``packing=`` packs documents into rows of ``seq_len + 1`` tokens on the leader::

    source = StreamingSource(mesh, local="/data/mds", batch_size=8, num_workers=2,
                             layout=TextColumn(tokenizer="/assets/tokenizer.json"),
                             packing=Packing(seq_len=2048, boundaries=("position_ids", "cu_seqlens")))

The DataLoader's workers read and tokenize sample-batches of ``documents_per_batch`` samples;
the leader's main process packs them, in the DataLoader's order, into steps of ``batch_size``
rows. Its state hands over what each leader has trained (:mod:`collective_loader.text.resume`), so
a resume, with the same DP degree or another, trains every token once.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader

from collective_loader.delivery.leaders import LeaderGroup
from collective_loader.delivery.workers import stop_dataloader_workers, stop_workers
from collective_loader.plan.mesh import DEFAULT_PLACEMENT, MeshLayout, Placement
from collective_loader.streaming.balancing import BalancedRows
from collective_loader.streaming.cleanup import release, remove_stale
from collective_loader.streaming.leaders import leader_env, leaders_barrier, leaders_world
from collective_loader.text.collate import lm_collate
from collective_loader.text.layouts import ColumnLayout, DocumentCollate, TextColumn, TokenColumn
from collective_loader.text.packing import Packing
from collective_loader.text.resume import Cursor, combine
from collective_loader.text.rows import PackedRows

Sample = Mapping[str, Any]
CLOSE_WAIT = 60.0  # seconds a leader waits for the others before releasing shared files


class StreamingSource:
    """Builds a ``StreamingDataset`` and its ``DataLoader`` on the leaders; pass it to
    ``CollectiveLoader`` as the source.

    Construct it on **every** rank (it creates a process group of the leaders, which every rank
    must join); the dataset itself is built only when ``CollectiveLoader`` calls it, on leaders.

    Args:
        mesh: the same ``DeviceMesh`` given to ``CollectiveLoader``.
        batch_size: per-replica batch size of one step: samples, or rows when packing.
        collate: samples -> batch; :func:`lm_collate` by default (reading ``layout``'s token
            column). Not with ``packing``, which makes the batches itself.
        layout: where a sample's tokens are: :class:`~collective_loader.text.layouts.TokenColumn`
            (bytes of a ``dtype``, or an integer ndarray) or, with ``packing``,
            :class:`~collective_loader.text.layouts.TextColumn` (text and a tokenizer). Default
            ``TokenColumn("tokens")``.
        packing: pack documents into rows (:class:`~collective_loader.text.packing.Packing`);
            batches then hold ``input_ids``, ``labels`` and the boundaries it asks for.
        documents_per_batch: with ``packing``, samples per DataLoader batch (and streaming's
            ``batch_size``); ``batch_size`` by default. Elastic resume keeps it times dp_size.
        num_workers: DataLoader worker processes per leader.
        roles: dim roles, as for ``CollectiveLoader``.
        placement: where the leaders sit, as for ``CollectiveLoader`` (``"spread"`` by default;
            give both the same).
        clean_stale: first remove the shared memory and lock files killed runs left on this
            node (:func:`remove_stale`); blocks that a live process maps are kept.
        timeout: seconds the leaders wait for each other while building.
        dataloader_kwargs: more DataLoader arguments (``pin_memory``, ``prefetch_factor``, …).
        **dataset_kwargs: passed to ``StreamingDataset`` unchanged (``local``, ``remote``,
            ``streams``, ``shuffle``, ``shuffle_algo``, ``shuffle_seed``,
            ``num_canonical_nodes``, ``epoch_size``, …).
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        *,
        batch_size: int,
        collate: Callable[[Sequence[Sample]], Mapping[str, Any]] | None = None,
        layout: ColumnLayout | None = None,
        packing: Packing | None = None,
        documents_per_batch: int | None = None,
        num_workers: int = 0,
        roles: Mapping[str, str] | None = None,
        placement: Placement = DEFAULT_PLACEMENT,
        clean_stale: bool = False,
        timeout: float = 600.0,
        dataloader_kwargs: Mapping[str, Any] | None = None,
        **dataset_kwargs: Any,
    ) -> None:
        if "batch_size" in (dataloader_kwargs or {}) or "replication" in dataset_kwargs:
            raise ValueError("give batch_size once, to StreamingSource; replication is what this class replaces")
        layout = TokenColumn() if layout is None else layout
        _check_text_options(layout, packing, collate, documents_per_batch)
        mesh_layout = MeshLayout.from_mesh(mesh, roles, placement)
        self.place = mesh_layout.place(dist.get_rank())
        leaders = mesh_layout.leaders()
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        # pure arithmetic from the layout and the node size, done on every rank: a placement
        # streaming cannot express is refused everywhere, not on the leaders alone (the others
        # would wait for them in a group creation until killed)
        self._env = leader_env(leaders, self.place.dp_rank, local_world_size)
        self._leaders = LeaderGroup.build(leaders, timeout, "streaming_leaders")
        # balancing runs on the transfer thread: a group of its own, apart from gather_state's
        self._balance = (
            LeaderGroup.build(leaders, timeout, "balance") if packing is not None and packing.balance else None
        )
        self.batch_size = batch_size
        self.packing = packing
        self.layout = layout
        # what streaming and the DataLoader batch: samples of a step, or of a sample-batch when packing
        self.documents_per_batch = batch_size if packing is None else (documents_per_batch or batch_size)
        self._collate: Callable[[Sequence[Sample]], Any]
        if packing is not None:
            self._collate = DocumentCollate(layout)
        elif collate is not None:
            self._collate = collate
        else:
            assert isinstance(layout, TokenColumn)
            self._collate = functools.partial(lm_collate, key=layout.column, dtype=layout.dtype)
        self._num_workers = num_workers
        self._clean_stale = clean_stale
        self._dataloader_kwargs = dict(dataloader_kwargs or {})
        self._dataset_kwargs = dataset_kwargs

    def __call__(self) -> LeaderStream:
        """Build the dataset and DataLoader (leaders only; ``CollectiveLoader`` calls this)."""
        if not self.place.is_leader:
            raise RuntimeError(f"rank {self.place.rank} is not a leader; only leaders build the dataset")
        from collective_loader.streaming.dataset import DownloadFailureRaisingDataset
        from collective_loader.streaming.indexed import IndexedDataset

        kind = DownloadFailureRaisingDataset if self.packing is None else IndexedDataset
        with leaders_world(self._env, self._leaders.group):
            if self._clean_stale:
                if self.place.dp_rank % int(self._env["LOCAL_WORLD_SIZE"]) == 0:  # the node's first leader
                    remove_stale()
                leaders_barrier()  # nobody looks for blocks while they are removed
            dataset = kind(batch_size=self.documents_per_batch, **self._dataset_kwargs)
        loader = DataLoader(
            dataset,
            batch_size=self.documents_per_batch,
            num_workers=self._num_workers,
            collate_fn=self._collate,
            **self._dataloader_kwargs,
        )
        global_batch = self.documents_per_batch * self.place.dp_size
        if self.packing is None:
            return LeaderStream(dataset, loader, global_batch, self._leaders)
        world = (int(self._env["WORLD_SIZE"]), int(self._env["LOCAL_WORLD_SIZE"]))
        balanced = None
        if self._balance is not None:
            balanced = BalancedRows(self.packing, self.batch_size, self.place.dp_rank, self._balance)
        return LeaderStream(
            dataset,
            loader,
            global_batch,
            self._leaders,
            PackedRows(self.packing, self.batch_size, self.place.dp_rank, world),
            balanced,
        )


def _check_text_options(layout: Any, packing: Packing | None, collate: Any, documents_per_batch: int | None) -> None:
    """Refuse options that do not fit together (on every rank, at construction)."""
    if not isinstance(layout, (TokenColumn, TextColumn)):
        raise TypeError(f"layout must be a TokenColumn or a TextColumn, got {type(layout).__qualname__}")
    if packing is not None and not isinstance(packing, Packing):
        raise TypeError(f"packing must be a Packing, got {type(packing).__qualname__}")
    if isinstance(layout, TextColumn) and packing is None:
        raise ValueError(
            f"TextColumn({layout.column!r}) needs packing=Packing(seq_len=...): tokenized text has any length, and "
            "packing cuts it into rows"
        )
    if packing is not None and collate is not None:
        raise ValueError("with packing=, StreamingSource makes the batches itself: leave out collate=")
    if packing is None and documents_per_batch is not None:
        raise ValueError("documents_per_batch= is the packing's sample-batch: give it with packing=, or leave it out")


class LeaderStream:
    """A leader's dataset and DataLoader, and a state that says where it is in them.

    Without packing, its state is streaming's own (``StreamingDataset.state_dict``) for the
    *global* number of samples consumed, ``batches taken x global batch``, plus the global batch
    size, which a resume must keep (``supports_elastic_resume``: the DP degree may change with
    it). Streaming is asked once per epoch; the per-batch snapshots are arithmetic on that answer
    (each call of streaming's ``state_dict`` after a resume maps one more shared-memory block
    until exit).

    With packing (``rows``), leaders take different numbers of samples per step, so each
    snapshot holds this leader's packer cursor, and :meth:`gather_state` (collective over the
    leaders, which ``CollectiveLoader.state_dict`` calls) turns the leaders' snapshots into one
    state every rank saves: streaming's state at the lowest cursor step, and the hand-over of the
    documents trained since (:mod:`collective_loader.text.resume`).
    """

    supports_elastic_resume = True

    def __init__(
        self,
        dataset: Any,
        loader: DataLoader,
        global_batch: int,
        leaders: LeaderGroup,
        rows: PackedRows | None = None,
        balanced: BalancedRows | None = None,
    ) -> None:
        self.dataset: Any = dataset
        self.loader: DataLoader | None = loader
        self.global_batch = global_batch
        self.rows = rows
        self.balanced = balanced
        self._leaders = leaders
        self._taken = 0
        self._epoch_state: dict[str, Any] | None = None
        self._batches: Any = None  # the DataLoader iterator of the current (or last) epoch

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        assert self.loader is not None, "LeaderStream used after close()"
        self._taken, self._epoch_state = 0, None
        batches = self._batches = iter(self.loader)
        try:
            if self.rows is not None and self.balanced is not None:
                yield from self.balanced.batches(self.rows.row_lists(batches, self._first_step))
                return
            if self.rows is not None:
                yield from self.rows.rows(batches, self._first_step)
                return
            for batch in batches:
                self._epoch_start()  # the epoch has started: streaming knows its offset now
                self._taken += 1
                yield batch
        except GeneratorExit:  # left early (CollectiveLoader.close): workers exit now, not at gc
            stop_workers(batches, self.loader)
            raise

    def _epoch_start(self) -> dict[str, Any]:
        if self._epoch_state is None:
            self._epoch_state = self.dataset.state_dict(num_samples=0, from_beginning=False)
        return self._epoch_state

    def _first_step(self) -> int:
        offset = self._epoch_start()["sample_in_epoch"]
        if offset % self.global_batch:
            raise ValueError(
                f"the epoch resumed at sample {offset}, which is no whole number of steps of {self.global_batch} samples "
                "(documents_per_batch x dp_size): resume a packing source from its own state"
            )
        return offset // self.global_batch

    def state_dict(self) -> dict[str, Any]:
        """Right after a batch: without packing, the state to resume from; with packing, this
        leader's snapshot, which :meth:`gather_state` turns into that state."""
        state = dict(self._epoch_start())
        if self.rows is None:
            state["sample_in_epoch"] += self._taken * self.global_batch
            return {**state, "global_batch": self.global_batch}
        cursor = self.rows.cursor()
        state["sample_in_epoch"] = cursor.step * self.global_batch  # this leader's own; gather_state takes the lowest
        packed = {"cursor": [cursor.step, cursor.index, cursor.offset], "iteration": self.rows.iteration}
        return {**state, "global_batch": self.global_batch, "packing": packed}

    def gather_state(self, state: Any) -> Any:
        """Every leader's snapshot (:meth:`state_dict`) of the same step in one state, returned on
        every leader: streaming's state at the lowest cursor step ``D`` over the leaders, and
        ``packing = {"world": [leaders, leaders per node], "entries": (n, 4) int64 tensor}``, the
        hand-over of the documents trained at steps ``>= D``. Collective over the leaders: call it
        on every leader at the same step (``CollectiveLoader.state_dict`` does). Other states
        (not packing, or already gathered) are returned as they are.
        """
        rows = self.rows
        if rows is None or not isinstance(state, Mapping) or "cursor" not in state.get("packing", {}):
            return state
        if state["packing"]["iteration"] != rows.iteration:
            raise RuntimeError("the packing state is of an earlier epoch than the one this leader is in")
        cursor = Cursor(*state["packing"]["cursor"])
        first = min(self._leaders.gather(cursor.step))
        parts = self._leaders.gather(rows.log.hand_over(rows.dp_rank, cursor, first))
        entries = combine(parts, rows.resumed, first)
        rows.log.prune(first)
        out = {k: v for k, v in state.items() if k != "packing"}
        out["sample_in_epoch"] = first * self.global_batch
        out["packing"] = {"world": list(rows.world), "entries": torch.from_numpy(entries)}
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("global_batch") != self.global_batch:
            raise ValueError(
                f"the state was saved with a global batch of {state.get('global_batch')} samples; this run's is "
                f"{self.global_batch} ({'documents_per_batch' if self.rows else 'batch_size'} x dp_size): streaming "
                "resumes exactly only with the same global batch"
            )
        packed = state.get("packing")
        if (packed is None) != (self.rows is None):
            raise ValueError(
                "the state was saved "
                + ("with" if packed is not None else "without")
                + " packing and this source "
                + ("does not pack" if self.rows is None else "packs")
                + ": resume with the source that saved it"
            )
        if packed is not None:
            assert self.rows is not None
            if "entries" not in packed:
                raise ValueError(
                    "a packing leader's own snapshot cannot resume: pass the state gather_state returns "
                    "(CollectiveLoader.state_dict does)"
                )
            self.rows.resume(np.asarray(packed["entries"], dtype=np.int64).reshape(-1, 4), packed["world"])
        self.dataset.load_state_dict({k: v for k, v in state.items() if k not in ("global_batch", "packing")})

    def packing_stats(self) -> dict[str, float]:
        """This leader's packing in the current (or last) epoch: ``documents`` taken, ``rows``
        packed (padding rows included), ``tokens`` of documents in them, ``carried`` (tokens of a
        document begun in an earlier row), ``padding`` (token slots of padding), ``dropped``
        (tokens of the last partial rows and batch with ``at_end="drop"``). With
        ``Packing(balance=...)`` also ``balanced_steps`` and, averaged over them, the replicas'
        cost max/mean as the leaders packed the rows (``cost_max_over_mean_packed``) and as they
        were placed (``cost_max_over_mean``). Empty without packing."""
        if self.rows is None:
            return {}
        out: dict[str, float] = dict(self.rows.stats)
        if self.balanced is not None:
            figures = self.balanced.stats
            steps = int(figures["steps"])
            out["balanced_steps"] = steps
            out["cost_max_over_mean_packed"] = figures["cost_ratio_packed"] / steps if steps else 1.0
            out["cost_max_over_mean"] = figures["cost_ratio_placed"] / steps if steps else 1.0
        return out

    def close(self) -> None:
        """Release the dataset's shared memory and lock files now rather than at interpreter exit.

        Every leader calls it (``CollectiveLoader.close`` does); it first waits, at most
        ``CLOSE_WAIT`` seconds, for the other leaders, which share the node's blocks and locks.
        """
        if self.dataset is None:
            return
        # the last epoch's workers: a packing leader's epoch can end at another leader's last step,
        # leaving its DataLoader iterator (and workers) unfinished; and persistent_workers
        stop_workers(self._batches, self.loader)
        stop_dataloader_workers(self.loader)
        dataset, self.dataset, self.loader = self.dataset, None, None
        missing = self._leaders.wait_for_all(CLOSE_WAIT)
        if missing is not None:
            warnings.warn(
                f"not every leader closed its dataset; leaving streaming's files in place: {missing}", stacklevel=2
            )
            return
        release(dataset)
