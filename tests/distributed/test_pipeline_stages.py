"""Pipeline schedules of every shape: labels reach the rank that computes the loss, and middle
stages that receive nothing need not iterate.

One world of 8 ranks, mesh (pp, dp) = (4, 2): rank = 2 * pp_rank + dp_rank, so replica ``d`` is
ranks ``d, 2 + d, 4 + d, 6 + d`` from the first stage to the last.

* Megatron's pattern: the middle stages never call ``next()``; activations travel stage to stage
  with ``dist.send`` / ``dist.recv``, and the last stage checks that what reached it was computed
  from the inputs its labels belong to. The run ends cleanly, ``state_dict()`` gives every rank,
  middle ones included, its leader's state, and a failure on a leader ends every rank: the
  stages in delivery at ``next()``, the middle ones at ``close()``.
* ``stage_style="v"`` (ZBVZeroBubble, DualPipeV): pp rank 0 gets the inputs and the labels, the
  others ``{}`` and the same end, when they iterate.
* A real ``ScheduleZBVZeroBubble`` given with ``stage_style="loop"`` is refused on every rank.
"""

from __future__ import annotations

import datetime

import pytest
import ranks
import torch
import torch.distributed as dist
from world import World

from collective_loader import CollectiveLoader, ConstructionError, mesh_place
from collective_loader.plan.mesh import MeshLayout

MESH = (("pp", "dp"), (4, 2))
STEPS = 5  # batches per replica: 20 samples, 2 replicas, 2 per batch
P2P_TIMEOUT = 8.0  # seconds a stage waits for its neighbour's activations (an NCCL watchdog's job)


@pytest.fixture(scope="module")
def world():
    w = World(8)
    yield w
    w.close()


class _Batches:
    """Replica ``dp_rank``'s batches, anew at every ``iter()`` (like a DataLoader)."""

    def __init__(self, dp_rank: int, fail_at: int | None) -> None:
        self.dp_rank, self.fail_at = dp_rank, fail_at

    def __iter__(self):
        for step, batch in enumerate(ranks.id_batches(self.dp_rank, 2, 20, 2, 8)):
            if step == self.fail_at:
                raise OSError("disk on fire")
            yield batch


def _source(dp_rank: int, fail_at: int | None = None):
    return lambda: _Batches(dp_rank, fail_at)


def megatron_loop(fail_at: int | None = None, fail_dp: int = 1) -> dict:
    """Every rank: a pipeline of 4 stages whose middle stages never touch the loader."""
    mesh = ranks.make_mesh(*MESH)
    rank = dist.get_rank()
    place = mesh_place(mesh, rank)
    dp, pp = place.dp_rank, place.pp_rank
    # activations go over a group with a short timeout: when a stage stops, its neighbours' waits end
    p2p = dist.new_group(list(range(8)), backend="gloo", timeout=datetime.timedelta(seconds=P2P_TIMEOUT))
    source = _source(dp, fail_at if dp == fail_dp else None)
    loader = CollectiveLoader(source, mesh, **ranks.KEYS, timeout=30)
    out: dict = {"rank": rank, "pp": pp, "in_delivery": loader.in_delivery, "checked": 0, "error": None}
    try:
        with loader:  # close() on the way out, on every rank: a middle stage learns of a failure there
            data = iter(loader) if loader.in_delivery else None
            for step in range(STEPS + 1):  # one step past the data: the ends must see its end
                if pp == 0:
                    assert data is not None
                    try:
                        batch = next(data)
                    except StopIteration:
                        out["stopped_at"] = step
                        break
                    x = batch["input_ids"].float()
                    dist.send(x, rank + 2, group=p2p)
                elif pp < 3:
                    if step == STEPS:  # a middle stage runs a known number of steps (train_iters)
                        break
                    x = torch.empty(2, 8)
                    dist.recv(x, rank - 2, group=p2p)
                    dist.send(x + 1, rank + 2, group=p2p)
                else:
                    assert data is not None
                    try:
                        batch = next(data)
                    except StopIteration:
                        out["stopped_at"] = step
                        break
                    x = torch.empty(2, 8)
                    dist.recv(x, rank - 2, group=p2p)
                    # labels = input_ids + 1, and each middle stage added 1
                    assert torch.equal(x.long() - 2 + 1, batch["labels"]), (step, x, batch["labels"])
                    out["checked"] += 1
            state = loader.state_dict()
            out["state"] = (state["epoch"], state["steps"], state["dp_size"])
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def test_middle_stages_that_never_iterate_run_to_the_end(world):
    results = world.run(megatron_loop, timeout=120)
    for r in results:
        assert r["error"] is None, r
        assert r["in_delivery"] == (r["pp"] in (0, 3)), r
        if r["pp"] in (0, 3):
            assert r["stopped_at"] == STEPS, r
        assert r["state"] == (0, STEPS, 2), r  # middle stages too: read from their leader's bulletin
    assert sum(r["checked"] for r in results) == 2 * STEPS  # every step's labels met their inputs


