"""One step of the delivery protocol, as a replica's leader runs it and as every other rank does.

Leader, step ``k`` (:class:`LeaderStep`): load a batch, check it and pack it once per delivery
group, agree with the other replicas' leaders on the step's outcome (DATA, END, or the first
error by rank), and send it to every delivery group; a failure is passed on so that every rank
ends within ``timeout``. Any other rank (:class:`MemberStep`): receive step ``k``'s message.

Both return an :class:`Item` for the training thread. Everything a step needs is in its
:class:`~collective_loader.delivery.settings.Settings`. Nothing here starts a thread: the epoch
(:mod:`~collective_loader.delivery.epoch`) runs these steps ahead of its training loop with
:class:`~collective_loader.delivery.prefetch.Prefetcher`, and a test may call ``step(k)``
directly on every rank.

The two transports have one shape: ``step(k)`` (transfer thread, gloo only) then
:func:`post` and :func:`complete` (training thread).

* ``"host"``: ``step(k)`` moves the whole message; on a CUDA mesh it also starts the batch's
  copy to the GPU (:func:`~collective_loader.delivery.device.copy_to_device`). :func:`post` has nothing
  to do; :func:`complete` returns the batch.
* ``"device"``: ``step(k)`` moves the header and the batch description; :func:`post` starts the
  tensor bytes' collective on the device group and :func:`complete` waits for it. The training
  thread posts them in program order, so they never interleave with its own NCCL collectives in
  a rank-dependent order.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from collective_loader.delivery.agreement import agree_outcome
from collective_loader.delivery.device import copy_to_device
from collective_loader.delivery.settings import Settings
from collective_loader.delivery.transport import Channel
from collective_loader.delivery.watchdog import StallWatch
from collective_loader.errors import BatchError, DeliveryError, LeaderError, WireError
from collective_loader.plan import wire
from collective_loader.plan.wire import Header, Kind

Batch = dict[str, Any]
# a host tensor of at least this many bytes is broadcast from its own memory, in a collective of
# its own, instead of being copied into the step's message: the copy of a large tensor costs the
# leader more than one more collective (16 MiB: docs/performance.md); below this, not measured
APART_MIN_BYTES = 1 << 20
log = logging.getLogger(__name__)
# a leader whose source has not returned a batch after this share of `timeout` reports itself
# stalled (by 0.8 x timeout, see StallWatch), so its peers, who wait at most `timeout` for it,
# hear why before they give up
STALL_AFTER = 0.75


@dataclass(slots=True)
class Item:
    """One step as the transfer thread hands it to the training thread."""

    kind: Kind
    step: int
    batch: Batch = field(default_factory=dict)
    error: BaseException | None = None
    source_state: Any = None  # leader only: the source's state right after this batch
    event: Any = None  # the CUDA event after the batch's copy to the GPU (None: nothing to wait for)
    host: Any = None  # host tensors that copy reads: kept alive until the event has completed
    # device transport, DATA only: what the training thread still moves
    sends: list[tuple[Channel, Any]] = field(default_factory=list)  # leader: (channel, tensor bytes)
    receive: tuple[Channel, Header, torch.Tensor] | None = None  # member: (channel, header, description)


@dataclass
class _Packed:
    """One channel's message (or per-member messages) of a step, as its leader built them."""

    message: Any  # the message, or the i-th member's message per member (scatter)
    header: Header  # of the leader's own message (on a scattered channel, every message's size)
    batch: Batch  # the leader's own host batch: views of its own message (tensors sent apart: as given)
    layout: wire.PayloadLayout  # the description of the leader's own message
    apart: list[torch.Tensor] = field(default_factory=list)  # broadcast after the message, in order


class _Step:
    """What leaders and members share: the settings and the device hop."""

    def __init__(self, settings: Settings, stream: Any) -> None:
        self.settings = settings
        self.place = settings.place
        self.device = settings.device
        self.stream = stream  # the side stream for copies to the GPU (None on a CPU mesh)

    def _on_device(self, item: Item, host: Any) -> Item:
        """``item`` with ``host`` as its batch, copied to the GPU on a CUDA mesh."""
        if self.stream is None:
            item.batch = host
        else:
            item.batch, item.event = copy_to_device(host, self.device, self.stream)
            item.host = host
        return item


