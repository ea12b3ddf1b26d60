"""A rank that dies mid-epoch: every surviving rank raises within a bounded time, and says which
rank it was waiting for and for what. No process outlives the test.

Mesh pp=2, dp=2, tp=2 (8 ranks): a leader, a first-stage peer of the same replica, and a
last-stage rank are each killed (SIGKILL) at a step; the loader's ``timeout`` is short.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist

import ranks
from collective_loader import CollectiveLoader, DeliveryError, LeaderError, mesh_place

MESH = (("pp", "dp", "tp"), (2, 2, 2))
TIMEOUT = 5.0  # the loader's per-collective timeout in these tests
SLACK = 20.0  # start-up of the wait, error hand-off, a loaded machine


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
            if steps > at_step + 50_000:
                return {"rank": dist.get_rank(), "error": None}
    except Exception as e:
        return {"rank": dist.get_rank(), "error": type(e).__name__, "message": str(e),
                "after": time.monotonic() - since if since is not None else None, "steps": steps}


VICTIMS = {"leader": 0, "first_stage_peer": 1, "last_stage": 6}


@pytest.mark.parametrize("who", list(VICTIMS))
def test_survivors_raise_when_a_rank_is_killed(worlds, who):
    victim = VICTIMS[who]
    world = worlds.get(8)
    start = time.monotonic()
    records = world.run(killed_at, victim, 5, dying=frozenset({victim}), timeout=TIMEOUT + 3 * SLACK)
    assert time.monotonic() - start < TIMEOUT + 3 * SLACK
    assert world.alive() == []  # the broken world was killed: nothing outlives the test
    for rank, rec in enumerate(records):
        if rank == victim:
            continue
        assert rec["error"] in (DeliveryError.__name__, LeaderError.__name__), rec
        assert f"rank {rank}" in rec["message"] or "leader rank" in rec["message"], rec
        # within the timeout (plus slack) of the step at which the victim died
        assert rec["after"] is None or rec["after"] < TIMEOUT + SLACK, rec
