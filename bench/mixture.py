"""Data mixtures on a schedule (issues 38, 49): each window's shares of real tokens against the
schedule, what allocating every replica's rows costs per step, and a mixing leader's CPU per step.

    python bench/mixture.py            # bench/results/mixture.{json,md} (run time: bench/README.md)
    python bench/mixture.py --quick    # dp 1 and 2, fewer steps: bench/results/mixture_quick.* (git-ignored)

Three MDS datasets, one document per sample, lengths tenfold apart (*short* 20-60 tokens, *medium*
200-600, *long* 2000-6000), about 600k tokens each; token ``k`` of source ``s`` (its index in
``NAMES``) is ``(s + 1) * 2**24 + k``, so every trained token names its source.

1. **Window share error.** Gloo worlds of dp = 1, 2, 4 leaders, ``CollectiveLoader`` over a
   ``MixtureSource``: (a) ``A`` constant, (b) ``B`` from the middle step, (c) ``A`` ramped to ``B``
   over the middle half, and streaming's ``Stream(proportion=A)``. Per window of ``W`` steps, each
   source's share of real tokens against its weight integrated over the window, over all replicas
   (bound at constant weights: 1.5 rows of the window's) and per replica.
2. **Allocator time per step.** ``Allocation.allocate``, ``ROWS`` rows per replica, dp 8 to 1,024.
3. **Leader CPU per step.** One rank, ``num_workers=0``: a packing ``StreamingSource`` over each
   dataset, the ``MixtureSource`` over the three at ``A`` and one over *short* alone; the process's
   and the loader's transfer thread's CPU clocks per step, each variant once per round (rotated);
   ratios per round, then their median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

import numpy as np
from harness import Run, kept, table  # bench/harness.py: run as python bench/<name>.py
from mixture_ranks import (  # bench/: run as python bench/<name>.py
    CASES,
    CPU_ROWS,
    CPU_SEQ_LEN,
    CPU_SKIP,
    DATASET_TOKENS,
    DOCS_PER_BATCH,
    FULL,
    LENGTHS,
    NAMES,
    QUICK,
    ROWS,
    SEQ_LEN,
    VARIANTS,
    A,
    Settings,
    cpu_main,
    schedule_of,
    shares_main,
    write_data,
)

from collective_loader.testing import launch

SHOWN = ("short", "medium", "long")  # the order of the tables' cells
WINDOWS = (8, 32)  # window widths, in steps
ALLOC_DPS, ALLOC_SKIP, ALLOC_STEPS = (8, 64, 512, 1024), 3, 15
WEIGHTED = "mixture / (0.5 short + 0.3 medium + 0.2 long)"
RATIOS = (*(f"mixture / {n}" for n in SHOWN), WEIGHTED, "mixture of short / short")
CLOCKS = {"process": "per_step", "transfer": "transfer_per_step"}
BOUND = 2 - 1 / (len(NAMES) - 1)  # the allocator's bound at constant weights, rows over all replicas


# --- the parent -----------------------------------------------------------------------------------


def mean_weights(schedule: Any, p0: float, p1: float) -> np.ndarray:
    """Each source's weight (NAMES order) averaged over progress [p0, p1): the weights are linear
    between the phases' starts and ramps' ends, so trapezoids between those points are exact."""
    grid = sorted({p0, p1} | {p for ph in schedule.phases for p in (ph.start, ph.start + ph.ramp) if p0 < p < p1})
    total = np.zeros(len(NAMES))
    for a, b in zip(grid, grid[1:]):
        left, right = schedule.weights_at(a), schedule.weights_at(b - (b - a) * 1e-9)  # within [a, b)
        total += [(left.get(n, 0.0) + right.get(n, 0.0)) / 2 * (b - a) for n in NAMES]
    return total / (p1 - p0)


def window_errors(per_step: list, replicas: list, case: str, steps: int, dp: int, window: int) -> dict[str, Any]:
    """Over all replicas (``per_step``: tokens per step and source, summed over the replicas) per
    source: max and mean over the windows of |share - mean weight|, the max against the mean of the
    weights at the steps' starts, the share over the run; per replica (``replicas``: each one's
    ``per_step``), the largest error over replicas, windows and sources, in that replica's rows."""
    schedule, per = schedule_of(case, steps, dp), dp * ROWS * SEQ_LEN
    tokens = np.array(per_step, dtype=np.float64)  # (steps, sources)
    at_starts = np.array([[schedule.weights_at(k * per).get(n, 0.0) for n in NAMES] for k in range(len(tokens))])
    starts = range(len(tokens) - window + 1)
    targets = [mean_weights(schedule, t * per, (t + window) * per) for t in starts]

    def errors(counts: np.ndarray, against: list) -> np.ndarray:  # (windows, sources)
        got = np.array([counts[t : t + window].sum(axis=0) for t in starts])
        return np.abs(got / got.sum(axis=1, keepdims=True) - np.array(against))

    e = errors(tokens, targets)
    at = errors(tokens, [at_starts[t : t + window].mean(axis=0) for t in starts])
    worst_replica = max(float(errors(np.array(r, dtype=np.float64), targets).max()) for r in replicas)
    return {
        "windows": len(e),
        "rows_in_window": window * ROWS * dp,  # over all replicas
        "max": dict(zip(NAMES, e.max(axis=0).tolist())),
        "mean": dict(zip(NAMES, e.mean(axis=0).tolist())),
        "max_vs_step_starts": dict(zip(NAMES, at.max(axis=0).tolist())),
        "share": dict(zip(NAMES, (tokens.sum(axis=0) / tokens.sum()).tolist())),
        "replica_max_rows": worst_replica * window * ROWS,  # the worst replica's, in its own rows
    }


