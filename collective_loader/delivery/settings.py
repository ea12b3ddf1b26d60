"""What one delivery step needs, in one frozen object that ``CollectiveLoader`` builds once.

The protocol (:mod:`~collective_loader.delivery.protocol`) and the epoch
(:mod:`~collective_loader.delivery.epoch`) read their settings from here and from nothing else,
so one step of the protocol can run, and be tested, without a ``CollectiveLoader``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import torch

from collective_loader.delivery.transport import Groups, Transport
from collective_loader.plan.mesh import MeshLayout, Place
from collective_loader.plan.routing import Routing

Delivery = Literal["broadcast", "scatter"]


@dataclass(frozen=True)
class Settings:
    """One rank's delivery settings.

    ``mesh_layout``: the mesh's roles and places; ``place``: this rank's; ``routing``: which keys
    go where and how sequences split; ``groups``: the process groups this rank belongs to;
    ``device``: where delivered tensors land; ``transport``, ``delivery``: how they move;
    ``prefetch``: steps the transfer thread runs ahead; ``timeout``: seconds any rank waits in
    one collective; ``max_batch_bytes``: the largest payload one delivery group carries.
    """

    mesh_layout: MeshLayout
    place: Place
    routing: Routing
    groups: Groups
    device: torch.device
    transport: Transport
    delivery: Delivery
    prefetch: int
    timeout: float
    max_batch_bytes: int


def config_text(
    mesh_layout: MeshLayout,
    routing: Routing,
    delivery: str,
    transport: str,
    prefetch: int,
    timeout: float,
    max_batch_bytes: int,
) -> str:
    """What every rank's loader must agree on, as one line; compared by digest
    (:func:`~collective_loader.delivery.agreement.first_difference`), shown whole on a mismatch.

    >>> layout = MeshLayout.build(("dp", "tp"), (2, 2), range(4))
    >>> config_text(layout, Routing(("x",), ("y",), {}, "zigzag"), "broadcast", "host", 2, 60.0, 1024)[:47]
    'mesh=[dp=2(data) tp=2(replicate)] ranks_sha256='
    """
    # the rank order as a fingerprint: a 16k-rank list would be most of the text
    ranks = hashlib.sha256(str(list(mesh_layout.ranks)).encode()).hexdigest()[:16]
    r = routing
    return (
        f"mesh=[{mesh_layout.describe()}] ranks_sha256={ranks} placement={mesh_layout.placement} "
        f"inputs={list(r.inputs)} labels={list(r.labels)} every_stage={list(r.every_stage)} "
        f"seq_dims={dict(sorted(r.seq_dims.items()))} split={r.split} delivery={delivery} transport={transport} "
        f"prefetch={prefetch} timeout={timeout} max_batch_bytes={max_batch_bytes}"
    )
