"""``CollectiveLoader``: one leader per data-parallel replica loads; every rank gets what it needs.

Per step the leader takes one batch from its source, agrees with the other replicas' leaders on
whether every replica has one (so all replicas stop at the same step), and sends one message
(header, description and tensors in one buffer) per delivery group: first stage, last stage, and
middle stages (a header-only message unless ``every_stage`` keys exist); see
:mod:`collective_loader.delivery.protocol`. While batch sizes repeat that is one collective per group
(see :class:`~collective_loader.delivery.transport.Channel`). A watchdog on each leader reports a source
that stalls. Every rank runs the gloo part on a background thread that works at most
``prefetch`` steps ahead of what its training loop has consumed, so delivery overlaps compute,
and no rank ever waits inside a collective for a peer that is not about to post the matching
one. No NCCL collective is ever issued off the training thread.
"""

from __future__ import annotations

import atexit
import logging
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from collective_loader.delivery.agreement import (
    control_group,
    first_difference,
    run_phase,
)
from collective_loader.delivery.epoch import Epoch
from collective_loader.delivery.protocol import error_of
from collective_loader.delivery.settings import Delivery, Settings, config_text
from collective_loader.delivery.transport import Transport, build_groups, mesh_device
from collective_loader.delivery.workers import stop_workers
from collective_loader.errors import BatchError, ConfigMismatchError, ConstructionError, LeaderError
from collective_loader.plan import wire
from collective_loader.plan.mesh import DEFAULT_PLACEMENT, MeshLayout, Place, Placement
from collective_loader.plan.routing import Routing, SequenceSplit
from collective_loader.plan.wire import Kind

Batch = dict[str, Any]
log = logging.getLogger(__name__)


