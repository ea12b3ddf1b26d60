"""Data mixtures on a schedule (issue 38): how close each window's shares of real tokens come to
the schedule, over all replicas and per replica, what allocating every replica's rows costs per
step, and what mixing costs a leader's CPU per step.

    python bench/mixture.py            # bench/results/mixture.{json,md} (run time: bench/README.md)
    python bench/mixture.py --quick    # dp 1 and 2, fewer steps: bench/results/mixture_quick.* (git-ignored)

Three MDS datasets written here, one document per sample, whose lengths differ tenfold: *short*
(uniform 20-60 tokens), *medium* (200-600) and *long* (2000-6000), about 600k tokens each. Tokens
are numbered (uint32): token ``k`` of source ``s`` (its index in ``NAMES``) is
``(s + 1) * 2**24 + k``, so every trained token says which source it came from, with or without
``source_id``.

1. **Window share error.** Real gloo worlds of dp = 1, 2 and 4 ranks (every rank a leader), the
   real ``CollectiveLoader`` over a ``MixtureSource`` of the three sources, ``ROWS`` rows of
   ``SEQ_LEN`` tokens per replica and step (the same at every dp: the global batch grows with dp),
   ``unit="tokens"``. Three schedules, with the weights ``A = {short: 0.5, medium: 0.3, long: 0.2}``
   and ``B = {short: 0.2, medium: 0.3, long: 0.5}``: (a) ``A`` constant; (b) ``A``, then ``B`` from
   the run's middle step (a step change); (c) ``A`` ramped linearly to ``B`` from a quarter of the
   run to three quarters. Phase starts are in tokens over every replica, so they fall on the same
   step at every dp. Each rank counts, per step, the real tokens (``labels != -100``) of each
   source over its rows, the source read from the tokens themselves, and counts the rows whose
   ``source_id`` names another source (0 expected). For every window of ``W`` consecutive steps
   (``W`` = 8 and 32)::

       error(source) = | tokens(source) / tokens(all) - (1 / (P1 - P0)) * integral_P0^P1 w(source, p) dp |

   with ``P0``, ``P1`` the progress (tokens over every replica) at the window's first step and
   after its last. **Over all replicas** (the tokens summed over every replica): its max and its
   mean over the windows, per source, and in rows: the error times the window's
   ``W * ROWS * dp`` rows over all replicas (every row is full, so a row is ``SEQ_LEN`` real
   tokens and a share of rows is a share of tokens). The allocator's bound at constant weights is
   over all replicas: a ``ReplicaAllocator`` names each column's ``dp`` sources (row ``j`` of
   every replica) with one ``RowAllocator``, so each source's rows over all replicas in any window
   are within ``2 - 1/(n - 1)`` rows (n = 3: 1.5 rows) of its weight, over the window's
   ``W * ROWS * dp`` rows: the share error's bound shrinks as 1/dp. **Per replica**: the same
   error with each replica's own tokens (its ``W * ROWS`` rows) against the same weights, the
   worst over the replicas, windows and sources, in rows of that replica (a replica's deficit is
   property-tested, not proven, within 3 rows of its own target, so a window's error is expected
   within 6 at constant weights). The allocator samples the weights at each step's start, so against
   the integral a ramp adds up to half a step's change of the weights; "max vs step starts" is the
   error over all replicas against the mean of the weights at each step's start of the window
   instead. No bound is proven while the weights change (text/mixture.py).
   Beside it, what users do today for (a): one packing ``StreamingSource`` over
   ``streams=[Stream(local=..., proportion=w), ...]`` with ``A``'s weights, in the same worlds,
   the same rows per step, its tokens per source per window counted the same way. Streaming's
   proportions count samples, not tokens.
2. **Leader CPU per step.** A world of one rank (dp = 1) of its own, started before the others
   (no loader ran in it before), ``num_workers=0`` (the DataLoader's reading and the packing run
   in the leader's process, which is what is measured), ``CPU_ROWS`` rows of ``CPU_SEQ_LEN``
   tokens per step through the ``CollectiveLoader``: a single packing ``StreamingSource`` over
   each of the three datasets vs the ``MixtureSource`` over the three at ``A``, and a
   ``MixtureSource`` over the short dataset alone (weight 1: the mixture's machinery with one
   dataset) vs the single short source. Two clocks, read
   when each batch is in hand: ``time.process_time()`` (every thread of the process: the loader's
   transfer thread, streaming's own threads, gloo's) and the CPU clock of the loader's transfer
   thread (``time.pthread_getcpuclockid``; it runs the source: the reads, the packing, the
   mixture). CPU per step = a clock's difference between two consecutive batches, after
   ``CPU_SKIP`` warm-up steps; per variant and round the median and the mean over ``cpu_steps``
   steps, each variant once per round (``cpu_rounds`` rounds, the order rotated each round), then
   the median over rounds. The loop's only work is counting a batch's document pieces. Ratios,
   per round (the variants run back to back), then the median over rounds: the mixture's figure
   over a single source's, and over ``sum_s A[s] * single(s)`` (what the same mix of rows costs
   drawn from single sources). The median step of a source of long documents reads nothing
   (reads come ``DOCS_PER_BATCH`` documents at a time), so the mean is the figure that carries
   the reading.

3. **Allocator time per step.** In the parent, no world: ``ReplicaAllocator.allocate`` of one
   step of ``ROWS`` rows per replica, the three sources at ``A`` (constant), at dp 8, 64, 512 and
   1,024; ``time.perf_counter`` around each call, ``ALLOC_SKIP`` warm-up steps, then the median
   (and the range) over ``ALLOC_STEPS`` steps; beside it the same with the ``copy.deepcopy`` of
   the allocator that ``MixtureStream`` makes before each step (it keeps the trial only once every
   leader has its rows). Every leader computes every replica's rows, on the loader's transfer
   thread: this is a per-step cost on each leader, growing with dp.

Settings: ``FULL`` (dp 1, 2, 4; 160 steps; 5 CPU rounds of 400 steps) and ``QUICK`` (dp 1, 2; 40
steps; 2 rounds of 100).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from harness import Run, keep, kept, rotated, table  # bench/harness.py: run as python bench/<name>.py

from collective_loader.testing import launch

NAMES = ("long", "medium", "short")  # MixtureSource.names: sorted; a token's source is its index here
SHOWN = ("short", "medium", "long")  # the order of the tables' cells
LENGTHS = {"short": (20, 60), "medium": (200, 600), "long": (2000, 6000)}  # tokens, inclusive, uniform
DATASET_TOKENS = 600_000  # about, per source
A = {"short": 0.5, "medium": 0.3, "long": 0.2}
B = {"short": 0.2, "medium": 0.3, "long": 0.5}
SEQ_LEN, ROWS, DOCS_PER_BATCH = 128, 4, 8  # rows per replica and step; samples per DataLoader batch
WINDOWS = (8, 32)
CPU_SEQ_LEN, CPU_ROWS, CPU_SKIP = 256, 4, 30
ALLOC_DPS, ALLOC_SKIP, ALLOC_STEPS = (8, 64, 512, 1024), 3, 15  # part 3
CASES = ("a", "b", "c", "streaming")
VARIANTS = ("short", "medium", "long", "mixture", "mixture of short")  # part 2
RATIOS = (
    *(f"mixture / {n}" for n in ("short", "medium", "long")),
    "mixture / (0.5 short + 0.3 medium + 0.2 long)",
    "mixture of short / short",
)
CASE_TEXT = {
    "a": "(a) A constant",
    "b": "(b) A, B from the middle (step change)",
    "c": "(c) A ramped to B over the middle half",
    "streaming": "(a) streaming `Stream(proportion=)` at A",
}
SOURCE_SHIFT = 24


@dataclass(frozen=True)
class Settings:
    dps: tuple[int, ...]  # one world per dp
    steps: int  # per run of part 1
    cpu_steps: int  # timed steps per variant and round of part 2
    cpu_rounds: int


FULL = Settings(dps=(1, 2, 4), steps=160, cpu_steps=400, cpu_rounds=5)
QUICK = Settings(dps=(1, 2), steps=40, cpu_steps=100, cpu_rounds=2)


def write_data(root: str) -> tuple[dict[str, str], dict[str, float]]:
    """The three datasets under ``root``: their paths and their mean document lengths."""
    from collective_loader.testing.data import write_token_documents

    paths, means = {}, {}
    for s, name in enumerate(NAMES):
        low, high = LENGTHS[name]
        rng = np.random.default_rng(s)
        lengths = rng.integers(low, high + 1, size=DATASET_TOKENS * 2 // (low + high))
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        base = (s + 1) << SOURCE_SHIFT
        docs = [base + start + np.arange(n, dtype=np.int64) for start, n in zip(starts, lengths)]
        paths[name] = os.path.join(root, name)
        write_token_documents(paths[name], docs, "bytes", "uint32", shard_bytes=1 << 20)
        means[name] = float(lengths.mean())
    return paths, means


def schedule_of(case: str, steps: int, dp: int) -> Any:
    """Case ``case``'s schedule for a run of ``steps`` steps at ``dp`` (streaming's mix: ``A``)."""
    from collective_loader.text import MixtureSchedule, Phase

    per_step = dp * ROWS * SEQ_LEN  # the progress of one step: real tokens over every replica
    if case in ("a", "streaming"):
        return MixtureSchedule.constant(A)
    if case == "b":
        return MixtureSchedule((Phase(0, A), Phase(steps // 2 * per_step, B)))
    return MixtureSchedule((Phase(0, A), Phase(steps // 4 * per_step, B, ramp=steps // 2 * per_step)))


# --- on the ranks ---------------------------------------------------------------------------------


def counts_of(batch: Any) -> tuple[list[int], int, int]:
    """Real tokens per source (index into NAMES) over the batch's rows, the source read from each
    label token; the rows whose ``source_id`` does not name the one source of their tokens; the
    rows not full."""
    labels = batch["labels"].numpy()
    ids = batch["source_id"].numpy() if "source_id" in batch else None
    per_source = [0] * len(NAMES)
    mismatched = not_full = 0
    for r, row in enumerate(labels):
        real = row[row != -100]
        not_full += len(real) != SEQ_LEN
        sources = (real >> SOURCE_SHIFT) - 1
        for s, n in zip(*np.unique(sources, return_counts=True)):
            per_source[int(s)] += int(n)
        if ids is not None and set(sources.tolist()) != {int(ids[r])}:
            mismatched += 1
    return per_source, mismatched, not_full


def mixture_loader(mesh: Any, data: dict[str, str], schedule: Any, rows: int, seq_len: int) -> Any:
    from collective_loader import CollectiveLoader
    from collective_loader.streaming import MixtureSource
    from collective_loader.text import Packing, TokenColumn

    sources = {name: {"local": path, "shuffle": True, "shuffle_seed": 3} for name, path in data.items()}
    source = MixtureSource(
        mesh,
        sources,
        schedule,
        batch_size=rows,
        packing=Packing(seq_len),
        layout=TokenColumn(dtype="uint32"),
        documents_per_batch=DOCS_PER_BATCH,
        num_workers=0,
    )
    return CollectiveLoader(source, mesh, inputs=("input_ids", "position_ids"), labels=("labels", "source_id"))


def single_loader(mesh: Any, rows: int, seq_len: int, **dataset: Any) -> Any:
    """One packing StreamingSource, over one dataset (``local=``) or streaming's mix (``streams=``)."""
    from collective_loader import CollectiveLoader
    from collective_loader.streaming import StreamingSource
    from collective_loader.text import Packing, TokenColumn

    source = StreamingSource(
        mesh,
        batch_size=rows,
        packing=Packing(seq_len),
        layout=TokenColumn(dtype="uint32"),
        documents_per_batch=DOCS_PER_BATCH,
        num_workers=0,
        shuffle=True,
        shuffle_seed=3,
        **dataset,
    )
    return CollectiveLoader(source, mesh, inputs=("input_ids", "position_ids"), labels=("labels",))


