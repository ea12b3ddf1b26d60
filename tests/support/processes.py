"""A command run in a session of its own, killed whole (every process it started, in whatever
session) when it runs past its time; a module's long commands run two at a time."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # ranks import this module for free_port: no pytest there
    import pytest

T = TypeVar("T")


def _stat(pid: int) -> tuple[int, int] | None:
    """``(parent pid, session id)`` of ``pid`` from ``/proc``; ``None`` once it has gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[3])


def tree(pid: int) -> set[int]:
    """``pid`` and every process descended from it, and every process of a session one of them
    leads: torchrun starts each rank in a session of its own, so the agent's process group does
    not reach them, and a process whose parent has exited is no longer anyone's child, but it
    stays in its session."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            stats[int(entry)] = stat
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p in found:
            continue
        found.add(p)
        todo += [q for q, (ppid, sid) in stats.items() if ppid == p or sid == p]
    return found


def kill_tree(pid: int) -> set[int]:
    """SIGKILL ``pid`` and everything :func:`tree` finds. Each process is stopped (SIGSTOP) first,
    until no new one appears, so that none starts another or is orphaned out of sight meanwhile.
    Returns the pids it signalled."""
    stopped: set[int] = set()
    while new := tree(pid) - stopped:
        for p in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
        stopped |= new
    for p in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return stopped


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie, not yet reaped by its parent, has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def free_port() -> int:
    """A loopback port free now (another process may take it before the rendezvous does)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_group(cmd: Sequence[str], timeout: float, **popen: Any) -> tuple[int, str, str]:
    """``(returncode, stdout, stderr)`` of ``cmd``, its output captured as text. Past ``timeout``
    seconds every process it started is killed (:func:`kill_tree`: the command, torchrun's ranks
    in their own sessions, their DataLoader workers; a plain ``subprocess.run(timeout=...)``
    kills the command alone) and ``TimeoutExpired`` raised, with the output up to the kill.

    >>> run_group(["python", "-c", "print('hi')"], timeout=30)[:2]
    (0, 'hi\\n')
    """
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **popen
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        kill_tree(proc.pid)
        e.output, e.stderr = proc.communicate()
        raise
    return proc.returncode, out, err


@contextlib.contextmanager
def runs_in_background(
    request: pytest.FixtureRequest, runs: dict[str, Callable[[], T]], at_once: int = 2
) -> Iterator[dict[str, Future[T]]]:
    """A module fixture's body: ``runs[name]()`` for each test ``name`` of the module that this
    session selected, ``at_once`` at a time in threads from the start, in the order of ``runs``;
    yields each selected test's ``Future``, whose ``result()`` the test awaits. Commands that each
    leave a core idle for long (processes importing torch and streaming one after another) then
    fill both cores of this machine. Leaving the fixture waits for every run.
    """
    selected = {item.name for item in request.session.items if item.path == request.path}
    with ThreadPoolExecutor(at_once) as pool:
        yield {name: pool.submit(run) for name, run in runs.items() if name in selected}