class CollectiveLoader:
    """Deliver each rank of a ``DeviceMesh`` exactly the data it needs, loaded once per replica.

    Args:
        source: an iterable of batches (mappings of str to tensors, nested mappings and plain
            values allowed), or a zero-argument callable returning one. Only leaders touch it;
            a callable is called only on leaders, so other ranks build nothing.
        mesh: a ``DeviceMesh`` with named dims, in any order, holding every rank of the world.
        inputs: keys delivered to every rank of the first pipeline stage.
        labels: keys delivered to every rank of the last pipeline stage.
        every_stage: keys delivered to every rank of every stage, middle stages included (e.g.
            packed-sequence metadata like ``cu_seqlens`` that every attention layer reads).
        seq_dims: keys split over the shard dims, and along which dim; other keys are copied.
        split: ``"zigzag"`` or ``"contiguous"``: how a sequence is cut over a shard dim
            (:mod:`collective_loader.plan.sharding`); or a
            :class:`~collective_loader.plan.documents.PerDocument`: each packed document cut on
            its own, with each rank's attention metadata (:mod:`collective_loader.plan.documents`).
        roles: ``{dim_name: "data" | "pipeline" | "replicate" | "shard"}`` overriding the
            defaults (see :data:`collective_loader.plan.mesh.DEFAULT_ROLES`).
        placement: where each replica's leader sits: ``"spread"`` (default: over the pipeline
            stages, so the loading spreads over their nodes) or ``"first_stage"`` (every leader on
            the first stage; see :class:`~collective_loader.plan.mesh.MeshLayout`). Give a
            ``StreamingSource`` the same.
        delivery: ``"broadcast"`` (one collective, receivers slice their shard) or
            ``"scatter"`` (each rank receives only its bytes).
        transport: ``"host"`` (default): everything moves over gloo groups on the transfer
            thread, in (pinned) host memory; on a CUDA mesh each rank then copies its batch to
            its GPU on a side stream. ``"device"``: tensor bytes move over groups of the mesh
            device's backend (NCCL on a CUDA mesh, gloo on a CPU mesh), posted by the training
            thread inside ``next()``; for payloads that need NVLink/InfiniBand bandwidth. Every
            rank must then call ``next()`` once per step, and no other thread may issue NCCL
            collectives meanwhile (see ``docs/gpus.md``).
        prefetch: steps the transfer runs ahead of the training loop; default
            ``max(2, pipeline stages)``.
        timeout: seconds any rank waits in one collective before raising :class:`DeliveryError`.
        max_batch_bytes: the largest payload one delivery group may carry; bigger batches raise
            :class:`BatchError` on every rank, and received headers over the cap are refused.

    Example (every rank)::

        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        loader = CollectiveLoader(lambda: DataLoader(ds, batch_size=8), mesh,
                                  inputs=("input_ids",), labels=("labels",))
        for batch in loader:
            if loader.is_first_stage: model(batch["input_ids"])
            if loader.is_last_stage:  loss(batch["labels"])
    """

    def __init__(
        self,
        source: Iterable[Mapping[str, Any]] | Callable[[], Iterable[Mapping[str, Any]]],
        mesh: DeviceMesh,
        *,
        inputs: tuple[str, ...] = ("input_ids", "position_ids"),
        labels: tuple[str, ...] = ("labels",),
        every_stage: tuple[str, ...] = (),
        seq_dims: Mapping[str, int] | None = None,
        split: SequenceSplit = "zigzag",
        roles: Mapping[str, str] | None = None,
        placement: Placement = DEFAULT_PLACEMENT,
        delivery: Delivery = "broadcast",
        transport: Transport = "host",
        prefetch: int | None = None,
        timeout: float = 600.0,
        max_batch_bytes: int = 1 << 32,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("CollectiveLoader needs torch.distributed initialized (init_process_group) first")
        # each construction phase ends in an agreement over this group: a phase that fails on
        # some ranks ends construction on every rank, with that rank's error (run_phase)
        control = control_group(timeout)
        checked = run_phase(
            control,
            lambda: _check_arguments(
                mesh,
                inputs,
                labels,
                every_stage,
                seq_dims,
                split,
                roles,
                placement,
                delivery,
                transport,
                prefetch,
                timeout,
                max_batch_bytes,
            ),
            lambda rank, text: ConstructionError(f"rank {rank} could not build CollectiveLoader: {text}"),
        )
        mesh_layout, place, routing, device, prefetch, timeout, max_batch_bytes = checked
        # a buffer per step in flight (the queue, the loop's batch, the one being filled, one
        # posted or copied to the GPU) per distinct scatter part; a loop that keeps batches makes
        # the pool allocate, never overwrite
        parts = math.prod(size for _, size in routing.shard_dims) if delivery == "scatter" else 1
        groups = build_groups(
            control,
            mesh_layout,
            place,
            device,
            transport,
            timeout,
            delivery == "scatter",
            (prefetch + 3) * parts,
            middle_data=bool(routing.every_stage),
        )
        self.settings = Settings(
            mesh_layout, place, routing, groups, device, transport, delivery, prefetch, timeout, max_batch_bytes
        )
        self._check_same_config()
        self._source = run_phase(
            control,
            lambda: _resolve(source) if place.is_leader else None,
            lambda rank, text: LeaderError(f"leader rank {rank} could not build its source: {text}"),
        )
        self._epoch: Epoch | None = None
        self._resume: dict[str, Any] | None = None
        self.epoch = 0  # epochs started
        _LIVE.add(self)
        _log_construction(self.settings)

    # --- public facts ------------------------------------------------------------------------

    @property
    def place(self) -> Place:
        """Where this rank sits: replica, leader, stage, shard (see :class:`~collective_loader.Place`)."""
        return self.settings.place

    @property
    def mesh_layout(self) -> MeshLayout:
        return self.settings.mesh_layout

    @property
    def routing(self) -> Routing:
        return self.settings.routing

    @property
    def device(self) -> torch.device:
        """Where delivered batches land: the mesh's device type (on ``"cuda"``, the current device
        when the loader was built)."""
        return self.settings.device

    @property
    def dp_rank(self) -> int:
        return self.place.dp_rank

    @property
    def dp_size(self) -> int:
        return self.place.dp_size

    @property
    def is_leader(self) -> bool:
        return self.place.is_leader

    @property
    def is_first_stage(self) -> bool:
        return self.place.is_first_stage

    @property
    def is_last_stage(self) -> bool:
        return self.place.is_last_stage

    @property
    def source(self) -> Iterable[Mapping[str, Any]] | None:
        """On a leader, the source it loads from (what ``source()`` returned, for a callable), for
        its own figures, e.g. ``loader.source.packing_stats()``; ``None`` on every other rank,
        which builds nothing. Iterate the loader, never the source."""
        return self._source

    @property
    def group_count(self) -> int:
        """Process groups this loader created (every rank creates the same ones)."""
        return self.settings.groups.count

    # --- construction checks -----------------------------------------------------------------

    def _check_same_config(self) -> None:
        settings = self.settings
        reference = settings.mesh_layout.leaders()[0]
        text = config_text(
            settings.mesh_layout,
            settings.routing,
            settings.delivery,
            settings.transport,
            settings.prefetch,
            settings.timeout,
            settings.max_batch_bytes,
        )
        found = first_difference(settings.groups, reference, text)
        if found is not None:
            rank, theirs_ref, theirs = found
            raise ConfigMismatchError(
                f"rank {rank} built CollectiveLoader with other arguments than rank {reference} (the lowest such rank "
                f"is named; others may differ too).\n  rank {reference}: {theirs_ref}\n  rank {rank}: {theirs}"
            )

    # --- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        """Start an epoch (or resume the one a loaded state was saved in).

        An unfinished previous epoch is closed first, on every rank alike.
        """
        if self._epoch is not None:
            self._epoch.close()
        resume, self._resume = self._resume, None
        if resume is not None:
            self.epoch = resume["epoch"]
        self._epoch = Epoch(self.settings, self._source, resume)
        self.epoch += 1
        if resume is None or not resume["steps"]:
            return self._epoch
        return self._resumed(self._epoch)

    def _resumed(self, epoch: Epoch) -> Iterator[Batch]:
        """A resumed epoch; when its checkpoint was taken right after its last batch, the next
        epoch instead of an empty one (every rank sees the same end at the same step)."""
        try:
            first = next(epoch)
        except StopIteration:
            epoch = self._epoch = Epoch(self.settings, self._source, None)
            self.epoch += 1
            try:
                first = next(epoch)
            except StopIteration:
                return
        yield first
        yield from epoch

    # --- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the training loop is: epoch, batches it consumed, and the leader's source state.

        Collective over each replica: call it on every rank at the same step (as a checkpoint
        does). Every rank of a replica returns the same dict. Batches that were prefetched but
        not consumed are not counted: after a resume they are delivered again.

        The source state is the leader's ``source.state_dict()`` taken right after the last
        consumed batch, when the source has one (a ``StatefulDataLoader``,
        :class:`collective_loader.streaming.StreamingSource`); otherwise ``None``, and a resume
        skips the consumed batches. A source with ``gather_state`` (a packing ``StreamingSource``)
        turns it into one state over every leader there (a collective over the leaders), so that
        every rank saves what every leader has trained.
        """
        epoch = self._epoch
        steps = epoch.steps if epoch is not None else 0
        source_state = epoch.source_state if epoch is not None else None
        gather = getattr(self._source, "gather_state", None)
        if self.is_leader and callable(gather):
            source_state = gather(source_state)
        state = {
            "format": 1,
            "dp_size": self.dp_size,
            "epoch": max(self.epoch - 1, 0),
            "steps": steps,
            "source": source_state,
            "source_elastic": bool(getattr(self._source, "supports_elastic_resume", False)),
        }
        channel = self.settings.groups.replica
        if self.is_leader:
            try:
                plan = wire.plan(state)
            except BatchError as e:  # the replica waits for this message: send it the error instead
                text = f"leader rank {self.place.rank} cannot send its loader state to its replica: {e}"
                channel.send_plan(Kind.BATCH_ERROR, steps, wire.plan({"message": text}))
                raise BatchError(text) from e
            channel.send_plan(Kind.DATA, steps, plan)
            return state
        header, payload = channel.recv(self.settings.max_batch_bytes)
        leader_state = wire.unpack(payload, header.meta_nbytes)
        if header.kind != Kind.DATA:
            raise error_of(header.kind, str(leader_state.get("message")))
        if leader_state["steps"] != state["steps"] or leader_state["epoch"] != state["epoch"]:
            raise RuntimeError(
                f"rank {self.place.rank} asked for the loader state at epoch {state['epoch']} step {state['steps']}, "
                f"but its leader rank {self.place.leader} at epoch {leader_state['epoch']} step "
                f"{leader_state['steps']}: call state_dict() on every rank after the same step"
            )
        return leader_state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` at the next ``iter(loader)``; call on every rank.

        Raises ``ValueError`` for a state this loader cannot resume: another format, or another
        DP degree with a source that cannot re-partition (only sources that declare
        ``supports_elastic_resume``, such as ``StreamingSource`` with the same global batch, can).
        """
        if not isinstance(state, Mapping) or state.get("format") != 1:
            raise ValueError(f"not a CollectiveLoader state (format 1): {str(state)[:200]}")
        if state["dp_size"] != self.dp_size and not state["source_elastic"]:
            raise ValueError(
                f"the state was saved with {state['dp_size']} data-parallel replicas and this loader has "
                f"{self.dp_size}; its source cannot re-partition consumed data over another DP degree "
                "(a StreamingSource with the same global batch size can)"
            )
        self._resume = dict(state)

    def close(self) -> None:
        """Finish the transfers already under way, stop the background thread, close the source.

        Call it on every rank before ``dist.destroy_process_group()``; at interpreter exit it
        runs by itself.
        """
        if self._epoch is not None:
            self._epoch.close()
        if self._epoch is None or not self._epoch.in_source():
            # a DataLoader with persistent_workers keeps its workers after the last epoch
            stop_workers(getattr(self._source, "_iterator", None), self._source)
        close_source = getattr(self._source, "close", None)
        if callable(close_source):
            if self._epoch is not None and self._epoch.in_source():
                warnings.warn("the source is still inside a stalled call; it is left open", stacklevel=2)
            else:
                close_source()
        _LIVE.discard(self)

    def stats(self) -> dict[str, int]:
        """Collectives and bytes this rank has sent and received through its delivery groups."""
        out = {"collectives": 0, "bytes_sent": 0, "bytes_received": 0}
        for channel in self.settings.groups.channels.values():
            for key in out:
                out[key] += getattr(channel, key)
        return out

    def __enter__(self) -> CollectiveLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_LIVE: weakref.WeakSet[CollectiveLoader] = weakref.WeakSet()


@atexit.register
def _close_live_loaders() -> None:
    # A thread left inside a gloo collective at interpreter exit aborts the process.
    for loader in list(_LIVE):
        loader.close()


def _check_arguments(
    mesh: DeviceMesh,
    inputs: tuple[str, ...],
    labels: tuple[str, ...],
    every_stage: tuple[str, ...],
    seq_dims: Mapping[str, int] | None,
    split: SequenceSplit,
    roles: Mapping[str, str] | None,
    placement: Placement,
    delivery: Delivery,
    transport: Transport,
    prefetch: int | None,
    timeout: float,
    max_batch_bytes: int,
) -> tuple[MeshLayout, Place, Routing, torch.device, int, float, int]:
    """Check the arguments and derive this rank's settings (local: no collective)."""
    if delivery not in ("broadcast", "scatter"):
        raise ValueError(f"delivery must be 'broadcast' or 'scatter', got {delivery!r}")
    if transport not in ("host", "device"):
        raise ValueError(f"transport must be 'host' or 'device', got {transport!r}")
    mesh_layout = MeshLayout.from_mesh(mesh, roles, placement)
    world = dist.get_world_size()
    if sorted(mesh_layout.ranks) != list(range(world)):
        raise ValueError(
            f"the mesh must hold every rank of the world (size {world}); it holds {sorted(mesh_layout.ranks)}"
        )
    place = mesh_layout.place(dist.get_rank())
    routing = Routing(
        tuple(inputs), tuple(labels), dict(seq_dims or {}), split, mesh_layout.shard_dims(), tuple(every_stage)
    )
    steps_ahead = max(2, place.pp_size) if prefetch is None else int(prefetch)
    if steps_ahead < 1:
        raise ValueError(f"prefetch must be >= 1, got {prefetch}")
    if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return mesh_layout, place, routing, mesh_device(mesh.device_type), steps_ahead, float(timeout), int(max_batch_bytes)


def _resolve(source: Any) -> Iterable[Mapping[str, Any]]:
    """A leader's source: ``source`` itself, or what calling it returns."""
    if hasattr(source, "__iter__"):
        return source
    if not callable(source):
        raise TypeError(f"source must be an iterable or a callable, got {type(source).__qualname__}")
    built = source()
    if not hasattr(built, "__iter__"):
        raise TypeError(f"source() returned a {type(built).__qualname__}, which is not iterable")
    return built


def _log_construction(settings: Settings) -> None:
    """INFO: on rank 0 what the loader decided for the whole mesh; on each leader its replica."""
    if not log.isEnabledFor(logging.INFO):
        return
    layout, place, groups = settings.mesh_layout, settings.place, settings.groups
    if place.rank == 0:
        log.info(
            "CollectiveLoader: mesh [%s], %d replicas, leaders %s (placement=%s); %d process groups (every rank makes them); "
            "delivery=%s transport=%s device=%s prefetch=%d timeout=%.0fs",
            layout.describe(),
            layout.dp_size,
            list(layout.leaders()),
            layout.placement,
            groups.count,
            settings.delivery,
            settings.transport,
            settings.device,
            settings.prefetch,
            settings.timeout,
        )
    if place.is_leader:
        channels = ", ".join(f"{name} {list(ch.ranks)}" for name, ch in groups.channels.items())
        log.info(
            "CollectiveLoader: rank %d leads replica %d (dp_rank %d of %d, %s stage); delivers to %s",
            place.rank,
            place.dp_rank,
            place.dp_rank,
            place.dp_size,
            place.stage,
            channels,
        )
