"""A gloo world of spawned processes, started once and reused to run many functions.

Every call has a deadline; on a miss the whole world is killed (no process outlives a test) and
the next call starts a fresh one. Functions and their results must be picklable, so the
functions run on the ranks are module-level functions of test modules.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable

STARTUP_TIMEOUT = 300.0


def _worker(rank: int, size: int, init_file: str, tasks: mp.Queue, results: mp.Queue) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    results.put((rank, True, "ready"))
    while True:
        task = tasks.get()
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
        self._procs: list[mp.Process] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.mkdtemp(prefix="cl_world_")
        init_file = os.path.join(self._tmp, "init")
        self._tasks = [ctx.Queue() for _ in range(self.size)]
        self._results = ctx.Queue()
        self._procs = [
            # not daemons: DataLoader workers need a non-daemon parent; kill() ends them all
            ctx.Process(target=_worker, args=(r, self.size, init_file, self._tasks[r], self._results), daemon=False)
            for r in range(self.size)
        ]
        for p in self._procs:
            p.start()
        # starting many ranks on two cores takes a while: that is not the tested function's time
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for _ in range(self.size):
            try:
                self._results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise TimeoutError(f"a world of {self.size} ranks did not start within {STARTUP_TIMEOUT}s") from None

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, dying: frozenset[int] = frozenset(),
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
            while any(self._procs[r].is_alive() for r in dying) and time.monotonic() < deadline:
                time.sleep(0.05)
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
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5)
        self._procs = []
        shutil.rmtree(self._tmp, ignore_errors=True)

    def close(self) -> None:
        if not self._procs:
            return
        for q in self._tasks:
            q.put(None)
        deadline = time.monotonic() + 20
        for p in self._procs:
            p.join(max(0.1, deadline - time.monotonic()))
        self.kill()
