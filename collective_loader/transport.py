"""Process groups and the collectives that move messages (a header and a payload in one buffer).

Everything that calls ``torch.distributed`` lives here. Groups are built once, by every rank, in
the same order (``dist.new_group`` is collective over the default group). Control messages
travel over gloo (CPU) groups; batches over the default backend (gloo on CPU, NCCL on GPUs).

A :class:`Channel` is one delivery group seen from one rank: the leader sends each message
(header and payload in one buffer) as a broadcast, or as a scatter of equal-sized per-rank
messages; every other member receives it. While message sizes repeat, that is one collective
per step.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from collective_loader import wire
from collective_loader.buffers import BufferPool
from collective_loader.layout import MeshLayout, Place
from collective_loader.wire import Header, Kind

MESSAGE_BYTES = 4096  # fixed size of an error message exchanged between leaders


def _new_group(ranks: Sequence[int], backend: str, timeout: float) -> dist.ProcessGroup | None:
    """Create a group on every rank; return it on members, None elsewhere."""
    group = dist.new_group(list(ranks), backend=backend, timeout=datetime.timedelta(seconds=timeout))
    return group if dist.get_rank() in ranks else None


@dataclass
class Channel:
    """One delivery group (sorted global ``ranks``, ``leader`` among them) seen from this rank.

    Every message is one buffer: a :data:`~collective_loader.wire.HEADER_BYTES` header, then the
    payload (see :func:`collective_loader.wire.write_message`). Receivers cannot know a message's
    size before its header, so both ends track ``frame_nbytes``, the size of the previous
    message on this channel: the leader sends the first ``frame_nbytes`` bytes of the next
    message (padded when it is shorter) in one collective, and the rest, if it is longer, in a
    second. While batch sizes repeat, a step is therefore one collective per group.

    ``group`` is gloo on gloo worlds; on GPU worlds the first- and last-stage groups use the
    default backend and ``device`` is the GPU. ``pool`` reuses CPU buffers (None on GPUs, where
    the caching allocator does that). On a ``scattered`` channel every message is a scatter of
    equal-sized per-member messages (receivers must know how to receive before they see a
    header); end and error messages are then the same message for every member. A channel that
    does not ``carry_data`` (middle stages without ``every_stage`` keys) only ever gets headers.
    """

    name: str
    ranks: tuple[int, ...]
    leader: int
    group: dist.ProcessGroup
    device: torch.device
    scattered: bool = False
    pool: BufferPool | None = None
    carries_data: bool = True
    frame_nbytes: int = wire.HEADER_BYTES
    # what this rank moved through the channel: the leader counts bytes it sends to each peer
    collectives: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer on ``device`` for a message of ``nbytes`` (longer when the frame is)."""
        nbytes = max(nbytes, self.frame_nbytes)
        if self.pool is not None:
            return self.pool.take(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def message(self, kind: Kind, step: int, plan: wire.Plan) -> tuple[torch.Tensor, int]:
        """Leader: ``(buffer on device, size)`` of the message announcing ``kind`` with ``plan``."""
        nbytes = wire.HEADER_BYTES + plan.nbytes
        if self.device.type == "cuda":
            # pinned staging (torch caches pinned blocks), so the copy to the GPU is asynchronous
            host = torch.empty(max(nbytes, self.frame_nbytes), dtype=torch.uint8, pin_memory=True)
            wire.write_message(kind, step, plan, host)
            return host.to(self.device, non_blocking=True), nbytes
        buf = self.buffer(nbytes)
        wire.write_message(kind, step, plan, buf)
        return buf, nbytes

    def send_plan(self, kind: Kind, step: int, plan: wire.Plan = wire.NOTHING) -> None:
        """Leader: build one message and send it to every member."""
        self.send(*self.message(kind, step, plan))

    def _pieces(self, nbytes: int) -> list[slice]:
        frame = self.frame_nbytes
        return [slice(0, frame)] + ([slice(frame, nbytes)] if nbytes > frame else [])

    def _count(self, nbytes: int) -> None:
        self.collectives += 1
        if dist.get_rank() == self.leader:
            self.bytes_sent += nbytes * (len(self.ranks) - 1)
        else:
            self.bytes_received += nbytes

    def send(self, message: torch.Tensor | Sequence[torch.Tensor], nbytes: int) -> None:
        """Leader: send a message of ``nbytes`` (from :meth:`message`) to every member.

        On a scattered channel ``message`` may be a list, the i-th for the i-th member (sorted
        ranks), all of ``nbytes``.
        """
        for piece in self._pieces(nbytes):
            if not self.scattered:
                dist.broadcast(message[piece], src=self.leader, group=self.group)
            else:
                parts = [message] * len(self.ranks) if isinstance(message, torch.Tensor) else message
                # the leader receives its own part into scratch space: its message stays as it is
                scratch = self.buffer(piece.stop - piece.start)[: piece.stop - piece.start]
                dist.scatter(scratch, [m[piece] for m in parts], src=self.leader, group=self.group)
            self._count(piece.stop - piece.start)
        self.frame_nbytes = nbytes

    def recv(self, max_payload_bytes: int) -> tuple[Header, torch.Tensor]:
        """Members: the next message's header and payload (a view of the received buffer).

        Raises :class:`~collective_loader.errors.WireError` for a header that does not decode or
        announces more than ``max_payload_bytes``.
        """
        frame = self.frame_nbytes
        buf = self.buffer(frame)
        self._recv_into(buf[:frame])
        header = Header.decode(buf[: wire.HEADER_BYTES].view(torch.int64).cpu(), max_payload_bytes)
        nbytes = wire.HEADER_BYTES + header.payload_nbytes
        if nbytes > frame:
            whole = self.buffer(nbytes)
            whole[:frame].copy_(buf[:frame])
            self._recv_into(whole[frame:nbytes])
            buf = whole
        self.frame_nbytes = nbytes
        return header, buf[wire.HEADER_BYTES : nbytes]

    def _recv_into(self, buf: torch.Tensor) -> None:
        if self.scattered:
            dist.scatter(buf, None, src=self.leader, group=self.group)
        else:
            dist.broadcast(buf, src=self.leader, group=self.group)
        self._count(buf.numel())


@dataclass
class Groups:
    """The groups this rank belongs to; built by :func:`build_groups`."""

    control: dist.ProcessGroup  # gloo, every mesh rank
    leaders: dist.ProcessGroup | None  # gloo, the replicas' leaders (dp > 1, leaders only)
    channels: dict[str, Channel]  # this rank's delivery groups by name (first / last / middle)
    replica: Channel  # gloo, this rank's whole replica: the leader shares the loader's state
    device: torch.device  # where delivered tensors land
    count: int  # groups created by every rank


def build_groups(
    layout: MeshLayout, place: Place, timeout: float, scatter: bool, buffers_per_channel: int, middle_data: bool
) -> Groups:
    """Create every group the loader needs. Must be called by every rank, in the same order.

    ``scatter``: the delivery channels that carry data scatter; ``buffers_per_channel``: how many
    CPU buffers each delivery channel keeps for reuse; ``middle_data``: whether middle stages get
    data (``every_stage`` keys) or only headers.
    """
    backend = dist.get_backend()
    on_gpu = backend != "gloo"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    cpu = torch.device("cpu")
    count = 0

    def make(ranks: Sequence[int], backend_: str) -> dist.ProcessGroup | None:
        nonlocal count
        count += 1
        return _new_group(ranks, backend_, timeout)

    control = make(sorted(layout.ranks), "gloo")
    leader_ranks = layout.leaders()
    leaders = make(sorted(leader_ranks), "gloo") if len(leader_ranks) > 1 else None
    channels: dict[str, Channel] = {}
    mine: Channel | None = None
    for replica in layout.replica_groups():
        group = make(replica.ranks, "gloo")
        if group is not None:
            mine = Channel("replica", replica.ranks, replica.leader, group, cpu)
        for name, ranks in replica.all():
            # middle stages that only ever get headers and error messages stay on gloo and the CPU
            data = name != "middle" or middle_data
            where = device if data else cpu
            group = make(ranks, "gloo" if where.type == "cpu" else backend)
            if group is not None:
                pool = BufferPool(buffers_per_channel) if where.type == "cpu" else None
                channels[name] = Channel(name, ranks, replica.leader, group, where, scatter and data, pool, data)
    assert control is not None and mine is not None
    return Groups(control, leaders, channels, mine, device, count)


# --- control messages -------------------------------------------------------------------------


def encode_message(text: str) -> torch.Tensor:
    data = text.encode()[: MESSAGE_BYTES - 8]
    out = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    out[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    if data:
        out[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def decode_message(buf: torch.Tensor) -> str:
    n = int(buf[:8].view(torch.int64))
    n = max(0, min(n, MESSAGE_BYTES - 8))
    return bytes(buf[8 : 8 + n].numpy()).decode(errors="replace")


def agree(group: dist.ProcessGroup, kind: Kind, message: str) -> tuple[Kind, str, int]:
    """All members decide one outcome for a step: the first error by rank wins, then END.

    Each member passes its own ``kind`` (DATA, END or an error) and error ``message``; returns
    ``(kind, message, origin_rank)`` agreed by everyone. Costs one small all-reduce; one more
    broadcast only when someone failed.
    """
    me = dist.get_rank()
    failed = kind in (Kind.SOURCE_ERROR, Kind.BATCH_ERROR, Kind.DELIVERY_ERROR)
    # MAX-reduce: [any END, any failure, -(lowest failing rank)]
    flags = torch.tensor([int(kind == Kind.END), int(failed), -me if failed else -(1 << 40)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if not flags[1]:
        return (Kind.END if flags[0] else Kind.DATA), "", -1
    origin = int(-flags[2])
    buf = encode_message(f"{int(kind)}:{message}") if me == origin else torch.empty(MESSAGE_BYTES, dtype=torch.uint8)
    dist.broadcast(buf, src=origin, group=group)
    code, _, text = decode_message(buf).partition(":")
    return Kind(int(code)), text, origin


def gather_strings(group: dist.ProcessGroup, text: str) -> list[str]:
    """Every member's ``text`` (truncated to a fixed size), in group rank order."""
    mine = encode_message(text)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [decode_message(b) for b in out]
