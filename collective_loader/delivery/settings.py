"""What one delivery step needs, in one frozen object: the config plus what it means on the mesh.

:func:`build_settings` is the loader's construction, run by every rank: derive the layout, the
routing and the device from a :class:`~collective_loader.delivery.config.LoaderConfig`, create the
process groups, and check that every rank was given the same config. The protocol
(:mod:`~collective_loader.delivery.protocol`) and the epoch (:mod:`~collective_loader.delivery.epoch`)
read their settings from here and from nothing else, so one step of the protocol can run, and be
tested, without a ``CollectiveLoader``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from collective_loader.delivery.agreement import first_difference, run_phase
from collective_loader.delivery.config import LoaderConfig
from collective_loader.delivery.transport import Groups, build_groups, mesh_device
from collective_loader.errors import ConfigMismatchError, ConstructionError
from collective_loader.plan.mesh import MeshLayout, Place
from collective_loader.plan.routing import Routing

log = logging.getLogger("collective_loader.loader")  # the name users configure


@dataclass(frozen=True)
class Settings:
    """One rank's delivery settings.

    ``config``: the options every rank agreed on; ``mesh_layout``: the mesh's roles and places;
    ``place``: this rank's; ``routing``: which keys go where and how sequences split; ``device``:
    where delivered tensors land; ``prefetch``: steps the transfer thread runs ahead
    (``config.prefetch`` or its default for this mesh); ``groups``: the process groups this rank
    belongs to.
    """

    config: LoaderConfig
    mesh_layout: MeshLayout
    place: Place
    routing: Routing
    device: torch.device
    prefetch: int
    groups: Groups


def build_settings(make_config: Callable[[], LoaderConfig], mesh: DeviceMesh, control: dist.ProcessGroup) -> Settings:
    """Every rank: make the config, derive this rank's settings, create the groups, and check
    every rank has the same config. Collective over ``control`` (every rank of the world).

    A config that ``make_config`` refuses, or that cannot run on ``mesh``, raises
    :class:`~collective_loader.ConstructionError` on every rank with the first failing rank's
    message; ranks with different configs raise :class:`~collective_loader.errors.ConfigMismatchError`.
    """

    def derive() -> tuple[LoaderConfig, MeshLayout, Routing, int, torch.device]:
        config = make_config()
        layout, routing, prefetch = config.settle(mesh, dist.get_rank(), dist.get_world_size())
        return config, layout, routing, prefetch, mesh_device(mesh.device_type)

    config, layout, routing, prefetch, device = run_phase(
        control, derive, lambda rank, text: ConstructionError(f"rank {rank} could not build CollectiveLoader: {text}")
    )
    place = layout.place(dist.get_rank())
    scatter = config.delivery == "scatter"
    # a buffer per step in flight (the queue, the loop's batch, the one being filled, one
    # posted or copied to the GPU) per distinct scatter part; a loop that keeps batches makes
    # the pool allocate, never overwrite
    parts = math.prod(size for _, size in routing.shard_dims) if scatter else 1
    groups = build_groups(
        control,
        layout,
        place,
        device=device,
        transport=config.transport,
        timeout=config.timeout,
        scatter=scatter,
        buffers_per_channel=(prefetch + 3) * parts,
        middle_data=bool(routing.every_stage),
    )
    settings = Settings(config, layout, place, routing, device, prefetch, groups)
    _check_same_config(settings)
    return settings


def _check_same_config(settings: Settings) -> None:
    reference = settings.mesh_layout.leaders()[0]
    found = first_difference(settings.groups, reference, settings.config.fingerprint(settings.mesh_layout))
    if found is not None:
        rank, theirs_ref, theirs = found
        raise ConfigMismatchError(
            f"rank {rank} built CollectiveLoader with other arguments than rank {reference} (the lowest such rank "
            f"is named; others may differ too).\n  rank {reference}: {theirs_ref}\n  rank {rank}: {theirs}"
        )


def log_settings(settings: Settings) -> None:
    """INFO: on rank 0 what the loader decided for the whole mesh; on each leader its replica."""
    if not log.isEnabledFor(logging.INFO):
        return
    layout, place, groups = settings.mesh_layout, settings.place, settings.groups
    if place.rank == 0:
        log.info(
            "CollectiveLoader: mesh [%s], %d replicas, leaders %s (placement=%s); %d process groups (every rank makes them); "
            "delivery=%s transport=%s device=%s prefetch=%d timeout=%.0fs",
            layout.describe(),
            layout.dp_size,
            list(layout.leaders()),
            layout.placement,
            groups.count,
            settings.config.delivery,
            settings.config.transport,
            settings.device,
            settings.prefetch,
            settings.config.timeout,
        )
    if place.is_leader:
        channels = ", ".join(f"{name} {list(ch.ranks)}" for name, ch in groups.channels.items())
        log.info(
            "CollectiveLoader: rank %d leads replica %d (dp_rank %d of %d, %s stage); delivers to %s",
            place.rank,
            place.dp_rank,
            place.dp_rank,
            place.dp_size,
            place.stage,
            channels,
        )
