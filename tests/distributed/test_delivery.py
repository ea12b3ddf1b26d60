"""Delivery over real gloo worlds: the (a)-(e) invariants on a matrix of meshes and dim orders.

pp in {1, 2, 3}, dp in {1, 2}, cp in {1, 2}, tp in {1, 2}, in TorchTitan's, TorchTitan 0.3's,
Megatron's and odd dim orders, both layouts, both delivery modes, composed shard dims.
"""

from __future__ import annotations

import math

import pytest
import ranks
from checks import verify

from collective_loader.plan.mesh import MeshLayout, group_count

SEQ = 16  # divisible by every layout below (zigzag over cp=2 x sp=2 needs 8)

MESHES_8 = [
    (("pp", "dp", "tp"), (2, 2, 2)),
    (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (2, 1, 2, 2, 1)),  # TorchTitan
    (("pp", "batch", "cp", "tp"), (2, 1, 2, 2)),  # TorchTitan 0.3 data-loading mesh
    (("pp", "dp", "cp", "tp"), (1, 2, 2, 2)),  # Megatron order, one stage
    (("tp", "pp", "dp", "cp"), (2, 2, 2, 1)),  # odd order, size-1 dim
    (("dp", "cp", "sp"), (2, 2, 2)),  # two shard dims compose
    (("pp", "cp", "tp"), (2, 2, 2)),  # dp = 1
]
MESHES_12 = [
    (("pp", "dp", "tp"), (3, 2, 2)),
    (("tp", "pp", "cp"), (2, 3, 2)),
    (("pp", "dp", "cp", "tp"), (3, 2, 2, 1)),
]
MESHES_24 = [
    (("pp", "dp", "cp", "tp"), (3, 2, 2, 2)),  # Megatron order, full 4-D
    # TorchTitan order: its 8-rank form runs by default (MESHES_8), this one with -m slow
    pytest.param(("pp", "dp_replicate", "dp_shard", "cp", "tp"), (3, 1, 2, 2, 2), marks=pytest.mark.slow),
]


# in worlds of 12 ranks the device transport is slow: it runs by default at 8 ranks, with both
# deliveries (test_layouts_and_delivery_modes_8, test_mesh_8), and the host transport at 12
TRANSPORT_DELIVERY_12 = [
    ("host", "broadcast"),
    ("host", "scatter"),
    pytest.param("device", "broadcast", marks=pytest.mark.slow),
    pytest.param("device", "scatter", marks=pytest.mark.slow),
]


@pytest.fixture(params=["host", "device"])
def transport(request):
    """Every case runs with both transports: the device one (collectives from the training
    thread, over groups of the mesh device's backend) is gloo here, NCCL on a CUDA mesh."""
    return request.param


def _run(worlds, transport, dims, shape, layout, delivery, **kw):
    world = worlds.get(math.prod(shape))
    n_samples, batch_size = 24, 2
    records = world.run(
        ranks.deliver,
        dims,
        shape,
        n_samples=n_samples,
        batch_size=batch_size,
        seq_len=SEQ,
        split=layout,
        delivery=delivery,
        transport=transport,
        timeout=120,
        **kw,
    )
    verify(
        records,
        n_samples=n_samples,
        batch_size=batch_size,
        seq_len=SEQ,
        layout=layout,
        epochs=kw.get("epochs", 1),
        every_stage=kw.get("every_stage", ()),
    )
    mesh = MeshLayout.build(dims, shape, range(math.prod(shape)), kw.get("roles"))
    middle_data, style = bool(kw.get("every_stage")), kw.get("stage_style", "loop")
    want = group_count(mesh.dp_size, mesh.pp_size, transport, middle_data=middle_data, stage_style=style)
    assert {r["group_count"] for r in records} == {want}
    return records


def test_single_rank(worlds, transport):
    _run(worlds, transport, ("pp", "dp", "tp"), (1, 1, 1), "zigzag", "broadcast")


def test_epochs_restart_and_roles_override(worlds, transport):
    """Two epochs in a row; Megatron-style sp as a replicate dim (roles=)."""
    records = _run(
        worlds, transport, ("pp", "dp", "sp"), (2, 2, 2), "zigzag", "broadcast", epochs=2, roles={"sp": "replicate"}
    )
    assert all(rec["shard"] == () for rec in records)


@pytest.mark.parametrize("dims,shape", MESHES_8, ids=lambda x: ",".join(map(str, x)))
def test_mesh_8(worlds, transport, dims, shape):
    _run(worlds, transport, dims, shape, "zigzag", "broadcast")