class LeaderStep(_Step):
    """A replica's leader. ``load(step)`` returns the next batch (``StopIteration`` at the end),
    ``source_state()`` the source's state after it (or ``None``); ``watch`` marks each load."""

    def __init__(
        self,
        settings: Settings,
        stream: Any,
        load: Callable[[int], Mapping[str, Any]],
        source_state: Callable[[], Any],
        watch: StallWatch,
    ) -> None:
        super().__init__(settings, stream)
        self._load, self._source_state, self.watch = load, source_state, watch
        self._device_transport = settings.config.transport == "device"
        self._data_channels = [(name, ch) for name, ch in settings.groups.channels.items() if ch.carries_data]

    def step(self, step: int) -> Item:
        cause: BaseException | None
        packed: dict[str, _Packed] = {}
        kind, message, cause, state = Kind.DATA, "", None, None
        try:
            with self.watch.loading(step):  # step 0 also starts (and resumes) the source
                batch = self._load(step)
                state = self._source_state()
            self.settings.routing.check(batch)
            self._count_shard_work(step, batch)
            packed = {name: self._pack(ch, step, batch) for name, ch in self._data_channels}
        except StopIteration:
            kind = Kind.END
        except BatchError as e:
            kind, message, cause = Kind.BATCH_ERROR, str(e), e
        except Exception as e:
            kind, message, cause = Kind.SOURCE_ERROR, f"{type(e).__name__}: {e}", e
        if self.watch.stalled:  # the watchdog has told everyone; the collectives are its now
            return Item(Kind.SOURCE_ERROR, step)
        what = f"gave up delivering step {step} to its replica"
        return self._deliver_or_explain(what, step, kind, message, cause, packed, state)

    def _count_shard_work(self, step: int, batch: Mapping[str, Any]) -> None:
        """Under a split that reports its work (per document) over more than one shard rank: the
        micro-batch's work per shard rank, into ``settings.shard_work`` (``stats()``) and the DEBUG log."""
        work = self.settings.routing.work(batch)
        if work is None:
            return
        self.settings.shard_work.add(work)
        log.debug(
            "leader rank %d step %d: cost max/mean over the %d shard ranks %.3f, padding %.1f%%",
            self.place.rank,
            step,
            len(work.costs),
            work.max_over_mean,
            100 * work.padding,
        )

    def stalled(self, step: int) -> Item:
        """Watchdog thread: the source is still loading ``step``; say so on every rank."""
        message = (
            f"still loading step {step} after {self.watch.after:.0f}s: the source has not returned a batch "
            f"(timeout={self.settings.config.timeout}s; a leader reports a stall after {STALL_AFTER:.0%} of it)"
        )
        what = f"gave up reporting a stalled source at step {step}"
        try:
            return self._deliver_or_explain(what, step, Kind.SOURCE_ERROR, message, None, {}, None)
        except DeliveryError as e:
            return Item(Kind.DELIVERY_ERROR, step, error=e)

    def _deliver_or_explain(
        self,
        what: str,
        step: int,
        kind: Kind,
        message: str,
        cause: BaseException | None,
        packed: dict[str, _Packed],
        state: Any,
    ) -> Item:
        """:meth:`_deliver`, a failed or timed-out collective turned into a DeliveryError saying who
        waited for what (a try, not a context manager: it runs every step)."""
        try:
            return self._deliver(step, kind, message, cause, packed, state)
        except DeliveryError:
            raise
        except RuntimeError as e:
            raise _delivery_error(self.settings, what, e) from e

    def _deliver(
        self, step: int, kind: Kind, message: str, cause: BaseException | None, packed: dict[str, _Packed], state: Any
    ) -> Item:
        """Agree on the step's outcome with the other leaders, then send it to every group."""
        settings, place, groups = self.settings, self.place, self.settings.groups
        origin = place.rank
        if groups.leaders is not None:
            try:
                kind, message, origin = agree_outcome(groups.leaders, kind, message)
            except RuntimeError as e:
                others = [r for r in settings.mesh_layout.leaders() if r != place.rank]
                text = self._failure(f"lost contact with the other leaders (ranks {others}) before step {step}", e)
                self._warn_replica(step, text, sent=())
                raise DeliveryError(text) from e
        if kind == Kind.DATA:
            sent: list[str] = []
            for name, channel in groups.channels.items():
                try:
                    if channel.carries_data:
                        channel.send(packed[name].message, packed[name].header, packed[name].apart)
                    else:
                        channel.send_encoded(Kind.DATA, step)
                except RuntimeError as e:
                    text = self._failure(
                        f"could not deliver step {step} to the {name} stage (ranks {list(channel.ranks)})", e
                    )
                    self._warn_leaders(text)
                    self._warn_replica(step, text, sent, failed=name)
                    raise DeliveryError(text) from e
                sent.append(name)
            return self._data_item(step, packed, state)
        if kind == Kind.END:
            for channel in groups.channels.values():
                channel.send_encoded(Kind.END, step)
            return Item(Kind.END, step)
        dp = settings.mesh_layout.leaders().index(origin)
        # a delivery failure's message already names its leader and step
        text = (
            message
            if kind == Kind.DELIVERY_ERROR
            else f"leader rank {origin} (dp_rank {dp}) failed at step {step}: {message}"
        )
        for channel in groups.channels.values():
            channel.send_encoded(kind, step, wire.encode({"message": text}))
        error = error_of(kind, text)
        if origin == place.rank and cause is not None:
            error.__cause__ = cause
        return Item(kind, step, error=error)

    def _data_item(self, step: int, packed: dict[str, _Packed], state: Any) -> Item:
        """The leader's own batch of a delivered step; with the device transport, on the device,
        with the tensor bytes the training thread will send (:func:`post`)."""
        item = Item(Kind.DATA, step, source_state=state)
        own = "first" if self.place.stage == "both" else self.place.stage  # the leader's stage group
        if not self._device_transport:
            return self._on_device(item, packed[own].batch if own in packed else {})
        channels = self.settings.groups.channels
        # every distinct message's payload once (scatter peers that share a shard share a message)
        unique = {id(m): _payload(m, p.header) for p in packed.values() for m in _as_list(p.message)}
        on_device = cast(dict[int, torch.Tensor], self._on_device(item, unique).batch)
        for name, p in packed.items():
            start = wire.data_start(p.header.meta_nbytes)
            data = [on_device[id(m)][start:] for m in _as_list(p.message)]
            item.sends.append((channels[name], data if channels[name].scattered else data[0]))
        # the leader's own batch: views into its device copy of its stage's message
        if own not in packed:  # a middle stage that gets no data
            item.batch = {}
            return item
        channel, p = channels[own], packed[own]
        mine = _as_list(p.message)[channel.ranks.index(self.place.rank) if channel.scattered else 0]
        batch = p.layout.batch(on_device[id(mine)])
        item.batch = batch if channel.scattered else self.settings.routing.piece(batch, self.place.shard)
        return item

    def _pack(self, channel: Channel, step: int, batch: Mapping[str, Any]) -> _Packed:
        """The message (or per-member messages) of one channel, and the leader's own host batch:
        views of its message, as a member's decode would give them, without decoding."""
        settings = self.settings
        routing, layout = settings.routing, settings.mesh_layout
        stage = "both" if self.place.pp_size == 1 else channel.name
        selected = routing.select(batch, stage)
        if settings.config.delivery == "broadcast":
            message, header, own, plan = self._message(channel, step, selected)
            assert plan.layout is not None
            return _Packed(message, header, routing.piece(own, self.place.shard), plan.layout, plan.apart)
        by_levels: dict[tuple, tuple[torch.Tensor, Header, Batch, wire.Encoded]] = {}
        for rank in channel.ranks:
            levels = layout.place(rank).shard
            if levels not in by_levels:
                by_levels[levels] = self._message(channel, step, routing.piece(selected, levels))
        headers = {(h.payload_nbytes, h.meta_nbytes) for _, h, _, _ in by_levels.values()}
        assert len(headers) == 1, headers  # equal shapes per shard, so equal sizes
        messages = [by_levels[layout.place(r).shard][0] for r in channel.ranks]
        _, header, own, plan = by_levels[self.place.shard]
        assert plan.layout is not None
        return _Packed(messages, header, own, plan.layout)

    def _message(
        self, channel: Channel, step: int, batch: Mapping[str, Any]
    ) -> tuple[torch.Tensor, Header, Batch, wire.Encoded]:
        """``(message, header, the batch as the leader holds it: views of the message, its plan)``.

        On a broadcast channel of the host transport large host tensors travel apart
        (:data:`APART_MIN_BYTES`); a scatter sends one message per member, and the device
        transport moves the tensor bytes as one buffer of its own.
        """
        apart = not channel.scattered and channel.data_group is None
        plan = wire.encode(batch, APART_MIN_BYTES if apart else None)
        if plan.nbytes > self.settings.config.max_batch_bytes:
            raise BatchError(
                f"a {channel.name}-stage payload is {plan.nbytes} bytes; max_batch_bytes is {self.settings.config.max_batch_bytes}"
            )
        return (*channel.message(Kind.DATA, step, plan), plan)

    def _failure(self, what: str, error: BaseException) -> str:
        place = self.place
        return f"leader rank {place.rank} (dp_rank {place.dp_rank}) {what} (timeout={self.settings.config.timeout}s): {error}"

    def _warn_leaders(self, text: str) -> None:
        """Best effort: the other leaders learn of this leader's failure at their next agreement
        and pass it on to their replicas, instead of waiting for a timeout."""
        leaders = self.settings.groups.leaders
        if leaders is not None:
            with contextlib.suppress(RuntimeError):
                agree_outcome(leaders, Kind.DELIVERY_ERROR, text)

    def _warn_replica(self, step: int, text: str, sent: Iterable[str], failed: str | None = None) -> None:
        """Best effort: tell this replica's channels whose state is sound (not ``failed``) about a
        delivery failure, as the message of ``step`` (of the next step where it was already sent)."""
        sent = set(sent)
        for name, channel in self.settings.groups.channels.items():
            if name != failed:
                with contextlib.suppress(RuntimeError):
                    channel.send_encoded(Kind.DELIVERY_ERROR, step + (name in sent), wire.encode({"message": text}))


