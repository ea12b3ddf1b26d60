"""The replicas' leaders as one gloo group, for what leaders share outside the delivery steps.

A source that runs on the leaders alone (a ``StreamingSource``) needs a few collectives among
them: the agreements of its construction, gathering their packing states into one checkpoint,
balancing packed rows over the replicas (:mod:`collective_loader.streaming.balanced_rows`), and
waiting for each other before shared files are released. They go through a
:class:`LeaderGroup`, built by every rank (group creation is collective over the world).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from collective_loader.delivery.transport import new_group
from collective_loader.errors import LeaderError
from collective_loader.plan import wire
from collective_loader.plan.wire import Kind

Local = TypeVar("Local")


class LeaderGroup:
    """The leaders' group seen from one leader; ``group`` is ``None`` when this leader is alone
    (one replica), and every collective then returns at once. ``first_replica``: the replica of
    the group's first leader, for errors (a group of the leaders of consecutive replicas, such as
    a block of :class:`~collective_loader.text.balance.Balance`'s ``replicas``).

    What uses the group holds it (:meth:`hold`) and lets go when it closes (:meth:`release`); the
    last to let go gives the group back to torch, so its gloo threads end while the interpreter is
    alive (:meth:`~collective_loader.delivery.transport.Groups.release` says why that matters).

    Example (every rank builds it; only leaders use it)::

        leaders = LeaderGroup.build(layout.leaders(), timeout=600.0, name="streaming_leaders")
        if place.is_leader:
            stream_leaders = leaders.hold()
            steps = stream_leaders.gather(my_step)   # one entry per leader, in dp_rank order
            stream_leaders.release()                 # the group is given back: nobody else holds it
    """

    def __init__(self, group: dist.ProcessGroup | None, first_replica: int = 0) -> None:
        self.group, self.first_replica = group, first_replica
        self._holders = 0
        self._released = False

    @classmethod
    def build(cls, leaders: Sequence[int], timeout: float, name: str, first_replica: int = 0) -> LeaderGroup:
        """Every rank of the world, in the same order: the group of ``leaders`` (global ranks)."""
        if len(leaders) < 2:
            return cls(None, first_replica)
        return cls(new_group(sorted(leaders), "gloo", timeout, f"collective_loader:{name}"), first_replica)

    def hold(self) -> LeaderGroup:
        """Take the group for one user (a stream built from the source that built it); returns it.
        ``RuntimeError`` once it was given back: a source's groups serve the one loader that
        closed it."""
        if self._released:
            raise RuntimeError(
                "this source's leaders' group was given back when the loader that used it closed: "
                "build a new source for a new loader"
            )
        self._holders += 1
        return self

    def release(self) -> None:
        """One user is done with the group; the last gives it back to torch (destroyed here, on
        this leader; idempotent once given back)."""
        if self._released:
            return
        self._holders -= 1
        if self._holders > 0:
            return
        self._released = True
        if self.group is not None:
            with contextlib.suppress(ValueError):  # destroy_process_group() came first
                dist.destroy_process_group(self.group)

    @property
    def rank(self) -> int:
        """This leader's place in the group's order (sorted global ranks); 0 when alone."""
        return 0 if self.group is None else dist.get_rank(self.group)

    def gather(self, value: Any) -> list[Any]:
        """Every leader's ``value``, in leader order, on every leader: anything a batch holds (a
        tensor, a mapping, a list or plain value; tuples come back as lists), sent as a wire
        message (:func:`~collective_loader.plan.wire.message`: no pickle, nothing received is
        evaluated). Two all-gathers: the sizes, then the messages."""
        return [batch["value"] for _, batch in self._gather(wire.message({"value": value}))]

    def agree(self, compute: Callable[[], tuple[Local, Any]], what: str) -> tuple[Local, list[Any]]:
        """``compute()`` gives ``(local, shared)``: returns ``local`` and every leader's
        ``shared`` (as :meth:`gather` takes it), in leader order, on every leader (one gather).
        When ``compute`` raises on a leader, that leader raises it after telling the others
        (its message's kind is an error), which raise :class:`~collective_loader.errors.LeaderError`
        naming it and ``what`` they were doing (the others would otherwise wait in the gather
        until its timeout)."""
        try:
            local, shared = compute()
        except Exception as e:
            self._gather(wire.message({"message": f"{type(e).__name__}: {e}"}, Kind.SOURCE_ERROR))
            raise
        heard = self._gather(wire.message({"value": shared}))
        for j, (header, batch) in enumerate(heard):
            if header.kind != Kind.DATA:
                raise LeaderError(
                    f"the leader of replica {self.first_replica + j} failed while the leaders {what}: {batch['message']}"
                )
        return local, [batch["value"] for _, batch in heard]

    def _gather(self, message: torch.Tensor) -> list[tuple[wire.Header, dict[str, Any]]]:
        """Every leader's wire ``message``, read (:class:`~collective_loader.errors.WireError`
        for one that is not a message), in leader order."""
        if self.group is None:
            return [wire.read_message(message)]
        n = dist.get_world_size(self.group)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        dist.all_gather(sizes, torch.tensor([message.numel()]), group=self.group)
        longest = max(int(size) for size in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: message.numel()] = message
        heard = [torch.empty(longest, dtype=torch.uint8) for _ in range(n)]
        dist.all_gather(heard, padded, group=self.group)
        return [wire.read_message(buf[: int(size)], longest) for buf, size in zip(heard, sizes)]

    def exchange(self, send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> torch.Tensor:
        """Every leader sends ``send_counts[j]`` elements of ``send`` (1-D, in leader order) to
        leader ``j`` and receives ``recv_counts[j]`` from it (one all-to-all); returns what it
        received, in leader order."""
        if self.group is None:
            return send
        out = torch.empty(sum(recv_counts), dtype=send.dtype)
        dist.all_to_all_single(out, send, list(recv_counts), list(send_counts), group=self.group)
        return out

    def wait_for_all(self, seconds: float) -> str | None:
        """Wait, at most ``seconds``, until every leader calls this too; ``None`` when they did,
        else torch's report of who did not (no exception: the caller decides)."""
        if self.group is None:
            return None
        try:
            dist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=seconds))
        except RuntimeError as e:
            return str(e)
        return None
