"""examples/pipeline_parity.py, run as a user runs it: pipeline-parallel training (GPipe and
1F1B over a (pp, dp) = (2, 2) gloo world) fed by CollectiveLoader over a real StreamingDataset
matches single-process training step for step; the seed's naive set-up does not."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "pipeline_parity.py")


def test_pipeline_training_matches_single_process_and_naive_diverges():
    proc = subprocess.Popen([sys.executable, EXAMPLE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the example and every rank it started
        proc.communicate()
        raise
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    gaps = re.findall(r"^(GPipe|1F1B)\s+(collective_loader|naive replication)\s.*worst relative gap (\S+)$", out, re.M)
    assert len(gaps) == 4, out
    for schedule, setup, gap in gaps:
        if setup == "collective_loader":
            assert float(gap) <= 1e-5, (schedule, gap)  # float32 parity
        else:
            assert float(gap) > 0.1, (schedule, gap)  # labels of other samples: the loss stays high