class MemberStep(_Step):
    """Any rank but the leader: receives each step from its leader on its one delivery group."""

    def __init__(self, settings: Settings, stream: Any) -> None:
        super().__init__(settings, stream)
        self._channel = next(iter(settings.groups.channels.values()))

    def step(self, step: int) -> Item:
        settings = self.settings
        channel = self._channel
        try:
            header, payload = channel.recv(settings.config.max_batch_bytes)
        except RuntimeError as e:  # a failed or timed-out collective (see LeaderStep.step)
            what = f"waited for leader rank {channel.leader} to deliver step {step} and gave up"
            raise _delivery_error(settings, what, e) from e
        if header.step != step:
            raise WireError(f"expected step {step} from leader rank {channel.leader}, got step {header.step}")
        if header.kind == Kind.END:
            return Item(Kind.END, step)
        if header.kind == Kind.DATA:
            if not channel.carries_data:
                return Item(Kind.DATA, step)
            if channel.data_group is not None:
                return Item(Kind.DATA, step, receive=(channel, header, payload))
            layout = wire.decode(payload, header.meta_nbytes)
            if header.apart_nbytes:
                try:
                    channel.recv_apart(payload, layout.apart(header.inline_nbytes))
                except RuntimeError as e:
                    what = f"waited for leader rank {channel.leader} to deliver step {step}'s large tensors and gave up"
                    raise _delivery_error(settings, what, e) from e
            batch = layout.batch(payload)
            if not channel.scattered:
                batch = settings.routing.piece(batch, self.place.shard)
            return self._on_device(Item(Kind.DATA, step), batch)
        text = wire.decode(payload, header.meta_nbytes).batch(payload).get("message")
        if not isinstance(text, str):
            raise WireError("error message from the leader does not decode")
        return Item(header.kind, step, error=error_of(header.kind, text))


