"""Run a script on N local ranks the way ``torchrun --standalone --nproc-per-node N`` runs it, with
the imports paid once: ``python forked_ranks.py N script.py``.

The parent imports torch, torch.distributed, collective_loader and streaming (3-9 s of CPU a
process here), runs nothing of torch, and forks one child per rank, each given the environment
torchrun gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``) before the script
runs as ``__main__``. Forking after imports alone is what a fork server does: no torch thread
has run, so none holds a lock. As under torchrun, the ranks' start method stays fork (their
DataLoader workers fork), rank 0 hosts the store of ``init_process_group()`` (torchrun's agent
hosts it there: the library handles both), and when a rank fails the others are killed; the
exit code is the first failing rank's. The tests' docs examples run this way
(``tests/distributed/test_docs_examples.py``); torchrun itself is run by the demo and job tests.
"""

from __future__ import annotations

import os
import runpy
import signal
import socket
import sys
import traceback

import streaming  # noqa: F401  (imported once, here, for every rank)
import torch  # noqa: F401
import torch.distributed  # noqa: F401

import collective_loader  # noqa: F401


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_main(rank: int, size: int, port: int, script: str) -> int:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_WORLD_SIZE=str(size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID="forked_ranks",
    )
    sys.argv = [script]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` puts it
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def main(size: int, script: str) -> int:
    port = free_port()
    children: dict[int, int] = {}
    for rank in range(size):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = rank_main(rank, size, port, script)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank
    worst = 0
    while children:
        pid, status = os.wait()
        rank = children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and worst == 0:
            worst = code if code > 0 else 128 - code
            print(f"forked_ranks: rank {rank} exited {code}; stopping the others", file=sys.stderr)
            for other in children:
                os.kill(other, signal.SIGKILL)
    return worst


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2]))
