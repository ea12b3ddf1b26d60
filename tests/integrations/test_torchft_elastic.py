"""Replica groups killed (SIGKILL), restarted, leaving for good and joining a running torchft job,
in both quorum modes: over the committed steps every sample is trained once, with a constant
global batch (``tests/support/ft_job.py`` checks the ranks' logs and the final weights). The
same with packed rows of MDS documents that each group's leaders read with a real
``StreamingDataset``: every token of every document once, in the order's sequence.

Each group is a 2-rank job (tp=2 or dp_shard=2; its ranks forked with torchrun's environment) training ``nn.Linear`` under
torchft's ``Manager`` on ``QuorumData``; the lighthouse runs in the test on 127.0.0.1. The kill
point (step, and phase: before, during or after the gradient all-reduce) is drawn from a seed.
"""

from __future__ import annotations

import random
import time

import pytest

pytest.importorskip("torchft")

from ft_job import FtJob, check  # noqa: E402

PHASES = ("before", "during", "after")
STARTUP = 120.0  # seconds for a group to start and commit on 2 loaded cores


def kill_point(seed: int, phase: str | None = None) -> str:
    rng = random.Random(seed)
    step = rng.randint(2, 4)
    return f"{step}:{phase or rng.choice(PHASES)}"


def kill_and_restart(job: FtJob, seed: int, phase: str | None = None, groups: int = 2) -> dict:
    """Groups g0.. start; g1 stops at a seeded point and is SIGKILLed, then restarted: it heals
    from a live peer and trains again."""
    names = [f"g{i}" for i in range(groups)]
    stop_at = kill_point(seed, phase)
    for name in names:
        job.start(name, stop_at if name == "g1" else "", start_with=groups)
    job.start("g1", standby=True)  # the restart, its processes started ahead
    job.wait_for(job.stopped("g1"), STARTUP, f"g1 to reach {stop_at}")
    job.kill("g1")
    killed_at = time.monotonic()
    before = job.committed_steps("g0")
    job.wait_for(job.committed("g0", before + 1), 60, "the survivors to commit without g1")
    survivors_resumed = time.monotonic() - killed_at
    trained = job.committed_steps("g1", trained=True)
    job.release("g1")
    job.wait_for(job.committed("g1", trained + 1, trained=True), STARTUP, "the restarted g1 to train")
    job.finish(extra_steps=2, timeout=60)
    figures = check(job)
    figures.update(kill_at=stop_at, survivors_resumed_s=round(survivors_resumed, 1))
    return figures


def leave_and_join(job: FtJob, seed: int) -> dict:
    """g0 and g1 start; g1 stops at a seeded point and is SIGKILLed for good; g2, new, joins the
    running job and trains."""
    stop_at = kill_point(seed)
    job.start("g0", start_with=2)
    job.start("g1", stop_at, start_with=2)
    job.start("g2", standby=True)
    job.wait_for(job.stopped("g1"), STARTUP, f"g1 to reach {stop_at}")
    job.kill("g1")
    before = job.committed_steps("g0")
    job.wait_for(job.committed("g0", before + 2), 60, "g0 to go on alone")
    job.release("g2")
    job.wait_for(job.committed("g2", 1, trained=True), STARTUP, "the new g2 to train")
    job.finish(extra_steps=2, timeout=60)
    figures = check(job)
    figures.update(kill_at=stop_at)
    return figures


def run(tmp_path, mode: str, dim: str, scenario, data: str = "samples", **kwargs) -> dict:
    job = FtJob(tmp_path / "job", mode, dim, data=data)
    started = time.monotonic()
    try:
        figures = scenario(job, **kwargs)
    finally:
        job.close()
    figures["seconds"] = round(time.monotonic() - started, 1)
    sizes = figures.pop("quorum_sizes")
    print(f"{mode} {dim} {data} {scenario.__name__} {kwargs}: {figures}")
    assert len(set(sizes)) > 1 and figures["joined_at_step"]  # the quorum changed; a group joined a running job
    return figures


@pytest.mark.timeout(300)
def test_a_group_killed_mid_step_heals_and_trains_every_sample_once_sync(tmp_path):
    run(tmp_path, "sync", "tp", kill_and_restart, seed=1)


@pytest.mark.timeout(300)
def test_a_group_leaves_and_a_new_one_joins_packed_rows_of_a_streaming_dataset_async(tmp_path):
    """Packed rows: each group's two leaders (dp_shard=2) read the MDS documents with a
    StreamingDataset built in a world of their own; the new group heals, sits a step out
    (asynchronous quorum) and takes its rows from the cursor and anchor a live peer sent."""
    run(tmp_path, "async", "dp_shard", leave_and_join, data="rows", seed=2)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode, dim", [("sync", "tp"), ("async", "dp_shard"), ("async", "tp")])
def test_packed_rows_kill_and_restart(tmp_path, mode, dim):
    run(tmp_path, mode, dim, kill_and_restart, data="rows", seed=5)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("dim", ["tp", "dp_shard"])
def test_kill_and_restart_at_every_phase(tmp_path, mode, dim, phase):
    run(tmp_path, mode, dim, kill_and_restart, seed=3, phase=phase, groups=3)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode, dim", [("sync", "tp"), ("async", "tp"), ("async", "dp_shard")])
def test_leave_and_join(tmp_path, mode, dim):
    run(tmp_path, mode, dim, leave_and_join, seed=4)
