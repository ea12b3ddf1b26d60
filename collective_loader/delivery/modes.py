"""How one delivery channel moves a step's batch: one small class per mode, behind one interface.

A channel that carries data is broadcast or scattered (the config's ``delivery``), and its tensor
bytes travel in its gloo message or over its device group (the config's ``transport``).
:func:`mode_for` picks the channel's mode once; the step code (:mod:`~collective_loader.delivery.protocol`)
calls :meth:`Mode.pack`, :meth:`Mode.send` and :meth:`Mode.hand_over` on the leader and
:meth:`Mode.receive` on a member, and never asks which mode it has:

* :class:`HostBroadcast`: one message for every member, its tensor bytes in it; host tensors of
  at least :data:`APART_MIN_BYTES` follow it, each in a broadcast of its own from its own memory.
* :class:`HostScatter`: one message per member, holding its piece.
* :class:`DeviceBroadcast`, :class:`DeviceScatter`: the same messages, but only their header and
  description travel over gloo; the training thread posts the tensor bytes on the device group.

Example (what a 2-rank CPU world's host broadcast channel packs)::

    mode = mode_for(settings, settings.groups.channels[Stage.FIRST], stream=None)
    packed = mode.pack(step, batch)    # leader: the message, and its own batch
    mode.send(packed)                  # leader: one broadcast (and one per large tensor)
    item = mode.receive(step, header, payload)   # the other rank
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from collective_loader.delivery.device import copy_to_device
from collective_loader.delivery.settings import Settings
from collective_loader.delivery.transport import Channel
from collective_loader.errors import BatchError, DeliveryError
from collective_loader.plan import wire
from collective_loader.plan.mesh import Stage
from collective_loader.plan.wire import Header, Kind
from collective_loader.types import Batch

# a host tensor of at least this many bytes is broadcast from its own memory, in a collective of
# its own, instead of being copied into the step's message: the copy of a large tensor costs the
# leader more than one more collective (16 MiB: docs/performance.md); below this, copying wins
# (bench/results/delivery_small_tensors.md)
APART_MIN_BYTES = 1 << 20


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
    receive: tuple[DeviceMode, Header, torch.Tensor] | None = None  # member: (mode, header, description)


@dataclass
class Packed:
    """One channel's step as its leader built it."""

    messages: list[torch.Tensor]  # host buffers: one for every member, or the i-th member's (sorted ranks)
    header: Header  # of every message (a scatter's are of one size)
    batch: Batch  # the leader's own host batch: views of its own message (tensors sent apart: as given)
    layout: wire.PayloadLayout  # the description of the leader's own message
    mine: int = 0  # which of ``messages`` holds the leader's own piece
    apart: list[torch.Tensor] = field(default_factory=list)  # broadcast after the message, in order


def delivery_error(settings: Settings, what: str, error: BaseException) -> DeliveryError:
    """The error of a rank that gave up on a collective: who waited for what, and for how long."""
    place = settings.place
    return DeliveryError(
        f"rank {place.rank} ({place.stage} stage, dp_rank {place.dp_rank}) {what} (timeout={settings.config.timeout}s): {error}"
    )


def to_device(item: Item, host: Batch, settings: Settings, stream: Any) -> Item:
    """``item`` with ``host`` as its batch, its copy to the GPU started on a CUDA mesh (``stream``:
    the side stream for copies to the GPU, None on a CPU mesh)."""
    if stream is None:
        item.batch = host
    else:
        item.batch, item.event = copy_to_device(host, settings.device, stream)
        item.host = host
    return item


