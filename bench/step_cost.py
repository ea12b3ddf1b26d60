"""What delivery costs the training process per step: CPU and GIL time against a raw broadcast's.

    python bench/step_cost.py                 # the package on sys.path: bench/results/step_cost.{json,md}
    python bench/step_cost.py --before REV    # REV (a commit) and that package, side by side
    python bench/step_cost.py --quick         # a small version: bench/results/step_cost_quick.* (git-ignored)

(Run times: bench/README.md.)

Every measurement runs in a 2-rank gloo world, mesh ``("dp", "tp") = (1, 2)``: rank 0 is the
leader, rank 1 receives (a tp peer: a copy of the whole batch). Batches are two int64 tensors
(``input_ids``, ``labels``) built once, so only delivery is counted, never loading. With
``--before`` every round starts one world per version (the order alternating), each measuring
all of the below, its own raw-broadcast limit included; tables give the median over rounds.

1. *Transfer-thread CPU per step*: the CPU time of the loader's transfer thread (read from its
   per-thread clock, ``time.pthread_getcpuclockid``, at two steps of a ``prefetch=1`` epoch),
   leader and receiver, against the CPU time of the thread that runs a raw ``dist.broadcast`` of
   the same tensor bytes into a buffer allocated once (``time.thread_time`` on that thread).
   Process CPU per step (``time.process_time``: every thread, gloo's included) is shown too.
2. *Time in* ``next()`` *for a ready batch*: each rank's median time inside ``next()`` while the
   training loop sleeps 20 ms per step (a host-idle step: the batch is there when it asks).
3. *A Python-bound training loop*: about 20 ms of small torch ops per step (calibrated in the
   world) and a one-float all-reduce standing in for the gradient sync, fed from memory, from the
   loader, and from a plain ``DataLoader`` with 2 worker processes on every rank, the three taking
   turns ``BLOCK`` steps at a time; the slowdown is the mean step time over the one from memory.
4. *Step time against a raw broadcast* (the ``prefetch=1`` epoch's slowest-rank p50 over the raw
   broadcast's, as in ``bench/delivery.py``) and the *exposed wait* of the host-idle 20 ms step
   (mean time in ``next()``, slowest rank per step, over 20 ms).
5. *This machine's floor*, in every world: the wall time of the least a ``next()`` can do (one
   ``put`` and one ``get`` on a ``queue.SimpleQueue``) right after the same 20 ms sleep; and the
   CPU time of a fixed piece of Python and torch work (``python_work(COLD_ROUNDS)``) back to back
   and right after a 100 µs sleep (a transfer thread's work follows its wait in a collective).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import os
import queue
import statistics
import subprocess
import sys
import tempfile
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
from collective_loader.testing import launch

REPO = harness.REPO
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
# the targets (issue 23)
CPU_LIMIT = 1.5  # transfer-thread CPU per step over the raw broadcast thread's
NEXT_LIMIT = 20e-6  # seconds inside next() for a ready batch
WAIT_LIMIT = 0.02  # exposed wait over the 20 ms step
STEP_LIMITS = {64 * harness.KIB: 1.5, harness.MIB: 1.15, 16 * harness.MIB: 1.15}  # loader p=1 step over raw broadcast


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


# --- the parent: versions, rounds, report ------------------------------------------------------


@contextlib.contextmanager
def first_on_path(path: str | None) -> Iterator[None]:
    """Spawned ranks import ``collective_loader`` from ``path`` (they get the parent's ``sys.path``)."""
    if path is None:
        yield
        return
    sys.path.insert(0, path)
    try:
        yield
    finally:
        sys.path.remove(path)


def describe(rev: str) -> str:
    out = subprocess.run(
        ["git", "-C", REPO, "log", "-1", "--format=%h %ad", "--date=short", rev],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def median_of(rows: list[dict[str, Any]], *path: Any) -> float:
    """The median over rounds of the figure at ``path`` (keys, then indices) in each row."""
    values = []
    for row in rows:
        value: Any = row
        for key in path:
            value = value[key]
        values.append(value)
    return statistics.median(values)


def median_ratio(rows: list[dict[str, Any]], num: tuple[Any, ...], den: tuple[Any, ...], minus: float = 0.0) -> float:
    """The median over rounds of the per-round ratio of two figures (minus ``minus``)."""
    return statistics.median(median_of([r], *num) / median_of([r], *den) - minus for r in rows)


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us"


def summarize(records: list[dict[str, Any]], version: str) -> dict[str, Any]:
    """Medians over rounds of one version's figures."""
    mine = [r for r in records if r["version"] == version]
    out: dict[str, Any] = {"payloads": {}, "loops": {}, "rounds": len(mine)}
    roles = tuple(zip(ROLES, (LEADER, 1 - LEADER)))
    for i, nbytes in enumerate(p["payload"] for p in mine[0]["payloads"]):
        rows = [r["payloads"][i] for r in mine]
        row: dict[str, Any] = {}
        for role, rank in roles:
            for what in ("thread_cpu", "process_cpu"):
                for variant in ("loader", "raw"):
                    row[f"{variant}_{what}_{role}"] = median_of(rows, variant, what, rank)
                row[f"{what}_ratio_{role}"] = median_ratio(rows, ("loader", what, rank), ("raw", what, rank))
        row["loader_step"] = median_of(rows, "loader", "step_p50")
        row["raw_step"] = median_of(rows, "raw", "step_p50")
        row["step_ratio"] = median_ratio(rows, ("loader", "step_p50"), ("raw", "step_p50"))
        out["payloads"][nbytes] = row
    for i, nbytes in enumerate(p["payload"] for p in mine[0]["loops"]):
        rows = [r["loops"][i] for r in mine]
        row = {name: median_of(rows, "loop", name) for name in ("memory", "loader", "dataloader")}
        for name in ("loader", "dataloader"):
            row[f"{name}_slowdown"] = median_ratio(rows, ("loop", name), ("loop", "memory"), minus=1.0)
        for role, rank in roles:
            for what in ("next_p50", "next_cpu_p50", "next_mean", "idle_thread_cpu"):
                row[f"{what}_{role}"] = median_of(rows, what, rank)
        row["exposed"] = median_of(rows, "exposed")
        out["loops"][nbytes] = row
    out["floor"] = {
        f"{what}_{role}": median_of([r["floor"] for r in mine], what, rank)
        for what in ("next_floor", "work_hot", "work_after_idle")
        for role, rank in roles
    }
    out["work_rounds"] = [r["work_rounds"] for r in mine]
    out["load"] = [(r["load_before"], r["load_after"]) for r in mine]
    return out


def verdict(ok: bool) -> str:
    return "met" if ok else "**MISSED**"


def target_rows(v: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(target, measured, met) for one version."""
    rows = []
    for nbytes, p in v["payloads"].items():
        worst = max(p["thread_cpu_ratio_leader"], p["thread_cpu_ratio_receiver"])
        rows.append(
            (
                f"transfer-thread CPU <= {CPU_LIMIT}x raw broadcast's, {harness.size(nbytes)}",
                f"leader {p['thread_cpu_ratio_leader']:.2f}x, receiver {p['thread_cpu_ratio_receiver']:.2f}x",
                worst <= CPU_LIMIT,
            )
        )
    for nbytes, p in v["loops"].items():
        worst = max(p["next_p50_leader"], p["next_p50_receiver"])
        rows.append(
            (
                f"next() <= {us(NEXT_LIMIT)} for a ready batch, {harness.size(nbytes)}",
                f"leader {us(p['next_p50_leader'])}, receiver {us(p['next_p50_receiver'])}",
                worst <= NEXT_LIMIT,
            )
        )
    for nbytes, p in v["loops"].items():
        rows.append(
            (
                f"Python-bound slowdown <= plain DataLoader's, {harness.size(nbytes)}",
                f"loader {p['loader_slowdown']:+.1%}, DataLoader {p['dataloader_slowdown']:+.1%}",
                p["loader_slowdown"] <= p["dataloader_slowdown"],
            )
        )
    for nbytes, p in v["payloads"].items():
        limit = STEP_LIMITS.get(nbytes, 1.15 if nbytes >= harness.MIB else 1.5)
        rows.append(
            (
                f"step <= {limit}x raw broadcast, {harness.size(nbytes)}",
                f"{p['step_ratio']:.2f}x",
                p["step_ratio"] <= limit,
            )
        )
    for nbytes, p in v["loops"].items():
        rows.append(
            (
                f"exposed wait <= {WAIT_LIMIT:.0%} of a 20 ms step, {harness.size(nbytes)}",
                f"{p['exposed'] / STEP:.1%}",
                p["exposed"] <= WAIT_LIMIT * STEP,
            )
        )
    return rows


def markdown(results: dict[str, Any]) -> list[str]:
    """The report's body, under the title and header ``harness.Run.write`` adds."""
    meta = results["meta"]
    versions = results["versions"]
    names = list(versions)
    head = " | ".join(f"{n} ({meta['labels'][n]})" for n in names)
    lines = [
        (
            "CPU times are steadier than wall times. 1-minute load average at the start and end of each world: "
            + "; ".join(f"{n} " + ", ".join(f"{a:.1f}-{b:.1f}" for a, b in versions[n]["load"]) for n in names)
            + "."
        ),
        "",
        (
            f"2 ranks, mesh (dp, tp) = (1, 2): rank 0 leads, rank 1 receives a copy. {meta['rounds']} round(s); every "
            "round starts one world per version (the order alternating) that measures everything below, its raw "
            "broadcast included; figures are medians over rounds. Batches: `input_ids` and `labels`, int64 (8, L), "
            "built once. See the docstring of `bench/step_cost.py` for how each figure is taken."
        ),
        "",
        "## Targets (issue 23)",
        "",
    ]
    per_version = {n: target_rows(versions[n]) for n in names}
    lines += harness.table(
        f"target | {head}",
        [
            (target, *(f"{per_version[n][i][1]}: {verdict(per_version[n][i][2])}" for n in names))
            for i, (target, _, _) in enumerate(per_version[names[0]])
        ],
    )
    lines += [
        "## 1. CPU per step: transfer thread and process, against a raw broadcast on a thread",
        "",
        "Per step, µs; ratio = loader / raw broadcast. The loader epoch uses `prefetch=1`, no compute.",
        "",
    ]
    lines += harness.table(
        "version | payload | role | transfer thread | raw broadcast thread | ratio | process CPU, loader | "
        "process CPU, raw | ratio",
        [
            (
                n,
                harness.size(nbytes),
                role,
                f"{p[f'loader_thread_cpu_{role}'] * 1e6:.0f}",
                f"{p[f'raw_thread_cpu_{role}'] * 1e6:.0f}",
                f"{p[f'thread_cpu_ratio_{role}']:.2f}",
                f"{p[f'loader_process_cpu_{role}'] * 1e6:.0f}",
                f"{p[f'raw_process_cpu_{role}'] * 1e6:.0f}",
                f"{p[f'process_cpu_ratio_{role}']:.2f}",
            )
            for n in names
            for nbytes, p in versions[n]["payloads"].items()
            for role in ROLES
        ],
    )
    lines += [
        "## 2. Time in `next()` for a ready batch, and 4b. exposed wait of a host-idle 20 ms step",
        "",
        "Default prefetch; the loop sleeps 20 ms per step. Time in `next()`: each rank's median (wall; CPU of the "
        "training thread in brackets) and mean; exposed wait: mean over steps of the slowest rank's time in "
        "`next()`, over 20 ms. Transfer-thread CPU per step in this epoch in the last column.",
        "",
    ]
    lines += harness.table(
        "version | payload | role | next() p50 (CPU) | next() mean | exposed wait / 20 ms | transfer thread CPU",
        [
            (
                n,
                harness.size(nbytes),
                role,
                f"{us(p[f'next_p50_{role}'])} ({us(p[f'next_cpu_p50_{role}'])})",
                us(p[f"next_mean_{role}"]),
                f"{p['exposed'] / STEP:.2%}",
                us(p[f"idle_thread_cpu_{role}"]),
            )
            for n in names
            for nbytes, p in versions[n]["loops"].items()
            for role in ROLES
        ],
    )
    lines += [
        "## 3. A Python-bound training loop (about 20 ms of small torch ops per step)",
        "",
        "Mean step time (slowest rank) fed from memory, from the loader (default prefetch) and from a plain "
        f"`DataLoader` with {WORKERS} worker processes on every rank (each item a fresh copy of the batch), the three "
        f"taking turns {BLOCK} steps at a time in one world; slowdown over the loop from memory (median over rounds of "
        "the per-round ratio). Work rounds per step (calibrated on rank 0 of each world): "
        + "; ".join(f"{n} {versions[n]['work_rounds']}" for n in names)
        + ".",
        "",
    ]
    lines += harness.table(
        "version | payload | from memory | loader | DataLoader, 2 workers | loader slowdown | DataLoader slowdown",
        [
            (
                n,
                harness.size(nbytes),
                *(f"{p[feed] * 1e3:.2f} ms" for feed in ("memory", "loader", "dataloader")),
                f"{p['loader_slowdown']:+.1%}",
                f"{p['dataloader_slowdown']:+.1%}",
            )
            for n in names
            for nbytes, p in versions[n]["loops"].items()
        ],
    )
    lines += [
        "## 4. Step time against a raw broadcast",
        "",
        "`prefetch=1`, no compute: the slowest rank's time between two batches, p50 (ms); the raw broadcast of the "
        "same tensor bytes on a thread likewise.",
        "",
    ]
    lines += harness.table(
        "version | payload | loader p=1 | raw broadcast | ratio",
        [
            (
                n,
                harness.size(nbytes),
                f"{p['loader_step'] * 1e3:.3f}",
                f"{p['raw_step'] * 1e3:.3f}",
                f"{p['step_ratio']:.2f}",
            )
            for n in names
            for nbytes, p in versions[n]["payloads"].items()
        ],
    )
    lines += [
        "## 5. This machine's floor",
        "",
        "In every world, each rank: *next() floor*, the median wall time of one `put` and one `get` on a "
        "`queue.SimpleQueue` right after a 20 ms sleep (the least a `next()` does); *work*, the median CPU time of "
        f"the same {COLD_ROUNDS} rounds of `python_work` (small torch ops) back to back and right after a "
        f"{IDLE * 1e6:.0f} µs sleep, the way a transfer thread's Python follows its wait in a collective.",
        "",
    ]
    floors = [(n, role, versions[n]["floor"]) for n in names for role in ROLES]
    lines += harness.table(
        "version | role | next() floor | work, back to back | work, after an idle | ratio",
        [
            (
                n,
                role,
                *(us(f[f"{what}_{role}"]) for what in ("next_floor", "work_hot", "work_after_idle")),
                f"{f[f'work_after_idle_{role}'] / f[f'work_hot_{role}']:.2f}",
            )
            for n, role, f in floors
        ],
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small version")
    parser.add_argument("--before", metavar="REV", help="also measure the package as of REV, side by side")
    parser.add_argument("--name", help="results file name (default step_cost, step_cost_quick with --quick)")
    args = parser.parse_args(argv)
    name = args.name or ("step_cost_quick" if args.quick else "step_cost")
    run = harness.Run("step_cost.py", argv)
    with tempfile.TemporaryDirectory() as tmp:
        s = dataclasses.replace(QUICK if args.quick else FULL, out=os.path.join(tmp, "records"))
        paths: dict[str, str | None] = {"after": None}
        labels = {"after": os.path.dirname(collective_loader.__file__)}  # the package the ranks inherit
        if args.before:
            os.makedirs(os.path.join(tmp, "before"))
            paths = {"before": harness.export(args.before, os.path.join(tmp, "before")), "after": None}
            labels = {"before": describe(args.before), **labels}

        def world(version: str, r: int) -> int:
            with first_on_path(paths[version]):
                return launch.run(
                    world_main, dataclasses.replace(s, version=version, round=r), 2, timeout=s.world_timeout
                )

        code = harness.worlds_in_rounds(list(paths), s.rounds, world)
        if code:
            return code
        records = harness.kept(s.out)[0]
    results = {
        "meta": run.meta(rounds=s.rounds, labels=labels, settings=dataclasses.asdict(s) | {"out": None}),
        "versions": {v: summarize(records, v) for v in paths},
        "records": records,
    }
    run.write(
        name, "Per-step cost of delivery to the training process (gloo, this machine)", results, markdown(results)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
