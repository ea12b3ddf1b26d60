"""A rank that dies mid-epoch: every surviving rank raises within a bounded time, and says which
rank it was waiting for and for what. No process outlives the test.

Mesh pp=2, dp=2, tp=2 (8 ranks): a leader, a first-stage peer and a last-stage rank are each
killed (SIGKILL) at a step. Ranks that share a delivery group with the dead rank may wait for
the loader's ``timeout``; every other survivor hears of the failure from a leader at once.
"""

from __future__ import annotations

import math
import os
import signal
import time

import pytest
import torch.distributed as dist

import ranks
from collective_loader import CollectiveLoader, DeliveryError, mesh_place
from collective_loader.layout import MeshLayout

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


VICTIMS = {"leader": 0, "first_stage_peer": 1, "last_stage": 6}


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
