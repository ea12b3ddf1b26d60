"""Unit and property tests for :mod:`collective_loader.plan.mesh` (roles, places, delivery groups).

Every expected value is recomputed from first principles with numpy's unravel/ravel over the
mesh shape, independently of the module's own arithmetic.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collective_loader.plan.mesh import (
    DEFAULT_ROLES,
    ROLES,
    MeshLayout,
    ReplicaGroups,
    group_count,
)

PROPS = settings(max_examples=80, deadline=None)

EXPECTED_DEFAULTS = {
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


# --- reference model --------------------------------------------------------------------------


class Reference:
    """Expected places and groups, computed by brute force over flat indices."""

    def __init__(self, names, shape, ranks, roles, placement="spread", stage_style="loop"):
        self.names, self.shape, self.ranks, self.roles = tuple(names), tuple(shape), list(ranks), list(roles)
        self.placement = placement
        self.data = [i for i, r in enumerate(self.roles) if r == "data"]
        self.pipe = [i for i, r in enumerate(self.roles) if r == "pipeline"]
        self.shard_dims = [i for i, r in enumerate(self.roles) if r == "shard"]
        self.pp = self.shape[self.pipe[0]] if self.pipe else 1
        self.dp = int(np.prod([self.shape[i] for i in self.data])) if self.data else 1
        self.last_pp = 0 if stage_style == "v" else self.pp - 1  # where the loss is computed

    def coords(self, rank):
        flat = self.ranks.index(rank)
        return tuple(int(c) for c in np.unravel_index(flat, self.shape))

    def dp_rank(self, rank):
        c = self.coords(rank)
        if not self.data:
            return 0
        return int(np.ravel_multi_index([c[i] for i in self.data], [self.shape[i] for i in self.data]))

    def leader_coords(self, rank):
        """Same data coords, 0 elsewhere; with "spread", the pipeline coord is the first stage's for
        the lower half of the dp_ranks and the last stage's for the upper half."""
        c = self.coords(rank)
        lc = [c[i] if self.roles[i] == "data" else 0 for i in range(len(c))]
        if self.placement == "spread" and self.pipe and self.last_pp != 0:
            lc[self.pipe[0]] = self.last_pp if 2 * self.dp_rank(rank) >= self.dp else 0
        return lc

    def leader(self, rank):
        return self.ranks[int(np.ravel_multi_index(self.leader_coords(rank), self.shape))]

    def pp_rank(self, rank):
        return self.coords(rank)[self.pipe[0]] if self.pipe else 0

    def shard(self, rank):
        c = self.coords(rank)
        return tuple((self.shape[i], c[i]) for i in self.shard_dims)

    def stage(self, rank):
        p = self.pp_rank(rank)
        if p == 0 == self.last_pp:
            return "both"
        return "first" if p == 0 else "last" if p == self.last_pp else "middle"

    def replica(self, dp):
        return [r for r in self.ranks if self.dp_rank(r) == dp]

    def groups(self, dp):
        members = self.replica(dp)
        lead = self.leader(members[0])
        first = tuple(sorted({lead} | {r for r in members if self.pp_rank(r) == 0}))
        last = tuple(sorted({lead} | {r for r in members if self.pp_rank(r) == self.last_pp})) if self.last_pp else None
        between = {r for r in members if self.pp_rank(r) not in (0, self.last_pp)}
        middle = tuple(sorted({lead} | between)) if between else None
        return ReplicaGroups(
            dp_rank=dp, leader=lead, ranks=tuple(sorted(members)), first=first, last=last, middle=middle
        )


