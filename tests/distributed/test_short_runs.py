"""Jobs whose loop ends within milliseconds exit cleanly: two steps, ``close()``,
``destroy_process_group()``, exit, on every rank at once, with no barrier. A rank that aborted at
interpreter exit ("terminate called without an active exception", no Python frame) would show
here as a negative exit code (SIGABRT)."""

from __future__ import annotations

import os

import pytest
from plain_world import run_plain_world

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "support", "short_loop_rank.py")
CASES = [(2, "host"), (2, "device"), (4, "host"), (4, "device")]


def _check_runs(size: int, transport: str, runs: int) -> None:
    for run in range(runs):
        for rank, end in enumerate(run_plain_world(SCRIPT, size, [transport], timeout=120.0)):
            assert end.code == 0, (run, rank, end.code, end.err[-3000:])
            # a rank of replica d got steps 0 and 1 of its own batches: every replica reads the list
            assert "done [0, 1]" in end.out, (run, rank, end.out, end.err[-3000:])


@pytest.mark.parametrize(("size", "transport"), [(2, "host"), (4, "device")])
def test_short_runs_exit_cleanly(size, transport):
    _check_runs(size, transport, runs=1)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 50 runs of 4 ranks: about 5 minutes here
@pytest.mark.parametrize(("size", "transport"), CASES)
def test_fifty_short_runs_each_exit_cleanly(size, transport):
    """200 runs in all (50 per case)."""
    _check_runs(size, transport, runs=50)