def shares_main(args: tuple[dict[str, str], Settings, str]) -> int:
    """On every rank of a world of dp ranks (all leaders): each schedule's run, then streaming's mix,
    keeping this rank's per-step token counts."""
    import torch.distributed as dist
    from streaming import Stream
    from torch.distributed.device_mesh import init_device_mesh

    data, settings, out = args
    steps = settings.steps
    dp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
    for case in CASES:
        if case == "streaming":
            streams = [Stream(local=data[name], proportion=A[name]) for name in NAMES]
            loader = single_loader(mesh, ROWS, SEQ_LEN, streams=streams)
        else:
            loader = mixture_loader(mesh, data, schedule_of(case, steps, dp), ROWS, SEQ_LEN)
        per_step, mismatched, not_full = [], 0, 0
        for batch in loader:
            counts, bad, partial = counts_of(batch)
            per_step.append(counts)
            mismatched, not_full = mismatched + bad, not_full + partial
            if len(per_step) == steps:
                break
        loader.close()
        record = {
            "case": case,
            "dp": dp,
            "rank": dist.get_rank(),
            "per_step": per_step,
            "mismatched": mismatched,
            "not_full": not_full,
        }
        keep(out, {"kind": "shares", **record})
    return 0


def transfer_clock() -> int:
    """The CPU clock of this rank's transfer thread (the loader's, which runs the source: the
    DataLoader's reading with ``num_workers=0``, the packing, the mixture)."""
    import threading

    import torch.distributed as dist

    name = f"collective_loader-r{dist.get_rank()}"
    threads = [t for t in threading.enumerate() if t.name == name and t.is_alive()]
    assert len(threads) == 1 and threads[0].ident is not None, [t.name for t in threading.enumerate()]
    return time.pthread_getcpuclockid(threads[0].ident)