def test_a_leaders_failure_ends_every_rank_middle_stages_at_close(world):
    """Replica 1's leader (rank 7, last stage) fails at step 2: every rank ends with its message,
    the ranks in delivery at next(), the middle stages (which never call next()) at close()."""
    assert MeshLayout.build(*MESH, range(8)).leaders() == (0, 7)  # "spread": the upper half on the last stage
    results = world.run(megatron_loop, 2, 1, timeout=120)
    for r in results:
        assert r["error"] is not None and "disk on fire" in r["error"], r
        assert "leader rank 7" in r["error"], r
        if r["pp"] in (1, 2):
            assert "learned at close()" in r["error"], r


def v_style(iterate_middle: bool) -> dict:
    """Every rank: a loader with stage_style="v"; pp rank 0 holds the first stage and the loss."""
    mesh = ranks.make_mesh(*MESH)
    place = mesh_place(mesh, dist.get_rank())
    loader = CollectiveLoader(_source(place.dp_rank), mesh, **ranks.KEYS, stage_style="v", timeout=30)
    got = []
    if loader.in_delivery or iterate_middle:
        got = [sorted(batch) for batch in loader]
    labels_match = None
    if loader.in_delivery:
        again = [b for b in loader]  # a second epoch: inputs and labels of one sample
        labels_match = len(again) == STEPS and all(torch.equal(b["labels"], b["input_ids"] + 1) for b in again)
    elif iterate_middle:
        got += [sorted(batch) for batch in loader]
    loader.close()
    return {
        "pp": place.pp_rank,
        "leader": loader.is_leader,
        "first": loader.is_first_stage,
        "last": loader.is_last_stage,
        "in_delivery": loader.in_delivery,
        "got": got,
        "labels_match": labels_match,
    }


@pytest.mark.parametrize("iterate_middle", [True, False], ids=["middle-iterates", "middle-idle"])
def test_v_style_gives_pp_rank_0_the_inputs_and_the_labels(world, iterate_middle):
    results = world.run(v_style, iterate_middle, timeout=120)
    for r in results:
        if r["pp"] == 0:
            assert r["first"] and r["last"] and r["in_delivery"] and r["leader"], r
            assert r["got"] == [["input_ids", "labels", "position_ids", "sample_id"]] * STEPS, r
            assert r["labels_match"] is True, r
        else:
            assert not (r["first"] or r["last"] or r["in_delivery"] or r["leader"]), r
            assert r["got"] == ([[]] * (2 * STEPS) if iterate_middle else []), r