def check_layout(layout: MeshLayout, ref: Reference):
    assert layout.roles == tuple(ref.roles)
    assert layout.dp_size == ref.dp and layout.pp_size == ref.pp
    for rank in ref.ranks:
        place = layout.place(rank)
        assert place.rank == rank
        assert place.coords == ref.coords(rank)
        assert layout.coords(rank) == ref.coords(rank)
        assert layout.rank_at(ref.coords(rank)) == rank
        assert place.dp_rank == ref.dp_rank(rank)
        assert place.dp_size == ref.dp
        assert place.leader == ref.leader(rank)
        assert place.is_leader == (rank == ref.leader(rank))
        assert place.pp_rank == ref.pp_rank(rank) and place.pp_size == ref.pp
        assert place.stage == ref.stage(rank)
        assert place.is_first_stage == (ref.pp_rank(rank) == 0)
        assert place.is_last_stage == (ref.pp_rank(rank) == ref.last_pp)
        assert place.shard == ref.shard(rank)
        assert list(ref.coords(place.leader)) == ref.leader_coords(rank)

    groups = layout.replica_groups()
    assert [g.dp_rank for g in groups] == list(range(ref.dp))
    for g in groups:
        assert g == ref.groups(g.dp_rank)
        named = g.all()
        has_middle = ref.pp > (2 if ref.last_pp else 1)
        assert [n for n, _ in named] == ["first"] + ["last"] * (ref.last_pp > 0) + ["middle"] * has_middle
        for _, ranks in named:
            assert list(ranks) == sorted(ranks) and g.leader in ranks
        replica = ref.replica(g.dp_rank)
        assert layout.replica_ranks(g.dp_rank) == replica
        for rank in replica:
            if rank != g.leader:
                assert sum(rank in ranks for _, ranks in named) == 1, rank
        others = {r for o in groups if o.dp_rank != g.dp_rank for _, rs in o.all() for r in rs}
        assert not others & set(replica)
    assert layout.leaders() == tuple(ref.leader(ref.replica(d)[0]) for d in range(ref.dp))
    n_groups = sum(len(g.all()) + 1 for g in groups) + 1 + (ref.dp > 1)  # + one replica group each
    style = layout.stage_style
    assert group_count(ref.dp, ref.pp, middle_data=True, stage_style=style) == n_groups
    # without every_stage keys the middle stages are outside delivery: no middle group
    n_middle = sum(g.middle is not None for g in groups)
    assert group_count(ref.dp, ref.pp, stage_style=style) == n_groups - n_middle


def build_and_check(names, shape, ranks, roles=None, placement=None, stage_style="loop"):
    """``placement=None``: the library's default, which the reference takes to be "spread"."""
    layout = MeshLayout.build(
        names, shape, ranks, roles, stage_style=stage_style, **({"placement": placement} if placement else {})
    )
    resolved = [(roles or {}).get(n, EXPECTED_DEFAULTS.get(n)) for n in names]
    check_layout(layout, Reference(names, shape, ranks, resolved, placement or "spread", stage_style))
    return layout


# --- roles ------------------------------------------------------------------------------------


def test_default_roles_table():
    assert DEFAULT_ROLES == EXPECTED_DEFAULTS
    assert ROLES == ("data", "pipeline", "replicate", "shard")


@pytest.mark.parametrize("name", sorted(EXPECTED_DEFAULTS))
def test_build_assigns_default_role(name):
    layout = MeshLayout.build((name,), (2,), (5, 9))
    assert layout.roles == (EXPECTED_DEFAULTS[name],)


def test_describe():
    layout = MeshLayout.build(("pp", "dp", "tp", "cp", "sp"), (2, 3, 1, 1, 2), range(12))
    assert layout.roles == ("pipeline", "data", "replicate", "shard", "shard")
    assert layout.describe() == "pp=2(pipeline) dp=3(data) tp=1(replicate) cp=1(shard) sp=2(shard)"


def test_roles_override_sp_to_replicate():
    layout = MeshLayout.build(("dp", "sp"), (2, 2), range(4), roles={"sp": "replicate"})
    assert layout.roles == ("data", "replicate")
    assert layout.place(1).shard == () and layout.place(1).leader == 0
    assert layout.place(3).leader == 2 and layout.place(3).dp_rank == 1


def test_roles_for_unknown_dim_name():
    layout = MeshLayout.build(("ep", "dp"), (2, 2), range(4), roles={"ep": "replicate"})
    assert layout.roles == ("replicate", "data")
    assert layout.place(3).leader == 1


