"""Start a local gloo world of processes, or run on this rank under torchrun.

The one way this project starts a local world: ``spawn_ranks`` starts the processes,
``init_rank`` makes each one a rank, ``kill_ranks`` ends them. ``run`` (the demo and the
benchmarks: ``python -m collective_loader demo`` starts its own world; ``torchrun
--nproc-per-node N -m collective_loader demo`` runs one rank per process) and the tests' reusable
``World`` are both built on them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import forkserver
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

import torch
import torch.distributed as dist

# A fork server, not fork: a child forked from this process would inherit its torch threads and
# locks. Not spawn either: each rank would import torch again (3-4 s of CPU per rank, most of a
# small test's cost), and streaming on top (5 more: it imports transformers) where it reads data.
# The server imports them once and runs nothing; each rank is forked from it. Queues shared with
# the ranks must come from this context too.
CONTEXT = mp.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "collective_loader", "streaming"])


def start_fork_server() -> None:
    """Start the fork server now (it starts at the first rank otherwise): its imports (9 s of
    CPU here) then run beside this process's own work, such as writing a dataset, on another core."""
    forkserver.ensure_running()


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def init_rank(rank: int, size: int, init_file: str, backend: str = "gloo") -> None:
    """Make this process rank ``rank`` of a world of ``size`` on this machine (gloo, or e.g.
    ``"cpu:gloo,cuda:nccl"`` for a one-rank world on a GPU: NCCL allows one rank per GPU).

    Sets the environment torchrun would (libraries such as streaming read it to find their rank)
    and rendezvous through ``init_file``, so no port has to be found free. One torch thread per
    rank: many ranks share a few cores.
    """
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1",
    )
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=size)


def spawn_ranks(target: Callable[..., None], size: int, *args: Any) -> tuple[list[BaseProcess], str]:
    """Start ``target(rank, size, init_file, *args)`` in ``size`` processes of the fork server.

    Returns the processes and the temp dir holding ``init_file``; give both to ``kill_ranks``.
    ``target`` calls ``init_rank(rank, size, init_file)``. The processes are not daemons: a
    daemon may not have children, and a rank's DataLoader starts worker processes.
    """
    tmp = tempfile.mkdtemp(prefix="collective_loader_")
    init_file = os.path.join(tmp, "init")
    procs: list[BaseProcess] = []
    parent = _Parent(dict(os.environ), os.getcwd(), list(sys.path))
    try:
        for rank in range(size):
            p = CONTEXT.Process(target=_start, args=(parent, target, rank, size, init_file, *args), daemon=False)
            p.start()
            procs.append(p)
    except BaseException:
        kill_ranks(procs, tmp)  # the started ones would wait for the others forever
        raise
    return procs, tmp


@dataclass(frozen=True)
class _Parent:
    """What a spawned child would take from its parent at start, and a child of the fork server
    takes from the server instead (its state when it started): the environment (a test's
    ``setenv``, the endpoint of a fixture), the working directory and ``sys.path``."""

    environ: dict[str, str]
    cwd: str
    path: list[str]


def _start(parent: _Parent, target: Callable[..., None], *args: Any) -> None:
    os.environ.clear()
    os.environ.update(parent.environ)
    os.chdir(parent.cwd)
    sys.path[:] = parent.path
    target(*args)


def kill_ranks(procs: list[BaseProcess], tmp: str) -> None:
    """Kill the ranks still running, reap them and remove their temp dir.

    SIGKILL, not SIGTERM: a rank may be blocked inside a collective that never completes.
    """
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)
    shutil.rmtree(tmp, ignore_errors=True)


def _call(fn: Callable[[Any], int], args: Any) -> NoReturn:
    try:
        code = fn(args)
    finally:
        dist.destroy_process_group()
    sys.exit(code)


def _rank_main(rank: int, size: int, init_file: str, fn: Callable[[Any], int], args: Any, backend: str) -> None:
    init_rank(rank, size, init_file, backend)
    _call(fn, args)


def run(fn: Callable[[Any], int], args: Any, world_size: int, timeout: float, backend: str = "gloo") -> int:
    """Run ``fn(args)`` on every rank of a world of ``backend``; return the worst exit code.
    Kills the world on timeout.

    Under torchrun this process is one rank: it runs ``fn`` and exits with its code.
    """
    if under_torchrun():
        dist.init_process_group(backend)
        _call(fn, args)
    procs, tmp = spawn_ranks(_rank_main, world_size, fn, args, backend)
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        if hung:
            print(f"ranks {hung} did not finish within {timeout:.0f}s; stopping the world", file=sys.stderr)
            return 124
        return max(abs(p.exitcode or 0) for p in procs)
    finally:
        kill_ranks(procs, tmp)