def mismatched_schedule() -> str:
    """Every rank: a real ScheduleZBVZeroBubble (2 stages per pp rank, in a V), and a loader told
    stage_style="loop"."""
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

    mesh = ranks.make_mesh(*MESH)
    pp_group = mesh.get_group("pp")
    pp = mesh.get_local_rank("pp")
    stages = [
        PipelineStage(torch.nn.Linear(4, 4), index, 8, torch.device("cpu"), group=pp_group)
        for index in (pp, 2 * 4 - 1 - pp)
    ]
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss)
    place = mesh_place(mesh, dist.get_rank())
    refused = "accepted"
    try:
        CollectiveLoader(_source(place.dp_rank), mesh, **ranks.KEYS, schedule=schedule)
    except ConstructionError as e:
        refused = str(e)
    good = CollectiveLoader(_source(place.dp_rank), mesh, **ranks.KEYS, stage_style="v", schedule=schedule)
    good.close()
    return refused


# every schedule torch.distributed.pipelining exports, and the style its stage-to-rank mapping has
SCHEDULES = {
    "ScheduleGPipe": "loop",
    "Schedule1F1B": "loop",
    "ScheduleInterleaved1F1B": "loop",
    "ScheduleLoopedBFS": "loop",
    "ScheduleInterleavedZeroBubble": "loop",
    "ScheduleZBVZeroBubble": "v",
    "ScheduleDualPipeV": "v",
}


def every_schedule_style() -> dict[str, str]:
    """Every rank: each of torch's schedules over the mesh's pp dim (1 stage per rank for the
    single-stage ones, 2 for the others, placed as each schedule expects), read by stage_style_of."""
    from torch.distributed import pipelining

    from collective_loader import stage_style_of

    mesh = ranks.make_mesh(*MESH)
    pp_group, pp = mesh.get_group("pp"), mesh.get_local_rank("pp")
    found = {}
    for name, style in SCHEDULES.items():
        schedule_class = getattr(pipelining, name)
        single = name in ("ScheduleGPipe", "Schedule1F1B")
        indices = [pp] if single else [pp, 2 * 4 - 1 - pp] if style == "v" else [pp, pp + 4]
        stages = [
            pipelining.PipelineStage(torch.nn.Linear(4, 4), i, len(indices) * 4, torch.device("cpu"), group=pp_group)
            for i in indices
        ]
        loss = torch.nn.functional.mse_loss
        schedule = schedule_class(stages[0] if single else stages, n_microbatches=8, loss_fn=loss)
        found[name] = stage_style_of(schedule)
    return found


def test_every_torch_schedule_has_its_stage_style(world):
    from torch.distributed import pipelining

    assert {n for n in pipelining.__all__ if n.startswith("Schedule")} == set(SCHEDULES)
    for found in world.run(every_schedule_style, timeout=120):
        assert found == SCHEDULES


def test_a_schedule_that_puts_the_loss_elsewhere_is_refused_on_every_rank(world):
    results = world.run(mismatched_schedule, timeout=120)
    for text in results:  # and the same schedule with stage_style="v" is accepted
        assert "stage_style='loop'" in text and "pass stage_style='v'" in text, text


def source_with_other_leaders() -> str:
    """Every rank: a StreamingSource built for a V schedule (every leader on pp rank 0), given to a
    loader left at stage_style="loop" (leaders on both end stages)."""
    from collective_loader.streaming import StreamingSource

    mesh = ranks.make_mesh(*MESH)
    source = StreamingSource(mesh, batch_size=2, local="/nowhere", stage_style="v", timeout=30)
    try:
        CollectiveLoader(source, mesh, **ranks.KEYS, timeout=30)
    except ConstructionError as e:
        return str(e)
    return "accepted"


def test_a_source_that_placed_the_leaders_elsewhere_is_refused_on_every_rank(world):
    """Before, the leaders both agreed on built their datasets and waited in streaming's barrier
    for the others, which never came: a silent hang of streaming's timeout (10 minutes)."""
    for text in world.run(source_with_other_leaders, timeout=120):
        assert "places the replicas' leaders on ranks [0, 1], the loader on [0, 7]" in text, text
        assert "stage_style='loop'" in text, text