def cpu_main(args: tuple[dict[str, str], Settings, str]) -> int:
    """On the one rank of a world of its own (no loader ran there before): leader CPU per step,
    each single source and the mixture, once per round, rotated."""
    from torch.distributed.device_mesh import init_device_mesh

    from collective_loader.text import MixtureSchedule

    data, settings, out = args
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    for r in range(settings.cpu_rounds):
        for variant in rotated(VARIANTS, r):
            if variant == "mixture":
                loader = mixture_loader(mesh, data, MixtureSchedule.constant(A), CPU_ROWS, CPU_SEQ_LEN)
            elif variant == "mixture of short":
                short = MixtureSchedule.constant({"short": 1.0})
                loader = mixture_loader(mesh, {"short": data["short"]}, short, CPU_ROWS, CPU_SEQ_LEN)
            else:
                loader = single_loader(mesh, CPU_ROWS, CPU_SEQ_LEN, local=data[variant])
            clocks, thread_clocks, pieces = [], [], []
            transfer = None
            for batch in loader:
                clocks.append(time.process_time())
                transfer = transfer_clock() if transfer is None else transfer
                thread_clocks.append(time.clock_gettime(transfer))
                pieces.append(int((batch["position_ids"] == 0).sum()))  # the loop's only work, in every variant
                if len(clocks) == CPU_SKIP + settings.cpu_steps + 1:
                    break
                del batch  # the loader may reuse its buffer
            loader.close()
            record = {
                "variant": variant,
                "round": r,
                "per_step": np.diff(clocks[CPU_SKIP:]).tolist(),
                "transfer_per_step": np.diff(thread_clocks[CPU_SKIP:]).tolist(),
                "pieces": pieces[CPU_SKIP + 1 :],
            }
            keep(out, {"kind": "cpu", **record})
    return 0


