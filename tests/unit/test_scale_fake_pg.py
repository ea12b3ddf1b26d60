"""The largest mesh docs/performance.md shows (65,536 ranks: pp 16 × dp 512 × tp 8) builds on one
sampled rank of a fake world (torch's fake backend, ``bench/scale.py --one``, in a process of its
own) with every group the loader's arithmetic says, quickly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from collective_loader.plan.mesh import MeshLayout, group_count

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
SHAPE = (16, 512, 8)  # pp, dp, tp: bench/scale.py's largest mesh


@pytest.mark.timeout(60)
def test_a_65536_rank_mesh_builds_on_a_last_stage_leader():
    layout = MeshLayout.build(("pp", "dp", "tp"), SHAPE, range(16 * 512 * 8))
    rank = layout.leaders()[-1]  # a leader on the last stage: in the most groups (leaders, first, last)
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH, "scale.py"), "--one", ",".join(map(str, SHAPE)), str(rank)],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    built = json.loads(proc.stdout.strip().splitlines()[-1])
    assert built["world"] == 65536 and built["leader"] and built["stage"] == "last"
    assert built["group_count"] == built["new_group_calls"] == group_count(dp=512, pp=16) == 1538
    member = dict(built["member_of"])
    assert member["collective_loader:control"] == 65536 and member["collective_loader:leaders"] == 512
    assert member["collective_loader:first511"] == 9 and member["collective_loader:last511"] == 8
