"""``tests/support/processes.py``'s ``run_group``: a command past its time is killed with every
process it started, also those in sessions of their own (torchrun's ranks) and those whose parent
has exited; none is left behind."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys

import pytest
from processes import run_group

# A torchrun-like tree: the command (a session of its own, as run_group starts it) starts a "rank"
# in a new session, which starts a "worker"; and a "parent" that starts an "orphan" and exits (the
# orphan is then no one's descendant, and stays in the command's session only). Each prints its
# role, pid and session once its own children have, then waits for a signal (for ever); the
# command prints "ready" last.
TREE = r"""
import os, signal, subprocess, sys

role = sys.argv[1]
print(role, os.getpid(), os.getsid(0), flush=True)
for kid in {"command": ["rank", "parent"], "rank": ["worker"], "parent": ["orphan"]}.get(role, []):
    p = subprocess.Popen(
        [sys.executable, __file__, kid], stdout=subprocess.PIPE, text=True, start_new_session=kid == "rank"
    )
    for _ in range(1 if kid in ("worker", "orphan") else 2):
        sys.stdout.write(p.stdout.readline())
    sys.stdout.flush()
if role == "command":
    print("ready", flush=True)
if role != "parent":
    signal.pause()
"""


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid``, ``None`` if it has gone (reaped)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def _exits(fd: int | None, within: float) -> bool:
    """Whether the process exits within ``within`` seconds (a bound for a hang: a killed process
    exits at once): its pidfd becomes readable when it has."""
    return fd is None or bool(select.select([fd], [], [], within)[0])


@pytest.mark.timeout(120)
def test_a_timed_out_group_leaves_no_process_behind(tmp_path):
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        run_group([sys.executable, str(script), "command"], timeout=5)  # the tree starts in under 1 s
    out = caught.value.output or ""
    assert out.rstrip().endswith("ready"), f"the tree did not start within the timeout (a loaded machine?): {out!r}"
    started = {role: (int(pid), int(sid)) for role, pid, sid in (line.split() for line in out.splitlines()[:-1])}
    assert set(started) == {"command", "rank", "worker", "parent", "orphan"}, out
    fds = {role: _pidfd(pid) for role, (pid, _) in started.items()}
    try:
        # what the command's process group alone does not reach: the rank's own session, and an
        # orphan (its parent exited by itself before the kill: it is no one's descendant)
        assert started["rank"][1] != started["command"][1] and started["worker"][1] == started["rank"][0], started
        assert started["orphan"][1] == started["command"][1] and _exits(fds["parent"], 60), started
        left = [role for role, fd in fds.items() if not _exits(fd, 60)]
        assert left == [], f"still running after run_group's kill: {left} of {started}"
    finally:
        for fd in fds.values():
            if fd is not None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                os.close(fd)