def window_table(records: list[dict], settings: Settings) -> tuple[list, dict[str, list], dict[str, int]]:
    """Each run's :func:`window_errors` per window width, its tokens per step over every replica, and
    the checks summed over the runs."""
    runs: dict[tuple[str, int], dict[int, list]] = {}
    for r in records:
        runs.setdefault((r["case"], r["dp"]), {})[r["rank"]] = r["per_step"]  # every rank a leader: rank = replica
    checks = {k: sum(r[k] for r in records) for k in ("mismatched", "not_full")}
    shares, tokens = [], {}
    for (case, dp), by_rank in sorted(runs.items(), key=lambda item: (list(CASES).index(item[0][0]), item[0][1])):
        replicas = [by_rank[rank] for rank in sorted(by_rank)]
        tokens[f"{case}, dp {dp}"] = per_step = np.sum(replicas, axis=0).tolist()
        for w in WINDOWS:
            errors = window_errors(per_step, replicas, case, settings.steps, dp, w)
            shares.append({"case": case, "dp": dp, "window": w, **errors})
    return shares, tokens, checks


def allocator_times() -> list[dict[str, Any]]:
    """``Allocation.allocate`` of one step (``ROWS`` rows per replica, ``A`` constant) at each dp
    of ``ALLOC_DPS``: per step after ``ALLOC_SKIP``, in ms."""
    from collective_loader.text import MixtureSchedule
    from collective_loader.text.mixture import Allocation

    out = []
    for dp in ALLOC_DPS:
        allocation, times = Allocation.start(MixtureSchedule.constant(A), dp), []
        for k in range(ALLOC_SKIP + ALLOC_STEPS):
            started = time.perf_counter()
            _, allocation = allocation.allocate(k * dp * ROWS * SEQ_LEN, ROWS)
            times.append(1e3 * (time.perf_counter() - started))
        out.append({"dp": dp, "ms": times[ALLOC_SKIP:], "median_ms": statistics.median(times[ALLOC_SKIP:])})
    return out


def summarize_cpu(records: list[dict]) -> dict[str, Any]:
    """Per variant and clock: the median and the mean per step of each round (ms) and their median
    over rounds; per round the ratios :data:`RATIOS`, and their medians over rounds."""
    rounds = sorted({r["round"] for r in records})
    at = {(r["variant"], r["round"]): r for r in records}
    v: dict[str, Any] = {}
    for variant in VARIANTS:
        mine = [at[(variant, k)] for k in rounds]
        v[variant] = {
            "pieces_per_step": statistics.fmean(sum((r["pieces"] for r in mine), [])),
            "steps": len(mine[0]["per_step"]),
        }
        for clock, key in CLOCKS.items():
            for stat, fn in (("median", statistics.median), ("mean", statistics.fmean)):
                v[variant][f"{clock}_{stat}_rounds_ms"] = per_round = [1e3 * fn(r[key]) for r in mine]
                v[variant][f"{clock}_{stat}_ms"] = statistics.median(per_round)
    ratios: dict[str, dict[str, list[float]]] = {}
    for clock_stat in (f"{c}_{s}" for c in CLOCKS for s in ("median", "mean")):
        key = f"{clock_stat}_rounds_ms"
        for k in range(len(rounds)):
            over = {f"mixture / {n}": v[n][key][k] for n in SHOWN}
            over[WEIGHTED] = sum(A[n] * v[n][key][k] for n in SHOWN)
            for name, value in over.items():
                ratios.setdefault(clock_stat, {}).setdefault(name, []).append(v["mixture"][key][k] / value)
            ratios[clock_stat].setdefault(RATIOS[-1], []).append(v["mixture of short"][key][k] / v["short"][key][k])
    medians = {cs: {name: statistics.median(x) for name, x in by.items()} for cs, by in ratios.items()}
    return {"variants": v, "ratios": ratios, "ratio_medians": medians}


def pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def cells(values: dict[str, float]) -> str:
    return " / ".join(pct(values[name]) for name in SHOWN)


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}"


def markdown(results: dict[str, Any], settings: Settings) -> list[str]:
    shares, cpu, means = results["shares"], results["cpu"], results["mean_lengths"]
    ratio = cpu["ratio_medians"]
    window_rows = []
    for m in shares:
        n, worst = m["rows_in_window"], max(m["max"].values()) * m["rows_in_window"]
        bound = "—" if m["case"] == "streaming" else f"{pct(BOUND / n)} ({BOUND:g} rows)"
        at_starts = "—" if m["case"] in ("a", "streaming") else cells(m["max_vs_step_starts"])
        mean = f"{max(m['mean'].values()) * n:.2f}"
        window_rows.append((CASES[m["case"]], m["dp"], m["window"], n, bound, cells(m["max"]), cells(m["mean"])))
        window_rows[-1] += (f"{worst:.2f}", mean, f"{m['replica_max_rows']:.2f}", at_starts, cells(m["share"]))
    held = all(max(m["max"].values()) * m["rows_in_window"] <= BOUND + 1e-9 for m in shares if m["case"] in ("a", "b"))
    expected = {n: A[n] * means[n] for n in NAMES}
    expected = {n: x / sum(expected.values()) for n, x in expected.items()}
    alloc_rows = [
        (
            a["dp"],
            a["dp"] * ROWS,
            f"{a['median_ms']:.2f} ({spread(a['ms'])})",
            f"{1e3 * a['median_ms'] / (a['dp'] * ROWS):.1f}",
        )
        for a in results["allocator"]
    ]
    stats = [f"{c}_{s}" for c in CLOCKS for s in ("median", "mean")]
    labels = {"mixture": "`MixtureSource` over the three at A", "mixture of short": "`MixtureSource` over short alone"}
    cpu_rows = []
    for x, v in cpu["variants"].items():
        figures = [f"{v[f'{cs}_ms']:.2f} ({spread(v[f'{cs}_rounds_ms'])})" for cs in stats]
        cpu_rows.append((labels.get(x, f"single source: {x}"), f"{v['pieces_per_step']:.1f}", *figures))
    ratio_rows = [(r, *(f"{ratio[cs][r]:.2f} ({spread(cpu['ratios'][cs][r])})" for cs in stats)) for r in RATIOS]
    lengths = ", ".join(f"*{n}* {LENGTHS[n][0]}-{LENGTHS[n][1]} tokens (mean {means[n]:.0f})" for n in SHOWN)
    return [
        f"`uptime` before: `{results['uptime_before']}`; after: `{results['uptime_after']}` (2 shared cores: the "
        "window errors do not depend on the load; CPU time moves with it, about ±20% between runs: compare the "
        f"ratios, measured back to back). Sources: {lengths}; about {DATASET_TOKENS // 1000}k tokens each.",
        "",
        "## Window share error",
        "",
        f"Gloo worlds of dp = {', '.join(map(str, settings.dps))} leaders, {ROWS} rows of {SEQ_LEN} tokens per replica "
        f"and step, {DOCS_PER_BATCH} documents per DataLoader batch, {settings.steps} steps; (b) switches at step "
        f"{settings.steps // 2}, (c) ramps from step {settings.steps // 4} to {settings.steps * 3 // 4}. Error = |a "
        "source's share of a window's real tokens − its weight integrated over the window|, cells short / medium / "
        f"long; in rows over all replicas: times the window's W x {ROWS} x dp rows (bound {BOUND:g} rows at constant "
        f"weights); per replica: the worst replica's, in its own W x {ROWS} rows; *max vs step starts*: against the "
        "weights at the window's step starts (what the allocator samples).",
        "",
        *table(
            "schedule | dp | W (steps) | rows in window, all replicas | bound, all replicas (share of tokens) | "
            "max error | mean error | worst, rows over all replicas | mean, rows over all replicas | worst per "
            "replica, rows | max vs step starts | share over the run",
            window_rows,
        ),
        f"Rows whose `source_id` named another source than their tokens: {results['checks']['mismatched']}; rows not "
        f"full: {results['checks']['not_full']}. Over all replicas (a) and (b) {'stay' if held else 'do NOT all stay'} "
        f"within {BOUND:g} rows in every window. Streaming's proportions count samples: its expected share of tokens "
        f"over an epoch at A is {cells(expected)}.",
        "",
        "## Allocator time per step",
        "",
        f"`Allocation.allocate` of one step, {ROWS} rows per replica, A, in the parent: the median over {ALLOC_STEPS} "
        f"steps after {ALLOC_SKIP} (range). Every leader computes every replica's rows each step; a trial that is not "
        "kept (the leaders' step agreement) costs no copy: the allocation is pure.",
        "",
        *table("dp | rows per step, all replicas | allocate: median ms per step | allocate: µs per row", alloc_rows),
        "## Leader CPU per step",
        "",
        f"One rank, `num_workers=0`, {CPU_ROWS} rows of {CPU_SEQ_LEN} tokens per step. *process*: "
        "`time.process_time()` (every thread); *transfer thread*: the CPU clock of the loader's thread that runs the "
        f"source (reads, packing, mixing). Per step after {CPU_SKIP} warm-up steps, over "
        f"{cpu['variants']['mixture']['steps']}; the median and the mean per round, then the median over "
        f"{settings.cpu_rounds} rounds (range). A long-document source reads on few steps: the mean carries the reads.",
        "",
        *table(
            "source(s) | pieces per step | process: median ms per step | process: mean | transfer thread: median | transfer thread: mean",
            cpu_rows,
        ),
        f"Ratios per round, then the median over rounds (range). **`{WEIGHTED}`**: the mixture's CPU per step over "
        "the CPU per step of the same mix of rows from single sources, each single source's weighted by its share of "
        "the mixture's rows; `mixture of short / short`: the mixture's own machinery over one dataset.",
        "",
        *table("ratio | process: median | process: mean | transfer thread: median | transfer thread: mean", ratio_rows),
        f"The mixture cost {ratio['process_mean'][WEIGHTED]:.2f}x (process, mean) and {ratio['transfer_mean'][WEIGHTED]:.2f}x "
        f"(transfer thread, mean) what its rows cost from single sources; over one dataset "
        f"{ratio['process_mean'][RATIOS[-1]]:.2f}x and {ratio['transfer_mean'][RATIOS[-1]]:.2f}x.",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="dp 1 and 2, 40 steps, 2 CPU rounds of 100 steps")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    run = Run("mixture.py", argv)
    uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()  # noqa: E731
    before, allocator = uptime(), allocator_times()  # part 2 first, in this process alone: no world runs yet
    print("allocator:", ", ".join(f"dp {a['dp']} {a['median_ms']:.2f} ms" for a in allocator), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        data, means = write_data(tmp)
        out = os.path.join(tmp, "records")
        for fn, size in [(cpu_main, 1), *((shares_main, dp) for dp in settings.dps)]:  # CPU first: a fresh process
            if code := launch.run(fn, (data, settings, out), size, timeout=600):
                print(f"the {fn.__name__} world of {size} failed with exit code {code}", file=sys.stderr)
                return code
            print(f"{fn.__name__}, {size} ranks: done", flush=True)
        records = [r for rank in kept(out).values() for r in rank]
    shares, tokens_per_step, checks = window_table([r for r in records if r["kind"] == "shares"], settings)
    results = {
        "meta": run.meta(settings=asdict(settings), seq_len=SEQ_LEN, rows=ROWS, documents_per_batch=DOCS_PER_BATCH,
                         cpu={"seq_len": CPU_SEQ_LEN, "rows": CPU_ROWS, "skip": CPU_SKIP},
                         allocator={"dps": ALLOC_DPS, "rows": ROWS, "skip": ALLOC_SKIP, "steps": ALLOC_STEPS}),
        "uptime_before": before,
        "uptime_after": uptime(),
        "names": NAMES,
        "mean_lengths": means,
        "checks": checks,
        "shares": shares,
        "tokens_per_step": tokens_per_step,  # per run: each step's real tokens per source (NAMES) over every replica
        "cpu": summarize_cpu([r for r in records if r["kind"] == "cpu"]),
        "allocator": allocator,
    }  # fmt: skip
    title = "Data mixtures on a schedule: window share error, allocator time and leader CPU"
    run.write("mixture_quick" if args.quick else "mixture", title, results, markdown(results, settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
