"""A rank that dies mid-epoch: every surviving rank raises within a bounded time, and says which
rank it was waiting for and for what. No process outlives the test.

Mesh pp=2, dp=2, tp=2 (8 ranks): a leader, a first-stage peer and a last-stage rank are each
killed (SIGKILL) at a step. Ranks that share a delivery group with the dead rank may wait for
the loader's ``timeout``; every other survivor hears of the failure from a leader at once.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import time

import pytest
import ranks
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from collective_loader import CollectiveLoader, DeliveryError, LeaderError, mesh_place
from collective_loader.plan.mesh import MeshLayout

MESH = (("pp", "dp", "tp"), (2, 2, 2))
TIMEOUT = 10.0  # the loader's per-collective timeout in these tests
FAST = 5.0  # survivors that do not share a group with the dead rank raise sooner than this
SLACK = 20.0  # the error's hand-off to the loop on a loaded machine


def killed_at(victim: int, at_step: int):
    """Iterate a long epoch; ``victim`` kills itself at ``at_step``. Survivors report what they raised."""
    mesh = ranks.make_mesh(*MESH)
    dp = mesh_place(mesh, dist.get_rank()).dp_rank
    loader = CollectiveLoader(lambda: ranks.id_batches(dp, 2, 100_000, 2, 16), mesh, **ranks.KEYS, timeout=TIMEOUT)
    steps, since = 0, None
    try:
        for _ in loader:
            steps += 1
            if steps == at_step:
                if dist.get_rank() == victim:
                    os.kill(os.getpid(), signal.SIGKILL)
                since = time.monotonic()
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "after": time.monotonic() - since, "steps": steps}
    return {"error": None, "steps": steps}


def group_mates(victim: int) -> set[int]:
    """Ranks in a delivery group (first, last or middle stage) with ``victim``."""
    layout = MeshLayout.build(*MESH, range(math.prod(MESH[1])))
    return {r for replica in layout.replica_groups() for _, g in replica.all() if victim in g for r in g} - {victim}


# on MESH with the default placement the leaders are ranks 0 (first stage) and 6 (last stage)
VICTIMS = {"leader": 0, "first_stage_peer": 1, "last_stage": 4}


@pytest.mark.parametrize("who", list(VICTIMS))
def test_survivors_raise_when_a_rank_is_killed(worlds, who):
    victim = VICTIMS[who]
    world = worlds.get(8)
    records = world.run(killed_at, victim, 5, dying=frozenset({victim}), timeout=TIMEOUT + 3 * SLACK)
    assert world.alive() == []  # the broken world was killed: nothing outlives the test
    mates = group_mates(victim)
    for rank, rec in enumerate(records):
        if rank == victim:
            continue
        assert rec["error"] == DeliveryError.__name__, (rank, rec)
        # it says who waited for whom: this rank waiting for its leader, or the leader that failed
        assert f"rank {rank} " in rec["message"] or "leader rank" in rec["message"], (rank, rec)
        limit = TIMEOUT + SLACK if rank in mates else FAST
        assert rec["after"] < limit, (rank, sorted(mates), rec)
    # the leaders' warnings reached the replica that did not lose a rank
    other = [r for r in range(8) if r not in mates | {victim}]
    assert other and all("leader rank" in records[r]["message"] for r in other)


class CrashingDataset(torch.utils.data.Dataset):
    """Replica ``dp``'s samples; the worker that loads sample ``crash_at`` dies (os._exit)."""

    def __init__(self, dp: int, crash_at: int) -> None:
        self.dp, self.crash_at = dp, crash_at

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        if i == self.crash_at:
            os._exit(3)
        return {k: v[0] for k, v in ranks.sample_batch([self.dp + 2 * i], 16).items()}


def worker_crash(crash_on_dp: int):
    mesh = ranks.make_mesh(*MESH)
    dp = mesh_place(mesh, dist.get_rank()).dp_rank
    dataset = CrashingDataset(dp, crash_at=20 if dp == crash_on_dp else -1)
    loader = CollectiveLoader(lambda: DataLoader(dataset, batch_size=2, num_workers=2), mesh, **ranks.KEYS, timeout=60)
    steps = 0
    try:
        for _ in loader:
            steps += 1
    except Exception as e:
        # the loop never closes the loader: the error itself must have stopped the workers (left
        # to the garbage collector, each is joined for 5 s wherever it runs, a collective included)
        workers = len(multiprocessing.active_children())
        return {"error": type(e).__name__, "message": str(e), "steps": steps, "workers": workers}
    return {"error": None, "steps": steps}


