"""What every benchmark here shares, in one place: the machine and run header, rounds that
alternate the variants, a step timer with warm-up, the slowest rank per step, how records leave
the ranks, and the writer of ``bench/results/<name>.{json,md}``.

Scripts import it as ``harness`` (they run as ``python bench/<name>.py``, so ``bench/`` is first
on ``sys.path``; spawned ranks inherit that path).
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

import collective_loader

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results")
KIB, MIB = 1 << 10, 1 << 20
T = TypeVar("T")


# --- what one process used ---------------------------------------------------------------------


def cpu_seconds(children: bool = False) -> float:
    """User + system CPU seconds of this process (``children``: plus its waited-for children, e.g.
    DataLoader workers that have exited)."""
    used = [resource.getrusage(resource.RUSAGE_SELF)]
    if children:
        used.append(resource.getrusage(resource.RUSAGE_CHILDREN))
    return sum(r.ru_utime + r.ru_stime for r in used)


def rss_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (since :func:`reset_peak_rss`, if called)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def reset_peak_rss() -> None:
    """Make the peak resident memory this process's resident memory now (Linux's ``clear_refs``),
    so :func:`peak_rss_bytes` then gives the peak of what follows alone."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# --- in a world: timing and gathering ----------------------------------------------------------


@dataclass
class Steps:
    """One rank's timed steps: ``steps`` the time between two consecutive batches in hand (the
    loop's work included), ``waits`` the wall time inside ``next()`` alone, ``wait_cpu`` this
    thread's CPU time inside ``next()`` (its clock read outside the wall window)."""

    steps: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    wait_cpu: list[float] = field(default_factory=list)


def timed_steps(
    batches: Iterable[Any], skip: int, n: int | None = None, each: Callable[[int, Any], None] | None = None
) -> Steps:
    """Iterate ``batches`` to its end and time steps ``skip`` to ``skip + n`` (to the end when
    ``n`` is None): the first ``skip`` are warm-up. ``each(i, batch)`` runs after step ``i`` (every
    step, warm-up included), outside ``next()``: the training loop's work, or reading clocks."""
    out = Steps()
    stop = None if n is None else skip + n
    it = iter(batches)
    last = time.perf_counter()
    i = 0
    while True:
        start_cpu = time.thread_time()
        start = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return out
        now = time.perf_counter()
        now_cpu = time.thread_time()
        if skip <= i and (stop is None or i < stop):
            out.steps.append(now - last)
            out.waits.append(now - start)
            out.wait_cpu.append(now_cpu - start_cpu)
        if each is not None:
            each(i, batch)
        del batch  # the loader may reuse its buffer
        last = now
        i += 1


def gather(value: T) -> list[T]:
    """Every rank's ``value``, in rank order (a collective: every rank calls it)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def slowest(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per step, the largest value over the ranks (``per_rank``: one list of steps per rank)."""
    return [max(step) for step in zip(*per_rank)]


# --- rounds ---------------------------------------------------------------------------------------


def rotated(names: Sequence[T], r: int) -> list[T]:
    """The order of round ``r``: ``names`` rotated by ``r``, so each goes first in turn (two
    variants alternate)."""
    k = r % len(names)
    return [*names[k:], *names[:k]]


