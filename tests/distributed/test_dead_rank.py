"""A rank that dies mid-epoch: every surviving rank raises (the world's deadline bounds a hang),
and says which rank it was waiting for and for what. No process outlives the test.

Mesh pp=2, dp=2, tp=2 (8 ranks): a leader, a first-stage peer and a last-stage rank are each
killed (SIGKILL) at a step. Ranks that share a delivery group with the dead rank may wait for
the loader's ``timeout``; every other survivor hears of the failure from a leader, which saw the
dead rank's connection go: nobody on the way waited out a timeout.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import threading

import pytest
import ranks
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from collective_loader import CollectiveLoader, DeliveryError, LeaderError, mesh_place
from collective_loader.plan.mesh import MeshLayout

MESH = (("pp", "dp", "tp"), (2, 2, 2))
TIMEOUT = 10.0  # the loader's per-collective timeout in these tests
SLACK = 20.0  # the error's hand-off to the loop on a loaded machine (a bound for a hang only)
WAITED_OUT = f"Timed out waiting {TIMEOUT * 1000:.0f}ms"  # gloo's words for a wait of the loader's timeout


def killed_at(victim: int, at_step: int):
    """Iterate a long epoch; ``victim`` kills itself at ``at_step``. Survivors report what they raised."""
    mesh = ranks.make_mesh(*MESH)
    dp = mesh_place(mesh, dist.get_rank()).dp_rank
    loader = CollectiveLoader(lambda: ranks.id_batches(dp, 2, 100_000, 2, 16), mesh, **ranks.KEYS, timeout=TIMEOUT)
    steps = 0
    try:
        for _ in loader:
            steps += 1
            if steps == at_step and dist.get_rank() == victim:
                os.kill(os.getpid(), signal.SIGKILL)
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "steps": steps}
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
        assert rec["steps"] >= 4, (rank, rec)  # it got the steps before the kill
        if rank in mates:  # it may have waited for the dead rank: the loader's timeout, no longer
            assert "Timed out" not in rec["message"] or WAITED_OUT in rec["message"], (rank, rec)
        else:  # at once: from a leader that saw the dead rank's connection close, not its own wait
            assert rec["message"].startswith("leader rank") and "Timed out" not in rec["message"], (rank, rec)
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


RELEASE = threading.Event()  # on each rank: set once its loader is closed, so that a stalled call returns


class StallingSource:
    """Replica ``dp``'s batches; on replica ``stall_on_dp`` one call blocks until ``RELEASE``:
    ``next`` before batch ``at``, ``state_dict`` right after it, the first ``iter`` (where
    DataLoader workers start), or ``load_state_dict`` (a resume)."""

    def __init__(self, dp: int, stall_on_dp: int, where: str, at: int) -> None:
        self.dp, self.stalls, self.where, self.at = dp, dp == stall_on_dp, where, at
        self.step = -1

    def _stall(self, where: str) -> None:
        if self.stalls and self.where == where and (where in ("iter", "load_state_dict") or self.step == self.at):
            RELEASE.wait()

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


def _loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("collective_loader")]


def stalled_source(stall_on_dp: int, where: str, at: int):
    RELEASE.clear()
    try:
        mesh = ranks.make_mesh(*MESH)
        dp = mesh_place(mesh, dist.get_rank()).dp_rank
        loader = CollectiveLoader(StallingSource(dp, stall_on_dp, where, at), mesh, **ranks.KEYS, timeout=TIMEOUT)
        if where == "load_state_dict":
            loader.load_state_dict(
                {"format": 1, "dp_size": 2, "epoch": 0, "steps": 0, "source": {"step": -1}, "source_elastic": False}
            )
        steps = 0
        try:
            for _ in loader:
                steps += 1
        except Exception as e:
            loader.close()  # the stalled call is still blocked: close leaves the source open
            out = {"error": type(e).__name__, "message": str(e), "steps": steps, "stuck": len(_loader_threads())}
        else:
            return {"error": None, "steps": steps}
    finally:
        RELEASE.set()
    for t in _loader_threads():  # once the call returns, the thread it held ends
        t.join(2 * TIMEOUT)
    out["left"] = [t.name for t in _loader_threads()]
    return out


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
        assert rec["steps"] == at and f"timeout={TIMEOUT}s" in rec["message"], rec
        assert rec["left"] == [], rec  # the thread a stalled call held ended once the call returned
    assert records[leader]["stuck"] >= 1, records[leader]  # closed while its thread was inside the source
