"""examples/megatron_schedule.py, run as a user runs it: megatron-core's own
``get_forward_backward_func()`` trains a GPTModel (local layer spec) on CollectiveLoader's
``get_batch``, from a ``.bin``/``.idx`` corpus read on the leaders, on one world of 4 gloo ranks:
pp=2 x dp=2 (1F1B), pp=4 x dp=1 (two middle stages that never touch the loader) and pp=2 x dp=2
with two model chunks per pp rank (the interleaved schedule) give the per-step losses of
pp=1 x dp=2 (x tp=2), and pp=2 x dp=2 resumed from a checkpoint after step 1 gives the
uninterrupted run's later losses exactly."""

from __future__ import annotations

import os
import re
import sys

import pytest
from processes import run_group

pytest.importorskip("megatron.core")

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "megatron_schedule.py")
RESUMED = re.compile(r"^pp=2 dp=2 tp=1 vp=1  resumed after step 1: losses ([\d. ]+?)\s+exact: (\w+)$", re.M)
LINE = re.compile(
    r"^pp=(\d) dp=(\d) tp=(\d) vp=(\d) (\w+)\s+losses ([\d. ]+?)\s+worst relative gap to pp=1 dp=2 tp=2 (\S+)$", re.M
)


@pytest.mark.timeout(300)
def test_megatron_schedule_matches_unpipelined_losses_and_resumes_exactly():
    returncode, out, err = run_group([sys.executable, EXAMPLE], timeout=280)
    assert returncode == 0, out[-3000:] + err[-3000:]
    found = {
        tuple(map(int, layout)): (schedule, losses.split(), float(gap))
        for *layout, schedule, losses, gap in LINE.findall(out)
    }
    assert sorted(found) == [(1, 2, 2, 1), (2, 2, 1, 1), (2, 2, 1, 2), (4, 1, 1, 1)], out
    for layout, (schedule, losses, gap) in found.items():
        assert len(losses) == 3 and gap <= 1e-5, (layout, losses, gap)
        pp, vp = layout[0], layout[3]
        want = (
            "no_pipelining"
            if pp == 1
            else "pipelining_with_interleaving"
            if vp > 1
            else "pipelining_without_interleaving"
        )
        assert schedule == f"forward_backward_{want}", (layout, schedule)
    [(resumed, exact)] = RESUMED.findall(out)
    assert exact == "True" and resumed.split() == found[(2, 2, 1, 1)][1][1:], out