# --- the parent -----------------------------------------------------------------------------------


def mean_weights(schedule: Any, p0: float, p1: float) -> dict[str, float]:
    """Each source's weight averaged over progress [p0, p1): the weights are linear between the
    phases' starts and ramps' ends, so trapezoids between those points are exact."""
    points = {p0, p1} | {p for ph in schedule.phases for p in (ph.start, ph.start + ph.ramp) if p0 < p < p1}
    grid = sorted(points)
    total = dict.fromkeys(NAMES, 0.0)
    for a, b in zip(grid, grid[1:]):
        left, right = schedule.weights_at(a), schedule.weights_at(b - (b - a) * 1e-9)  # within [a, b)
        for name in NAMES:
            total[name] += (left.get(name, 0.0) + right.get(name, 0.0)) / 2 * (b - a)
    return {name: v / (p1 - p0) for name, v in total.items()}


def window_errors(
    per_step: list[list[int]], replicas: list[list[list[int]]], case: str, steps: int, dp: int, window: int
) -> dict[str, Any]:
    """Over all replicas (``per_step``: each step's tokens per source summed over the replicas),
    per source: the max and the mean over every window of |share - mean weight|, the max against
    the mean of the weights at the window's step starts, and the share over the run; per replica
    (``replicas``: each replica's own ``per_step``): the largest error over the replicas, windows
    and sources, in that replica's rows."""
    schedule = schedule_of(case, steps, dp)
    per = dp * ROWS * SEQ_LEN
    tokens = np.array(per_step, dtype=np.float64)  # (steps, sources), over every replica
    at_starts = np.array([[schedule.weights_at(k * per).get(n, 0.0) for n in NAMES] for k in range(len(tokens))])
    starts = range(len(tokens) - window + 1)
    targets = []
    for t in starts:
        target = mean_weights(schedule, t * per, (t + window) * per)
        targets.append(np.array([target[n] for n in NAMES]))

    def errors_of(counts: np.ndarray) -> np.ndarray:
        """(windows, sources): |share - mean weight| of each window of ``counts`` (steps, sources)."""
        out = []
        for t, target in zip(starts, targets):
            got = counts[t : t + window].sum(axis=0)
            out.append(np.abs(got / got.sum() - target))
        return np.array(out)

    e = errors_of(tokens)
    v = []
    for t in starts:
        got = tokens[t : t + window].sum(axis=0)
        v.append(np.abs(got / got.sum() - at_starts[t : t + window].mean(axis=0)))
    per_replica = [errors_of(np.array(r, dtype=np.float64)) for r in replicas]
    worst_replica = [float(r.max()) for r in per_replica]
    return {
        "windows": len(e),
        "rows_in_window": window * ROWS * dp,  # over all replicas
        "max": dict(zip(NAMES, e.max(axis=0).tolist())),
        "mean": dict(zip(NAMES, e.mean(axis=0).tolist())),
        "max_vs_step_starts": dict(zip(NAMES, np.array(v).max(axis=0).tolist())),
        "share": dict(zip(NAMES, (tokens.sum(axis=0) / tokens.sum()).tolist())),
        "replica_max": worst_replica,  # per replica: its largest error over windows and sources (share)
        "replica_max_rows": max(worst_replica) * window * ROWS,  # the worst replica's, in its own rows
    }