# --- the training thread's part ---------------------------------------------------------------


@dataclass
class Posted:
    """A step whose tensor bytes are on their way (device transport), or an item that has none."""

    item: Item
    works: list[tuple[Channel, Any]] = field(default_factory=list)  # (channel, work) per collective
    into: torch.Tensor | None = None  # member: the payload being received


def post(settings: Settings, item: Item) -> Posted:
    """Training thread: start the collectives that move ``item``'s tensor bytes (device transport).

    Every rank of a delivery group posts them at the same call of ``next()``, in the order of
    the loader's channels, so they are issued in the same order everywhere.
    """
    posted = Posted(item)
    if item.event is not None and item.sends:
        # the leader's tensor bytes are still being copied to the GPU: the collective waits for that
        torch.cuda.current_stream().wait_event(item.event)
    current: Channel | None = None  # the channel whose collective is being posted
    try:
        for current, data in item.sends:
            posted.works.append((current, current.post_data(data)))
        if item.receive is not None:
            current, header, _ = item.receive
            start = min(wire.data_start(header.meta_nbytes), header.payload_nbytes)
            posted.into = torch.empty(header.payload_nbytes, dtype=torch.uint8, device=settings.device)
            if start < header.payload_nbytes:
                posted.works.append((current, current.post_data(posted.into[start:])))
    except RuntimeError as e:
        assert current is not None
        raise _transfer_error(settings, item.step, current, e) from e
    return posted


