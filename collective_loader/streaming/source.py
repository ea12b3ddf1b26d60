"""mosaicml-streaming's ``StreamingDataset`` on the data-parallel leaders only.

Streaming assumes every rank builds and iterates the dataset and that ranks which should see the
same samples are adjacent. Under pipeline parallelism neither holds. :class:`StreamingSource`
builds the dataset and its ``DataLoader`` on the leaders alone, showing streaming a world of
exactly the leaders (rank = dp_rank, world = dp_size, local world = leaders on this node: see
:mod:`collective_loader.streaming.leaders_world`), and :class:`~collective_loader.CollectiveLoader`
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

import copy
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader

from collective_loader.delivery.leader_group import LeaderGroup
from collective_loader.plan.mesh import DEFAULT_PLACEMENT, MeshLayout, Placement, StageStyle
from collective_loader.streaming.balanced_rows import BalancedRows
from collective_loader.streaming.cleanup import remove_stale
from collective_loader.streaming.leaders_world import leader_env, leaders_barrier, leaders_world
from collective_loader.streaming.streams import BalancedStream, LeaderDataset, PackedStream, SampleStream
from collective_loader.text.collate import lm_collate
from collective_loader.text.layouts import ColumnLayout, DocumentCollate, TextColumn, TokenColumn
from collective_loader.text.packing import Packing
from collective_loader.text.rows import PackedRows
from collective_loader.types import Sample

STALE_AFTER = 2.0  # seconds: clean_stale keeps a block younger than this (remove_stale's min_age)


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
        stage_style: which pp ranks hold the first and the last stage, as for
            ``CollectiveLoader`` (``"loop"`` by default; ``"v"`` puts every leader on pp rank 0;
            give both the same).
        clean_stale: first remove the shared memory and lock files killed runs left on this
            node (:func:`remove_stale`); blocks that a live process maps, or that are younger
            than 2 s, are kept. Without it they stay, and no dataset built here takes their prefix.
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
        stage_style: StageStyle = "loop",
        clean_stale: bool = False,
        timeout: float = 600.0,
        dataloader_kwargs: Mapping[str, Any] | None = None,
        **dataset_kwargs: Any,
    ) -> None:
        if "batch_size" in (dataloader_kwargs or {}) or "replication" in dataset_kwargs:
            raise ValueError("give batch_size once, to StreamingSource; replication is what this class replaces")
        layout = TokenColumn() if layout is None else layout
        _check_text_options(layout, packing, collate, documents_per_batch)
        mesh_layout = MeshLayout.from_mesh(mesh, roles, placement, stage_style)
        self.place = mesh_layout.place(dist.get_rank())
        self.leaders = leaders = mesh_layout.leaders()
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        # pure arithmetic from the layout and the node size, done on every rank: a placement
        # streaming cannot express is refused everywhere, not on the leaders alone (the others
        # would wait for them in a group creation until killed)
        self._env = leader_env(leaders, self.place.dp_rank, local_world_size)
        # the same before any group: Balance(replicas=k) with a k that does not divide dp
        blocks = None if packing is None or packing.balance is None else packing.balance.blocks(self.place.dp_size)
        self._leaders = LeaderGroup.build(leaders, timeout, "streaming_leaders")
        # balancing runs on the transfer thread: groups of its own, apart from checkpoint_state's
        self._balance = None if blocks is None else balance_group(blocks, leaders, self.place.dp_rank, timeout)
        self.batch_size = batch_size
        self.packing = packing
        self.layout = layout
        self.timeout = timeout
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

    def saved_global_batches(self, state: Mapping[str, Any]) -> list[int] | None:
        """The global batch (samples of all leaders per step) a saved state counts in, as a list
        of one; ``None`` for a state a ``StreamingSource`` did not save (a mixture's). Every rank
        can ask, before a resume: the format stays this class's."""
        return [state["global_batch"]] if "global_batch" in state else None

    def over(self, **dataset_kwargs: Any) -> StreamingSource:
        """This source over another dataset: ``dataset_kwargs`` over the ``StreamingDataset``
        arguments it was given, everything else its own, its leaders' group too (a mixture's
        sources share one; no collective: it builds no group)."""
        other = copy.copy(self)
        other._dataset_kwargs = {**self._dataset_kwargs, **dataset_kwargs}
        return other

    def __call__(self) -> SampleStream | PackedStream:
        """Build the dataset and DataLoader (leaders only; ``CollectiveLoader`` calls this)."""
        if not self.place.is_leader:
            raise RuntimeError(f"rank {self.place.rank} is not a leader; only leaders build the dataset")
        from collective_loader.streaming.dataset import DownloadFailureRaisingDataset
        from collective_loader.streaming.indexed import IndexedDataset

        kind = DownloadFailureRaisingDataset if self.packing is None else IndexedDataset
        # the stream's, released when it closes (a failed construction keeps it, as other leaders
        # may still be inside one of its collectives)
        leaders = self._leaders.hold()
        with leaders_world(self._env, leaders.group):
            if self._clean_stale:
                if self.place.dp_rank % int(self._env["LOCAL_WORLD_SIZE"]) == 0:  # the node's first leader
                    remove_stale(min_age=STALE_AFTER)  # not another job's block of this very moment
                leaders_barrier()  # nobody looks for blocks while they are removed
            dataset = kind(batch_size=self.documents_per_batch, **self._dataset_kwargs)
        loader = DataLoader(
            dataset,
            batch_size=self.documents_per_batch,
            num_workers=self._num_workers,
            collate_fn=self._collate,
            **self._dataloader_kwargs,
        )
        data = LeaderDataset(dataset, loader, self.documents_per_batch * self.place.dp_size, leaders)
        if self.packing is None:
            return SampleStream(data)
        world = (int(self._env["WORLD_SIZE"]), int(self._env["LOCAL_WORLD_SIZE"]))
        rows = PackedRows(self.packing, self.batch_size, self.place.dp_rank, world)
        if self._balance is None:
            return PackedStream(data, rows)
        return BalancedStream(
            data, rows, BalancedRows(self.packing, self.batch_size, self.place.dp_rank, self._balance)
        )


def balance_group(blocks: Sequence[range], leaders: Sequence[int], dp_rank: int, timeout: float) -> LeaderGroup:
    """The group of the leaders of ``dp_rank``'s block of replicas (``Balance.blocks``).

    Every rank of the world creates every block's group, in the same order (``new_group`` is
    collective over the world), and keeps its own block's (its members, not the ranks outside it,
    ever use it). One block keeps the name of the group of all leaders.

    Example (every rank)::

        blocks = Balance(replicas=8).blocks(layout.place(rank).dp_size)
        group = balance_group(blocks, layout.leaders(), layout.place(rank).dp_rank, timeout=600.0)
    """
    mine = LeaderGroup(None)
    for b, block in enumerate(blocks):
        name = "balance" if len(blocks) == 1 else f"balance_{b}"
        group = LeaderGroup.build([leaders[d] for d in block], timeout, name, first_replica=block.start)
        if dp_rank in block:
            mine = group
    return mine


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
