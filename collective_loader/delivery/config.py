"""``LoaderConfig``: every option of :class:`~collective_loader.CollectiveLoader`, in one place.

A frozen, keyword-only dataclass: one field per option, with its default and its meaning beside
it. It checks its own values when it is made, derives what depends on the mesh
(:meth:`LoaderConfig.settle`) and gives the line every rank must agree on
(:meth:`LoaderConfig.fingerprint`). Adding an option means adding a field here (and reading it
where it is used): ``CollectiveLoader(source, mesh, **options)`` passes its keywords through.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, cast

from torch.distributed.device_mesh import DeviceMesh

from collective_loader.delivery.transport import Transport
from collective_loader.plan.mesh import DEFAULT_PLACEMENT, STAGE_STYLES, MeshLayout, Placement, StageStyle
from collective_loader.plan.routing import Routing, str_keys
from collective_loader.plan.sharding import SplitName
from collective_loader.plan.split import Split, as_split

Delivery = Literal["broadcast", "scatter"]


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """What a :class:`~collective_loader.CollectiveLoader` delivers, where, and how.

    Every rank must build its loader with the same config (checked by digest at construction:
    :class:`~collective_loader.errors.ConfigMismatchError` otherwise). A value that cannot work raises
    ``ValueError`` or ``TypeError`` naming the field when the config is made.

    Example::

        >>> config = LoaderConfig(inputs=("input_ids",), labels=("labels",), seq_dims={"input_ids": 1})
        >>> config.delivery, config.timeout
        ('broadcast', 600.0)
        >>> LoaderConfig(delivery="allgather")
        Traceback (most recent call last):
        ...
        ValueError: delivery must be 'broadcast' or 'scatter', got 'allgather'
    """

    inputs: tuple[str, ...] = ("input_ids", "position_ids")
    """Keys delivered to every rank of the first pipeline stage."""

    labels: tuple[str, ...] = ("labels",)
    """Keys delivered to every rank of the last pipeline stage."""

    every_stage: tuple[str, ...] = ()
    """Keys delivered to every rank of every stage, middle stages included (packed-sequence
    metadata such as ``cu_seqlens`` that every attention layer reads)."""

    seq_dims: Mapping[str, int] = field(default_factory=dict)
    """Keys split over the shard dims (``cp``, Ulysses ``sp``), and along which dim; other keys
    are copied whole."""

    split: Split | SplitName = "zigzag"
    """How a sequence is cut over a shard dim: ``"zigzag"`` or ``"contiguous"``
    (:mod:`collective_loader.plan.sharding`), or a :class:`~collective_loader.plan.split.Split`
    such as :class:`~collective_loader.plan.documents.PerDocument` (each packed document cut on
    its own, with each rank's attention metadata). A name becomes its
    :class:`~collective_loader.plan.split.RowSplit` when the config is made."""

    roles: Mapping[str, str] | None = None
    """``{dim_name: "data" | "pipeline" | "replicate" | "shard"}`` overriding the defaults
    (:data:`collective_loader.plan.mesh.DEFAULT_ROLES`)."""

    placement: Placement = DEFAULT_PLACEMENT
    """Where each replica's leader sits: ``"spread"`` over the first and the last pipeline stage
    (so the loading spreads over their nodes) or ``"first_stage"``. Give a ``StreamingSource``
    the same."""

    stage_style: StageStyle = "loop"
    """Which pp ranks hold the first stage (it gets ``inputs``) and the last (it computes the loss
    and gets ``labels``), as the pipeline schedule places its stages: ``"loop"`` (stage ``i`` on pp
    rank ``i % pp``: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble; the last
    stage on pp rank ``pp - 1``) or ``"v"`` (pp rank ``r`` holds stages ``r`` and
    ``2 pp - 1 - r``: ZBVZeroBubble, DualPipeV; both on pp rank 0). Give the loader the schedule
    (``schedule=``) and it checks this against it; :func:`~collective_loader.stage_style_of`
    reads it from one."""

    delivery: Delivery = "broadcast"
    """``"broadcast"`` (one collective; receivers slice their shard) or ``"scatter"`` (each rank
    receives only its bytes)."""

    transport: Transport = "host"
    """``"host"``: everything moves over gloo groups on the transfer thread, in (pinned) host
    memory; on a CUDA mesh each rank then copies its batch to its GPU on a side stream.
    ``"device"``: tensor bytes move over groups of the mesh device's backend (NCCL on a CUDA
    mesh), posted by the training thread inside ``next()`` (see ``docs/gpus.md``)."""

    prefetch: int | None = None
    """Steps the transfer runs ahead of the training loop; ``None``: ``max(2, pipeline stages)``."""

    timeout: float = 600.0
    """Seconds any rank waits in one collective before raising
    :class:`~collective_loader.DeliveryError`."""

    max_batch_bytes: int = 1 << 32
    """The largest payload one delivery group may carry; a bigger batch raises
    :class:`~collective_loader.BatchError` on every rank, and received headers over it are refused."""

    def __post_init__(self) -> None:
        for name in ("inputs", "labels", "every_stage"):
            object.__setattr__(self, name, str_keys(name, getattr(self, name)))
        # read-only copies: a frozen config must not change under the ranks' agreement
        object.__setattr__(self, "seq_dims", MappingProxyType(dict(self.seq_dims or {})))
        if self.roles is not None:
            object.__setattr__(self, "roles", MappingProxyType(dict(self.roles)))
        object.__setattr__(self, "split", as_split(self.split))
        if self.delivery not in ("broadcast", "scatter"):
            raise ValueError(f"delivery must be 'broadcast' or 'scatter', got {self.delivery!r}")
        if self.stage_style not in STAGE_STYLES:
            raise ValueError(f"stage_style must be one of {STAGE_STYLES}, got {self.stage_style!r}")
        if self.transport not in ("host", "device"):
            raise ValueError(f"transport must be 'host' or 'device', got {self.transport!r}")
        if self.prefetch is not None and (isinstance(self.prefetch, bool) or int(self.prefetch) < 1):
            raise ValueError(f"prefetch must be >= 1 (or None for the default), got {self.prefetch!r}")
        if not usable_timeout(self.timeout):
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        object.__setattr__(self, "timeout", float(self.timeout))
        if isinstance(self.max_batch_bytes, bool) or int(self.max_batch_bytes) < 1:
            raise ValueError(f"max_batch_bytes must be a positive number of bytes, got {self.max_batch_bytes!r}")

    def settle(self, mesh: DeviceMesh, rank: int, world_size: int) -> tuple[MeshLayout, Routing, int]:
        """What this config means on ``mesh`` (local: no collective): the mesh's layout, the
        routing of keys over its stages and shard dims, and the steps to prefetch.

        Raises ``ValueError`` when the mesh does not hold exactly the ``world_size`` ranks.
        """
        layout = MeshLayout.from_mesh(mesh, self.roles, self.placement, self.stage_style)
        if sorted(layout.ranks) != list(range(world_size)):
            raise ValueError(
                f"the mesh must hold every rank of the world (size {world_size}); it holds {sorted(layout.ranks)}"
            )
        split = cast(Split, self.split)  # a Split since __post_init__
        routing = Routing(self.inputs, self.labels, dict(self.seq_dims), split, layout.shard_dims(), self.every_stage)
        pp_size = layout.place(rank).pp_size
        return layout, routing, max(2, pp_size) if self.prefetch is None else int(self.prefetch)

    def fingerprint(self, layout: MeshLayout) -> str:
        """What every rank's loader must agree on, as one line: the mesh and every option.
        Compared by digest (:func:`~collective_loader.delivery.agreement.first_difference`),
        shown whole on a mismatch.

        >>> layout = MeshLayout.build(("dp", "tp"), (2, 2), range(4))
        >>> LoaderConfig(inputs=("x",), labels=("y",)).fingerprint(layout)[:47]
        'mesh=[dp=2(data) tp=2(replicate)] ranks_sha256='
        """
        # the rank order as a fingerprint: a 16k-rank list would be most of the text
        ranks = hashlib.sha256(str(list(layout.ranks)).encode()).hexdigest()[:16]
        return (
            f"mesh=[{layout.describe()}] ranks_sha256={ranks} placement={layout.placement} "
            f"stage_style={layout.stage_style} "
            f"inputs={list(self.inputs)} labels={list(self.labels)} every_stage={list(self.every_stage)} "
            f"seq_dims={dict(sorted(self.seq_dims.items()))} split={self.split} delivery={self.delivery} "
            f"transport={self.transport} prefetch={self.prefetch} timeout={self.timeout} "
            f"max_batch_bytes={self.max_batch_bytes}"
        )


def usable_timeout(timeout: object) -> bool:
    """Whether ``timeout`` is a positive number of seconds (``bool`` is not)."""
    return isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0


def make_config(config: LoaderConfig | None, options: Mapping[str, Any]) -> LoaderConfig:
    """The loader's config: ``config``, or one made of the keyword ``options`` (not both).

    >>> make_config(None, {"timeout": 30}).timeout
    30.0
    """
    if config is None:
        return LoaderConfig(**options)
    if options:
        raise TypeError(f"give a LoaderConfig or its fields as keywords, not both (got config= and {sorted(options)})")
    if not isinstance(config, LoaderConfig):
        raise TypeError(f"config must be a LoaderConfig, got {type(config).__qualname__}")
    return config
