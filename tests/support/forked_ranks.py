"""Run a script or module on N local ranks the way ``torchrun --standalone --nproc-per-node N``
runs it, with the imports paid once::

    python forked_ranks.py N script.py [ARGS...]
    python forked_ranks.py [--import MODULE[:FUNCTION]]... [--tee] N -m MODULE [ARGS...]

The parent imports torch, torch.distributed, collective_loader and streaming (3-9 s of CPU a
process here), then each ``--import`` module in order, calling ``FUNCTION()`` of it where given
(TorchTitan's CPU launcher must patch the device before torchtitan's modules are imported:
14 s of CPU a process), runs nothing of torch, and forks one child per rank, each given the
environment torchrun gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``)
before the script or module runs as ``__main__`` with ``ARGS``. Forking after imports alone is
what a fork server does: no torch thread has run, so none holds a lock. As under torchrun, the
ranks' start method stays fork (their DataLoader workers fork), rank 0 hosts the store of
``init_process_group()`` (torchrun's agent hosts it there: the library handles both), and when a
rank fails the others are killed; the exit code is the first failing rank's. ``--tee`` prefixes
each line a rank prints with ``[default<rank>]:``, as ``torchrun --tee=3`` does. TorchTitan's
runs start this way (``tests/support/titan_run.py``), from the test process's fork server.

:func:`run_from_fork_server` runs a script or module from inside a test, on ranks forked from the
test process's fork server (``collective_loader.testing.launch``: torch and streaming imported
there once a session, not once a run): the docs examples run this way
(``tests/distributed/test_docs_examples.py``), and TorchTitan's runs start this script so (its
parent then imports only TorchTitan). torchrun itself is run by the demo and job tests.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import runpy
import selectors
import signal
import sys
import tempfile
import time
import traceback
import warnings
from multiprocessing import connection

import streaming  # noqa: F401  (imported once, here, for every rank)
import torch
import torch.distributed  # noqa: F401
from processes import free_port, kill_tree

import collective_loader  # noqa: F401
from collective_loader.testing import launch


def worker_environment(rank: int, size: int, port: int) -> dict[str, str]:
    """What torchrun sets for its worker ``rank`` of ``size`` on one node."""
    return dict(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_WORLD_SIZE=str(size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID="forked_ranks",
    )


def run_as_main(target: list[str]) -> int:
    """Run ``target`` (``[script, *args]`` or ``["-m", module, *args]``) as ``python`` would; its exit code."""
    try:
        if target[0] == "-m":
            # the parent may have imported it (``--import``) to fork after its imports: runpy
            # warns of that, and it runs as ``__main__`` all the same
            warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package", RuntimeWarning)
            sys.argv = [target[1], *target[2:]]
            sys.path[0] = os.getcwd()  # as `python -m module` puts it
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(target)
            sys.path[0] = os.path.dirname(os.path.abspath(target[0]))  # as `python script.py` puts it
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def rank_main(rank: int, size: int, port: int, target: list[str]) -> int:
    """Run ``target`` as rank ``rank`` of ``size``; its exit code."""
    os.environ.update(worker_environment(rank, size, port))
    return run_as_main(target)


def start(rank: int, size: int, port: int, target: list[str], tee: bool) -> tuple[int, int | None]:
    """Fork rank ``rank``: its pid, and the read end of its output's pipe when ``tee``."""
    read = write = None
    if tee:
        read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        # torch's thread pool, made in this parent (set_num_threads), is marked lost in a forked
        # child and remade by the first call that asks for it; two threads asking at once (the
        # autograd engine's and a loader's) could both see none: "Invalid thread pool!", abort
        # (1 Trainer rank here). Remade now, before the rank starts a thread.
        torch.set_num_threads(torch.get_num_threads())
        try:
            if write is not None:
                os.close(read)
                os.dup2(write, 1)
                os.dup2(write, 2)
            code = rank_main(rank, size, port, target)
        finally:
            atexit._run_exitfuncs()  # as a process that python ran would at its exit (streaming frees its shared memory)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    if write is not None:
        os.close(write)
    return pid, read