def test_unknown_dim_without_role_raises():
    with pytest.raises(ValueError, match=r"'ep'.*roles="):
        MeshLayout.build(("dp", "ep"), (2, 2), range(4))


def test_override_of_dim_not_in_mesh_raises():
    with pytest.raises(ValueError, match="'zz'"):
        MeshLayout.build(("dp", "tp"), (2, 2), range(4), roles={"zz": "data"})


def test_bad_role_name_raises():
    with pytest.raises(ValueError, match=r"'bogus'.*'tp'"):
        MeshLayout.build(("dp", "tp"), (2, 2), range(4), roles={"tp": "bogus"})


def test_two_pipeline_dims_raise():
    with pytest.raises(ValueError, match="pipeline"):
        MeshLayout.build(("pp", "stage"), (2, 2), range(4), roles={"stage": "pipeline"})


@pytest.mark.parametrize(
    "names, shape, ranks, match",
    [
        (("dp", "dp"), (2, 2), range(4), "unique"),
        (("dp", "tp"), (2,), range(2), "names"),
        (("dp",), (2, 2), range(4), "names"),
        (("dp", "tp"), (2, 2), range(3), "needs 4 ranks"),
        (("dp", "tp"), (2, 2), range(5), "needs 4 ranks"),
        (("dp", "tp"), (2, 2), [0, 1, 1, 2], "twice"),
        (("dp", "tp"), (2, 0), [], "size >= 1"),
    ],
)
def test_bad_mesh_raises(names, shape, ranks, match):
    with pytest.raises(ValueError, match=match):
        MeshLayout.build(names, shape, ranks)


def test_rank_not_in_mesh_raises():
    layout = MeshLayout.build(("dp",), (2,), [4, 5])
    with pytest.raises(ValueError, match="rank 0 is not in the mesh"):
        layout.place(0)


# --- places and groups ------------------------------------------------------------------------


def test_docstring_example():
    layout = MeshLayout.build(("pp", "dp", "tp"), (2, 2, 2), range(8))
    p = layout.place(5)
    assert (p.dp_rank, p.leader, p.stage) == (0, 0, "last")
    assert layout.replica_groups()[0] == ReplicaGroups(0, 0, (0, 1, 4, 5), (0, 1), (0, 4, 5), None)
    # the default placement, "spread": replica 1's leader is on the last stage, and sends to the first
    assert layout.replica_groups()[1] == ReplicaGroups(1, 6, (2, 3, 6, 7), (2, 3, 6), (6, 7), None)
    assert layout.leaders() == (0, 6)
    first_stage = MeshLayout.build(("pp", "dp", "tp"), (2, 2, 2), range(8), placement="first_stage")
    assert first_stage.replica_groups()[1] == ReplicaGroups(1, 2, (2, 3, 6, 7), (2, 3), (2, 6, 7), None)
    assert first_stage.leaders() == (0, 2)


def test_hand_computed_megatron_mesh():
    # pp=3, dp=2, cp=2, tp=2: rank = ((pp*2 + dp)*2 + cp)*2 + tp
    layout = MeshLayout.build(("pp", "dp", "cp", "tp"), (3, 2, 2, 2), range(24), placement="first_stage")
    p = layout.place(23)  # pp=2 dp=1 cp=1 tp=1
    assert p.coords == (2, 1, 1, 1) and p.dp_rank == 1 and p.leader == 4 and p.stage == "last"
    assert p.shard == ((2, 1),)
    g1 = layout.replica_groups()[1]
    assert g1.first == (4, 5, 6, 7)
    assert g1.middle == (4, 12, 13, 14, 15)
    assert g1.last == (4, 20, 21, 22, 23)
    assert layout.leaders() == (0, 4)


ORDERS = [
    (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 2, 2, 2)),
    (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (3, 1, 2, 1, 2)),
    (("pp", "batch", "cp", "tp"), (2, 3, 2, 2)),
    (("pp", "dp", "cp", "tp"), (4, 2, 2, 1)),
    (("tp", "pp", "dp", "cp"), (2, 3, 2, 2)),
    (("dp", "pp", "tp", "sp", "cp"), (2, 3, 2, 2, 2)),
    (("cp", "dp", "tp"), (2, 3, 2)),
    (("dp",), (5,)),
    (("tp",), (4,)),
    (("pp",), (4,)),
    (("pp", "tp", "fsdp"), (1, 1, 1)),
    (("fsdp", "pp", "dp"), (2, 2, 2)),
]


