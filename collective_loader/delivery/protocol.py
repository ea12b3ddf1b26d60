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

How each delivery group's step is packed, sent and received is its mode
(:mod:`~collective_loader.delivery.modes`); the steps here never ask which.
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
from typing import Any

import torch

from collective_loader.delivery.agreement import agree_outcome
from collective_loader.delivery.figures import ShardWorkTally
from collective_loader.delivery.modes import Item, Mode, Packed, delivery_error, mode_for
from collective_loader.delivery.settings import Settings
from collective_loader.delivery.transport import Channel
from collective_loader.delivery.watchdog import StallWatch
from collective_loader.errors import BatchError, DeliveryError, WireError
from collective_loader.plan import wire
from collective_loader.plan.mesh import Stage
from collective_loader.plan.wire import Kind

log = logging.getLogger(__name__)
# a leader whose source has not returned a batch after this share of `timeout` reports itself
# stalled (by 0.8 x timeout, see StallWatch), so its peers, who wait at most `timeout` for it,
# hear why before they give up
STALL_AFTER = 0.75


class _Step:
    """What leaders and members share: the settings. ``stream``, given to each channel's mode:
    the side stream for copies to the GPU (None on a CPU mesh)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.place = settings.place


class LeaderStep(_Step):
    """A replica's leader. ``load(step)`` returns the next batch (``StopIteration`` at the end),
    ``source_state()`` the source's state after it (or ``None``); ``watch`` marks each load;
    ``shard_work`` counts the work over the shard ranks (under a split that reports it);
    ``epoch_id`` numbers the loader's epochs (its bulletin's entries, when its replica has ranks
    outside delivery)."""

    def __init__(
        self,
        settings: Settings,
        stream: Any,
        load: Callable[[int], Mapping[str, Any]],
        source_state: Callable[[], Any],
        watch: StallWatch,
        shard_work: ShardWorkTally,
        epoch_id: int,
    ) -> None:
        super().__init__(settings)
        self._load, self._source_state, self.watch = load, source_state, watch
        self.shard_work = shard_work
        self.epoch_id = epoch_id
        self._bulletin = settings.groups.bulletin
        # how each channel moves a step
        self._modes: dict[str, Mode] = {
            name: mode_for(settings, channel, stream) for name, channel in settings.groups.channels.items()
        }

    def step(self, step: int) -> Item:
        cause: BaseException | None
        packed: dict[str, Packed] = {}
        kind, message, cause, state = Kind.DATA, "", None, None
        try:
            with self.watch.loading(step):  # step 0 also starts (and resumes) the source
                batch = self._load(step)
                state = self._source_state()
            self.settings.routing.check(batch)
            self._count_shard_work(step, batch)
            packed = {name: mode.pack(step, batch) for name, mode in self._modes.items()}
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
        micro-batch's work per shard rank, into ``shard_work`` (``stats()``) and the DEBUG log."""
        work = self.settings.routing.work(batch)
        if work is None:
            return
        self.shard_work.add(work)
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
        packed: dict[str, Packed],
        state: Any,
    ) -> Item:
        """:meth:`_deliver`, a failed or timed-out collective turned into a DeliveryError saying who
        waited for what (a try, not a context manager: it runs every step)."""
        try:
            return self._deliver(step, kind, message, cause, packed, state)
        except DeliveryError:
            raise
        except RuntimeError as e:
            raise delivery_error(self.settings, what, e) from e

    def _deliver(
        self, step: int, kind: Kind, message: str, cause: BaseException | None, packed: dict[str, Packed], state: Any
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
                    self._modes[name].send(packed[name])
                except RuntimeError as e:
                    text = self._failure(
                        f"could not deliver step {step} to the {name} stage (ranks {list(channel.ranks)})", e
                    )
                    self._warn_leaders(text)
                    self._warn_replica(step, text, sent, failed=name)
                    raise DeliveryError(text) from e
                sent.append(name)
            if self._bulletin is not None:
                self._bulletin.post_step(self.epoch_id)
            return self._data_item(step, packed, state)
        if kind == Kind.END:
            if self._bulletin is not None:  # first: a rank in delivery may stop its loop at once
                self._bulletin.post_last(self.epoch_id, Kind.END, step)
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
        if self._bulletin is not None:
            self._bulletin.post_last(self.epoch_id, kind, step, text)
        for channel in groups.channels.values():
            channel.send_encoded(kind, step, wire.encode({"message": text}))
        error = kind.error(text)
        if origin == place.rank and cause is not None:
            error.__cause__ = cause
        return Item(kind, step, error=error)

    def _data_item(self, step: int, packed: dict[str, Packed], state: Any) -> Item:
        """The leader's own batch of a delivered step (from its stage's channel) and, with the
        device transport, the tensor bytes the training thread will send (:func:`post`)."""
        item = Item(Kind.DATA, step, source_state=state)
        own = Stage.FIRST if self.place.stage == Stage.BOTH else self.place.stage  # the leader's stage group
        for name, mode in self._modes.items():
            mode.hand_over(item, packed[name], own=name == own)
        return item

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
        if self._bulletin is not None:  # it posts a step after every channel has it
            with contextlib.suppress(RuntimeError):
                self._bulletin.post_last(self.epoch_id, Kind.DELIVERY_ERROR, step, text)
        for name, channel in self.settings.groups.channels.items():
            if name != failed:
                with contextlib.suppress(RuntimeError):
                    channel.send_encoded(Kind.DELIVERY_ERROR, step + (name in sent), wire.encode({"message": text}))


class MemberStep(_Step):
    """Any rank but the leader: receives each step from its leader on its one delivery group."""

    def __init__(self, settings: Settings, stream: Any) -> None:
        super().__init__(settings)
        self._channel = next(iter(settings.groups.channels.values()))
        self._mode = mode_for(settings, self._channel, stream)

    def step(self, step: int) -> Item:
        settings = self.settings
        channel = self._channel
        try:
            header, payload = channel.recv(settings.config.max_batch_bytes)
        except RuntimeError as e:  # a failed or timed-out collective (see LeaderStep.step)
            what = f"waited for leader rank {channel.leader} to deliver step {step} and gave up"
            raise delivery_error(settings, what, e) from e
        if header.step != step:
            raise WireError(f"expected step {step} from leader rank {channel.leader}, got step {header.step}")
        if header.kind == Kind.END:
            return Item(Kind.END, step)
        if header.kind == Kind.DATA:
            return self._mode.receive(step, header, payload)
        text = wire.decode(payload, header.meta_nbytes).batch(payload).get("message")
        if not isinstance(text, str):
            raise WireError("error message from the leader does not decode")
        return Item(header.kind, step, error=header.kind.error(text))


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
            mode, header, _ = item.receive
            current = mode.channel
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
        mode, header, meta = item.receive
        assert posted.into is not None
        item.batch = mode.finish(header, meta, posted.into)
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


def _transfer_error(settings: Settings, step: int, channel: Channel, error: BaseException) -> DeliveryError:
    return delivery_error(
        settings,
        f"could not move step {step}'s tensor bytes over the {channel.name} group (ranks {list(channel.ranks)})",
        error,
    )