def relay(pipes: dict[int, int], pending: dict[int, bytes], selector: selectors.BaseSelector) -> None:
    """Copy what the ranks wrote since the last call to stdout, whole lines, each prefixed with its rank."""
    for key, _ in selector.select(timeout=0.2):
        fd, rank = key.fd, key.data
        chunk = os.read(fd, 65536)
        if not chunk:
            selector.unregister(fd)
            os.close(fd)
            del pipes[rank]
            chunk = b"\n" if pending.get(rank) else b""
        *lines, pending[rank] = (pending.get(rank, b"") + chunk).split(b"\n")
        if lines:
            sys.stdout.buffer.write(b"".join(b"[default%d]:%s\n" % (rank, line) for line in lines))
            sys.stdout.buffer.flush()


def main(size: int, target: list[str], tee: bool) -> int:
    port = free_port()
    children: dict[int, int] = {}
    pipes: dict[int, int] = {}
    selector = selectors.DefaultSelector()
    for rank in range(size):
        pid, read = start(rank, size, port, target, tee)
        children[pid] = rank
        if read is not None:
            pipes[rank] = read
            selector.register(read, selectors.EVENT_READ, rank)
    pending: dict[int, bytes] = {}
    worst = 0
    while children or pipes:
        if pipes:
            relay(pipes, pending, selector)
        pid, status = os.waitpid(-1, os.WNOHANG if pipes else 0) if children else (0, 0)
        if pid == 0:
            continue
        rank = children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and worst == 0:
            worst = code if code > 0 else 128 - code
            print(f"forked_ranks: rank {rank} exited {code}; stopping the others", file=sys.stderr, flush=True)
            for other in children:
                os.kill(other, signal.SIGKILL)
    return worst


def parse(argv: list[str]) -> tuple[int, list[str], bool]:
    """``(ranks, target, tee)`` from the command line, doing each ``--import`` on the way."""
    tee = False
    while argv[0].startswith("--"):
        if argv[0] == "--tee":
            tee, argv = True, argv[1:]
        elif argv[0] == "--import":
            module, _, function = argv[1].partition(":")
            imported = importlib.import_module(module)
            if function:
                getattr(imported, function)()
            argv = argv[2:]
        else:
            raise SystemExit(f"forked_ranks: unknown option {argv[0]}")
    return int(argv[0]), argv[1:], tee


def _served_rank(
    rank: int, size: int, init_file: str, target: list[str], cwd: str, output: str, port: int, env: dict[str, str]
) -> None:
    # a fork-server process: its output goes to ``output`` (fd level: DataLoader workers' too)
    fd = os.open(output, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(cwd)
    os.environ.update(env)
    # what a new interpreter would take from the environment: the server's has run nothing yet
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    # a fork-server child inherits the server's start method; a program that python or torchrun
    # starts has the platform's, fork (its DataLoader workers fork, pickling nothing)
    multiprocessing.set_start_method("fork", force=True)
    # torch's thread pool remade before any thread starts (see ``start``)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", torch.get_num_threads())))
    if port:
        os.environ.update(worker_environment(rank, size, port))
    code = run_as_main(target)
    atexit._run_exitfuncs()  # a fork-server child exits without them; a program that python ran would not
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def run_from_fork_server(
    target: list[str], ranks: int | None, cwd: str, timeout: float, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run ``target`` (as :func:`run_as_main` takes it) in ``cwd`` on ``ranks`` ranks with torchrun's
    workers' environment, or as one plain process when ``ranks`` is None, with ``env`` added to
    this process's environment; ``(exit code, output)``. The first rank to fail stops the others;
    past ``timeout`` every rank is stopped and the code is 124. Each rank and everything it
    started is killed before this returns."""
    size, port = (1, 0) if ranks is None else (ranks, free_port())
    with tempfile.NamedTemporaryFile("w+", prefix="forked_ranks_", suffix=".log") as log:
        procs, tmp = launch.spawn_ranks(_served_rank, size, target, cwd, log.name, port, env or {})
        try:
            deadline, running, code = time.monotonic() + timeout, {p.sentinel: p for p in procs}, 0
            while running and not code:
                left = deadline - time.monotonic()
                if left <= 0:
                    code = 124
                for sentinel in connection.wait(list(running), max(left, 0)):
                    ended = running.pop(sentinel)
                    ended.join()
                    code = code or abs(ended.exitcode or 0)  # the first rank to fail stops the others
        finally:
            for p in procs:
                if p.exitcode is None:
                    kill_tree(p.pid)  # a rank still running, and what it started
            launch.kill_ranks(procs, tmp)
        log.seek(0)
        return code, log.read()


if __name__ == "__main__":
    sys.exit(main(*parse(sys.argv[1:])))