@pytest.mark.parametrize("names, shape", ORDERS, ids=lambda x: "-".join(map(str, x)))
@pytest.mark.parametrize("perm", ["identity", "shuffled", "offset"])
@pytest.mark.parametrize("placement", [None, "first_stage"], ids=["default", "first_stage"])
@pytest.mark.parametrize("stage_style", ["loop", "v"])
def test_mesh_orders(names, shape, perm, placement, stage_style):
    n = int(np.prod(shape))
    ranks = list(range(n))
    if perm == "shuffled":
        random.Random(n).shuffle(ranks)
    elif perm == "offset":
        ranks = [1000 + 3 * r for r in reversed(ranks)]
    build_and_check(names, shape, ranks, placement=placement, stage_style=stage_style)


NAME_POOL = ["pp", "dp", "dp_shard", "batch", "tp", "cp", "sp", "ep", "x"]


@st.composite
def meshes(draw):
    names = draw(st.lists(st.sampled_from(NAME_POOL), min_size=1, max_size=5, unique=True))
    shape = draw(st.lists(st.integers(1, 3), min_size=len(names), max_size=len(names)))
    n = int(np.prod(shape))
    ranks = draw(st.lists(st.integers(0, 10_000), min_size=n, max_size=n, unique=True))
    roles = {}
    for name in names:  # override some roles; names without a default always get one
        if name not in EXPECTED_DEFAULTS or draw(st.integers(0, 3)) == 0:
            roles[name] = draw(st.sampled_from(ROLES))
    resolved = [roles.get(n, EXPECTED_DEFAULTS.get(n)) for n in names]
    if resolved.count("pipeline") > 1:  # keep one pipeline dim: demote the others to replicate
        first = resolved.index("pipeline")
        for i, n in enumerate(names):
            if resolved[i] == "pipeline" and i != first:
                roles[n] = "replicate"
    return tuple(names), tuple(shape), ranks, roles


@given(meshes(), st.sampled_from([None, "first_stage", "spread"]), st.sampled_from(["loop", "v"]))
@PROPS
def test_random_meshes(mesh, placement, stage_style):
    names, shape, ranks, roles = mesh
    build_and_check(names, shape, ranks, roles, placement, stage_style)


def test_all_role_assignments_small_mesh():
    names, shape = ("a", "b", "c"), (2, 3, 2)
    ranks = list(range(12))
    random.Random(0).shuffle(ranks)
    for roles, placement in itertools.product(itertools.product(ROLES, repeat=3), ["first_stage", "spread"]):
        if roles.count("pipeline") > 1:
            continue
        build_and_check(names, shape, ranks, dict(zip(names, roles)), placement)
        build_and_check(names, shape, ranks, dict(zip(names, roles)), placement, "v")


def test_v_stages_put_the_loss_on_pp_rank_0():
    """ZBVZeroBubble / DualPipeV: pp rank r holds stages r and 2 pp - 1 - r, so pp rank 0 gets the
    inputs and the labels, every other pp rank is a middle stage, and every leader is on pp rank 0."""
    layout = MeshLayout.build(("pp", "dp", "tp"), (4, 2, 2), range(16), stage_style="v")
    assert [layout.place(r).stage for r in (0, 3, 4, 15)] == ["both", "both", "middle", "middle"]
    assert layout.place(0).is_last_stage and not layout.place(12).is_last_stage
    assert layout.leaders() == (0, 2)
    g = layout.replica_groups()[1]
    assert (g.first, g.last, g.middle) == ((2, 3), None, (2, 6, 7, 10, 11, 14, 15))
    assert group_count(2, 4, stage_style="v") == 1 + 1 + 2 * 2  # control, leaders; replica and first each


