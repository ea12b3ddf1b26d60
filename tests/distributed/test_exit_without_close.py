"""A training script that stops mid-epoch and exits without closing the loader exits cleanly.

Started the way users start it, with torchrun, so the exit code seen is the one a job sees.

A thread left inside a gloo collective when the interpreter exits aborts the process
("terminate called without an active exception"); the loader's exit hook prevents that.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from collective_loader import CollectiveLoader
    import torch

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    batches = [{"x": torch.full((2, 4), i), "y": torch.full((2,), i)} for i in range(50)]
    loader = CollectiveLoader(batches, mesh, inputs=("x",), labels=("y",))
    it = iter(loader)
    for _ in range(3):
        next(it)
    print("done", dist.get_rank(), flush=True)
    """
)


def _stop(torchrun: subprocess.Popen) -> str:
    """Stop a torchrun that is still running, with its ranks; return its output.

    SIGTERM first: torchrun starts each rank in a session of its own, which killing torchrun's
    process group does not reach, and on SIGTERM it stops the ranks itself (SIGKILL after 30 s).
    Reading the output meanwhile keeps torchrun from blocking on a full pipe.
    """
    os.killpg(torchrun.pid, signal.SIGTERM)
    try:
        return torchrun.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
        os.killpg(torchrun.pid, signal.SIGKILL)
        return torchrun.communicate()[0]


def test_exit_mid_epoch_without_close_is_clean(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    torchrun = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            "--tee",
            "3",
            str(script),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = torchrun.communicate(timeout=120)
    finally:
        if torchrun.poll() is None:  # past the timeout, or the test was interrupted
            print(_stop(torchrun))  # pytest shows it with the failure
    assert torchrun.returncode == 0, f"torchrun exited with {torchrun.returncode}:\n{out}"
    # --tee: torchrun copies each rank's output line by line as "[default<local rank>]:<line>"; the
    # ranks' own writes to the shared pipe are unbuffered (python -u) and interleave mid-line
    assert sorted(re.findall(r"^\[default(\d)\]:done \1$", out, re.MULTILINE)) == ["0", "1", "2", "3"], out
    assert "terminate called" not in out, out
