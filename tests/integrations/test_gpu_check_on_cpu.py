"""bench/gpu_check.sh runs its whole flow on CPUs and reports each check's verdict; the comparison
its checks rest on catches a wrong tensor, and a problem fails the check."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
sys.path.append(BENCH)  # appended: bench's modules never shadow the tests' own

import gpu_check  # noqa: E402 (bench/ is on the path only from here)

CPU = torch.device("cpu")


@pytest.mark.timeout(360)  # the script stops itself at 300 s
def test_cpu_flow_passes_and_reports_every_check(tmp_path):
    proc = subprocess.run(
        ["bash", os.path.join(BENCH, "gpu_check.sh"), "--cpu", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=330,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (report,) = tmp_path.glob("gpu_check_*.md")
    text = report.read_text()
    assert "device: cpu " in text
    for name in ("delivery_pp2_tp2", "delivery_dp2_cp2", "device_transport_1rank"):
        assert f"- {name}: passed\n" in text, text
    assert "- no_host_sync: not applicable\n" in text, text  # set_sync_debug_mode is CUDA-only
    wait = "passed" if gpu_check.overlap_possible(4) else "not applicable"
    assert f"- exposed_wait: {wait}\n" in text, text
    for row in ("next(), no compute (synchronous delivery)", "next(), with compute", "compute"):
        assert f"| {row} |" in text


def test_a_wrong_tensor_fails_the_check():
    s = gpu_check.CPU
    where = gpu_check.Where(dp_rank=1, dp_size=2, first=True, last=True, cp_size=2, cp_index=1)
    want = gpu_check.expected(3, where, s)
    assert gpu_check.compare(want, want, CPU) == []
    wrong = {**want, "labels": want["labels"].clone()}
    wrong["labels"][1, 5] += 1
    assert gpu_check.compare(wrong, want, CPU) == [
        f"labels: differs first at (1, 5): {int(want['labels'][1, 5]) + 1}, want {int(want['labels'][1, 5])}"
    ]
    assert gpu_check.compare(gpu_check.expected(4, where, s), want, CPU)  # another step's batch
    other_shard = gpu_check.Where(dp_rank=1, dp_size=2, first=True, last=True, cp_size=2, cp_index=0)
    assert gpu_check.compare(gpu_check.expected(3, other_shard, s), want, CPU)  # another cp rank's slice
    assert gpu_check.compare({"input_ids": want["input_ids"]}, want, CPU)[0].startswith("keys ")
    assert gpu_check.compare({**want, "sample_id": want["sample_id"].int()}, want, CPU)  # another dtype
    # a rank's problems make its check fail, and a failed check the script's exit code
    assert gpu_check.verdict("delivery_pp2_tp2", ["rank 1: step 3: labels: differs"], "").status == "failed"
