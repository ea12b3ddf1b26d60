"""A gloo world of processes (launch.spawn_ranks), started once and reused to run many functions.

Every call has a deadline; on a miss the whole world is killed (no process outlives a test) and
the next call starts a fresh one. Functions and their results must be picklable, so the
functions run on the ranks are module-level functions of test modules.
"""

from __future__ import annotations

import queue
import time
import traceback
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import Any

import torch.distributed as dist

from collective_loader.testing import launch

STARTUP_TIMEOUT = 300.0


def _worker(rank: int, size: int, init_file: str, tasks: list[Queue], results: Queue) -> None:
    launch.init_rank(rank, size, init_file)
    results.put((rank, True, "ready"))
    while True:
        task = tasks[rank].get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # reported to the test with the traceback
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class World:
    """``size`` ranks that run ``fn(*args)`` on every rank and return the results by rank."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._procs: list[BaseProcess] = []

    def _start(self) -> None:
        self._tasks = [launch.CONTEXT.Queue() for _ in range(self.size)]
        self._results = launch.CONTEXT.Queue()
        self._procs, self._tmp = launch.spawn_ranks(_worker, self.size, self._tasks, self._results)
        # starting many ranks on two cores takes a while: that is not the tested function's time
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for _ in range(self.size):
            try:
                self._results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise TimeoutError(f"a world of {self.size} ranks did not start within {STARTUP_TIMEOUT}s") from None

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = 120.0,
        dying: frozenset[int] = frozenset(),
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; raise with every failing rank's traceback,
        or on the deadline.

        ``dying``: ranks that kill themselves during ``fn``; their results are ``None``, the
        others' are waited for as usual, and the world (its process group now broken) is killed
        afterwards, so the next call starts a fresh one.
        """
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out: dict[int, tuple[bool, Any]] = {r: (True, None) for r in dying}
        deadline = time.monotonic() + timeout
        try:
            self._collect(out, f"{fn.__name__} within {timeout}s", deadline)
            for r in sorted(dying):
                self._procs[r].join(max(0.0, deadline - time.monotonic()))
            alive = [r for r in sorted(dying) if self._procs[r].is_alive()]
            if alive:
                raise TimeoutError(f"ranks {alive} were to die in {fn.__name__} and still ran after {timeout}s")
        finally:
            if dying:
                self.kill()
        failed = {r: v for r, (ok, v) in out.items() if not ok}
        if failed:
            raise AssertionError("".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items())))
        return [out[r][1] for r in range(self.size)]

    def _collect(self, out: dict[int, tuple[bool, Any]], what: str, deadline: float) -> None:
        while len(out) < self.size:
            try:
                rank, ok, value = self._results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(self.size)) - set(out))
                self.kill()
                raise TimeoutError(f"ranks {missing} did not finish {what}") from None
            out[rank] = (ok, value)

    def alive(self) -> list[int]:
        """Ranks whose process is running."""
        return [r for r, p in enumerate(self._procs) if p.is_alive()]

    def kill(self) -> None:
        launch.kill_ranks(self._procs, self._tmp)
        self._procs = []

    def close(self) -> None:
        if not self._procs:
            return
        for q in self._tasks:
            q.put(None)
        deadline = time.monotonic() + 20
        for p in self._procs:
            p.join(max(0.1, deadline - time.monotonic()))
        self.kill()