def in_rounds(runs: dict[str, Callable[[], T]], rounds: int, first: int = 0) -> dict[str, list[T]]:
    """Each run's result once per round, in one process; round ``r`` runs them in the order
    :func:`rotated` by ``first + r``, so a change of load falls on every variant alike."""
    out: dict[str, list[T]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in rotated(list(runs), first + r):
            out[name].append(runs[name]())
    return out


def worlds_in_rounds(cases: Sequence[Any], rounds: int, world: Callable[[Any, int], int]) -> int:
    """``world(case, r)`` (a world of its own: it starts the ranks and returns their exit code) for
    every case, ``rounds`` times, in the order :func:`rotated` by the round. The first failing
    world's exit code, else 0."""
    for r in range(rounds):
        for case in rotated(cases, r):
            code = world(case, r)
            if code:
                print(f"round {r + 1}: {case} world failed with exit code {code}", file=sys.stderr)
                return code
            print(f"round {r + 1}: {case} done", flush=True)
    return 0


# --- how records leave the ranks ------------------------------------------------------------------


def keep(path: str, record: Any) -> None:
    """Append ``record`` as one JSON line to this rank's file of ``path``: the one way results leave
    the ranks. No collective, so the records of a rank whose peers failed still come back."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(f"{path}.{rank}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def kept(path: str) -> dict[int, list[Any]]:
    """Every rank's records of ``path``, in the order kept, by rank (ranks that kept none are absent)."""
    out = {}
    for name in glob.glob(f"{glob.escape(path)}.*.jsonl"):
        rank = int(name[len(path) + 1 : -len(".jsonl")])
        with open(name) as f:
            out[rank] = [json.loads(line) for line in f]
    return dict(sorted(out.items()))


def runs_of(path: str) -> list[list[Any]]:
    """The records of ``path`` as runs: the ``i``-th run is every rank's ``i``-th record, in rank
    order (each world of a benchmark keeps one record per rank)."""
    by_rank = kept(path)
    return [list(run) for run in zip(*by_rank.values(), strict=True)]


# --- the parent: header and results -------------------------------------------------------------


def machine() -> str:
    """``Linux x86_64, 2 CPU cores (AMD EPYC ...), 24 GiB RAM``."""
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores ({model}), {ram:.0f} GiB RAM"


class Run:
    """One benchmark run, from the parent: made at the start (it notes the time and the load
    average), it writes the results with the header every benchmark records."""

    def __init__(self, script: str, argv: Sequence[str] | None = None) -> None:
        """``script``: the file under ``bench/`` as run, ``delivery.py`` (by python) or
        ``gpu_check.sh`` (by bash); ``argv``: its arguments (default: this process's)."""
        self.start = time.time()
        self.load_before = os.getloadavg()
        program = "bash" if script.endswith(".sh") else "python"
        self.command = " ".join([f"{program} bench/{script}", *(sys.argv[1:] if argv is None else argv)])

    def meta(self, **extra: Any) -> dict[str, Any]:
        """The header: date, machine, versions, the package the ranks import (the first
        ``collective_loader`` on ``sys.path``, which spawned ranks inherit), the command as run, its
        seconds so far and the load average before and now; then ``extra`` (settings, rounds)."""
        return {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": machine(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "package": os.path.dirname(collective_loader.__file__),
            "command": self.command,
            "seconds": time.time() - self.start,
            "load_before": " ".join(f"{x:.1f}" for x in self.load_before),
            "load_after": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            **extra,
        }

    def write(self, name: str, title: str, results: dict[str, Any], body: Sequence[str], out: str = RESULTS) -> str:
        """``out/<name>.json`` (``results`` with its ``meta``) and ``out/<name>.md``: ``# title``, the
        header line, then ``body``'s lines. Prints the markdown and returns its path."""
        meta = results["meta"]
        header = (
            f"{meta['date']}; {meta['machine']}; torch {meta['torch']}; Python {meta['python']}; "
            f"package `{meta['package']}`. "
            f"`{meta['command']}` ran {meta['seconds']:.0f} s; load average (1, 5, 15 min) {meta['load_before']} "
            f"before, {meta['load_after']} after (other processes share the cores)."
        )
        text = "\n".join([f"# {title}", "", header, "", *body]).rstrip("\n") + "\n"
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(results, f)
        path = os.path.join(out, f"{name}.md")
        with open(path, "w") as f:
            f.write(text)
        print(text + f"written to {path}")
        return path


def export(rev: str, into: str) -> str:
    """The package as of ``rev`` (``git archive``), unpacked under ``into``: put ``into`` first on
    ``sys.path`` (or ``PYTHONPATH``) to run a benchmark on that version."""
    archive = subprocess.run(["git", "-C", REPO, "archive", rev, "collective_loader"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    return into


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
    """``rev`` as ``<short hash> <date>``, to name a version in a report."""
    out = subprocess.run(
        ["git", "-C", REPO, "log", "-1", "--format=%h %ad", "--date=short", rev],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


# --- sources and sizes ----------------------------------------------------------------------------


class Repeat:
    """A source yielding the same batch ``steps`` times per epoch; set ``steps`` before ``iter``:
    delivery alone is measured, never loading."""

    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.batch = batch
        self.steps = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return itertools.repeat(self.batch, self.steps)


def size(nbytes: int) -> str:
    """``64 KiB``, ``16 MiB``."""
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def table(header: str, rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table's lines: ``header`` (its cells joined by `` | ``), its separator, one line
    per row, then a blank line. Raises ValueError on a row with another number of cells than the
    header."""
    names = header.split(" | ")
    lines = [f"| {header} |", "|" + "---|" * len(names)]
    for row in rows:
        if len(row) != len(names):
            raise ValueError(f"a row of {len(row)} cells under a header of {len(names)}: {row}")
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return [*lines, ""]


def rank_table(label: str, rows: dict[str, Sequence[object]]) -> list[str]:
    """A :func:`table` of one column per rank: a row per key of ``rows`` (its first cell, under
    ``label``), then that row's cells, rank 0 first."""
    ranks = len(next(iter(rows.values())))
    header = " | ".join([label, *(f"rank {i}" for i in range(ranks))])
    return table(header, [(name, *cells) for name, cells in rows.items()])
