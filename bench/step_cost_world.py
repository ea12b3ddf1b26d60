"""The ranks' side of ``bench/step_cost.py``: one 2-rank world measures everything once (one round)
and rank 0 keeps its record (:func:`world_main`); what each measure is: ``step_cost.py``'s docstring."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import harness  # bench/harness.py: run as python bench/<name>.py
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, Dataset

import collective_loader
from collective_loader import CollectiveLoader

SKIP = 3  # warm-up steps left out at the start of every epoch
TAIL = 4  # steps after the last measured one: the transfer thread is still alive when its clock is read
TIMEOUT = 120.0  # seconds a loader waits in one collective
STEP = 0.020  # seconds of a training step: the host-idle sleep and the Python-bound loop's target
LEADER = 0
ROLES = ("leader", "receiver")  # rank LEADER, the other rank
WORKERS = 2  # DataLoader worker processes per rank
BLOCK = 20  # steps of the Python-bound loop each feed runs in its turn
COLD_ROUNDS = 10  # rounds of python_work in the floor's fixed piece of work
IDLE = 100e-6  # seconds of sleep before the piece of work "after an idle"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one world measures; ``--quick`` shrinks it."""

    payloads: tuple[int, ...]  # measures 1 and 4 (steps against raw)
    loop_payloads: tuple[int, ...]  # measures 2, 3 and the exposed wait
    steps: tuple[int, ...]  # measured steps per epoch, per payload
    loop_steps: int  # measured steps of the 20 ms epochs
    rounds: int
    world_timeout: float
    out: str = ""  # JSON-lines file rank 0 appends to
    version: str = ""  # which package version this world runs ("before", "after")
    round: int = 0  # rotates the order of the variants inside the world

    def steps_for(self, nbytes: int) -> int:
        return self.steps[self.payloads.index(nbytes)]


FULL = Settings(
    payloads=(64 * harness.KIB, harness.MIB, 16 * harness.MIB),
    loop_payloads=(64 * harness.KIB, harness.MIB),
    steps=(400, 200, 40),
    loop_steps=100,
    rounds=3,
    world_timeout=900,
)
QUICK = Settings(
    payloads=(64 * harness.KIB, harness.MIB),
    loop_payloads=(64 * harness.KIB,),
    steps=(60, 30),
    loop_steps=30,
    rounds=1,
    world_timeout=300,
)


# --- batches and sources --------------------------------------------------------------------


