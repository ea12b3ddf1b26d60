"""Process groups and the collectives that move messages (a header and a payload in one buffer).

Groups are built once, by every rank, in the same order (``dist.new_group`` is collective over the default group). Control messages and
every message header travel over gloo (CPU) groups, whatever the mesh's device is.

A :class:`Channel` is one delivery group seen from one rank: the leader sends each message
(header and payload in one buffer) as a broadcast, or as a scatter of equal-sized per-rank
messages; every other member receives it. While message sizes repeat, that is one collective
per step.

Two transports (see :mod:`collective_loader.delivery.protocol`):

* ``"host"`` (default): the whole message moves over the channel's gloo group, in host memory
  (pinned on a CUDA mesh). Its collectives may run on any thread: gloo never touches a GPU.
* ``"device"``: the header and the batch description move over gloo; the tensor bytes move over
  a second group of the mesh device's backend (NCCL on a CUDA mesh, gloo on a CPU mesh), whose
  collectives are posted by the training thread only (:meth:`Channel.post_data`).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from collective_loader.delivery.buffers import BufferPool
from collective_loader.delivery.bulletin import Bulletin, Readers, hosts_job_store
from collective_loader.plan import wire
from collective_loader.plan.mesh import MeshLayout, Place, Stage
from collective_loader.plan.wire import Header, Kind

Transport = Literal["host", "device"]
T = TypeVar("T")


def new_group(ranks: Sequence[int], backend: str, timeout: float | None, desc: str) -> dist.ProcessGroup | None:
    """Create a group on every rank (``desc`` names it in torch's logs and errors); return it on
    members, None elsewhere."""
    group = dist.new_group(
        list(ranks),
        backend=backend,
        timeout=None if timeout is None else datetime.timedelta(seconds=timeout),
        group_desc=desc,
    )
    if dist.get_rank() not in ranks:
        return None
    assert isinstance(group, dist.ProcessGroup)
    return group


def mesh_device(device_type: str) -> torch.device:
    """Where delivered tensors land on a mesh of ``device_type``: the current device of that type.

    Chosen from the mesh, never from the default group's backend: ``init_process_group()`` with
    no backend, or ``"cpu:gloo,cuda:nccl"``, serves both devices, and a CPU mesh must never
    touch CUDA.
    """
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type, None)
    if module is None or not hasattr(module, "current_device"):
        raise ValueError(f"CollectiveLoader delivers to 'cpu' or 'cuda' meshes, not {device_type!r}")
    return torch.device(device_type, module.current_device())


def device_backend(device: torch.device) -> str:
    """The collective backend torch pairs with ``device``'s type (``"gloo"`` on CPU, ``"nccl"`` on CUDA)."""
    return dist.get_default_backend_for_device(device.type)


@dataclass
class Channel:
    """One delivery group (sorted global ``ranks``, ``leader`` among them) seen from this rank.

    Every message is one buffer: a :data:`~collective_loader.plan.wire.HEADER_BYTES` header, then the
    payload (see :meth:`collective_loader.plan.wire.Encoded.write`). Receivers cannot know a message's
    size before its header, so both ends track ``frame_nbytes``, the size of the previous
    message on this channel: the leader sends the first ``frame_nbytes`` bytes of the next
    message (padded when it is shorter) in one collective, and the rest, if it is longer, in a
    second. While batch sizes repeat, a step is therefore one collective per group.

    ``group`` is always gloo; ``pool`` reuses its host buffers (pinned on a CUDA mesh). With the
    device transport, ``data_group`` (the mesh device's backend) carries the tensor bytes of DATA
    messages and ``group`` only the header and the batch description. On a ``scattered`` channel
    every message is a scatter of equal-sized per-member messages (receivers must know how to
    receive before they see a header); end and error messages are then the same message for
    every member.
    """

    name: str  # a stage's group (first, last, middle), or the whole "replica"
    ranks: tuple[int, ...]
    leader: int
    group: dist.ProcessGroup
    scattered: bool = False
    pool: BufferPool | None = None
    data_group: dist.ProcessGroup | None = None
    frame_nbytes: int = wire.HEADER_BYTES
    # members: the host bytes of the previous message (its whole payload, apart tensors included)
    message_nbytes: int = wire.HEADER_BYTES
    # what this rank moved through the channel: the leader counts bytes it sends to each peer
    collectives: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    def __post_init__(self) -> None:
        self._leading = dist.get_rank() == self.leader

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A host uint8 buffer for a message of ``nbytes`` (longer when the frame is)."""
        nbytes = max(nbytes, self.frame_nbytes)
        if self.pool is not None:
            return self.pool.take(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def message(self, kind: Kind, step: int, encoded: wire.Encoded) -> tuple[torch.Tensor, Header, dict[str, Any]]:
        """Leader: ``(host buffer, header, batch)`` of the message announcing ``kind`` with
        ``encoded``; ``batch`` is the encoded batch as the leader holds it (see
        :meth:`~collective_loader.plan.wire.Encoded.write`)."""
        header = encoded.header(kind, step)
        buf = self.buffer(wire.HEADER_BYTES + header.inline_nbytes)
        return buf, header, encoded.write(buf, kind, step)

    def send_encoded(self, kind: Kind, step: int, encoded: wire.Encoded = wire.NOTHING) -> None:
        """Leader: build one message and send it to every member over gloo."""
        buf, header, _ = self.message(kind, step, encoded)
        self.send(buf, header)

    def send(
        self, message: torch.Tensor | Sequence[torch.Tensor], header: Header, apart: Sequence[torch.Tensor] = ()
    ) -> None:
        """Leader: send a message (from :meth:`message`) over gloo, then each tensor that travels
        apart (``apart``: the encoded batch's, as bytes) in a broadcast of its own.

        With the device transport a DATA message's tensor bytes stay behind (they follow with
        :meth:`post_data`). On a scattered channel ``message`` may be a list, the i-th for the
        i-th member (sorted ranks), all of one size.
        """
        nbytes = wire.HEADER_BYTES + self.carried_nbytes(header)
        for piece in self._pieces(nbytes):
            if isinstance(message, torch.Tensor) and not self.scattered:
                whole = piece.start == 0 and piece.stop == message.numel()  # the steady state: no view to make
                dist.broadcast(message if whole else message[piece], src=self.leader, group=self.group)
            else:
                parts = [message] * len(self.ranks) if isinstance(message, torch.Tensor) else message
                # the leader receives its own part into scratch space: its message stays as it is
                scratch = self.buffer(piece.stop - piece.start)[: piece.stop - piece.start]
                dist.scatter(scratch, [m[piece] for m in parts], src=self.leader, group=self.group)
            self._count(piece.stop - piece.start)
        self.frame_nbytes = nbytes
        for tensor in apart:
            dist.broadcast(tensor, src=self.leader, group=self.group)
            self._count(tensor.numel())

    def carried_nbytes(self, header: Header) -> int:
        """How many payload bytes of the message ``header`` announces travel in it over gloo."""
        if self.data_group is None or header.kind != Kind.DATA:
            return header.inline_nbytes
        return min(header.payload_nbytes, wire.data_start(header.meta_nbytes))

    def _pieces(self, nbytes: int) -> list[slice]:
        frame = self.frame_nbytes
        return [slice(0, frame)] + ([slice(frame, nbytes)] if nbytes > frame else [])

    def _count(self, nbytes: int) -> None:
        self.collectives += 1
        if self._leading:
            self.bytes_sent += nbytes * (len(self.ranks) - 1)
        else:
            self.bytes_received += nbytes

    def recv(self, max_payload_bytes: int) -> tuple[Header, torch.Tensor]:
        """Members: the next message's header and its payload in host memory (a view of the
        received buffer: the whole payload, or with the device transport a DATA message's
        description only). Tensors that travel apart are not received yet: see :meth:`recv_apart`.

        Raises :class:`~collective_loader.errors.WireError` for a header that does not decode or
        announces more than ``max_payload_bytes``.
        """
        frame = self.frame_nbytes
        buf = self.buffer(max(frame, self.message_nbytes))  # the previous message's size: usually this one's
        self._recv_into(buf[:frame])
        header = Header.read(buf, max_payload_bytes)
        nbytes = wire.HEADER_BYTES + self.carried_nbytes(header)
        whole = (
            nbytes
            if self.data_group is not None and header.kind == Kind.DATA
            else wire.HEADER_BYTES + header.payload_nbytes
        )
        if whole > buf.numel():
            bigger = self.buffer(whole)
            bigger[:frame].copy_(buf[:frame])
            buf = bigger
        if nbytes > frame:
            self._recv_into(buf[frame:nbytes])
        self.frame_nbytes, self.message_nbytes = nbytes, whole
        return header, buf[wire.HEADER_BYTES : whole]

    def recv_apart(self, payload: torch.Tensor, ranges: Sequence[slice]) -> None:
        """Members: receive the tensors that travel apart into their ``ranges`` of ``payload``
        (from :meth:`~collective_loader.plan.wire.PayloadLayout.apart`), in order."""
        for where in ranges:
            self._recv_into(payload[where])

    def _recv_into(self, buf: torch.Tensor) -> None:
        if self.scattered:
            dist.scatter(buf, None, src=self.leader, group=self.group)
        else:
            dist.broadcast(buf, src=self.leader, group=self.group)
        self._count(buf.numel())

    def post_data(self, data: torch.Tensor | Sequence[torch.Tensor]) -> dist.Work:
        """Device transport, training thread only: start moving one message's tensor bytes.

        The leader passes its bytes (one tensor, or one per member on a scattered channel),
        members the tensor to receive into. Returns the collective's work; ``wait()`` on it
        makes the caller's stream wait (NCCL) or blocks until it is done (gloo).
        """
        assert self.data_group is not None
        if isinstance(data, torch.Tensor):  # a member's buffer, or the one message of a broadcast
            nbytes = data.numel()
            if self.scattered:
                work = dist.scatter(data, None, src=self.leader, group=self.data_group, async_op=True)
            else:
                work = dist.broadcast(data, src=self.leader, group=self.data_group, async_op=True)
        else:  # the scattering leader's per-member messages
            parts = list(data)
            nbytes = parts[0].numel()
            work = dist.scatter(
                torch.empty_like(parts[0]), parts, src=self.leader, group=self.data_group, async_op=True
            )
        assert work is not None
        self._count(nbytes)
        return work


@dataclass
class Groups:
    """The groups this rank belongs to; built by :func:`build_groups`.

    A rank outside delivery (a middle stage without ``every_stage`` keys) has no channel and no
    ``replica``; it reads its leader's ``bulletin``, which that leader posts on.
    """

    control: dist.ProcessGroup  # gloo, every mesh rank
    leaders: dist.ProcessGroup | None  # gloo, the replicas' leaders (dp > 1, leaders only)
    channels: dict[Stage, Channel]  # this rank's delivery groups by stage (first / last / middle)
    replica: Channel | None  # gloo, the replica's ranks in delivery: the leader shares the loader's state
    bulletin: Bulletin | None  # the replica's ranks outside delivery read it, its leader posts on it
    readers: Readers | None  # every rank outside delivery, on them and on the job store's host
    count: int  # groups created by every rank
    released: bool = False  # release() gave the groups back

    @property
    def in_delivery(self) -> bool:
        """Whether this rank is in a delivery group (and must iterate the loader)."""
        return bool(self.channels)

    def release(self) -> None:
        """Give back every process group above (the loader is closed; idempotent): torch forgets
        them and this rank drops them, so each one's gloo worker threads end now, while the
        interpreter is alive. Left to interpreter exit (the loader still holding them after
        ``destroy_process_group()``), a worker that still held a finished collective's tensors
        needed the GIL to free them and aborted the process ("terminate called without an active
        exception"; 1 of about 20 two-step runs on a loaded machine). A closed loader's groups are
        gone: using one raises ``AttributeError``."""
        if self.released:
            return
        self.released = True
        channels = self._channels()
        owned = [self.control, self.leaders, *(c.group for c in channels), *(c.data_group for c in channels)]
        for group in {id(g): g for g in owned if g is not None}.values():
            with contextlib.suppress(ValueError):  # already destroyed (destroy_process_group() before close())
                dist.destroy_process_group(group)
        for channel in channels:
            del channel.group, channel.data_group
        del self.control, self.leaders

    def _channels(self) -> list[Channel]:
        return [*self.channels.values(), *([self.replica] if self.replica is not None else [])]

    def traffic(self) -> dict[str, int]:
        """Collectives and bytes this rank has sent and received through its delivery groups."""
        out = {"collectives": 0, "bytes_sent": 0, "bytes_received": 0}
        for channel in self.channels.values():
            for key in out:
                out[key] += getattr(channel, key)
        return out


def build_groups(
    control: dist.ProcessGroup,
    layout: MeshLayout,
    place: Place,
    *,
    device: torch.device,
    transport: Transport,
    timeout: float,
    scatter: bool,
    buffers_per_channel: int,
    middle_data: bool,
) -> Groups:
    """Create every group the loader needs but ``control``. Must be called by every rank, in the
    same order.

    ``device``: where batches land (pinned host buffers when it is a GPU); ``transport``: whether
    tensor bytes also get groups of ``device``'s backend; ``scatter``: the delivery channels that
    carry data scatter; ``buffers_per_channel``: how many host buffers each delivery channel
    keeps for reuse; ``middle_data``: whether middle stages get data (``every_stage`` keys) or
    nothing (they are then outside delivery, and their replica's leader posts on a bulletin).

    The device groups' communicators are created here, on the constructing thread, by one small
    collective each in creation order (NCCL creates them lazily on their first collective
    otherwise, which would then happen inside the training loop's first step).
    """
    pin = device.type == "cuda"
    count = 1  # the control group (see control_group)

    def make(ranks: Sequence[int], backend: str, desc: str) -> dist.ProcessGroup | None:
        nonlocal count
        count += 1
        return new_group(ranks, backend, timeout, f"collective_loader:{desc}")

    leader_ranks = layout.leaders()
    leaders = make(sorted(leader_ranks), "gloo", "leaders") if len(leader_ranks) > 1 else None
    channels: dict[Stage, Channel] = {}
    mine: Channel | None = None
    bulletin: Bulletin | None = None
    outside_ranks: list[int] = []
    warm: list[tuple[dist.ProcessGroup, int]] = []
    for replica in layout.replica_groups():
        destinations = [(name, ranks) for name, ranks in replica.all() if name != Stage.MIDDLE or middle_data]
        delivered = tuple(sorted({rank for _, ranks in destinations for rank in ranks}))
        outside = replica.middle is not None and not middle_data
        if outside:
            outside_ranks += [rank for rank in replica.middle or () if rank not in delivered]
        if outside and place.dp_rank == replica.dp_rank and (place.is_leader or place.rank not in delivered):
            bulletin = Bulletin.open(control.group_name, replica.dp_rank, timeout)
        group = make(delivered, "gloo", f"replica{replica.dp_rank}")
        if group is not None:
            mine = Channel("replica", delivered, replica.leader, group)
        for name, ranks in destinations:
            group = make(ranks, "gloo", f"{name}{replica.dp_rank}")
            data_group = None
            if transport == "device":
                data_group = make(ranks, device_backend(device), f"{name}{replica.dp_rank}_data")
                if data_group is not None:
                    warm.append((data_group, replica.leader))
            if group is not None:
                pool = BufferPool(buffers_per_channel, pin=pin)
                channels[name] = Channel(name, ranks, replica.leader, group, scatter, pool, data_group)
    for group, leader in warm:
        dist.broadcast(torch.zeros(1, device=device), src=leader, group=group)
    readers = None
    if outside_ranks and (place.rank in outside_ranks or hosts_job_store()):
        readers = Readers.open(control.group_name, sorted(outside_ranks), timeout)
    return Groups(control, leaders, channels, mine, bulletin, readers, count)