def test_spread_leaders_sit_on_the_end_stages():
    """A middle stage may never iterate (Megatron's), so no leader sits there: "spread" shares
    the replicas out over the first and the last stage."""
    layout = MeshLayout.build(("pp", "dp"), (4, 4), range(16))
    assert [layout.place(r).pp_rank for r in layout.leaders()] == [0, 0, 3, 3]


# --- group counts -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dp, pp, expected",
    [(1, 1, 3), (2, 1, 6), (1, 2, 4), (1, 3, 4), (4, 2, 14), (3, 5, 11), (128, 16, 386)],
)
def test_group_count_values(dp, pp, expected):
    assert group_count(dp, pp) == expected


def test_16k_gpu_mesh_groups():
    names, shape = ("pp", "dp", "cp", "tp"), (16, 128, 2, 4)
    n = int(np.prod(shape))
    layout = MeshLayout.build(names, shape, range(n))
    groups = layout.replica_groups()
    assert len(groups) == 128
    # delivery groups (no middle one: without every_stage keys the middle stages are outside
    # delivery) + one replica group each + control + leaders
    assert sum(len(g.all()) for g in groups) + 2 == group_count(128, 16) == 386
    assert group_count(128, 16, middle_data=True) == 514
    assert all(len(g.ranks) == 16 * 2 * 4 for g in groups)
    # replica d: ranks (p*128 + d)*8 + j; its leader (placement "spread") is on the first stage
    # for d < 64, on the last for the others
    for d in (0, 77, 127):
        g = groups[d]
        lead = ((15 if d >= 64 else 0) * 128 + d) * 8
        assert g.leader == lead
        assert g.first == tuple(sorted({lead} | {d * 8 + j for j in range(8)}))
        assert g.last == tuple(sorted({lead} | {(15 * 128 + d) * 8 + j for j in range(8)}))
        assert g.middle == tuple(sorted({lead} | {(p * 128 + d) * 8 + j for p in range(1, 15) for j in range(8)}))
    assert layout.leaders() == tuple(((15 if d >= 64 else 0) * 128 + d) * 8 for d in range(128))


def test_the_configuration_digest_sees_the_last_field_on_a_16k_rank_layout():
    """The configuration check compares digests of the whole text, whatever the world size; the
    4 KiB messages it once gathered cut off every field after the rank list past ~800 ranks."""
    from collective_loader.delivery.agreement import digest
    from collective_loader.delivery.config import LoaderConfig

    dims, shape = ("pp", "dp", "cp", "tp"), (16, 128, 2, 4)
    layout = MeshLayout.build(dims, shape, range(16 * 128 * 2 * 4))
    config = LoaderConfig(inputs=("input_ids",), labels=("labels",), seq_dims={"input_ids": 1, "labels": 1})
    base = config.fingerprint(layout)
    last_field = LoaderConfig(
        inputs=("input_ids",), labels=("labels",), seq_dims={"input_ids": 1, "labels": 1}, max_batch_bytes=(1 << 32) - 1
    ).fingerprint(layout)
    swapped = MeshLayout.build(dims, shape, [*range(16 * 128 * 2 * 4 - 2), 16383, 16382])  # last two ranks swapped
    other_ranks = config.fingerprint(swapped)
    assert len(base) < 1024  # short enough to be shown whole on a mismatch
    assert not torch.equal(digest(base), digest(last_field))
    assert not torch.equal(digest(base), digest(other_ranks))
    assert torch.equal(digest(base), digest(config.fingerprint(layout)))


def test_the_benchmark_tables_are_well_formed():
    """Every markdown table in bench/results has as many cells in each row as in its header
    (bench/delivery.py once wrote a separator of 10 cells under 9 headers)."""
    import pathlib

    results = pathlib.Path(__file__).resolve().parents[2] / "bench" / "results"
    bad = []
    for path in sorted(results.glob("*.md")):
        header = None
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.startswith("|"):
                header = None
                continue
            cells = line.strip().count("|") - 1
            if header is None:
                header = cells
            elif cells != header:
                bad.append(f"{path.name}:{number}: {cells} cells under a header of {header}")
    assert results.is_dir() and not bad, bad