class Mode(ABC):
    """How one data channel moves a step: how the leader packs and sends it (the shape:
    broadcast or scatter) and how the batch reaches the training thread (the bytes: host or
    device). ``stream``: the side stream for copies to the GPU (None on a CPU mesh)."""

    apart_min: int | None = None  # tensors of at least this many bytes travel apart (None: none do)

    def __init__(self, settings: Settings, channel: Channel, stream: Any) -> None:
        self.settings, self.channel, self.stream = settings, channel, stream
        self.place = settings.place
        # the keys this channel's stage gets: the leader's first-stage channel carries both ends'
        # keys when one pp rank holds the first and the last stage (decided once, not per step)
        stage = Stage(channel.name)
        self.stage = Stage.BOTH if stage == Stage.FIRST and self.place.first_is_last else stage

    # --- the shape: one message or one per member

    @abstractmethod
    def pack(self, step: int, batch: Mapping[str, Any]) -> Packed:
        """Leader: the step's message(s) for this channel and the leader's own host batch, views
        of its message as a member's decode would give them, without decoding."""

    @abstractmethod
    def piece(self, batch: Batch) -> Batch:
        """This rank's piece of a batch decoded from its message."""

    @abstractmethod
    def _outgoing(self, parts: list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
        """What a collective of this shape sends of one part per message: the one, or all."""

    def send(self, packed: Packed) -> None:
        """Leader, transfer thread: send the step's message(s) over gloo, then the tensors that
        travel apart."""
        self.channel.send(self._outgoing(packed.messages), packed.header, packed.apart)

    # --- the bytes: in the message, or over the device group

    @abstractmethod
    def hand_over(self, item: Item, packed: Packed, own: bool) -> None:
        """Leader: what ``item`` (the delivered step) needs of this channel: the leader's own
        batch when ``own`` (its stage's channel), and the tensor bytes still to post."""

    @abstractmethod
    def receive(self, step: int, header: Header, payload: torch.Tensor) -> Item:
        """Member, transfer thread: the item of a DATA message (``payload``: the host bytes
        :meth:`Channel.recv` received)."""

    def _message(self, step: int, batch: Mapping[str, Any]) -> tuple[torch.Tensor, Header, Batch, wire.Encoded]:
        """``(message, header, the batch as the leader holds it: views of the message, its encoding)``."""
        encoded = wire.encode(batch, self.apart_min)
        limit = self.settings.config.max_batch_bytes
        if encoded.nbytes > limit:
            raise BatchError(
                f"a {self.channel.name}-stage payload is {encoded.nbytes} bytes; max_batch_bytes is {limit}"
            )
        return (*self.channel.message(Kind.DATA, step, encoded), encoded)

    def _stage(self, batch: Mapping[str, Any]) -> Batch:
        """The keys of ``batch`` this channel's stage gets."""
        return self.settings.routing.select(batch, self.stage)


class _Broadcast(Mode):
    """One message for every member; each takes its own piece of the whole batch."""

    def pack(self, step: int, batch: Mapping[str, Any]) -> Packed:
        message, header, own, encoded = self._message(step, self._stage(batch))
        assert encoded.layout is not None
        return Packed([message], header, self.piece(own), encoded.layout, apart=encoded.apart)

    def piece(self, batch: Batch) -> Batch:
        return self.settings.routing.piece(batch, self.place.shard)

    def _outgoing(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0]


class _Scatter(Mode):
    """One message per member, holding its piece (members of one shard share one)."""

    def pack(self, step: int, batch: Mapping[str, Any]) -> Packed:
        routing, ranks = self.settings.routing, self.channel.ranks
        selected = self._stage(batch)
        by_levels: dict[tuple, tuple[torch.Tensor, Header, Batch, wire.Encoded]] = {}
        for levels in self._member_levels:
            if levels not in by_levels:
                by_levels[levels] = self._message(step, routing.piece(selected, levels))
        headers = {(h.payload_nbytes, h.meta_nbytes) for _, h, _, _ in by_levels.values()}
        assert len(headers) == 1, headers  # equal shapes per shard, so equal sizes
        messages = [by_levels[levels][0] for levels in self._member_levels]
        _, header, own, encoded = by_levels[self.place.shard]
        assert encoded.layout is not None
        return Packed(messages, header, own, encoded.layout, mine=ranks.index(self.place.rank))

    @functools.cached_property
    def _member_levels(self) -> list[tuple[tuple[int, int], ...]]:
        """Each member's shard levels (sorted ranks), found once: not a Place per member per step."""
        layout = self.settings.mesh_layout
        return [layout.place(rank).shard for rank in self.channel.ranks]

    def piece(self, batch: Batch) -> Batch:
        return batch  # its message holds this rank's piece alone

    def _outgoing(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        return parts


class _Host(Mode):
    """The whole message over gloo; on a CUDA mesh the transfer thread starts the batch's copy
    to the GPU."""

    def hand_over(self, item: Item, packed: Packed, own: bool) -> None:
        if own:
            to_device(item, packed.batch, self.settings, self.stream)

    def receive(self, step: int, header: Header, payload: torch.Tensor) -> Item:
        layout = wire.decode(payload, header.meta_nbytes)
        if header.apart_nbytes:
            try:
                self.channel.recv_apart(payload, layout.apart(header.inline_nbytes))
            except RuntimeError as e:
                what = (
                    f"waited for leader rank {self.channel.leader} to deliver step {step}'s large tensors and gave up"
                )
                raise delivery_error(self.settings, what, e) from e
        return to_device(Item(Kind.DATA, step), self.piece(layout.batch(payload)), self.settings, self.stream)


class DeviceMode(Mode):
    """Only the header and the description over gloo: the training thread posts the tensor
    bytes on the device group (:func:`~collective_loader.delivery.protocol.post`) and
    :meth:`finish` decodes them."""

    def hand_over(self, item: Item, packed: Packed, own: bool) -> None:
        # every distinct message's payload once (scatter peers that share a shard share a message)
        end = wire.HEADER_BYTES + packed.header.payload_nbytes
        unique = {id(m): m[wire.HEADER_BYTES : end] for m in packed.messages}
        on_device = unique
        if self.stream is not None:
            on_device, item.event = copy_to_device(unique, self.settings.device, self.stream)
            # the host bytes the copies read; one side stream, so the last event follows every copy
            item.host = [*(item.host or ()), unique]
        start = wire.data_start(packed.header.meta_nbytes)
        item.sends.append((self.channel, self._outgoing([on_device[id(m)][start:] for m in packed.messages])))
        if own:  # the leader's own batch: views into its device copy of its message
            item.batch = self.piece(packed.layout.batch(on_device[id(packed.messages[packed.mine])]))

    def receive(self, step: int, header: Header, payload: torch.Tensor) -> Item:
        return Item(Kind.DATA, step, receive=(self, header, payload))

    def finish(self, header: Header, meta: torch.Tensor, payload: torch.Tensor) -> Batch:
        """Training thread: the batch of a received ``payload`` (on the device) whose description
        ``meta`` came over gloo."""
        return self.piece(wire.decode(payload, header.meta_nbytes, meta=meta).batch(payload))


class HostBroadcast(_Host, _Broadcast):
    """One message over gloo; large host tensors follow it from their own memory."""

    apart_min = APART_MIN_BYTES


class HostScatter(_Host, _Scatter):
    """One message per member over gloo."""


class DeviceBroadcast(DeviceMode, _Broadcast):
    """One header and description over gloo; the tensor bytes broadcast on the device group."""


class DeviceScatter(DeviceMode, _Scatter):
    """A header and description per member over gloo; the tensor bytes scattered on the device group."""


MODES: dict[tuple[str, str], type[Mode]] = {
    ("host", "broadcast"): HostBroadcast,
    ("host", "scatter"): HostScatter,
    ("device", "broadcast"): DeviceBroadcast,
    ("device", "scatter"): DeviceScatter,
}


def mode_for(settings: Settings, channel: Channel, stream: Any) -> Mode:
    """The mode of a data ``channel``, from the config's ``transport`` and ``delivery``."""
    return MODES[settings.config.transport, settings.config.delivery](settings, channel, stream)
