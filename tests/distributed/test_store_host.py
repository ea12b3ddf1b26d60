"""Middle stages in a plain ``env://`` world, where rank 0 hosts the job's store (srun-style
launchers; under torchrun its agent does): every rank exits right after its loop, middle stages
last, and each one still reads its replica's end, or its leader's error, from the store.

Without rank 0 waiting for them at its close (``Readers``), its exit took the store with it and
the middle stages failed with torch's ``DistNetworkError``. When rank 0 is killed for real, the
middle stages raise ``DeliveryError`` naming the store.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
from plain_world import run_plain_world

RANK_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "support", "plain_env_rank.py")
STEPS = 6  # plain_env_rank.STEPS
# torch's exception in a Python traceback (its C++ log lines name the C++ class when the store is gone)
ESCAPED = "torch.distributed.DistNetworkError"


def run_world(pp: int, dp: int, *args: str) -> list[tuple[int, dict | None, str]]:
    """``(exit code, JSON line or None, stderr)`` per rank of a plain env:// world of ``pp * dp``."""
    ends = run_plain_world(RANK_SCRIPT, pp * dp, ["--pp", str(pp), "--dp", str(dp), *args], timeout=120.0)
    results = []
    for end in ends:
        lines = [line for line in end.out.splitlines() if line.startswith("{")]
        results.append((end.code, json.loads(lines[-1]) if lines else None, end.err))
    return results


def _check_clean_end(results: list[tuple[int, dict | None, str]]) -> None:
    for rank, (code, out, err) in enumerate(results):
        assert ESCAPED not in err, (rank, err[-3000:])
        assert code == 0 and out is not None, (rank, code, err[-3000:])
        assert out["error"] is None, out
        if out["in_delivery"]:
            assert out["steps"] == STEPS, out


@pytest.mark.parametrize(
    ("pp", "dp", "middle"), [(3, 2, "iterate"), (4, 1, "never")], ids=["pp3xdp2-iterate", "pp4-never"]
)
def test_middle_stages_end_their_epoch_after_rank_0_is_done(pp, dp, middle):
    results = run_world(pp, dp, "--middle", middle)
    _check_clean_end(results)
    outside = [out for _, out, _ in results if not out["in_delivery"]]
    assert outside, results  # the layout has ranks outside delivery
    assert all(out["steps"] == (STEPS if middle == "iterate" else 0) for out in outside), outside


@pytest.mark.parametrize("middle", ["iterate", "never"])
def test_a_failing_leader_on_rank_0_reaches_the_middle_stages(middle):
    """Rank 0's source fails at step 2 and rank 0 exits: its middle stages get its error (from
    ``next()`` or at ``close()``), not the store's disconnection."""
    results = run_world(3, 1, "--middle", middle, "--fail-at", "2")
    for rank, (code, out, err) in enumerate(results):
        assert ESCAPED not in err, (rank, err[-3000:])
        assert out is not None and out["error"] is not None, (rank, code, err[-3000:])
        assert "LeaderError" in out["error"] and "disk on fire" in out["error"], out
    # the middle stage that never iterates learns of it at close(), the iterating one from next()
    assert ("learned at close()" in results[1][1]["error"]) == (middle == "never"), results[1]


def test_a_killed_store_host_is_named_on_the_middle_stages():
    """Rank 0 is killed after 2 steps: the iterating middle stage ends with ``DeliveryError``
    naming the job's store, within the loader's timeout."""
    results = run_world(3, 1, "--middle", "iterate", "--kill-at", "2", "--timeout", "20")
    assert results[0][0] == -signal.SIGKILL
    code, out, err = results[1]  # the middle stage
    assert out is not None and out["error"] is not None, (code, err[-3000:])
    assert out["error"].startswith("DeliveryError") and "key-value store" in out["error"], out
    assert ESCAPED not in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 20 worlds of 4 to 6 ranks
@pytest.mark.parametrize(
    ("pp", "dp", "middle"),
    [(3, 2, "iterate"), (3, 2, "never"), (4, 1, "iterate"), (4, 1, "never")],
)
def test_twenty_runs_each(pp, dp, middle):
    for _ in range(20):
        _check_clean_end(run_world(pp, dp, "--middle", middle))