@pytest.mark.parametrize("delivery", ["broadcast", "scatter"])
# the contiguous layout with the device transport is slow: the layout is the split's (tested
# without processes), and runs here with the host transport
@pytest.mark.parametrize(
    "transport,layout",
    [
        ("host", "zigzag"),
        ("host", "contiguous"),
        ("device", "zigzag"),
        pytest.param("device", "contiguous", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("dims,shape", [MESHES_8[1], MESHES_8[5]], ids=["torchtitan", "cp-x-sp"])
def test_layouts_and_delivery_modes_8(worlds, transport, dims, shape, layout, delivery):
    _run(worlds, transport, dims, shape, layout, delivery)


@pytest.mark.parametrize("transport,delivery", TRANSPORT_DELIVERY_12)
@pytest.mark.parametrize("dims,shape", MESHES_12, ids=lambda x: ",".join(map(str, x)))
def test_mesh_12(worlds, transport, dims, shape, delivery):
    _run(worlds, transport, dims, shape, "zigzag", delivery)


@pytest.mark.slow  # 24 ranks on 2 cores, 27 s a case: the same paths run by default at 8 and 12 ranks
@pytest.mark.parametrize("delivery", ["broadcast", "scatter"])
@pytest.mark.parametrize("dims,shape", MESHES_24, ids=lambda x: ",".join(map(str, x)))
@pytest.mark.parametrize("transport_", ["host", "device"])
def test_mesh_24(worlds, transport_, dims, shape, delivery):
    _run(worlds, transport_, dims, shape, "zigzag", delivery)


@pytest.mark.parametrize("transport,delivery", TRANSPORT_DELIVERY_12)
def test_every_stage_keys_reach_middle_stages_12(worlds, transport, delivery):
    """Packed-sequence offsets go to all three stages; middle stages get exactly that key."""
    records = _run(worlds, transport, ("pp", "dp", "cp"), (3, 2, 2), "zigzag", delivery, every_stage=("cu_seqlens",))
    middle = [r for r in records if r["stage"] == "middle"]
    assert len(middle) == 4
    assert all(set(b) == {"cu_seqlens"} for r in middle for b in r["epochs"][0])


@pytest.mark.parametrize("every_stage", [(), ("cu_seqlens",)], ids=["plain", "packed"])
@pytest.mark.parametrize("dims,shape", [(("pp", "dp", "tp"), (2, 2, 2)), (("pp", "cp"), (4, 2))], ids=["pp2", "pp4"])
def test_v_stage_style(worlds, transport, dims, shape, every_stage):
    """ZBVZeroBubble / DualPipeV: pp rank 0 holds the first stage and the loss, so it gets the
    inputs and the labels of the same samples; the other pp ranks are middle stages (in delivery
    only with every_stage keys, else reading their leader's bulletin), and every rank sees the
    same steps."""
    records = _run(worlds, transport, dims, shape, "zigzag", "broadcast", stage_style="v", every_stage=every_stage)
    assert {r["stage"] for r in records} == {"both", "middle"}
    assert all(r["is_leader"] <= (r["stage"] == "both") for r in records)


FIRST_STAGE = [
    ("host", *MESHES_8[0], ()),
    ("host", *MESHES_8[1], ()),
    ("host", *MESHES_12[0], ()),
    ("host", ("pp", "dp", "cp"), (3, 2, 2), ("cu_seqlens",)),
    ("device", ("pp", "dp", "cp"), (3, 2, 2), ("cu_seqlens",)),
]


@pytest.mark.parametrize("delivery", ["broadcast", "scatter"])
@pytest.mark.parametrize(
    "transport_,dims,shape,every_stage",
    FIRST_STAGE,
    ids=["pp2-dp2-tp2", "torchtitan", "pp3-dp2-tp2", "pp3-dp2-cp2-every-stage", "device-pp3-dp2-cp2-every-stage"],
)
def test_leaders_all_on_the_first_stage(worlds, transport_, dims, shape, every_stage, delivery):
    """placement="first_stage": every leader on the first stage, delivering every role its data
    (the other cases here run the default, "spread", where the second replica's leader sits on a
    later stage)."""
    records = _run(
        worlds, transport_, dims, shape, "zigzag", delivery, placement="first_stage", every_stage=every_stage
    )
    stages = {r["dp_rank"]: r["stage"] for r in records if r["is_leader"]}
    assert set(stages.values()) == {"first"}, stages
