"""A world of separate processes started the way srun-style launchers start them: each rank gets
``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` and calls
``init_process_group()`` itself (``env://``), so rank 0 hosts the job's store (no torchrun
agent). Every process runs in a session of its own and is killed past the deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from processes import free_port


@dataclass(frozen=True)
class Exited:
    """One rank's end: its exit code (negative: killed by that signal) and what it printed."""

    code: int
    out: str
    err: str


def run_plain_world(script: str, size: int, args: Sequence[str], timeout: float) -> list[Exited]:
    """Run ``python script *args`` as ranks ``0..size-1``; return each rank's end, by rank.
    Raises ``TimeoutError`` (after killing every rank) when the world has not ended within
    ``timeout`` seconds."""
    port = free_port()
    procs = []
    try:
        for rank in range(size):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
            env.update(WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size))
            env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
            procs.append(
                subprocess.Popen(
                    [sys.executable, script, *args],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
            )
        ends = []
        for rank, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"rank {rank} of a world of {size} did not end within {timeout}s") from None
            ends.append(Exited(p.returncode, out, err))
        return ends
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