def make_batch(nbytes: int) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``labels``, int64 of shape (8, L), ``nbytes`` together."""
    length = max(1, nbytes // 2 // 8 // 8)
    ids = torch.randint(0, 32000, (8, length), dtype=torch.int64)
    return {"input_ids": ids, "labels": ids.roll(-1, 1)}


class Fresh(Dataset):
    """What a DataLoader worker hands over each step: a fresh copy of the batch (a real dataset
    builds new tensors per item; the same tensor would be moved to shared memory once only)."""

    def __init__(self, batch: dict[str, torch.Tensor], n: int) -> None:
        self.batch, self.n = batch, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.batch.items()}


def new_loader(batch: dict[str, torch.Tensor], mesh: Any, **options: Any) -> tuple[CollectiveLoader, harness.Repeat]:
    source = harness.Repeat(batch)
    loader = CollectiveLoader(source, mesh, inputs=("input_ids",), labels=("labels",), timeout=TIMEOUT, **options)
    return loader, source


# --- per-thread clocks ------------------------------------------------------------------------


def transfer_clock() -> int:
    """The CPU clock of this rank's transfer thread (the epoch's ``Prefetcher``)."""
    name = f"collective_loader-r{dist.get_rank()}"
    threads = [t for t in threading.enumerate() if t.name == name and t.is_alive()]
    assert len(threads) == 1, [t.name for t in threading.enumerate()]
    assert threads[0].ident is not None
    return time.pthread_getcpuclockid(threads[0].ident)


# --- the measurements (every rank) --------------------------------------------------------------


def loader_epoch(loader: CollectiveLoader, source: harness.Repeat, n: int, compute: float = 0.0) -> dict[str, Any]:
    """One epoch of ``n`` measured steps (after ``SKIP``, before ``TAIL``): this rank's step times,
    time and CPU time inside ``next()``, and its transfer thread's and process's CPU per step.
    ``compute`` seconds of sleep follow every step (a host-idle training step)."""
    cpu: dict[str, Any] = {}  # the transfer thread's clock, then its CPU and the process's per step

    def each(i: int, batch: Any) -> None:
        if i == SKIP - 1:
            cpu["clock"] = transfer_clock()
            cpu["thread"], cpu["process"] = time.clock_gettime(cpu["clock"]), time.process_time()
        elif i == SKIP + n - 1:
            cpu["thread"] = (time.clock_gettime(cpu["clock"]) - cpu["thread"]) / n
            cpu["process"] = (time.process_time() - cpu["process"]) / n
        if compute:
            time.sleep(compute)

    gc.collect()
    dist.barrier()
    source.steps = SKIP + n + TAIL
    t = harness.timed_steps(loader, SKIP, n, each)
    return {
        "steps": t.steps,
        "waits": t.waits,
        "wait_cpu": t.wait_cpu,
        "thread_cpu": cpu["thread"],
        "process_cpu": cpu["process"],
    }


def raw_epoch(nbytes: int, group: dist.ProcessGroup, n: int) -> dict[str, Any]:
    """``n`` raw broadcasts of ``nbytes`` (after ``SKIP``) on a thread, into a buffer allocated once:
    per-step times, the thread's CPU and the process's CPU per step."""
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    out: dict[str, Any] = {}

    def run() -> None:
        for _ in range(SKIP):
            dist.broadcast(buf, LEADER, group=group)
        cpu0, proc0 = time.thread_time(), time.process_time()
        times = [time.perf_counter()]
        for _ in range(n):
            dist.broadcast(buf, LEADER, group=group)
            times.append(time.perf_counter())
        out["thread_cpu"] = (time.thread_time() - cpu0) / n
        out["process_cpu"] = (time.process_time() - proc0) / n
        out["steps"] = [b - a for a, b in zip(times, times[1:])]

    gc.collect()
    dist.barrier()
    thread = threading.Thread(target=run, name="raw-broadcast")
    thread.start()
    thread.join()
    return out


def python_work(k: int, x: torch.Tensor) -> torch.Tensor:
    """``k`` rounds of two small torch ops: a training step whose host time is Python launching ops."""
    for _ in range(k):
        x = x.mul(0.5).add(1.0)
    return x


def calibrate() -> int:
    """Rounds of :func:`python_work` that take about ``STEP`` on rank 0 (every rank uses its number)."""
    x = torch.ones(16)
    best = min(timed(lambda: python_work(500, x)) for _ in range(5))
    return harness.gather(max(1, round(STEP / (best / 500))))[0]


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def python_loops(
    feeds: dict[str, Iterator[Any]], k: int, blocks: int, sync: dist.ProcessGroup, first: int
) -> dict[str, float]:
    """Mean step time of the Python-bound loop fed by each of ``feeds``, slowest rank.

    The feeds take turns, ``BLOCK`` steps at a time, ``blocks`` times each (the order rotating,
    starting at ``first``), so a change of load on the machine falls on every feed alike. Every
    step reads its batch and all-reduces one float (the gradient sync keeps the ranks in step).
    """
    x, grad = torch.ones(16), torch.zeros(1)

    def run(feed: Iterator[Any], steps: int) -> torch.Tensor:
        y = x
        for _ in range(steps):
            batch = next(feed)
            y = python_work(k, y.add_(batch["input_ids"][0, 0]))
            dist.all_reduce(grad, group=sync)
        return y

    for feed in feeds.values():
        run(feed, SKIP)
    gc.collect()
    dist.barrier()
    names = list(feeds)
    spent = dict.fromkeys(names, 0.0)
    for b in range(blocks):
        j = (first + b) % len(names)
        for name in names[j:] + names[:j]:
            start = time.perf_counter()
            run(feeds[name], BLOCK)
            spent[name] += time.perf_counter() - start
    for feed in feeds.values():
        for _ in feed:  # to its end: the loader's epoch ends on every rank alike
            pass
    return {name: max(harness.gather(total / (blocks * BLOCK))) for name, total in spent.items()}


def one_round(runs: dict[str, Callable[[], Any]], r: int) -> dict[str, Any]:
    """Every run once, in the order of round ``r`` (the rounds are the worlds)."""
    return {name: results[0] for name, results in harness.in_rounds(runs, 1, first=r).items()}


def payload_case(s: Settings, mesh: Any, raw_group: dist.ProcessGroup, nbytes: int) -> dict[str, Any]:
    """Measures 1 and 4: the loader with ``prefetch=1`` and the raw broadcast, in rotating order."""
    batch = make_batch(nbytes)
    n = s.steps_for(nbytes)
    loader, source = new_loader(batch, mesh, prefetch=1)
    loader_epoch(loader, source, 2)  # warm: buffers, frames
    runs = {
        "loader": lambda: loader_epoch(loader, source, n),
        "raw": lambda: raw_epoch(nbytes, raw_group, n),
    }
    out = one_round(runs, s.round)
    loader.close()
    record: dict[str, Any] = {"payload": nbytes, "tensor_bytes": sum(t.nbytes for t in batch.values()), "steps": n}
    for name, r in out.items():
        record[name] = {
            "step_p50": statistics.median(harness.slowest(harness.gather(r["steps"]))),
            "thread_cpu": harness.gather(r["thread_cpu"]),
            "process_cpu": harness.gather(r["process_cpu"]),
        }
    return record


def loop_case(s: Settings, mesh: Any, sync: dist.ProcessGroup, k: int, nbytes: int) -> dict[str, Any]:
    """Measures 2, 3 and the exposed wait for one payload."""
    batch = make_batch(nbytes)
    n = s.loop_steps
    blocks = max(1, n // BLOCK)
    total = SKIP + blocks * BLOCK
    loader, source = new_loader(batch, mesh)
    loader_epoch(loader, source, 2)  # warm: buffers, frames
    dataloader = DataLoader(Fresh(batch, total), batch_size=None, num_workers=WORKERS, persistent_workers=True)
    for _ in itertools.islice(dataloader, 2):  # the workers start here, not in a timed epoch
        pass

    def loops() -> dict[str, float]:
        source.steps = total
        feeds = {"memory": itertools.repeat(batch, total), "loader": iter(loader), "dataloader": iter(dataloader)}
        return python_loops(feeds, k, blocks, sync, s.round)

    out = one_round({"loops": loops, "idle": lambda: loader_epoch(loader, source, n, compute=STEP)}, s.round)
    loader.close()
    idle = out["idle"]
    return {
        "payload": nbytes,
        "loop": out["loops"],
        "next_p50": harness.gather(statistics.median(idle["waits"])),
        "next_cpu_p50": harness.gather(statistics.median(idle["wait_cpu"])),
        "next_mean": harness.gather(statistics.fmean(idle["waits"])),
        "exposed": statistics.fmean(harness.slowest(harness.gather(idle["waits"]))),
        "idle_thread_cpu": harness.gather(idle["thread_cpu"]),
    }


def floor_case(n: int) -> dict[str, Any]:
    """Measure 5: this rank's floor for ``next()`` after a 20 ms sleep, and a fixed piece of work's
    CPU back to back and after a short sleep (medians over ``n``)."""
    q: queue.SimpleQueue[None] = queue.SimpleQueue()
    x = torch.ones(16)
    floor, hot, cold = [], [], []
    for _ in range(n):
        time.sleep(STEP)
        start = time.perf_counter()
        q.put(None)
        q.get()
        floor.append(time.perf_counter() - start)
    for sleep, into in ((0.0, hot), (IDLE, cold)):
        for _ in range(n):
            if sleep:
                time.sleep(sleep)
            start = time.thread_time()
            python_work(COLD_ROUNDS, x)
            into.append(time.thread_time() - start)
    return {
        "next_floor": harness.gather(statistics.median(floor)),
        "work_hot": harness.gather(statistics.median(hot)),
        "work_after_idle": harness.gather(statistics.median(cold)),
    }


def world_main(s: Settings) -> int:
    """Rank entry: every measurement once (one round), appended to ``s.out`` by rank 0."""
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    ranks = list(range(dist.get_world_size()))
    raw_group = dist.new_group(ranks, backend="gloo")
    sync = dist.new_group(ranks, backend="gloo")
    k = calibrate()
    record: dict[str, Any] = {
        "version": s.version,
        "round": s.round,
        "package": os.path.dirname(collective_loader.__file__),
        "work_rounds": k,
        "payloads": [],
        "loops": [],
        "load_before": os.getloadavg()[0],
    }
    for nbytes in s.payloads:
        record["payloads"].append(payload_case(s, mesh, raw_group, nbytes))
    for nbytes in s.loop_payloads:
        record["loops"].append(loop_case(s, mesh, sync, k, nbytes))
    record["floor"] = floor_case(s.loop_steps)
    record["load_after"] = os.getloadavg()[0]
    if dist.get_rank() == 0:
        harness.keep(s.out, record)
        print(f"{s.version or 'working tree'} round {s.round} done ({record['package']})", flush=True)
    return 0