def allocator_times() -> list[dict[str, Any]]:
    """Part 3: ``ReplicaAllocator.allocate`` of one step (``ROWS`` rows per replica, ``A``
    constant) at each dp of ``ALLOC_DPS``, alone and with the deep copy ``MixtureStream`` makes
    before each step: the median and the range over ``ALLOC_STEPS`` steps after ``ALLOC_SKIP``."""
    import copy

    from collective_loader.text import MixtureSchedule
    from collective_loader.text.mixture import ReplicaAllocator

    out = []
    for dp in ALLOC_DPS:
        per_step = dp * ROWS * SEQ_LEN
        allocator = ReplicaAllocator(MixtureSchedule.constant(A), dp)
        alone, copied = [], []
        for k in range(ALLOC_SKIP + ALLOC_STEPS):
            progress = 2 * k * per_step
            started = time.perf_counter()
            allocator.allocate(progress, ROWS)
            middle = time.perf_counter()
            trial = copy.deepcopy(allocator)  # as MixtureStream._allocate: copy, then allocate the copy
            trial.allocate(progress + per_step, ROWS)
            ended = time.perf_counter()
            allocator = trial
            if k >= ALLOC_SKIP:
                alone.append(middle - started)
                copied.append(ended - middle)
        out.append(
            {
                "dp": dp,
                "alone_ms": [1e3 * x for x in alone],
                "with_copy_ms": [1e3 * x for x in copied],
                "alone_median_ms": 1e3 * statistics.median(alone),
                "with_copy_median_ms": 1e3 * statistics.median(copied),
            }
        )
    return out


def bound_rows() -> float:
    """The allocator's bound at constant weights: rows over all replicas per window."""
    return 2 - 1 / (len(NAMES) - 1)


def pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def cells(values: dict[str, float], fmt: Callable[[float], str] = pct) -> str:
    return " / ".join(fmt(values[name]) for name in SHOWN)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


CLOCKS = {"process": "per_step", "transfer": "transfer_per_step"}


def summarize_cpu(records: list[dict]) -> dict[str, Any]:
    """Per variant and clock: the median and the mean per step of each round (ms), and their
    medians over rounds; per round, the ratios :data:`RATIOS` (the mixture's to each single's and
    to the singles weighted by ``A``; the mixture of short alone to the single short), and their
    medians over rounds."""
    rounds = sorted({r["round"] for r in records})
    at = {(r["variant"], r["round"]): r for r in records}
    out: dict[str, Any] = {"variants": {}, "ratios": {}}
    for variant in VARIANTS:
        mine = [at[(variant, k)] for k in rounds]
        entry: dict[str, Any] = {"pieces_per_step": statistics.fmean(p for r in mine for p in r["pieces"])}
        entry["steps"] = len(mine[0]["per_step"])
        for clock, key in CLOCKS.items():
            for stat, fn in (("median", statistics.median), ("mean", statistics.fmean)):
                per_round = [1e3 * fn(r[key]) for r in mine]
                entry[f"{clock}_{stat}_rounds_ms"] = per_round
                entry[f"{clock}_{stat}_ms"] = statistics.median(per_round)
        out["variants"][variant] = entry
    v = out["variants"]
    for clock in CLOCKS:
        for stat in ("median", "mean"):
            key = f"{clock}_{stat}_rounds_ms"
            for k in range(len(rounds)):
                weighted = sum(A[n] * v[n][key][k] for n in SHOWN)
                pairs = [*((f"mixture / {n}", "mixture", v[n][key][k]) for n in SHOWN)]
                pairs += [(RATIOS[-2], "mixture", weighted), (RATIOS[-1], "mixture of short", v["short"][key][k])]
                for name, numerator, value in pairs:
                    ratios = out["ratios"].setdefault(f"{clock}_{stat}", {}).setdefault(name, [])
                    ratios.append(v[numerator][key][k] / value)
    out["ratio_medians"] = {
        clock_stat: {against: statistics.median(x) for against, x in by.items()}
        for clock_stat, by in out["ratios"].items()
    }
    return out


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}"