def test_dataloader_worker_crash_is_a_leader_error_everywhere(worlds):
    records = worlds.get(8).run(worker_crash, 1, timeout=240)
    leader = MeshLayout.build(*MESH, range(8)).leaders()[1]
    for rank, rec in enumerate(records):
        assert rec["error"] == LeaderError.__name__, (rank, rec)
        assert f"leader rank {leader} (dp_rank 1)" in rec["message"], rec
        # what the DataLoader raised, as it saw the worker go: its own check, or the broken pipe
        assert "exited unexpectedly" in rec["message"] or "ConnectionResetError" in rec["message"], rec
        assert rec["workers"] == 0, (rank, rec)  # both leaders' DataLoader workers, the healthy one's too
    # every rank stops at the same step, before the batch that holds sample 20 (step 11 of 32)
    assert len({rec["steps"] for rec in records}) == 1 and records[0]["steps"] < 11, records


class StallingSource:
    """Replica ``dp``'s batches; on replica ``stall_on_dp`` one call blocks for an hour: ``next``
    before batch ``at``, ``state_dict`` right after it, the first ``iter`` (where DataLoader
    workers start), or ``load_state_dict`` (a resume)."""

    def __init__(self, dp: int, stall_on_dp: int, where: str, at: int) -> None:
        self.dp, self.stalls, self.where, self.at = dp, dp == stall_on_dp, where, at
        self.step = -1

    def _stall(self, where: str) -> None:
        if self.stalls and self.where == where and (where in ("iter", "load_state_dict") or self.step == self.at):
            time.sleep(3600)

    def __iter__(self):
        self._stall("iter")
        for self.step, batch in enumerate(  # noqa: B020 (records the step being loaded)
            ranks.id_batches(self.dp, 2, 1000, 2, 16)
        ):
            self._stall("next")
            yield batch

    def state_dict(self) -> dict:
        self._stall("state_dict")
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self._stall("load_state_dict")


def stalled_source(stall_on_dp: int, where: str, at: int):
    mesh = ranks.make_mesh(*MESH)
    dp = mesh_place(mesh, dist.get_rank()).dp_rank
    loader = CollectiveLoader(StallingSource(dp, stall_on_dp, where, at), mesh, **ranks.KEYS, timeout=TIMEOUT)
    if where == "load_state_dict":
        loader.load_state_dict(
            {"format": 1, "dp_size": 2, "epoch": 0, "steps": 0, "source": {"step": -1}, "source_elastic": False}
        )
    steps, start = 0, time.monotonic()
    try:
        for _ in loader:
            steps += 1
    except Exception as e:
        loader.close()
        return {"error": type(e).__name__, "message": str(e), "steps": steps, "after": time.monotonic() - start}
    return {"error": None, "steps": steps}


# every call into the source is watched: its first iter(), each next() and state_dict(), a resume
# (each waits out the watchdog's timeout: all but next, the same watch, are slow)
@pytest.mark.parametrize(
    "where,at",
    [
        ("next", 4),
        pytest.param("state_dict", 4, marks=pytest.mark.slow),
        pytest.param("iter", 0, marks=pytest.mark.slow),
        pytest.param("load_state_dict", 0, marks=pytest.mark.slow),
    ],
)
def test_stalled_leader_is_reported_as_still_loading(worlds, where, at):
    records = worlds.get(8).run(stalled_source, 1, where, at, timeout=TIMEOUT + 3 * SLACK)
    leader = MeshLayout.build(*MESH, range(8)).leaders()[1]
    for rank, rec in enumerate(records):
        assert rec["error"] == LeaderError.__name__, (rank, rec)
        assert f"leader rank {leader} (dp_rank 1)" in rec["message"] and f"still loading step {at}" in rec["message"], (
            rec
        )
        assert rec["steps"] == at and rec["after"] < TIMEOUT + SLACK, rec
