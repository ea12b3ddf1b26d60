"""``CollectiveLoader``: one leader per data-parallel replica loads; every rank gets what it needs.

Per step the leader takes one batch from its source, agrees with the other replicas' leaders on
whether every replica has one (so all replicas stop at the same step), and sends one message
(header, description and tensors in one buffer) per delivery group: first stage, last stage, and
middle stages (a header-only message unless ``every_stage`` keys exist). While batch sizes repeat that is one collective per
group (see :class:`~collective_loader.transport.Channel`). A watchdog on each leader reports a
source that stalls. Every rank runs the transfer on a background thread that works at most ``prefetch`` steps
ahead of what its training loop has consumed, so delivery overlaps compute, and no rank ever
waits inside a collective for a peer that is not about to post the matching one.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import queue
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping

import torch
import torch.distributed as dist

from collective_loader import transport, wire
from collective_loader.errors import BatchError, ConfigMismatchError, DeliveryError, LeaderError, WireError
from collective_loader.layout import MeshLayout
from collective_loader.routing import Routing
from collective_loader.sharding import Layout
from collective_loader.wire import Kind

Delivery = Literal["broadcast", "scatter"]
Batch = dict[str, Any]
# a leader whose source has not returned a batch after this share of `timeout` reports itself
# stalled (by 0.8 x timeout, see _StallWatch), so its peers, who wait at most `timeout` for it,
# hear why before they give up
STALL_AFTER = 0.75
JOIN_WAIT = 5.0  # seconds to wait for a transfer thread that has delivered its last step


@dataclass
class _Item:
    """What the transfer thread hands the training loop for one step."""

    kind: Kind
    batch: Batch = field(default_factory=dict)
    error: BaseException | None = None
    source_state: Any = None  # leader only: the source's state right after this batch


class _StallWatch:
    """A leader's watchdog: reports a source call that has not returned within ``after`` seconds.

    The transfer thread marks each call into the source with :meth:`loading`; the watchdog
    thread looks every ``after / 16`` seconds (nothing is signalled per step) and, once a call
    has taken longer than ``after``, sets ``stalled`` and calls ``report(step)``. Both happen
    under one lock, so either the call returned first or ``stalled`` is set: from then on the
    transfer thread delivers nothing and the collectives are the watchdog's.
    """

    def __init__(self, after: float, report: Callable[[int], None], name: str) -> None:
        self.after = after
        self.stalled = False
        self._report = report
        self._lock = threading.Lock()
        self._step: int | None = None  # the step being loaded, None between calls
        self._since = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def loading(self, step: int) -> Iterator[None]:
        with self._lock:
            self._step, self._since = step, time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._step = None

    def _run(self) -> None:
        while not self._stop.wait(self.after / 16):
            with self._lock:
                step = self._step
                if step is None or time.monotonic() - self._since < self.after:
                    continue
                self.stalled = True
            self._report(step)
            return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(JOIN_WAIT)


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
        delivery: ``"broadcast"`` (one collective, receivers slice their shard) or
            ``"scatter"`` (each rank receives only its bytes).
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
        delivery: Delivery = "broadcast",
        prefetch: int | None = None,
        timeout: float = 600.0,
        max_batch_bytes: int = 1 << 32,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("CollectiveLoader needs torch.distributed initialized (init_process_group) first")
        if delivery not in ("broadcast", "scatter"):
            raise ValueError(f"delivery must be 'broadcast' or 'scatter', got {delivery!r}")
        self.mesh_layout = MeshLayout.from_mesh(mesh, roles)
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
        self.prefetch = max(2, self.place.pp_size) if prefetch is None else int(prefetch)
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        self.timeout = float(timeout)
        self.max_batch_bytes = int(max_batch_bytes)
        # a buffer per step in flight (the queue, the loop's batch, the one being filled) per
        # distinct scatter part; a loop that keeps batches makes the pool allocate, never overwrite
        parts = math.prod(size for _, size in shard_dims) if delivery == "scatter" else 1
        self._groups = transport.build_groups(
            self.mesh_layout, self.place, self.timeout, delivery == "scatter", (self.prefetch + 2) * parts,
            middle_data=bool(self.routing.every_stage),
        )
        self._check_same_config()
        self._source = self._build_source(source)
        self._epoch: _Epoch | None = None
        self._resume: dict[str, Any] | None = None
        self.epoch = 0  # epochs started
        _LIVE.add(self)

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

    def _config(self) -> str:
        r = self.routing
        return (
            f"mesh=[{self.mesh_layout.describe()}] ranks={list(self.mesh_layout.ranks)} inputs={list(r.inputs)} "
            f"labels={list(r.labels)} every_stage={list(r.every_stage)} seq_dims={dict(sorted(r.seq_dims.items()))} layout={r.layout} "
            f"delivery={self.delivery} prefetch={self.prefetch} timeout={self.timeout} "
            f"max_batch_bytes={self.max_batch_bytes}"
        )

    def _check_same_config(self) -> None:
        configs = transport.gather_strings(self._groups.control, self._config())
        differ = [rank for rank, c in enumerate(configs) if c != configs[0]]
        if differ:
            first = differ[0]
            raise ConfigMismatchError(
                f"ranks {differ} built CollectiveLoader with other arguments than rank 0.\n"
                f"  rank 0:    {configs[0]}\n  rank {first}: {configs[first]}"
            )

    def _build_source(self, source: Any) -> Iterable[Mapping[str, Any]] | None:
        """Leaders resolve ``source``; every rank learns if any leader failed."""
        built, kind, message = None, Kind.DATA, ""
        if self.is_leader:
            try:
                if hasattr(source, "__iter__"):
                    built = source
                elif callable(source):
                    built = source()
                    if not hasattr(built, "__iter__"):
                        raise TypeError(f"source() returned a {type(built).__qualname__}, which is not iterable")
                else:
                    raise TypeError(f"source must be an iterable or a callable, got {type(source).__qualname__}")
            except Exception as e:  # reported on every rank below
                kind, message = Kind.SOURCE_ERROR, f"{type(e).__name__}: {e}"
                cause = e
        kind, message, origin = transport.agree(self._groups.control, kind, message)
        if kind == Kind.SOURCE_ERROR:
            error = LeaderError(f"leader rank {origin} could not build its source: {message}")
            if origin == self.place.rank:
                raise error from cause
            raise error
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
        return self._epoch

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


_LIVE: "weakref.WeakSet[CollectiveLoader]" = weakref.WeakSet()


@atexit.register
def _close_live_loaders() -> None:
    # A thread left inside a gloo collective at interpreter exit aborts the process.
    for loader in list(_LIVE):
        loader.close()


class _Epoch(Iterator[Batch]):
    """One pass over the source: a transfer thread plus the credits that bound its lead."""

    def __init__(self, loader: CollectiveLoader, resume: Mapping[str, Any] | None) -> None:
        self.loader = loader
        self._resume = resume
        self.steps = resume["steps"] if resume is not None else 0  # consumed, resumed ones included
        self.source_state = resume["source"] if resume is not None else None
        self._queue: queue.Queue[_Item] = queue.Queue()
        self._cond = threading.Condition()
        self._granted = loader.prefetch  # steps the thread may run; +1 per consumed batch
        self._done = 0  # steps the thread has run
        self._closing = False
        self._finished = False
        self._device = loader._groups.device
        place = loader.place
        self._watch = (
            _StallWatch(STALL_AFTER * loader.timeout, self._stalled, f"collective_loader-r{place.rank}-watch")
            if place.is_leader else None
        )
        target = self._lead if place.is_leader else self._receive
        self._thread = threading.Thread(target=self._run, args=(target,), name=f"collective_loader-r{place.rank}", daemon=True)
        self._thread.start()

    # --- training-loop side ----------------------------------------------------------------

    def __next__(self) -> Batch:
        if self._finished:
            raise StopIteration
        item = self._queue.get()
        if item.kind == Kind.DATA:
            self.steps += 1
            self.source_state = item.source_state
            with self._cond:
                self._granted += 1
                self._cond.notify()
            if self._device.type == "cuda":
                _record_stream(item.batch, torch.cuda.current_stream())
            return item.batch
        self._finished = True
        self._thread.join(JOIN_WAIT)  # a thread stuck in a stalled source is left behind
        if item.kind == Kind.END:
            raise StopIteration
        assert item.error is not None
        raise item.error

    def close(self) -> None:
        """Run the steps already granted (peers run them too), then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(JOIN_WAIT if self._finished else self.loader.timeout + JOIN_WAIT)
        self._finished = True
        # an epoch left early: stop the source's iterator now (DataLoader workers exit with it);
        # a thread still inside the source after the wait keeps it
        close_iter = getattr(getattr(self, "_source_iter", None), "close", None)
        if callable(close_iter) and not self.in_source():
            close_iter()

    def in_source(self) -> bool:
        """Whether the transfer thread is still running (after :meth:`close`: stuck in the source)."""
        return self._thread.is_alive()

    # --- transfer thread -------------------------------------------------------------------

    def _run(self, step_fn: Callable[[int], Kind]) -> None:
        stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            step = 0
            try:
                while True:
                    with self._cond:
                        while self._done >= self._granted and not self._closing:
                            self._cond.wait()
                        if self._done >= self._granted:
                            return
                    kind = step_fn(step)
                    if stream is not None:
                        stream.synchronize()  # the batch is complete before the loop sees it
                    self._done += 1
                    step += 1
                    if kind != Kind.DATA:
                        return
            except BaseException as e:  # handed to the training loop, raised there
                self._queue.put(_Item(Kind.SOURCE_ERROR, error=e))
            finally:
                if self._watch is not None:
                    self._watch.close()

    def _lead(self, step: int) -> Kind:
        loader, groups = self.loader, self.loader._groups
        kind, message, cause, parts, source_state = Kind.DATA, "", None, {}, None
        try:
            if step == 0:
                self._source_iter = self._start_source()
            with self._watch.loading(step):
                batch = next(self._source_iter)
            source_state = loader._source.state_dict() if hasattr(loader._source, "state_dict") else None
            loader.routing.check(batch)
            parts = {name: self._pack(ch, step, batch) for name, ch in groups.channels.items() if ch.carries_data}
        except StopIteration:
            kind = Kind.END
        except BatchError as e:
            kind, message, cause = Kind.BATCH_ERROR, str(e), e
        except Exception as e:
            kind, message, cause = Kind.SOURCE_ERROR, f"{type(e).__name__}: {e}", e
        if self._watch.stalled:  # the watchdog has told everyone; the collectives are its now
            return Kind.SOURCE_ERROR
        with self._collectives(f"gave up delivering step {step} to its replica"):
            return self._deliver(step, kind, message, cause, parts, source_state)

    def _stalled(self, step: int) -> None:
        """Watchdog: the source is still loading ``step``; say so on every rank."""
        message = (
            f"still loading step {step} after {self._watch.after:.0f}s: the source has not returned a batch "
            f"(timeout={self.loader.timeout}s; a leader reports a stall after {STALL_AFTER:.0%} of it)"
        )
        try:
            with self._collectives(f"gave up reporting a stalled source at step {step}"):
                self._deliver(step, Kind.SOURCE_ERROR, message, None, {}, None)
        except DeliveryError as e:
            self._queue.put(_Item(Kind.SOURCE_ERROR, error=e))

    def _deliver(
        self, step: int, kind: Kind, message: str, cause: BaseException | None, parts: dict, source_state: Any
    ) -> Kind:
        """Leader: agree on the step's outcome with the other leaders, then send it."""
        loader, place, groups = self.loader, self.loader.place, self.loader._groups
        origin = place.rank
        if groups.leaders is not None:
            try:
                kind, message, origin = transport.agree(groups.leaders, kind, message)
            except RuntimeError as e:
                text = self._failure(f"lost contact with the other leaders before step {step}", e)
                self._warn_replica(step, text, sent=())
                raise DeliveryError(text) from e
        if kind == Kind.DATA:
            sent: list[str] = []
            for name, channel in groups.channels.items():
                try:
                    self._send(channel, step, parts.get(name))
                except RuntimeError as e:
                    text = self._failure(f"could not deliver step {step} to the {name} stage (ranks {list(channel.ranks)})", e)
                    self._warn_leaders(text)
                    self._warn_replica(step, text, sent, failed=name)
                    raise DeliveryError(text) from e
                sent.append(name)
            self._queue.put(_Item(Kind.DATA, parts["first"][2], source_state=source_state))
            return kind
        if kind != Kind.END:
            dp = loader.mesh_layout.leaders().index(origin)
            # a delivery failure's message already names its leader and step
            text = message if kind == Kind.DELIVERY_ERROR else f"leader rank {origin} (dp_rank {dp}) failed at step {step}: {message}"
            for channel in groups.channels.values():
                channel.send_plan(kind, step, wire.plan({"message": text}))
            error = _error(kind, text)
            if origin == place.rank and cause is not None:
                error.__cause__ = cause
            self._queue.put(_Item(kind, error=error))
            return kind
        for channel in groups.channels.values():
            channel.send_plan(Kind.END, step)
        self._queue.put(_Item(Kind.END))
        return kind

    def _failure(self, what: str, error: BaseException) -> str:
        place = self.loader.place
        return f"leader rank {place.rank} (dp_rank {place.dp_rank}) {what} (timeout={self.loader.timeout}s): {error}"

    def _warn_leaders(self, text: str) -> None:
        """Best effort: the other leaders learn of this leader's failure at their next agreement
        and pass it on to their replicas, instead of waiting for a timeout."""
        leaders = self.loader._groups.leaders
        if leaders is not None:
            with contextlib.suppress(RuntimeError):
                transport.agree(leaders, Kind.DELIVERY_ERROR, text)

    def _warn_replica(self, step: int, text: str, sent: Iterable[str], failed: str | None = None) -> None:
        """Best effort: tell this replica's channels whose state is sound (not ``failed``) about a
        delivery failure, as the message of ``step`` (of the next step where it was already sent)."""
        sent = set(sent)
        for name, channel in self.loader._groups.channels.items():
            if name != failed:
                with contextlib.suppress(RuntimeError):
                    channel.send_plan(Kind.DELIVERY_ERROR, step + (name in sent), wire.plan({"message": text}))

    @contextlib.contextmanager
    def _collectives(self, what: str) -> Iterator[None]:
        """Turn a failed or timed-out collective into a DeliveryError saying who waited for what."""
        try:
            yield
        except (WireError, DeliveryError):
            raise
        except RuntimeError as e:
            place = self.loader.place
            raise DeliveryError(
                f"rank {place.rank} ({place.stage} stage, dp_rank {place.dp_rank}) {what} "
                f"(timeout={self.loader.timeout}s): {e}"
            ) from e

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

    def _pack(self, channel: transport.Channel, step: int, batch: Mapping[str, Any]) -> tuple[Any, int, Batch]:
        """``(message or per-rank messages, message size, leader's own batch)`` for one channel."""
        loader = self.loader
        routing, layout = loader.routing, loader.mesh_layout
        stage = "both" if loader.place.pp_size == 1 else channel.name
        selected = routing.select(batch, stage)
        if loader.delivery == "broadcast":
            message, nbytes, meta_nbytes = self._message(channel, step, selected)
            own = routing.piece(wire.unpack(message[wire.HEADER_BYTES : nbytes], meta_nbytes), loader.place.shard)
            return message, nbytes, own
        by_levels: dict[tuple, tuple[torch.Tensor, int, int]] = {}
        for rank in channel.ranks:
            levels = layout.place(rank).shard
            if levels not in by_levels:
                by_levels[levels] = self._message(channel, step, routing.piece(selected, levels))
        sizes = {(n, m) for _, n, m in by_levels.values()}
        assert len(sizes) == 1, sizes  # equal shapes per shard, so equal sizes
        nbytes, meta_nbytes = sizes.pop()
        messages = [by_levels[layout.place(r).shard][0] for r in channel.ranks]
        own = by_levels[loader.place.shard][0]
        return messages, nbytes, wire.unpack(own[wire.HEADER_BYTES : nbytes], meta_nbytes)

    def _message(self, channel: transport.Channel, step: int, batch: Mapping[str, Any]) -> tuple[torch.Tensor, int, int]:
        """``(message, its size, meta size)`` of one step's data for ``channel``."""
        plan = wire.plan(batch)
        if plan.nbytes > self.loader.max_batch_bytes:
            raise BatchError(
                f"a {channel.name}-stage payload is {plan.nbytes} bytes; max_batch_bytes is {self.loader.max_batch_bytes}"
            )
        message, nbytes = channel.message(Kind.DATA, step, plan)
        return message, nbytes, len(plan.meta)

    def _send(self, channel: transport.Channel, step: int, packed: Any) -> None:
        if not channel.carries_data:
            channel.send_plan(Kind.DATA, step)
            return
        message, nbytes, _ = packed
        channel.send(message, nbytes)

    def _receive(self, step: int) -> Kind:
        loader = self.loader
        channel = next(iter(loader._groups.channels.values()))
        with self._collectives(f"waited for leader rank {channel.leader} to deliver step {step} and gave up"):
            header, payload = channel.recv(loader.max_batch_bytes)
        if header.step != step:
            raise WireError(f"expected step {step} from leader rank {channel.leader}, got step {header.step}")
        if header.kind == Kind.END:
            self._queue.put(_Item(Kind.END))
            return Kind.END
        if not channel.carries_data and header.kind == Kind.DATA:
            self._queue.put(_Item(Kind.DATA, {}))
            return Kind.DATA
        if header.kind == Kind.DATA:
            batch = wire.unpack(payload, header.meta_nbytes)
            if not channel.scattered:
                batch = loader.routing.piece(batch, loader.place.shard)
            self._queue.put(_Item(Kind.DATA, batch))
            return Kind.DATA
        text = wire.unpack(payload.cpu(), header.meta_nbytes).get("message")
        if not isinstance(text, str):
            raise WireError("error message from the leader does not decode")
        self._queue.put(_Item(header.kind, error=_error(header.kind, text)))
        return header.kind


def _error(kind: Kind, text: str) -> BaseException:
    return {Kind.BATCH_ERROR: BatchError, Kind.DELIVERY_ERROR: DeliveryError}.get(kind, LeaderError)(text)


def _record_stream(value: Any, stream: "torch.cuda.Stream") -> None:
    """Tell the caching allocator the training loop's stream uses tensors made on the side stream."""
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            value.record_stream(stream)
    elif isinstance(value, dict):
        for v in value.values():
            _record_stream(v, stream)