def measured(results: dict[str, Any], settings: Settings) -> list[str]:
    """What the window table shows against dp, from the figures: each schedule's worst window
    over all replicas and per replica, at every dp, and where 8-step windows come within 1%."""
    at = {(m["case"], m["dp"], m["window"]): m for m in results["shares"]}
    short = WINDOWS[0]
    lines = []
    for case in ("a", "b", "c"):
        parts = []
        for dp in settings.dps:
            m = at[(case, dp, short)]
            worst = max(m["max"].values())
            parts.append(
                f"dp {dp}: {pct(worst)} ({worst * m['rows_in_window']:.2f} of {m['rows_in_window']} rows; worst "
                f"replica {m['replica_max_rows']:.2f} of its {short * ROWS} rows)"
            )
        lines.append(f"{CASE_TEXT[case]}, worst {short}-step window over all replicas: {'; '.join(parts)}.")
    under = {
        case: [dp for dp in settings.dps if max(at[(case, dp, short)]["max"].values()) < 0.01]
        for case in ("a", "b", "c")
    }
    reached = "; ".join(
        f"{case}: " + (f"at dp {', '.join(map(str, dps))}" if dps else "at none of these dp")
        for case, dps in under.items()
    )
    needed = -(-200 // (short * ROWS))  # dp at which the window holds 200 rows over all replicas
    held = all(
        max(m["max"].values()) * m["rows_in_window"] <= bound_rows() + 1e-9
        for m in results["shares"]
        if m["case"] in ("a", "b")
    )
    return [
        f"Measured (the mixture's figures now change with dp): over all replicas, (a) and (b) "
        f"{'stay within' if held else 'do NOT all stay within'} the bound of {bound_rows():g} rows in every "
        "window at every dp, while the window's rows over all replicas grow with dp. " + " ".join(lines),
        "",
        f"Within 1% over every {short}-step window, over all replicas, per schedule: {reached}. The bound "
        f"guarantees it from 200 rows over all replicas in the window: at {ROWS} rows per "
        f"replica, dp >= {needed} for {short} steps ({short * ROWS * max(settings.dps)} rows at dp "
        f"{max(settings.dps)} here).",
    ]


def markdown(results: dict[str, Any], settings: Settings) -> list[str]:
    rows = []
    for m in results["shares"]:
        streaming = m["case"] == "streaming"
        n = m["rows_in_window"]
        rows.append(
            (
                CASE_TEXT[m["case"]],
                m["dp"],
                m["window"],
                n,
                "—" if streaming else f"{pct(bound_rows() / n)} ({bound_rows():g} rows)",
                cells(m["max"]),
                cells(m["mean"]),
                f"{max(m['max'].values()) * n:.2f}",
                f"{max(m['mean'].values()) * n:.2f}",
                f"{m['replica_max_rows']:.2f}",
                "—" if m["case"] == "a" or streaming else cells(m["max_vs_step_starts"]),
                cells(m["share"]),
            )
        )
    alloc_rows = [
        (
            a["dp"],
            a["dp"] * ROWS,
            f"{a['alone_median_ms']:.2f} ({spread(a['alone_ms'])})",
            f"{a['with_copy_median_ms']:.2f} ({spread(a['with_copy_ms'])})",
            f"{1e3 * a['alone_median_ms'] / (a['dp'] * ROWS):.1f}",
        )
        for a in results["allocator"]
    ]
    means = results["mean_lengths"]
    expected = {n: A[n] * means[n] for n in NAMES}
    expected = {n: v / sum(expected.values()) for n, v in expected.items()}
    checks = results["checks"]
    cpu = results["cpu"]
    cpu_rows = []
    for variant in VARIANTS:
        c = cpu["variants"][variant]
        label = {
            "mixture": "`MixtureSource` over the three at A",
            "mixture of short": "`MixtureSource` over short alone (weight 1)",
        }.get(variant, f"single source: {variant}")
        cpu_rows.append(
            (
                label,
                f"{c['pieces_per_step']:.1f}",
                *(
                    f"{c[f'{clock}_{stat}_ms']:.2f} ({spread(c[f'{clock}_{stat}_rounds_ms'])})"
                    for clock in CLOCKS
                    for stat in ("median", "mean")
                ),
            )
        )
    ratio_rows = []
    medians = cpu["ratio_medians"]
    own = {f"{clock}_median": medians[f"{clock}_median"][RATIOS[-1]] for clock in CLOCKS}
    for against in RATIOS:
        ratio_rows.append(
            (
                against,
                *(
                    f"{medians[f'{clock}_{stat}'][against]:.2f} ({spread(cpu['ratios'][f'{clock}_{stat}'][against])})"
                    for clock in CLOCKS
                    for stat in ("median", "mean")
                ),
            )
        )
    lengths = ", ".join(f"*{n}* {LENGTHS[n][0]}-{LENGTHS[n][1]} tokens (mean {means[n]:.0f})" for n in SHOWN)
    windows = ", ".join(f"{settings.steps - w + 1} windows of {w}" for w in WINDOWS)
    return [
        f"Machine load: `uptime` before: `{results['uptime_before']}`; after: `{results['uptime_after']}`. "
        "2 cores, shared with other jobs; the window errors do not depend on the load; the CPU figures are "
        "CPU time, not wall time, but still move with the load (about ±20% between runs here): compare the "
        "ratios, measured back to back.",
        "",
        f"Sources: three MDS datasets written by the script, one document per sample, numbered uint32 tokens "
        f"(each token names its source): {lengths}; about {DATASET_TOKENS // 1000}k tokens each.",
        "",
        "## Window share error",
        "",
        f"Real gloo worlds of dp = {', '.join(map(str, settings.dps))} ranks (every rank a leader), the "
        f"`CollectiveLoader` over a `MixtureSource` of the three sources: {ROWS} rows of {SEQ_LEN} tokens per "
        f"replica and step, {DOCS_PER_BATCH} documents per DataLoader batch, {settings.steps} steps per run, "
        '`unit="tokens"`. A = {short: 0.5, medium: 0.3, long: 0.2}, B = {short: 0.2, medium: 0.3, long: 0.5}; '
        f"(b) switches at step {settings.steps // 2}, (c) ramps from step {settings.steps // 4} to "
        f"{settings.steps * 3 // 4} (phase starts in tokens over every replica: the same steps at every dp). "
        f"Per window of W consecutive steps ({windows}), error = |source's share of the window's real tokens "
        "(`labels != -100`) − its scheduled weight averaged (integrated) over the window's progress|. "
        "**Over all replicas** (every replica's tokens summed): max and mean over the windows, cells short / "
        f"medium / long; *rows in window*: W x {ROWS} x dp, the window's rows over all replicas; *worst, rows "
        "over all replicas*: the largest error x those rows; *mean, rows*: the largest of the per-source mean "
        "errors x those rows. Bound: the allocator's at constant weights, over all replicas (a "
        "`ReplicaAllocator` names row j of every replica with one `RowAllocator`): 2 − 1/(n − 1) = 1.5 rows "
        "(n = 3) over the window's rows over all replicas, so it shrinks as 1/dp; not proven while weights "
        "change. **Per replica**: *worst per replica, rows*: the same error with each replica's own tokens (its "
        f"W x {ROWS} rows) against the same weights, the largest over replicas, windows and sources, in that "
        "replica's rows (each replica's deficit is property-tested, not proven, within 3 rows of its own "
        "target, so a window's error is expected within 6 at constant weights). *Max vs step starts* (over "
        "all replicas): against the mean of the weights at the window's step starts, which is what the "
        "allocator samples (a ramp moves within a step). *Share over the run*: of all real tokens of the "
        f"{settings.steps} steps. The streaming rows: one packing `StreamingSource` over "
        "`streams=[Stream(local=..., proportion=A[s]), ...]` in the same worlds, the same rows per step, "
        "counted the same way.",
        "",
        *table(
            "schedule | dp | W (steps) | rows in window, all replicas | bound, all replicas (share of tokens) | "
            "max error | mean error | worst, rows over all replicas | mean, rows over all replicas | worst per "
            "replica, rows | max vs step starts | share over the run",
            rows,
        ),
        f"Checks over every run: rows whose `source_id` named another source than their tokens: "
        f"{checks['mismatched']}; rows not full (fewer than {SEQ_LEN} real tokens): {checks['not_full']}.",
        "",
        *measured(results, settings),
        "",
        "Streaming's proportions count samples: "
        "at A's weights and these mean lengths its expected share of tokens over an epoch is "
        f"{cells(expected)} (short / medium / long), and its epoch of "
        f"{results['streaming_epoch_samples']} samples repeats each long document about "
        f"{results['long_repeats']:.0f} times; the runs above see the first steps of that epoch, in the order "
        "its shuffle (`py1e`, by shard) deals them.",
        "",
        "## Allocator time per step",
        "",
        f"`ReplicaAllocator.allocate` of one step, {ROWS} rows per replica, the three sources at A (constant), "
        "in the bench's parent process before any world starts: `time.perf_counter` around each call, "
        f"{ALLOC_SKIP} warm-up steps, then the median over {ALLOC_STEPS} steps (range in brackets); *with the "
        "copy*: `copy.deepcopy` of the allocator and `allocate` on the copy, as `MixtureStream` does before "
        "each step (it keeps the trial once every leader has its rows). Every leader computes every replica's "
        "rows on the loader's transfer thread, so this is a per-step cost on each leader, at every dp "
        "below.",
        "",
        *table(
            "dp | rows per step, all replicas | allocate: median ms per step | with the copy: median ms | "
            "allocate: µs per row",
            alloc_rows,
        ),
        "## Leader CPU per step",
        "",
        f"One rank (dp = 1), `num_workers=0` (reading, collation and packing run in the leader's process), "
        f"{CPU_ROWS} rows of {CPU_SEQ_LEN} tokens per step through the `CollectiveLoader`, {DOCS_PER_BATCH} "
        "documents per DataLoader batch, each source shuffled. Two clocks, read when each batch is in hand: "
        "*process*, `time.process_time()` (every thread: the loader's transfer thread, streaming's own "
        "threads, which prepare each sample's shard ahead of the reads, gloo's); *transfer thread*, the "
        "loader's thread that runs the source (the DataLoader's reads with no workers, the packing, the "
        "mixture), from its own CPU clock. CPU per step: the difference between two consecutive batches, "
        f"after {CPU_SKIP} warm-up steps, over {cpu['variants']['mixture']['steps']} steps; the loop's only "
        f"work is counting a batch's document pieces. Each variant once per round, {settings.cpu_rounds} "
        "rounds in rotated order; the median and the mean over the steps of each round, then the median over "
        "rounds (the range over rounds in brackets). *Pieces per step*: document pieces in a step's rows (a "
        f"document cut over rows counts once per row). Reads come {DOCS_PER_BATCH} documents at a time per "
        "source, so the median step of a source of long documents reads nothing: the mean carries the reads.",
        "",
        *table(
            "source(s) | pieces per step | process: median ms per step | process: mean | transfer thread: median "
            "| transfer thread: mean",
            cpu_rows,
        ),
        "Ratios, per round (the variants ran back to back), median over rounds (range): the mixture against "
        "each single source, and against the single sources weighted by A (what the same mix of rows costs "
        "when each source's rows come from a single packing `StreamingSource`); a `MixtureSource` over the "
        "short source alone against the single short source (the mixture's own machinery: one row per pull, "
        "the allocator, the batch built from rows, with one dataset).",
        "",
        *table(
            "ratio | process: median | process: mean | transfer thread: median | transfer thread: mean",
            ratio_rows,
        ),
        "The mixture's own machinery (one row per pull, the rows queued ahead, the allocator, the batch built "
        "from rows), measured as the mixture of one source against the single source, costs "
        f"{own['process_median']:.2f}x (process) and {own['transfer_median']:.2f}x (transfer thread) the single "
        "source's CPU; the rest of what the mixture costs above the weighted single sources comes with "
        "drawing each step's rows from three datasets at once; this script does not attribute it further. "
        "The gap between the two clocks is mostly streaming's own threads, which do per-sample work: it grows "
        "with the documents per step.",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="dp 1 and 2, 40 steps, 2 CPU rounds of 100 steps: about a minute"
    )
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    name = "mixture_quick" if args.quick else "mixture"
    run = Run("mixture.py", argv)
    before = uptime()
    allocator = allocator_times()  # part 3 first, in this process alone: no world runs yet
    print(
        "allocator: " + ", ".join(f"dp {a['dp']} {a['alone_median_ms']:.2f} ms" for a in allocator) + " per step",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        data, means = write_data(tmp)
        print(f"datasets written in {time.perf_counter() - started:.0f} s", flush=True)
        out = os.path.join(tmp, "records")
        worlds = [("CPU, dp = 1", cpu_main, 1), *((f"shares, dp = {dp}", shares_main, dp) for dp in settings.dps)]
        for what, fn, size in worlds:
            code = launch.run(fn, (data, settings, out), size, timeout=600)
            if code:
                print(f"the {what} world failed with exit code {code}", file=sys.stderr)
                return code
            print(f"{what} done at {time.perf_counter() - started:.0f} s", flush=True)
        records = [r for rank in kept(out).values() for r in rank]
    summed: dict[tuple[str, int], np.ndarray] = {}
    by_replica: dict[tuple[str, int], dict[int, list[list[int]]]] = {}
    checks = {"mismatched": 0, "not_full": 0}
    for record in (r for r in records if r["kind"] == "shares"):
        key = (record["case"], record["dp"])
        counts = np.array(record["per_step"], dtype=np.int64)
        summed[key] = summed.get(key, 0) + counts
        by_replica.setdefault(key, {})[record["rank"]] = record["per_step"]  # every rank a leader: rank = replica
        checks["mismatched"] += record["mismatched"]
        checks["not_full"] += record["not_full"]
    shares, tokens_per_step = [], {}
    for case in CASES:
        for dp in settings.dps:
            per_step = summed[(case, dp)].tolist()
            replicas = [by_replica[(case, dp)][r] for r in sorted(by_replica[(case, dp)])]
            assert len(replicas) == dp, (case, dp, len(replicas))
            tokens_per_step[f"{case}, dp {dp}"] = per_step
            for window in WINDOWS:
                errors = window_errors(per_step, replicas, case, settings.steps, dp, window)
                shares.append({"case": case, "dp": dp, "window": window, **errors})
    samples = {n: DATASET_TOKENS * 2 // sum(LENGTHS[n]) for n in NAMES}
    epoch = sum(samples.values())  # streaming's epoch with proportions and no epoch_size: every stream's samples
    results = {
        "meta": run.meta(
            settings=asdict(settings),
            seq_len=SEQ_LEN,
            rows=ROWS,
            documents_per_batch=DOCS_PER_BATCH,
            cpu={"seq_len": CPU_SEQ_LEN, "rows": CPU_ROWS, "skip": CPU_SKIP},
            allocator={"dps": ALLOC_DPS, "rows": ROWS, "skip": ALLOC_SKIP, "steps": ALLOC_STEPS},
        ),
        "uptime_before": before,
        "uptime_after": uptime(),
        "names": NAMES,
        "mean_lengths": means,
        "checks": checks,
        "shares": shares,
        "tokens_per_step": tokens_per_step,  # per run: each step's real tokens per source (NAMES) over every replica
        "streaming_epoch_samples": epoch,
        "long_repeats": A["long"] * epoch / samples["long"],
        "cpu": summarize_cpu([r for r in records if r["kind"] == "cpu"]),
        "allocator": allocator,
    }
    title = "Data mixtures on a schedule: window share error, allocator time and leader CPU"
    run.write(name, title, results, markdown(results, settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
