"""Two hosts on one machine: a job started as two torchrun agents, each in namespaces of its own.

A second host differs from a second process on this one in what is node-local: ``/dev/shm``
(streaming's shared memory), the temp dir (its lock files), ``/proc`` (which ``remove_stale``
reads to tell live blocks from stale ones) and ``GROUP_RANK``/``LOCAL_RANK``. So each agent runs
under ``unshare --mount --pid --fork --mount-proc``:

- its ``/dev/shm`` is a directory of its node bound over the machine's, and ``TMPDIR`` another.
  Both live under the test's tmp dir and outlive the job, as a host's ``/dev/shm`` outlives a job
  killed on it: the test reads them afterwards, and a job started again on the same nodes finds
  what the last one left;
- its ``/proc`` shows its own processes only, so ``remove_stale`` on one node is not misled by
  the other node's blocks (same names) or by other streaming jobs on this machine;
- the agent is pid 1 of its pid namespace: when it exits, or is killed, the kernel kills every
  process left in it (ranks, their DataLoader workers, resource trackers), so a node goes down
  whole and leaves no rank behind.

The agents rendezvous over loopback (c10d, a free port); node 0 hosts the rendezvous store, as
the host named in ``--rdzv-endpoint`` does. Node ranks go by arrival, so global rank 0 may run on
either node: each rank writes where it runs (``Job.where``). Each agent names itself
``127.0.0.<node + 1>`` (``--local-addr``): the rendezvous tells nodes apart by address and pid,
and both agents are pid 1 (without it no rank ever started: the job hung until killed).

Each rank runs the target through a per-job ``entry.py`` that sends the rank's output to
``rank<R>.log`` and records how the target ended in ``rank<R>.exit.json``; the entry's unique
path is how a process of the job is recognized after it (there should never be one).
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from processes import free_port

REPO = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parent
NAMESPACES = ("unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc", "--kill-child")
# SIGKILL for unshare when the test process dies (its --kill-child then takes the node down), so
# no node outlives a test run killed outright
DIE_WITH_TEST = ("setpriv", "--pdeathsig", "KILL")
# bind the node's directory over /dev/shm, then become the node's agent (pid 1 of its namespace)
AGENT = 'mount --bind "$1" /dev/shm && shift && exec "$@"'
GRACE = 45.0  # seconds torchrun gets to stop its ranks (it waits 30 s for them) before SIGKILL
STREAMING_BLOCK = re.compile(r"^\d{6}_")
STREAMING_LOCK = re.compile(r"^\d{6}_.*filelock$")

ENTRY = '''\
"""One rank of a two-node test job: says where it runs, keeps its output, runs the target."""
import json, os, runpy, sys, time

job = os.path.dirname(os.path.abspath(__file__))
rank = os.environ["RANK"]


def record(name, value):
    """Write a small JSON file whole, so that a reader never sees half of one."""
    path = os.path.join(job, f"rank{rank}.{name}.json")
    with open(path + ".part", "w") as f:
        json.dump(value, f)
    os.replace(path + ".part", path)


log = open(os.path.join(job, f"rank{rank}.log"), "w", buffering=1)
os.dup2(log.fileno(), 1)
os.dup2(log.fileno(), 2)
record("where", {k.lower(): int(os.environ[k]) for k in ("RANK", "GROUP_RANK", "LOCAL_RANK", "TWO_NODES_NODE")})
target = sys.argv[1:]
code, error = 1, None
try:
    if target[0] == "-m":
        sys.argv = target[1:]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = target
        sys.path[0] = os.path.dirname(os.path.abspath(target[0]))
        runpy.run_path(target[0], run_name="__main__")
    code = 0
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else int(e.code is not None)
    raise
except BaseException as e:
    error = f"{type(e).__name__}: {e}"
    raise
finally:
    record("exit", {"code": code, "error": error, "time": time.time()})
'''


@functools.cache
def namespaces_refused() -> str | None:
    """Why a node cannot be made here (no util-linux, ``unshare`` or the bind mount refused), or None."""
    try:
        probe = subprocess.run(
            [*DIE_WITH_TEST, *NAMESPACES, "bash", "-c", AGENT, "node", "/dev/shm", "true"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except FileNotFoundError as e:
        return f"cannot make a node: {e}"
    return None if probe.returncode == 0 else f"{' '.join(NAMESPACES)} refused: {probe.stderr.strip()}"


def require_namespaces() -> None:
    """Skip the calling test, saying why, where namespaces are not permitted (not root, no
    CAP_SYS_ADMIN, a seccomp profile)."""
    reason = namespaces_refused()
    if reason is not None:
        pytest.skip(reason)


@dataclass(frozen=True)
class Node:
    """One host: its ``/dev/shm`` and temp dir, kept from job to job."""

    index: int
    dir: Path

    @property
    def shm(self) -> Path:
        return self.dir / "shm"

    @property
    def tmp(self) -> Path:
        return self.dir / "tmp"

    def blocks(self) -> list[str]:
        """Streaming's shared-memory blocks in this node's /dev/shm."""
        return sorted(n for n in os.listdir(self.shm) if STREAMING_BLOCK.match(n))

    def locks(self) -> list[str]:
        """Streaming's lock files in this node's temp dir."""
        return sorted(n for n in os.listdir(self.tmp) if STREAMING_LOCK.match(n))


@dataclass(frozen=True)
class RankEnd:
    """Where one global rank ran and how its target ended."""

    rank: int
    node: int  # index of the agent (host) it ran on
    group_rank: int  # torchrun's node rank: by arrival, so not always ``node``
    local_rank: int
    exit: dict[str, Any] | None  # {"code", "error", "time"}; None: killed before the target returned
    log: str

    def describe(self) -> str:
        how = "killed (no exit record)" if self.exit is None else f"exit {self.exit['code']}"
        if self.exit and self.exit["error"]:
            how += f": {self.exit['error'].splitlines()[0]}"
        return (
            f"rank {self.rank} on node {self.node} (group rank {self.group_rank}, local rank {self.local_rank}): {how}"
        )


@dataclass(frozen=True)
class Result:
    """What a finished job left: each agent's exit code, each rank's end, and the time it took."""

    codes: tuple[int, int]  # per node; negative: the signal that ended its agent
    ranks: dict[int, RankEnd]
    seconds: float
    timed_out: bool
    agent_logs: tuple[str, str]

    def describe(self) -> str:
        """Everything a failing assertion should show."""
        lines = [f"agents exited {self.codes} after {self.seconds:.1f}s" + (" (timed out)" if self.timed_out else "")]
        lines += [r.describe() for r in sorted(self.ranks.values(), key=lambda r: r.rank)]
        for i, log in enumerate(self.agent_logs):
            lines.append(f"--- agent of node {i} (last lines) ---\n" + "\n".join(log.splitlines()[-15:]))
        for r in sorted(self.ranks.values(), key=lambda r: r.rank):
            lines.append(f"--- rank {r.rank} (last lines) ---\n" + "\n".join(r.log.splitlines()[-15:]))
        return "\n".join(lines)


class Cluster:
    """Two nodes of ``nproc`` ranks each under ``root``; start jobs on them with :meth:`start`.

    A context manager: leaving it stops every job still running (a test that failed half-way).
    """

    def __init__(self, root: Path, nproc: int) -> None:
        require_namespaces()
        self.root = root
        self.nproc = nproc
        self.nodes = (Node(0, root / "node0"), Node(1, root / "node1"))
        for node in self.nodes:
            node.shm.mkdir(parents=True, exist_ok=True)
            node.tmp.mkdir(parents=True, exist_ok=True)
        self._jobs: list[Job] = []

    def __enter__(self) -> Cluster:  # noqa: PYI034 (no subclasses)
        return self

    def __exit__(self, *exc: object) -> None:
        for job in self._jobs:
            job.stop(GRACE)

    def start(self, target: Sequence[str], monitor_interval: float = 0.1) -> Job:
        """Start ``target`` (``["-m", module, args...]`` or ``[script, args...]``) on both nodes.

        ``monitor_interval``: how often torchrun looks at its ranks; once one has failed it
        stops the others, so a longer interval lets every rank report its own error first.
        """
        job = Job(self, self.root / f"job{len(self._jobs) + 1}", target, monitor_interval)
        self._jobs.append(job)
        return job


class Job:
    """One job: two agents, one per node; call :meth:`wait` (it always stops both)."""

    def __init__(self, cluster: Cluster, dir: Path, target: Sequence[str], monitor_interval: float) -> None:
        self.cluster = cluster
        self.dir = dir
        dir.mkdir()
        self.entry = dir / "entry.py"
        self.entry.write_text(ENTRY)
        port = free_port()
        self.started = time.monotonic()
        self.agents = tuple(self._agent(node, port, target, monitor_interval) for node in cluster.nodes)

    def _agent(self, node: Node, port: int, target: Sequence[str], monitor_interval: float) -> subprocess.Popen:
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            str(self.cluster.nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            self.dir.name,
            "--rdzv-conf",
            f"is_host={int(node.index == 0)}",
            "--local-addr",
            f"127.0.0.{node.index + 1}",
            "--monitor-interval",
            str(monitor_interval),
            str(self.entry),
            *target,
        ]
        env = {
            **os.environ,
            "TMPDIR": str(node.tmp),
            "TWO_NODES_NODE": str(node.index),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(SUPPORT), os.environ.get("PYTHONPATH")])),
        }
        with open(self.dir / f"agent{node.index}.log", "w") as log:  # the agent holds its own copy
            return subprocess.Popen(
                [*DIE_WITH_TEST, *NAMESPACES, "bash", "-c", AGENT, "node", str(node.shm), *torchrun],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.dir,
                start_new_session=True,
            )

    def where(self) -> dict[int, dict[str, int]]:
        """``{global rank: {"rank", "group_rank", "local_rank", "two_nodes_node"}}`` of the ranks
        started so far."""
        return {int(p.name.split(".")[0][4:]): json.loads(p.read_text()) for p in self.dir.glob("rank*.where.json")}

    def running(self) -> tuple[bool, bool]:
        """Whether each node's agent is still running."""
        return tuple(a.poll() is None for a in self.agents)  # type: ignore[return-value]

    def kill_node(self, node: int) -> None:
        """SIGKILL the whole node, as a host going down: its agent (pid 1 of the node's pid
        namespace) dies and the kernel kills every other process in it."""
        os.killpg(self.agents[node].pid, signal.SIGKILL)
        self.agents[node].wait()

    def wait(self, timeout: float) -> Result:
        """Wait for both agents; past ``timeout`` seconds stop the job (:meth:`stop`). Either way
        no process of the job is left afterwards."""
        deadline = self.started + timeout
        timed_out = False
        for agent in self.agents:
            try:
                agent.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
        seconds = time.monotonic() - self.started
        if timed_out:
            self.stop(GRACE)
        stray = self._stray()
        assert not stray, f"processes of {self.entry} outlived their node: {stray}"
        return self._result(seconds, timed_out)

    def stop(self, grace: float) -> None:
        """SIGTERM to each agent's process group (torchrun, pid 1 of the node, stops its ranks;
        ``unshare`` ignores it), SIGKILL after ``grace`` seconds (the whole node goes)."""
        live = [a for a in self.agents if a.poll() is None]
        for agent in live:
            os.killpg(agent.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for agent in live:
            try:
                agent.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()

    def _stray(self) -> list[str]:
        """Kill and name any process whose command line holds this job's entry path."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(self.entry) in cmdline:
                found.append(f"{pid}: {cmdline}")
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return found

    def _result(self, seconds: float, timed_out: bool) -> Result:
        ranks = {}
        for rank, where in self.where().items():
            exit_file = self.dir / f"rank{rank}.exit.json"
            ranks[rank] = RankEnd(
                rank,
                where["two_nodes_node"],
                where["group_rank"],
                where["local_rank"],
                json.loads(exit_file.read_text()) if exit_file.exists() else None,
                (self.dir / f"rank{rank}.log").read_text(errors="replace"),
            )
        codes = tuple(a.returncode for a in self.agents)
        logs = tuple((self.dir / f"agent{i}.log").read_text(errors="replace") for i in range(2))
        return Result(codes, ranks, seconds, timed_out, logs)  # type: ignore[arg-type]
