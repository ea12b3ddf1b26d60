"""A construction phase that fails on one rank ends construction on every rank, with its error.

Each phase is failed on one rank of a 4-rank world (mesh dp=2, tp=2: leaders 0 and 2): the
loader's argument check, a leader's source, and a leader's ``StreamingDataset`` constructor
(while the other leader waits in streaming's barrier). Before, the other ranks waited in the
next collective (a group creation, a barrier) until a timeout or forever.
"""

from __future__ import annotations

import time

import pytest
import ranks
import torch.distributed as dist

from collective_loader import (
    CollectiveLoader,
    ConstructionError,
    LeaderError,
    mesh_place,
)
from collective_loader.streaming import StreamingSource
from collective_loader.testing.data import INPUTS, LABELS, write_dataset

MESH = (("dp", "tp"), (2, 2))
FAILING = 2  # the rank (the second replica's leader) whose phase fails
FAST = 20.0  # seconds: the others hear at once, not after the timeout
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mds") / "tokens")
    write_dataset(out, 32, 8)
    return out


def build(phase: str, data: str) -> dict:
    mesh = ranks.make_mesh(*MESH)
    me = dist.get_rank()
    dp = mesh_place(mesh, me).dp_rank
    start = time.monotonic()
    try:
        if phase == "arguments":
            CollectiveLoader(
                lambda: [], mesh, inputs=INPUTS, labels=LABELS, prefetch=0 if me == FAILING else None, timeout=TIMEOUT
            )
        elif phase == "source":

            def source():
                if me == FAILING:
                    raise OSError("no such bucket")
                return []

            CollectiveLoader(source, mesh, inputs=INPUTS, labels=LABELS, timeout=TIMEOUT)
        else:  # a leader's StreamingDataset fails while the other leader is inside its constructor
            # streaming waits download_timeout for a shard index that is not there, then raises
            broken = {"local": data + "-missing", "download_timeout": 2} if me == FAILING else {"local": data}
            source = StreamingSource(mesh, batch_size=2, timeout=TIMEOUT, **broken)
            CollectiveLoader(source, mesh, inputs=INPUTS, labels=LABELS, timeout=TIMEOUT)
    except Exception as e:
        return {"rank": me, "dp": dp, "error": type(e).__name__, "message": str(e), "after": time.monotonic() - start}
    return {"rank": me, "dp": dp, "error": None}


@pytest.mark.parametrize(
    "phase,error,needle",
    [
        (
            "arguments",
            ConstructionError,
            f"rank {FAILING} could not build CollectiveLoader: ValueError: prefetch must be >= 1",
        ),
        ("source", LeaderError, f"leader rank {FAILING} could not build its source: OSError: no such bucket"),
        ("dataset", LeaderError, f"leader rank {FAILING} failed while the leaders built their datasets"),
    ],
)
def test_a_phase_failing_on_one_rank_fails_on_every_rank(worlds, data, phase, error, needle):
    records = worlds.get(4).run(build, phase, data, timeout=TIMEOUT + 30)
    messages = {r["message"] for r in records if r["error"]}
    for r in records:
        assert r["error"] == error.__name__, r
        assert needle in r["message"] and r["after"] < FAST, r
    assert len(messages) == 1, messages  # the same error everywhere
