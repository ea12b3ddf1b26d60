"""Mesh dims -> roles -> every rank's place and the rank lists of every delivery group.

Pure logic: nothing here talks to ``torch.distributed``, so it can be tested without processes.

Vocabulary (see the role table in ``docs/concepts.md``):

* a *data* dim splits the global batch; ranks that share all data-dim coordinates form a *replica*;
* the *pipeline* dim (at most one) orders the stages of a replica;
* a *replicate* dim gets identical copies;
* a *shard* dim gets one slice of every sequence key; several shard dims compose in mesh order
  (the outermost splits first).

Which pipeline coordinate holds the first stage and which the last (the loss) follows the
schedule's *stage style* (:data:`StageStyle`): ``"loop"`` (stage ``i`` on pp rank ``i % pp``: GPipe,
1F1B and the interleaved schedules) puts the first stage on pp rank 0 and the last on pp rank
``pp - 1``; ``"v"`` (rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``: ZBVZeroBubble, DualPipeV)
puts both on pp rank 0. Every other pp rank is a *middle* stage.

The *leader* of a replica is its rank with coordinate 0 on every non-data dim except the
pipeline dim, where it sits on an *end* stage (the first or the last: the stages that receive
keys and therefore iterate). With ``placement="spread"`` (the default) the ends are shared out
in blocks of consecutive dp_ranks (``ends[dp_rank * len(ends) // dp]``), so the loading spreads
over both ends' nodes; with ``placement="first_stage"`` every leader is on the first stage. The
leader is the only rank that loads data. Per replica there are up to three groups, each a sorted
tuple of global ranks that contains the leader:

* ``first``: the leader and every rank of the first pipeline stage (with one stage, or under
  ``"v"``, the first stage is also the last);
* ``last``: the leader and every rank of the last stage, when it is another stage than the first;
* ``middle``: the leader and every rank of the middle stages, when there are any. They receive
  the ``every_stage`` keys; without any, the middle ranks are outside delivery (see
  :mod:`collective_loader.delivery.bulletin`).
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # pure module: the mesh is only read, never needed at import
    from torch.distributed.device_mesh import DeviceMesh

Role = Literal["data", "pipeline", "replicate", "shard"]
ROLES: tuple[Role, ...] = ("data", "pipeline", "replicate", "shard")
# where each replica's leader sits: on the first pipeline stage, or spread over the stages in
# blocks of consecutive dp_ranks (so the loading spreads over the stages' nodes)
Placement = Literal["first_stage", "spread"]
PLACEMENTS: tuple[Placement, ...] = ("first_stage", "spread")
DEFAULT_PLACEMENT: Placement = "spread"
# which pp ranks hold the first and the last stage (see the module docstring)
StageStyle = Literal["loop", "v"]
STAGE_STYLES: tuple[StageStyle, ...] = ("loop", "v")


class Stage(enum.StrEnum):
    """What a rank's pipeline stage receives: the first stage's keys (the inputs), the last
    stage's (the labels), both (one stage, or pp rank 0 under the ``"v"`` style), or the middle
    stages' (only ``every_stage`` keys). A ``str``, so ``place.stage == "last"`` reads as before.

    >>> Stage.BOTH == "both", str(Stage.MIDDLE)
    (True, 'middle')
    """

    FIRST = "first"
    LAST = "last"
    BOTH = "both"
    MIDDLE = "middle"


DEFAULT_ROLES: dict[str, Role] = {
    "dp": "data",
    "dp_replicate": "data",
    "dp_shard": "data",
    "batch": "data",
    "fsdp": "data",
    "pp": "pipeline",
    "tp": "replicate",
    "cp": "shard",
    "sp": "shard",
}


@dataclass(frozen=True)
class ReplicaGroups:
    """The groups of one replica (sorted global ranks, leader included).

    ``ranks`` is the whole replica; ``first``, ``last`` and ``middle`` the ranks of its stages with
    the leader (``middle`` is a delivery group only when there are ``every_stage`` keys).
    """

    dp_rank: int
    leader: int
    ranks: tuple[int, ...]
    first: tuple[int, ...]
    last: tuple[int, ...] | None
    middle: tuple[int, ...] | None

    def all(self) -> list[tuple[Stage, tuple[int, ...]]]:
        """``(stage, ranks)`` of the stage groups that exist, in the order they are created."""
        named = [(Stage.FIRST, self.first), (Stage.LAST, self.last), (Stage.MIDDLE, self.middle)]
        return [(name, ranks) for name, ranks in named if ranks is not None]


@dataclass(frozen=True)
class Place:
    """Where one rank sits in the mesh and what it needs.

    ``shard`` lists ``(size, index)`` for every shard dim in mesh order (outermost first).
    ``stage`` is its :class:`Stage`.
    """

    rank: int
    coords: tuple[int, ...]
    dp_rank: int
    dp_size: int
    leader: int
    pp_rank: int
    pp_size: int
    shard: tuple[tuple[int, int], ...]
    stage_style: StageStyle = "loop"

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == last_stage_rank(self.pp_size, self.stage_style)

    @property
    def first_is_last(self) -> bool:
        """Whether one pp rank holds both the first and the last stage (one stage, or ``"v"``)."""
        return last_stage_rank(self.pp_size, self.stage_style) == 0

    @property
    def stage(self) -> Stage:
        if self.is_first_stage and self.is_last_stage:
            return Stage.BOTH
        if self.is_first_stage:
            return Stage.FIRST
        if self.is_last_stage:
            return Stage.LAST
        return Stage.MIDDLE


@dataclass(frozen=True)
class MeshLayout:
    """Roles of a mesh's dims and the arithmetic on its coordinates.

    ``ranks`` holds the mesh's global ranks in row-major order of ``shape``.

    Example::

        >>> layout = MeshLayout.build(("pp", "dp", "tp"), (2, 2, 2), range(8))
        >>> layout.place(5).dp_rank, layout.place(5).leader, layout.place(5).stage
        (0, 0, <Stage.LAST: 'last'>)
        >>> layout.replica_groups()[0].last
        (0, 4, 5)
        >>> layout.leaders()  # "spread": replica 1's leader is on the last stage
        (0, 6)
        >>> layout.replica_groups()[1].first  # ... and sends the first stage its inputs
        (2, 3, 6)
        >>> v = MeshLayout.build(("pp", "dp", "tp"), (2, 2, 2), range(8), stage_style="v")
        >>> v.place(0).stage, v.place(4).stage, v.leaders()  # the loss is on pp rank 0 too
        (<Stage.BOTH: 'both'>, <Stage.MIDDLE: 'middle'>, (0, 2))
    """

    dim_names: tuple[str, ...]
    shape: tuple[int, ...]
    roles: tuple[Role, ...]
    ranks: tuple[int, ...]
    placement: Placement = DEFAULT_PLACEMENT
    stage_style: StageStyle = "loop"

    @classmethod
    def build(
        cls,
        dim_names: Sequence[str],
        shape: Sequence[int],
        ranks: Sequence[int],
        roles: Mapping[str, str] | None = None,
        placement: str = DEFAULT_PLACEMENT,
        stage_style: str = "loop",
    ) -> MeshLayout:
        """Check the mesh description and assign a role to every dim.

        ``roles`` overrides the defaults of :data:`DEFAULT_ROLES` for any dim name;
        ``placement`` says where the leaders sit (:data:`Placement`), ``stage_style`` which pp
        ranks hold the first and the last stage (:data:`StageStyle`).
        """
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if stage_style not in STAGE_STYLES:
            raise ValueError(f"stage_style must be one of {STAGE_STYLES}, got {stage_style!r}")
        dim_names = tuple(dim_names)
        shape = tuple(int(s) for s in shape)
        ranks = tuple(int(r) for r in ranks)
        if len(dim_names) != len(shape):
            raise ValueError(f"mesh has {len(shape)} dims but {len(dim_names)} names: {dim_names}")
        if len(set(dim_names)) != len(dim_names):
            raise ValueError(f"mesh dim names must be unique, got {dim_names}")
        if any(s < 1 for s in shape):
            raise ValueError(f"mesh dims must have size >= 1, got shape {shape}")
        if len(ranks) != math.prod(shape):
            raise ValueError(f"mesh of shape {shape} needs {math.prod(shape)} ranks, got {len(ranks)}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"mesh lists a rank twice: {ranks}")
        overrides = dict(roles or {})
        unknown_override = sorted(set(overrides) - set(dim_names))
        if unknown_override:
            raise ValueError(f"roles= names dims {unknown_override} that are not in the mesh {dim_names}")
        resolved: list[Role] = []
        for name in dim_names:
            role = overrides.get(name, DEFAULT_ROLES.get(name))
            if role is None:
                raise ValueError(
                    f"mesh dim {name!r} has no default role; pass roles={{{name!r}: ...}} with one of {ROLES}"
                )
            if role not in ROLES:
                raise ValueError(f"role {role!r} for dim {name!r} is not one of {ROLES}")
            resolved.append(role)  # type: ignore[arg-type]
        if resolved.count("pipeline") > 1:
            pipes = [n for n, r in zip(dim_names, resolved) if r == "pipeline"]
            raise ValueError(f"at most one pipeline dim is supported, got {pipes}")
        return cls(dim_names, shape, tuple(resolved), ranks, placement, stage_style)  # type: ignore[arg-type]

    @classmethod
    def from_mesh(
        cls,
        mesh: DeviceMesh,
        roles: Mapping[str, str] | None = None,
        placement: str = DEFAULT_PLACEMENT,
        stage_style: str = "loop",
    ) -> MeshLayout:
        """The layout of a ``torch.distributed.device_mesh.DeviceMesh`` (needs named dims)."""
        if mesh.mesh_dim_names is None:
            raise ValueError("the DeviceMesh needs named dims (mesh_dim_names=...)")
        shape, ranks = tuple(mesh.mesh.shape), mesh.mesh.flatten().tolist()
        return cls.build(mesh.mesh_dim_names, shape, ranks, roles, placement, stage_style)

    # --- coordinates -------------------------------------------------------------------------

    @functools.cached_property
    def _flat_index(self) -> dict[int, int]:
        return {rank: i for i, rank in enumerate(self.ranks)}

    def _dims(self, role: Role) -> list[int]:
        return [i for i, r in enumerate(self.roles) if r == role]

    def coords(self, rank: int) -> tuple[int, ...]:
        """Coordinates of a global rank in the mesh."""
        flat = self._flat_index.get(rank)
        if flat is None:
            raise ValueError(f"rank {rank} is not in the mesh (ranks {self.ranks})")
        out = []
        for size in reversed(self.shape):
            out.append(flat % size)
            flat //= size
        return tuple(reversed(out))

    def rank_at(self, coords: Sequence[int]) -> int:
        flat = 0
        for c, size in zip(coords, self.shape):
            flat = flat * size + c
        return self.ranks[flat]

    @property
    def dp_size(self) -> int:
        return math.prod(self.shape[i] for i in self._dims("data"))

    @property
    def pp_size(self) -> int:
        dims = self._dims("pipeline")
        return self.shape[dims[0]] if dims else 1

    def _dp_rank(self, coords: Sequence[int]) -> int:
        dp = 0
        for i in self._dims("data"):
            dp = dp * self.shape[i] + coords[i]
        return dp

    def place(self, rank: int) -> Place:
        """The place of ``rank``: replica, leader, stage and shard coordinates."""
        coords = self.coords(rank)
        pipe = self._dims("pipeline")
        at = [c if r == "data" else 0 for c, r in zip(coords, self.roles)]
        if self.placement == "spread" and pipe:
            ends = sorted({0, last_stage_rank(self.pp_size, self.stage_style)})
            at[pipe[0]] = ends[self._dp_rank(coords) * len(ends) // self.dp_size]
        leader = self.rank_at(at)
        return Place(
            rank=rank,
            coords=coords,
            dp_rank=self._dp_rank(coords),
            dp_size=self.dp_size,
            leader=leader,
            pp_rank=coords[pipe[0]] if pipe else 0,
            pp_size=self.pp_size,
            shard=tuple((self.shape[i], coords[i]) for i in self._dims("shard")),
            stage_style=self.stage_style,
        )

    # --- groups ------------------------------------------------------------------------------

    def replica_ranks(self, dp_rank: int) -> list[int]:
        """All ranks of one replica, in mesh order."""
        return [r for r in self.ranks if self.place(r).dp_rank == dp_rank]

    def replica_groups(self) -> list[ReplicaGroups]:
        """The delivery groups of every replica, ordered by dp_rank (computed once per layout)."""
        return list(self._replica_groups)

    @functools.cached_property
    def _replica_groups(self) -> tuple[ReplicaGroups, ...]:
        # one pass over the ranks with coordinate arithmetic, no Place per rank: every rank
        # lists every group to new_group, so this runs on each of them, at 64k ranks too
        pipe = self._dims("pipeline")
        last_pp = last_stage_rank(self.pp_size, self.stage_style)
        # per replica: the ranks of its first stage, of its last (when another) and of its middle ones
        stages: list[tuple[list[int], list[int], list[int]]] = [([], [], []) for _ in range(self.dp_size)]
        for coords, rank in zip(itertools.product(*map(range, self.shape)), self.ranks):
            pp = coords[pipe[0]] if pipe else 0
            stages[self._dp_rank(coords)][0 if pp == 0 else 1 if pp == last_pp else 2].append(rank)
        out = []
        for dp, (first, last, middle) in enumerate(stages):
            leader = self.place(first[0]).leader
            out.append(
                ReplicaGroups(
                    dp_rank=dp,
                    leader=leader,
                    ranks=tuple(sorted(first + last + middle)),
                    first=tuple(sorted({*first, leader})),
                    last=tuple(sorted({*last, leader})) if last else None,
                    middle=tuple(sorted({*middle, leader})) if middle else None,
                )
            )
        return tuple(out)

    def leaders(self) -> tuple[int, ...]:
        """Leader ranks ordered by dp_rank."""
        return tuple(g.leader for g in self._replica_groups)

    def shard_dims(self) -> tuple[tuple[str, int], ...]:
        """``(name, size)`` of the shard dims, outermost first."""
        return tuple((n, s) for n, s, r in zip(self.dim_names, self.shape, self.roles) if r == "shard")

    def describe(self) -> str:
        """One line naming every dim with its size and role, e.g. ``pp=2(pipeline) dp=2(data)``."""
        return " ".join(f"{n}={s}({r})" for n, s, r in zip(self.dim_names, self.shape, self.roles))


def last_stage_rank(pp_size: int, stage_style: StageStyle) -> int:
    """The pp rank that holds the last stage (computes the loss) under ``stage_style``.

    >>> last_stage_rank(4, "loop"), last_stage_rank(4, "v")
    (3, 0)
    """
    return 0 if stage_style == "v" else pp_size - 1


def group_count(
    dp: int, pp: int, transport: str = "host", middle_data: bool = False, stage_style: StageStyle = "loop"
) -> int:
    """Process groups one loader creates on a mesh with ``dp`` replicas and ``pp`` stages.

    One control group over the whole mesh, one group of the leaders when ``dp > 1``, and per
    replica one group of the ranks in delivery (state at checkpoint time) and one per
    destination, all gloo: the first stage, the last stage when it is another (``"loop"``, pp > 1),
    the middle stages when they get ``every_stage`` keys (``middle_data``); middle stages without
    them are outside delivery and in none. The ``"device"`` transport adds, per replica, a group
    of the mesh device's backend for each destination.

    >>> group_count(dp=128, pp=16)
    386
    >>> group_count(dp=128, pp=16, transport="device")
    642
    >>> group_count(dp=128, pp=16, stage_style="v")
    258
    """
    separate_last = pp > 1 and stage_style == "loop"
    has_middle = pp > (2 if stage_style == "loop" else 1)
    destinations = 1 + separate_last + (has_middle and middle_data)
    data_groups = destinations if transport == "device" else 0
    return 1 + (dp > 1) + dp * (1 + destinations + data_groups)


def mesh_place(
    mesh: DeviceMesh,
    rank: int,
    roles: Mapping[str, str] | None = None,
    placement: str = DEFAULT_PLACEMENT,
    stage_style: str = "loop",
) -> Place:
    """Where ``rank`` sits in ``mesh``: its dp_rank, dp_size, leader and stage.

    Handy for a source that must know its replica before the loader exists, e.g.
    ``place = mesh_place(mesh, dist.get_rank())`` then ``DistributedSampler(ds, place.dp_size,
    place.dp_rank)``.
    """
    return MeshLayout.from_mesh(mesh, roles, placement, stage_style).place(rank)
