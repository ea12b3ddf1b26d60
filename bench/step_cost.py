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
import dataclasses
import os
import statistics
import sys
import tempfile
from typing import Any

import harness  # bench/harness.py: run as python bench/<name>.py
from step_cost_world import BLOCK, COLD_ROUNDS, FULL, IDLE, LEADER, QUICK, ROLES, STEP, WORKERS, world_main

import collective_loader
from collective_loader.testing import launch

# the targets (issue 23)
CPU_LIMIT = 1.5  # transfer-thread CPU per step over the raw broadcast thread's
NEXT_LIMIT = 20e-6  # seconds inside next() for a ready batch
WAIT_LIMIT = 0.02  # exposed wait over the 20 ms step
STEP_LIMITS = {64 * harness.KIB: 1.5, harness.MIB: 1.15, 16 * harness.MIB: 1.15}  # loader p=1 step over raw broadcast


# --- the parent: versions, rounds, report ------------------------------------------------------


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
            labels = {"before": harness.describe(args.before), **labels}

        def world(version: str, r: int) -> int:
            with harness.first_on_path(paths[version]):
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