def complete(settings: Settings, posted: Posted) -> Item:
    """Training thread: wait for a posted step's collectives; return its item with the batch."""
    item = posted.item
    for channel, work in posted.works:
        try:
            work.wait()
        except RuntimeError as e:
            raise _transfer_error(settings, item.step, channel, e) from e
    if item.receive is not None:
        channel, header, meta = item.receive
        assert posted.into is not None
        batch = wire.decode(posted.into, header.meta_nbytes, meta=meta).batch(posted.into)
        item.batch = batch if channel.scattered else settings.routing.piece(batch, settings.place.shard)
        item.receive = None
    item.sends = []
    return item


def failed(error: BaseException) -> Item:
    """The last item of a transfer thread whose step raised: the training loop raises ``error``
    itself, its class and message kept, and the item's kind follows the class."""
    if isinstance(error, BatchError):
        kind = Kind.BATCH_ERROR
    elif isinstance(error, (DeliveryError, WireError)):
        kind = Kind.DELIVERY_ERROR
    else:
        kind = Kind.SOURCE_ERROR
    return Item(kind, -1, error=error)


def error_of(kind: Kind, text: str) -> BaseException:
    """The exception a failure of ``kind`` raises on every rank."""
    return {Kind.BATCH_ERROR: BatchError, Kind.DELIVERY_ERROR: DeliveryError}.get(kind, LeaderError)(text)


def _delivery_error(settings: Settings, what: str, error: BaseException) -> DeliveryError:
    place = settings.place
    return DeliveryError(
        f"rank {place.rank} ({place.stage} stage, dp_rank {place.dp_rank}) {what} (timeout={settings.config.timeout}s): {error}"
    )


def _transfer_error(settings: Settings, step: int, channel: Channel, error: BaseException) -> DeliveryError:
    return _delivery_error(
        settings,
        f"could not move step {step}'s tensor bytes over the {channel.name} group (ranks {list(channel.ranks)})",
        error,
    )


def _payload(message: torch.Tensor, header: Header) -> torch.Tensor:
    return message[wire.HEADER_BYTES : wire.HEADER_BYTES + header.payload_nbytes]


def _as_list(message: Any) -> list[torch.Tensor]:
    return [message] if isinstance(message, torch.Tensor) else list(message)
