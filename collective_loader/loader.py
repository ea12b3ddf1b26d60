"""``CollectiveLoader``: one leader per data-parallel replica loads; every rank gets what it needs.

Per step the leader takes one batch from its source, agrees with the other replicas' leaders on
whether every replica has one (so all replicas stop at the same step), and sends one message
(header, description and tensors in one buffer) per delivery group: first stage, last stage, and
middle stages (a header-only message unless ``every_stage`` keys exist); see
:mod:`collective_loader.protocol`. While batch sizes repeat that is one collective per group
(see :class:`~collective_loader.transport.Channel`). A watchdog on each leader reports a source
that stalls. Every rank runs the gloo part on a background thread that works at most
``prefetch`` steps ahead of what its training loop has consumed, so delivery overlaps compute,
and no rank ever waits inside a collective for a peer that is not about to post the matching
one. No NCCL collective is ever issued off the training thread.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import hashlib
import math
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping

import torch
import torch.distributed as dist

from collective_loader import protocol, wire
from collective_loader.device import hand_over
from collective_loader.errors import ConfigMismatchError, ConstructionError, DeliveryError, LeaderError
from collective_loader.layout import MeshLayout, Placement
from collective_loader.prefetch import Prefetcher
from collective_loader.routing import Routing
from collective_loader.sharding import Layout
from collective_loader.transport import Transport, agreed, build_groups, control_group, first_difference, mesh_device
from collective_loader.watchdog import StallWatch
from collective_loader.wire import Kind
from collective_loader.workers import stop_workers

Delivery = Literal["broadcast", "scatter"]
Batch = dict[str, Any]
JOIN_WAIT = 5.0  # seconds to wait for a transfer thread that has delivered its last step


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
        layout: ``"zigzag"`` or ``"contiguous"``: how a sequence is split over a shard dim.
        roles: ``{dim_name: "data" | "pipeline" | "replicate" | "shard"}`` overriding the
            defaults (see :data:`collective_loader.layout.DEFAULT_ROLES`).
        placement: where each replica's leader sits: ``"spread"`` (default: over the pipeline
            stages, so the loading spreads over their nodes) or ``"first_stage"`` (every leader on
            the first stage; see :class:`~collective_loader.layout.MeshLayout`). Give a
            ``StreamingSource`` the same.
        delivery: ``"broadcast"`` (one collective, receivers slice their shard) or
            ``"scatter"`` (each rank receives only its bytes).
        transport: ``"host"`` (default): everything moves over gloo groups on the transfer
            thread, in (pinned) host memory; on a CUDA mesh each rank then copies its batch to
            its GPU on a side stream. ``"device"``: tensor bytes move over groups of the mesh
            device's backend (NCCL on a CUDA mesh, gloo on a CPU mesh), posted by the training
            thread inside ``next()``; for payloads that need NVLink/InfiniBand bandwidth. Every
            rank must then call ``next()`` once per step, and no other thread may issue NCCL
            collectives meanwhile (see the README's "GPUs").
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
        mesh: Any,
        *,
        inputs: tuple[str, ...] = ("input_ids", "position_ids"),
        labels: tuple[str, ...] = ("labels",),
        every_stage: tuple[str, ...] = (),
        seq_dims: Mapping[str, int] | None = None,
        layout: Layout = "zigzag",
        roles: Mapping[str, str] | None = None,
        placement: Placement = "spread",
        delivery: Delivery = "broadcast",
        transport: Transport = "host",
        prefetch: int | None = None,
        timeout: float = 600.0,
        max_batch_bytes: int = 1 << 32,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("CollectiveLoader needs torch.distributed initialized (init_process_group) first")
        # each construction phase ends in an agreement over this group: a phase that fails on
        # some ranks ends construction on every rank, with that rank's error (transport.agreed)
        control = control_group(timeout)
        agreed(
            control,
            lambda: self._configure(
                mesh, inputs, labels, every_stage, seq_dims, layout, roles, placement, delivery, transport, prefetch,
                timeout, max_batch_bytes,
            ),
            lambda rank, text: ConstructionError(f"rank {rank} could not build CollectiveLoader: {text}"),
        )
        # a buffer per step in flight (the queue, the loop's batch, the one being filled, one
        # posted or copied to the GPU) per distinct scatter part; a loop that keeps batches makes
        # the pool allocate, never overwrite
        parts = math.prod(size for _, size in self.routing.shard_dims) if delivery == "scatter" else 1
        self._groups = build_groups(
            control, self.mesh_layout, self.place, self.device, transport, self.timeout, delivery == "scatter",
            (self.prefetch + 3) * parts, middle_data=bool(self.routing.every_stage),
        )
        self._check_same_config()
        self._source = agreed(
            control,
            lambda: self._resolve(source) if self.is_leader else None,
            lambda rank, text: LeaderError(f"leader rank {rank} could not build its source: {text}"),
        )
        self._epoch: _Epoch | None = None
        self._resume: dict[str, Any] | None = None
        self.epoch = 0  # epochs started
        _LIVE.add(self)

    def _configure(
        self, mesh: Any, inputs: tuple[str, ...], labels: tuple[str, ...], every_stage: tuple[str, ...],
        seq_dims: Mapping[str, int] | None, layout: Layout, roles: Mapping[str, str] | None, placement: Placement,
        delivery: Delivery, transport: Transport, prefetch: int | None, timeout: float, max_batch_bytes: int,
    ) -> None:
        """Check the arguments and derive this rank's settings (local: no collective)."""
        if delivery not in ("broadcast", "scatter"):
            raise ValueError(f"delivery must be 'broadcast' or 'scatter', got {delivery!r}")
        if transport not in ("host", "device"):
            raise ValueError(f"transport must be 'host' or 'device', got {transport!r}")
        self.mesh_layout = MeshLayout.from_mesh(mesh, roles, placement)
        world = dist.get_world_size()
        if sorted(self.mesh_layout.ranks) != list(range(world)):
            raise ValueError(f"the mesh must hold every rank of the world (size {world}); it holds {sorted(self.mesh_layout.ranks)}")
        self.place = self.mesh_layout.place(dist.get_rank())
        shard_dims = tuple(
            (n, s) for n, s, r in zip(self.mesh_layout.dim_names, self.mesh_layout.shape, self.mesh_layout.roles)
            if r == "shard"
        )
        self.routing = Routing(tuple(inputs), tuple(labels), dict(seq_dims or {}), layout, shard_dims, tuple(every_stage))
        self.delivery = delivery
        self.transport = transport
        self.device = mesh_device(mesh.device_type)  # where batches land
        self.prefetch = max(2, self.place.pp_size) if prefetch is None else int(prefetch)
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        self.timeout = float(timeout)
        if not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.max_batch_bytes = int(max_batch_bytes)

    # --- public facts ------------------------------------------------------------------------

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
    def group_count(self) -> int:
        """Process groups this loader created (every rank creates the same ones)."""
        return self._groups.count

    # --- construction checks -----------------------------------------------------------------

    def _check_same_config(self) -> None:
        reference = self.mesh_layout.leaders()[0]
        text = config_text(
            self.mesh_layout, self.routing, self.delivery, self.transport, self.prefetch, self.timeout,
            self.max_batch_bytes,
        )
        found = first_difference(self._groups, reference, text)
        if found is not None:
            rank, theirs_ref, theirs = found
            raise ConfigMismatchError(
                f"rank {rank} built CollectiveLoader with other arguments than rank {reference} (the lowest such rank "
                f"is named; others may differ too).\n  rank {reference}: {theirs_ref}\n  rank {rank}: {theirs}"
            )

    @staticmethod
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
        self._epoch = _Epoch(self, resume)
        self.epoch += 1
        if resume is None or not resume["steps"]:
            return self._epoch
        return self._resumed(self._epoch)

    def _resumed(self, epoch: "_Epoch") -> Iterator[Batch]:
        """A resumed epoch; when its checkpoint was taken right after its last batch, the next
        epoch instead of an empty one (every rank sees the same end at the same step)."""
        try:
            first = next(epoch)
        except StopIteration:
            epoch = self._epoch = _Epoch(self, None)
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
        skips the consumed batches.
        """
        epoch = self._epoch
        state = {
            "format": 1,
            "dp_size": self.dp_size,
            "epoch": max(self.epoch - 1, 0),
            "steps": epoch.steps if epoch is not None else 0,
            "source": epoch.source_state if epoch is not None else None,
            "source_elastic": bool(getattr(self._source, "supports_elastic_resume", False)),
        }
        channel = self._groups.replica
        if self.is_leader:
            channel.send_plan(Kind.DATA, state["steps"], wire.plan(state))
            return state
        header, payload = channel.recv(self.max_batch_bytes)
        leader_state = wire.unpack(payload, header.meta_nbytes)
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
        for channel in self._groups.channels.values():
            for key in out:
                out[key] += getattr(channel, key)
        return out

    def __enter__(self) -> "CollectiveLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def config_text(
    mesh_layout: MeshLayout, routing: Routing, delivery: str, transport: str, prefetch: int, timeout: float,
    max_batch_bytes: int,
) -> str:
    """What every rank's loader must agree on, as one line; compared by digest
    (:func:`~collective_loader.transport.first_difference`), shown whole on a mismatch.

    >>> layout = MeshLayout.build(("dp", "tp"), (2, 2), range(4))
    >>> config_text(layout, Routing(("x",), ("y",), {}, "zigzag"), "broadcast", "host", 2, 60.0, 1024)[:47]
    'mesh=[dp=2(data) tp=2(replicate)] ranks_sha256='
    """
    # the rank order as a fingerprint: a 16k-rank list would be most of the text
    ranks = hashlib.sha256(str(list(mesh_layout.ranks)).encode()).hexdigest()[:16]
    r = routing
    return (
        f"mesh=[{mesh_layout.describe()}] ranks_sha256={ranks} placement={mesh_layout.placement} inputs={list(r.inputs)} labels={list(r.labels)} "
        f"every_stage={list(r.every_stage)} seq_dims={dict(sorted(r.seq_dims.items()))} layout={r.layout} "
        f"delivery={delivery} transport={transport} prefetch={prefetch} timeout={timeout} "
        f"max_batch_bytes={max_batch_bytes}"
    )


_LIVE: "weakref.WeakSet[CollectiveLoader]" = weakref.WeakSet()


@atexit.register
def _close_live_loaders() -> None:
    # A thread left inside a gloo collective at interpreter exit aborts the process.
    for loader in list(_LIVE):
        loader.close()


class _Epoch(Iterator[Batch]):
    """One pass over the source: the transfer thread's protocol steps, handed over one per ``next()``.

    The transfer thread (a :class:`~collective_loader.prefetch.Prefetcher`) runs the protocol's
    gloo part ahead of the loop. ``next()`` then, on the training thread: with the device
    transport, posts the next step's tensor collectives before it waits for this step's (so they
    overlap the step's compute, and are issued in program order); on a CUDA mesh, makes the
    current stream wait for the batch's copy to the GPU.
    """

    def __init__(self, loader: CollectiveLoader, resume: Mapping[str, Any] | None) -> None:
        self.loader = loader
        self._resume = resume
        self.steps = resume["steps"] if resume is not None else 0  # consumed, resumed ones included
        self.source_state = resume["source"] if resume is not None else None
        self._source_iter: Iterator[Mapping[str, Any]] | None = None
        self._finished = False
        self._posted: protocol.Posted | None = None  # device transport: the next step, on its way
        self._copies: collections.deque = collections.deque()  # (event, host tensors) of copies in flight
        place = loader.place
        stream = torch.cuda.Stream(loader.device) if loader.device.type == "cuda" else None
        name = f"collective_loader-r{place.rank}"
        if place.is_leader:
            self._watch: StallWatch | None = StallWatch(
                protocol.STALL_AFTER * loader.timeout, lambda step: self._prefetch.interrupt(self._step.stalled(step)),
                f"{name}-watch",
            )
            self._step: protocol.LeaderStep | protocol.MemberStep = protocol.LeaderStep(
                loader, stream, self._load, self._source_state, self._watch
            )
        else:
            self._watch = None
            self._step = protocol.MemberStep(loader, stream)
        # an exception in a step ends the epoch: it is raised in the training loop
        self._prefetch: Prefetcher[protocol.Item] = Prefetcher(
            self._step.step, loader.prefetch, is_last=lambda item: item.kind != Kind.DATA,
            on_error=protocol.failed, name=name,
        )

    # --- training-loop side ----------------------------------------------------------------

    def __next__(self) -> Batch:
        if self._finished:
            raise StopIteration
        try:
            item = self._next_item()
        except DeliveryError:
            self._finish()
            raise
        if item.kind != Kind.DATA:
            self._finish()
            if item.kind == Kind.END:
                raise StopIteration
            assert item.error is not None
            raise item.error
        self.steps += 1
        self.source_state = item.source_state
        while self._copies and self._copies[0][0].query():
            self._copies.popleft()  # their copies are done: the host buffers may be reused
        if item.event is not None:
            self._copies.append((item.event, item.host))
        return hand_over(item.batch, item.event)

    def _next_item(self) -> protocol.Item:
        if self.loader.transport == "host":
            return self._prefetch.take()
        posted = self._posted or protocol.post(self.loader, self._prefetch.take())
        self._posted = None
        if posted.item.kind == Kind.DATA:
            # every rank posts step k+1 in its k-th next(), so the order is the same everywhere
            self._posted = protocol.post(self.loader, self._prefetch.take())
        return protocol.complete(self.loader, posted)

    def _finish(self) -> None:
        self._finished = True
        self._prefetch.close(JOIN_WAIT)  # a thread stuck in a stalled source is left behind
        self._close_watch()

    def close(self) -> None:
        """Run the steps already granted (peers run them too), then stop the thread; an epoch
        left early also stops its source's iteration (and DataLoader workers) now."""
        early = not self._finished
        if self._posted is not None:  # posted by every rank alike: let it finish
            with contextlib.suppress(RuntimeError):
                protocol.complete(self.loader, self._posted)
            self._posted = None
        self._prefetch.close(JOIN_WAIT if self._finished else self.loader.timeout + JOIN_WAIT)
        self._finished = True
        self._close_watch()
        # a thread still inside the source after the wait keeps it
        if early and self._source_iter is not None and not self.in_source():
            stop_workers(self._source_iter, self.loader._source)
            close_generator = getattr(self._source_iter, "close", None)
            if callable(close_generator):
                close_generator()

    def _close_watch(self) -> None:
        if self._watch is not None and not self._prefetch.alive():
            self._watch.close()

    def in_source(self) -> bool:
        """Whether the transfer thread is still running (after :meth:`close`: stuck in the source)."""
        return self._prefetch.alive()

    # --- the leader's source -------------------------------------------------------------

    def _load(self, step: int) -> Mapping[str, Any]:
        if self._source_iter is None:
            self._source_iter = self._start_source()
        return next(self._source_iter)

    def _source_state(self) -> Any:
        source = self.loader._source
        return source.state_dict() if hasattr(source, "state_dict") else None

    def _start_source(self) -> Iterator[Mapping[str, Any]]:
        """``iter(source)``, resumed where a loaded state says."""
        source = self.loader._source
        resume = self._resume
        if resume is not None and resume["source"] is not None and hasattr(source, "load_state_dict"):
            source.load_state_dict(resume["source"])
            return iter(source)  # type: ignore[arg-type]
        it = iter(source)  # type: ignore[arg-type]
        if resume is not None and resume["steps"]:
            warnings.warn(
                f"the source has no state_dict/load_state_dict: resuming by skipping {resume['steps']} batches",
                stacklevel=2,
            )
            for _ in range(resume["steps"]):
                next(it)
        return it
