"""The main job runs end to end: its own local world, and under torchrun."""

from __future__ import annotations

import re
import subprocess
import sys


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_demo_default_shows_the_naive_mismatch_and_ours_clean():
    out = _run([sys.executable, "-m", "collective_loader", "demo", "--samples", "96"])
    assert "all checks passed" in out and out.count("[ok]") == 5
    assert re.search(r"naive, every rank builds StreamingDataset\(replication=2\): 100\.0%", out), out
    assert re.search(r"collective_loader: +0\.0% \(0 of \d+", out), out
    assert "samples per replica: {0: 48, 1: 48}" in out


def test_demo_local_world_with_middle_stages():
    out = _run([sys.executable, "-m", "collective_loader", "demo", "--mesh", "pp=3,dp=1,cp=2", "--samples", "48"])
    assert "middle stage" in out and "all checks passed" in out
    assert out.count("[ok]") == 5


def test_demo_under_torchrun():
    out = _run([
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        "-m", "collective_loader", "demo", "--mesh", "pp=2,dp=2", "--samples", "32",
    ])
    assert "all checks passed" in out


def test_demo_rejects_a_bad_mesh_flag():
    proc = subprocess.run([sys.executable, "-m", "collective_loader", "demo", "--mesh", "pp2"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--mesh wants name=size pairs" in proc.stderr
