"""A command run in a session of its own, killed whole when it runs past its time."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from typing import Any


def run_group(cmd: Sequence[str], timeout: float, **popen: Any) -> tuple[int, str, str]:
    """``(returncode, stdout, stderr)`` of ``cmd``, its output captured as text. Past ``timeout``
    seconds the whole session is killed (the command and every rank it started, which a plain
    ``subprocess.run(timeout=...)`` would leave running) and ``TimeoutExpired`` raised.

    >>> run_group(["python", "-c", "print('hi')"], timeout=30)[:2]
    (0, 'hi\\n')
    """
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **popen
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return proc.returncode, out, err
