"""Run a function on every rank of a local gloo world, or on this rank under torchrun.

Used by the demo and the benchmarks: ``python -m collective_loader demo`` starts its own world;
``torchrun --nproc-per-node N -m collective_loader demo`` runs one rank per process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

import torch.distributed as dist


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _rank_main(fn: Callable[..., int], args: Any, rank: int, size: int, init_file: str | None) -> None:
    if init_file is not None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size))
        import torch

        torch.set_num_threads(1)  # many ranks share a few cores
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    else:
        dist.init_process_group("gloo")
    try:
        code = fn(args)
    finally:
        dist.destroy_process_group()
    sys.exit(code)


def run(fn: Callable[[Any], int], args: Any, world_size: int, timeout: float) -> int:
    """Run ``fn(args)`` on every rank; return the worst exit code. Kills the world on timeout."""
    if under_torchrun():
        _rank_main(fn, args, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None)
    tmp = tempfile.mkdtemp(prefix="collective_loader_")
    ctx = mp.get_context("spawn")
    procs = [
        # not daemons: a rank's DataLoader may start worker processes; the finally below kills them
        ctx.Process(target=_rank_main, args=(fn, args, r, world_size, os.path.join(tmp, "init")))
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        if hung:
            print(f"ranks {hung} did not finish within {timeout:.0f}s; stopping the world", file=sys.stderr)
            return 124
        return max(abs(p.exitcode or 0) for p in procs)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
