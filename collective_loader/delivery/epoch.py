"""One pass over a leader's source, delivered to every rank: the transfer thread and the training
thread's side of each step.

An :class:`Epoch` runs the delivery protocol (:mod:`~collective_loader.delivery.protocol`) on a
:class:`~collective_loader.delivery.prefetch.Prefetcher` thread, ahead of the training loop by
at most ``settings.prefetch`` steps, and hands one batch per ``next()`` to the loop. Leaders
also watch their source for stalls (:class:`~collective_loader.delivery.watchdog.StallWatch`).
A rank outside delivery iterates an :class:`OutsideEpoch` instead: it reads its leader's
bulletin (:mod:`~collective_loader.delivery.bulletin`) and yields ``{}`` per step.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

import torch

from collective_loader.delivery import protocol
from collective_loader.delivery.device import hand_over
from collective_loader.delivery.figures import ShardWorkTally
from collective_loader.delivery.prefetch import Prefetcher
from collective_loader.delivery.settings import Settings
from collective_loader.delivery.source_protocol import Source
from collective_loader.delivery.watchdog import StallWatch
from collective_loader.errors import DeliveryError
from collective_loader.plan.wire import Kind
from collective_loader.types import Batch

JOIN_WAIT = 5.0  # seconds to wait for a transfer thread that has delivered its last step
log = logging.getLogger(__name__)


class Epoch(Iterator[Batch]):
    """One pass over the source: the transfer thread's protocol steps, handed over one per ``next()``.

    The transfer thread (a :class:`~collective_loader.delivery.prefetch.Prefetcher`) runs the protocol's
    gloo part ahead of the loop. ``next()`` then, on the training thread: with the device
    transport, posts the next step's tensor collectives before it waits for this step's (so they
    overlap the step's compute, and are issued in program order); on a CUDA mesh, makes the
    current stream wait for the batch's copy to the GPU.
    """

    def __init__(
        self,
        settings: Settings,
        source: Source | None,
        resume: Mapping[str, Any] | None,
        shard_work: ShardWorkTally,
        epoch_id: int,
    ) -> None:
        self.settings = settings
        self.source = source
        self._resume = resume
        self.steps = resume["steps"] if resume is not None else 0  # consumed, resumed ones included
        self.source_state = resume["source"] if resume is not None else None
        self._source_iter: Iterator[Mapping[str, Any]] | None = None
        self._finished = False
        self._posted: protocol.Posted | None = None  # device transport: the next step, on its way
        self._copies: collections.deque = collections.deque()  # (event, host tensors) of copies in flight
        place = settings.place
        stream = torch.cuda.Stream(settings.device) if settings.device.type == "cuda" else None
        name = f"collective_loader-r{place.rank}"
        self._step: protocol.LeaderStep | protocol.MemberStep
        self._watch: StallWatch | None = None
        if place.is_leader:
            leader: protocol.LeaderStep  # the watchdog reports through it (after seconds, not now)
            watch = StallWatch(
                protocol.STALL_AFTER * settings.config.timeout,
                lambda step: self._prefetch.interrupt(leader.stalled(step)),
                f"{name}-watch",
            )
            assert source is not None, "a leader has a source"
            leader = protocol.LeaderStep(settings, stream, self._load, source.state_dict, watch, shard_work, epoch_id)
            self._watch, self._step = watch, leader
        else:
            self._step = protocol.MemberStep(settings, stream)
        # an exception in a step ends the epoch: it is raised in the training loop
        self._prefetch: Prefetcher[protocol.Item] = Prefetcher(
            self._step.step,
            settings.prefetch,
            is_last=lambda item: item.kind != Kind.DATA,
            on_error=protocol.failed,
            name=name,
        )
        # the host transport takes each item as the transfer thread made it
        self._take = self._prefetch.take if settings.config.transport == "host" else self._next_item

    # --- training-loop side ----------------------------------------------------------------

    def __next__(self) -> Batch:
        # runs once per training step on the training thread: as little as it can be
        if self._finished:
            raise StopIteration
        started = time.perf_counter() if log.isEnabledFor(logging.DEBUG) else None
        try:
            item = self._take()
        except DeliveryError:
            self._finish(failed=True)
            raise
        if item.kind is not Kind.DATA:
            self._end(item)
        self.steps += 1
        self.source_state = item.source_state
        if started is not None:
            self._log_step(item, started)
        if self._copies:
            self._retire_copies()
        if item.event is None:
            return item.batch
        self._copies.append((item.event, item.host))
        return hand_over(item.batch, item.event)

    def _end(self, item: protocol.Item) -> NoReturn:
        """The epoch's last item: stop, or raise its error."""
        self._finish(failed=item.kind != Kind.END)
        if item.kind == Kind.END:
            raise StopIteration
        assert item.error is not None
        raise item.error

    def _log_step(self, item: protocol.Item, started: float) -> None:
        nbytes = sum(v.nbytes for v in item.batch.values() if isinstance(v, torch.Tensor))
        log.debug(
            "rank %d step %d: %d tensor bytes, waited %.3f ms in next()",
            self.settings.place.rank,
            item.step,
            nbytes,
            1e3 * (time.perf_counter() - started),
        )

    def _retire_copies(self) -> None:
        while self._copies and self._copies[0][0].query():
            self._copies.popleft()  # their copies are done: the host buffers may be reused

    def _next_item(self) -> protocol.Item:
        """Device transport: this step's item, its tensor bytes moved, after posting the next step's."""
        posted = self._posted or protocol.post(self.settings, self._prefetch.take())
        self._posted = None
        if posted.item.kind == Kind.DATA:
            # every rank posts step k+1 in its k-th next(), so the order is the same everywhere
            self._posted = protocol.post(self.settings, self._prefetch.take())
        return protocol.complete(self.settings, posted)

    def _finish(self, failed: bool) -> None:
        self._finished = True
        self._prefetch.close(JOIN_WAIT)  # a thread stuck in a stalled source is left behind
        self._close_watch()
        if failed:
            # a loop that catches the error may never close the loader: DataLoader workers left
            # to the garbage collector would be joined there, 5 s each, inside whatever runs then
            self._stop_source()

    def close(self) -> None:
        """Run the steps already granted (peers run them too), then stop the thread; an epoch
        left early also stops its source's iteration (and DataLoader workers) now."""
        early = not self._finished
        if self._posted is not None:  # posted by every rank alike: let it finish
            with contextlib.suppress(RuntimeError):
                protocol.complete(self.settings, self._posted)
            self._posted = None
        self._prefetch.close(JOIN_WAIT if self._finished else self.settings.config.timeout + JOIN_WAIT)
        self._finished = True
        self._close_watch()
        if early:
            self._stop_source()

    def _stop_source(self) -> None:
        """End the source's iteration now (its DataLoader workers exit), unless the transfer
        thread is still inside it (a stalled source keeps it)."""
        if self._source_iter is not None and not self.in_source():
            assert self.source is not None
            self.source.stop()
            self._source_iter = None

    def _close_watch(self) -> None:
        if self._watch is not None and not self._prefetch.alive():
            self._watch.close()

    def in_source(self) -> bool:
        """Whether the transfer thread is still running (after :meth:`close`: stuck in the source)."""
        return self._prefetch.alive()

    # --- the leader's source -------------------------------------------------------------

    def _load(self, step: int) -> Mapping[str, Any]:
        if self._source_iter is None:
            assert self.source is not None
            if self._resume is not None:
                self.source.resume(self._resume["source"], self._resume["steps"])
            self._source_iter = iter(self.source)
        return next(self._source_iter)


class OutsideEpoch(Iterator[Batch]):
    """One pass, on a rank outside delivery (a middle stage without ``every_stage`` keys): ``{}``
    per step its leader delivered, ``StopIteration`` where the epoch ends, the leader's error
    where it fails, read from the replica's bulletin on the training thread (no thread, no
    collective: a loop that never calls ``next()`` costs nothing)."""

    def __init__(self, settings: Settings, resume: Mapping[str, Any] | None, epoch_id: int) -> None:
        assert settings.groups.bulletin is not None, "a rank outside delivery reads a bulletin"
        self._bulletin = settings.groups.bulletin
        self._epoch_id = epoch_id
        self._step = 0  # protocol steps of this pass (a resumed pass counts from 0 too)
        self.steps = resume["steps"] if resume is not None else 0
        self.source_state = None
        self._finished = False

    def __next__(self) -> Batch:
        if self._finished:
            raise StopIteration
        kind, text = self._bulletin.wait_step(self._epoch_id, self._step)
        if kind != Kind.DATA:
            self._finished = True
            if kind == Kind.END:
                raise StopIteration
            self._bulletin.reported = True
            raise kind.error(text)
        self._step += 1
        self.steps += 1
        return {}

    def close(self) -> None:
        self._finished = True

    def in_source(self) -> bool:
        return False
