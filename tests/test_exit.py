"""A training script that stops mid-epoch and exits without closing the loader exits cleanly.

A thread left inside a gloo collective when the interpreter exits aborts the process
("terminate called without an active exception"); the loader's exit hook prevents that.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_exit_mid_epoch_without_close_is_clean(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    port = _free_port()
    procs = []
    for rank in range(4):
        env = dict(
            os.environ, RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="4",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 90
    try:
        outputs = [p.communicate(timeout=max(1, deadline - time.monotonic()))[0].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{out}"
        assert f"done {rank}" in out
        assert "terminate called" not in out
