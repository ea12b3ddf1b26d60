"""Process groups and the collectives that move headers and payloads.

Everything that calls ``torch.distributed`` lives here. Groups are built once, by every rank, in
the same order (``dist.new_group`` is collective over the default group). Headers and control
messages always travel over gloo (CPU) groups, so reading them never waits for a GPU; payloads
travel over the default backend (gloo on CPU, NCCL on GPUs).

A :class:`Channel` is one delivery group seen from one rank: the leader sends one header and one
payload collective per step (a broadcast, or a scatter of equal-sized per-rank payloads); every
other member receives them.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from collective_loader import wire
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

    ``header_group`` is gloo; ``payload_group`` is the same group on gloo worlds and an NCCL twin
    on GPU worlds. ``device`` is where payloads land.
    """

    name: str
    ranks: tuple[int, ...]
    leader: int
    header_group: dist.ProcessGroup
    payload_group: dist.ProcessGroup
    device: torch.device
    # what this rank moved through the channel: the leader counts bytes it sends to each peer
    collectives: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    def _count(self, nbytes: int, peers: int) -> None:
        self.collectives += 1
        if dist.get_rank() == self.leader:
            self.bytes_sent += nbytes * peers
        else:
            self.bytes_received += nbytes

    def send_header(self, header: Header) -> None:
        words = header.encode()
        dist.broadcast(words, src=self.leader, group=self.header_group)
        self._count(words.numel() * 8, len(self.ranks) - 1)

    def recv_header(self, max_payload_bytes: int) -> Header:
        words = torch.empty(wire.HEADER_WORDS, dtype=torch.int64)
        dist.broadcast(words, src=self.leader, group=self.header_group)
        self._count(words.numel() * 8, 0)
        return Header.decode(words, max_payload_bytes)

    def send_payload(self, payload: torch.Tensor) -> None:
        """Leader: broadcast one buffer to every member."""
        dist.broadcast(payload, src=self.leader, group=self.payload_group)
        self._count(payload.numel(), len(self.ranks) - 1)

    def scatter_payload(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Leader: send ``parts[i]`` to the i-th member (sorted ranks); returns the leader's own."""
        mine = torch.empty_like(parts[self.ranks.index(self.leader)])
        dist.scatter(mine, list(parts), src=self.leader, group=self.payload_group)
        self._count(mine.numel(), len(self.ranks) - 1)
        return mine

    def recv_payload(self, nbytes: int, scattered: bool) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if scattered:
            dist.scatter(buf, None, src=self.leader, group=self.payload_group)
        else:
            dist.broadcast(buf, src=self.leader, group=self.payload_group)
        self._count(nbytes, 0)
        return buf


@dataclass
class Groups:
    """The groups this rank belongs to; built by :func:`build_groups`."""

    control: dist.ProcessGroup  # gloo, every mesh rank
    leaders: dist.ProcessGroup | None  # gloo, the replicas' leaders (dp > 1, leaders only)
    channels: dict[str, Channel]  # this rank's delivery groups by name (first / last / middle)
    replica: Channel  # gloo, this rank's whole replica: the leader shares the loader's state
    device: torch.device  # where delivered tensors land
    count: int  # groups created by every rank


def build_groups(layout: MeshLayout, place: Place, timeout: float) -> Groups:
    """Create every group the loader needs. Must be called by every rank, in the same order."""
    backend = dist.get_backend()
    on_gpu = backend != "gloo"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
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
            mine = Channel("replica", replica.ranks, replica.leader, group, group, torch.device("cpu"))
        for name, ranks in replica.all():
            header = make(ranks, "gloo")
            payload = make(ranks, backend) if on_gpu and name != "middle" else header
            if header is not None:
                assert payload is not None
                # middle stages only ever get headers and error messages: keep them on the CPU
                where = torch.device("cpu") if name == "middle" else device
                channels[name] = Channel(name, ranks, replica.leader, header, payload, where)
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
    failed = kind in (Kind.SOURCE_ERROR, Kind.BATCH_ERROR)
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
