"""The leaders' per-step collectives, and what creating a gloo group costs, in real gloo worlds.

    python bench/leader_collectives.py            # bench/results/leader_collectives.{json,md}
    python bench/leader_collectives.py --quick    # 2, 4 and 8 leaders: results/leader_collectives_quick.*

A world of W processes on this machine plays the W leaders of a dp = W run (the other ranks of a
replica take no part in these collectives). In each world, every rank, with the library's own code:

* **agreement**: ``agreement.agree_outcome`` over the leaders' group, the 24-byte all-reduce every
  leader runs each step;
* **gather** (balancing, ``Packing(balance=Balance())``): ``LeaderGroup.gather`` of this leader's
  piece lengths, ``ROWS`` rows of ``PIECES`` pieces each, as ``streaming/balanced_rows.py`` gathers them;
* **exchange** (balancing): ``LeaderGroup.exchange`` of token ids (int64), ``ROWS`` rows of
  ``SEQ + 1`` tokens per leader, all of them moving, spread evenly over the leaders: the most a
  step's all-to-all can carry;
* **group creation**: ``dist.new_group`` of all W ranks (each a member: gloo connects every pair),
  on rank 0 of the W - 1 others (a non-member's call), and of all W again with
  ``TORCH_GLOO_LAZY_INIT=1`` (pairs connect on first use), then that group's first agreement;
* **blocks** (``Balance(replicas=k)``, for each k of ``BLOCKS`` that divides W and is less): every
  rank builds the blocks' groups as ``StreamingSource`` does (``source.balance_group``), then the
  gather and the exchange above among a block's k leaders, every block at once and block 0 alone
  (the others wait at a barrier: on a cluster each block runs on cores of its own, which this
  machine's 2 cores cannot give W processes at once).

Each op runs ``WARMUP`` times, then ``REPS`` times between two barriers; its time is the slowest
rank's mean. A line t = a + b (W - 1) is fitted per op (least squares); the dp at which it reaches
a 1 s and a 5 s step is where it stops hiding behind the step: the transfer thread runs it once per
step, ``prefetch`` steps ahead, so it must take less than a step on average. With blocks of k, a
step costs the agreement over every leader (the fit at dp) plus a block's gather and exchange,
taken from the world of k leaders (a block's collectives involve its k leaders alone).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from harness import Run, keep, kept, table  # run as python bench/<name>.py

from collective_loader.testing import launch

WORLDS = (2, 4, 8, 16, 32)
BLOCKS = (4, 8, 16)  # Balance(replicas=k) measured inside the larger worlds; k = 32 is the world of 32
MODEL_BLOCKS = (8, 32)  # the block sizes the model table states
ROWS, SEQ, PIECES = 4, 4096, 8  # per leader and step: 4 rows of 4096 tokens, 8 documents a row
WARMUP, REPS = 5, 40
STEPS = (1.0, 5.0)  # step times to hide behind (seconds)
TIMEOUT = 600.0


def rank_main(out: str) -> int:
    """One leader: time each op, keep a record."""
    import torch
    import torch.distributed as dist

    from collective_loader.delivery.agreement import agree_outcome
    from collective_loader.delivery.leader_group import LeaderGroup
    from collective_loader.plan.wire import Kind
    from collective_loader.streaming.source import balance_group
    from collective_loader.text.balance import Balance

    rank, world = dist.get_rank(), dist.get_world_size()
    record: dict[str, Any] = {"rank": rank, "world": world}
    start = time.perf_counter()
    group = dist.new_group(list(range(world)), backend="gloo")
    record["new_group_member"] = time.perf_counter() - start
    if world > 2:
        start = time.perf_counter()
        dist.new_group(list(range(1, world)), backend="gloo")
        record["new_group_other"] = time.perf_counter() - start
    # the same group with gloo's pairs connected on first use (torch reads the variable when it
    # creates a group's device), then its first collective, which connects the pairs it uses
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    dist.barrier()
    start = time.perf_counter()
    lazy = dist.new_group(list(range(world)), backend="gloo")
    record["new_group_lazy"] = time.perf_counter() - start
    start = time.perf_counter()
    agree_outcome(lazy, Kind.DATA, "")
    record["lazy_first_agreement"] = time.perf_counter() - start
    del os.environ["TORCH_GLOO_LAZY_INIT"]
    leaders = LeaderGroup(group)
    pieces = [[SEQ // PIECES] * PIECES for _ in range(ROWS)]  # what a leader gathers: its rows' piece lengths
    tokens = ROWS * (SEQ + 1)
    send = torch.arange(tokens, dtype=torch.int64)

    def balancing(leaders: LeaderGroup, size: int) -> dict[str, Callable[[], Any]]:
        """A step's gather and exchange among ``size`` leaders: this leader's rows spread evenly."""
        counts = [tokens // size + (j < tokens % size) for j in range(size)]
        return {
            "gather": lambda: leaders.gather(("ok", pieces)),
            "exchange": lambda: leaders.exchange(send, counts, [counts[leaders.rank]] * size),
        }

    def timed(op: Callable[[], Any] | None) -> float | None:
        """``op``'s mean time between two barriers of the world; ``None`` runs nothing and waits."""
        if op is None:
            dist.barrier(group)
            dist.barrier(group)
            return None
        for _ in range(WARMUP):
            op()
        dist.barrier(group)
        start = time.perf_counter()
        for _ in range(REPS):
            op()
        took = (time.perf_counter() - start) / REPS
        dist.barrier(group)
        return took

    ops = {"agreement": lambda: agree_outcome(group, Kind.DATA, ""), **balancing(leaders, world)}
    for name, op in ops.items():
        record[name] = timed(op)
    record["exchange_bytes"] = tokens * 8
    for k in BLOCKS:
        if world <= k or world % k:
            continue
        start = time.perf_counter()
        block = balance_group(Balance(replicas=k).blocks(world), range(world), rank, TIMEOUT)
        record[f"build_{k}"] = time.perf_counter() - start
        for name, op in balancing(block, k).items():
            record[f"{name}_{k}"] = timed(op)
            alone = timed(op if rank < k else None)
            if alone is not None:
                record[f"{name}_{k}_alone"] = alone
    dist.barrier(group)
    keep(out, record)
    return 0


def fit(points: dict[int, float]) -> tuple[float, float]:
    """``(a, b)`` of t = a + b (W - 1), least squares over ``{W: t}``."""
    x = np.array([w - 1 for w in points], dtype=float)
    y = np.array(list(points.values()))
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def reach(a: float, b: float, seconds: float) -> str:
    """The dp at which a + b (dp - 1) reaches ``seconds``."""
    return "never" if b <= 0 else f"{int((seconds - a) / b) + 1:,}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2, 4 and 8 leaders")
    a = parser.parse_args()
    run = Run("leader_collectives.py")
    worlds = WORLDS[:3] if a.quick else WORLDS
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "records")
        for w in worlds:
            code = launch.run(rank_main, out, w, timeout=TIMEOUT)
            if code:
                print(f"the world of {w} leaders failed with exit code {code}", file=sys.stderr)
                return code
            print(f"{w} leaders done", flush=True)
        records = [record for records in kept(out).values() for record in records]  # one per rank and world
    per: dict[str, dict[int, float]] = {}  # op -> W -> the slowest rank's time (over the ranks that ran it)
    for w in worlds:
        for r in records:
            if r["world"] == w:
                for name, value in r.items():
                    if name not in ("rank", "world", "exchange_bytes"):
                        per.setdefault(name, {})[w] = max(value, per.get(name, {}).get(w, 0.0))
    names = {
        "agreement": "agreement: 24 B all-reduce",
        "gather": f"balancing gather: {ROWS}×{PIECES} piece lengths",
        "exchange": f"balancing exchange: {ROWS}×{SEQ + 1} int64 tokens ({ROWS * (SEQ + 1) * 8 // 1024} KiB)",
    }
    rows = [(names[n], *(f"{per[n][w] * 1e3:.2f}" for w in worlds)) for n in names]
    fits = {n: fit(per[n]) for n in names}
    total = {w: sum(per[n][w] for n in names) for w in worlds}
    fits["total"] = fit(total)
    fit_rows = [
        (names.get(n, "all three, one step with balancing"), f"{a_ * 1e3:.2f}", f"{b * 1e6:.0f}")
        + tuple(f"{(a_ + b * (dp - 1)) * 1e3:,.0f}" for dp in (128, 1024))
        + tuple(reach(a_, b, s) for s in STEPS)
        for n, (a_, b) in fits.items()
    ]
    group_rows = [
        (label, *(f"{per[n][w] * 1e3:.1f}" if w in per.get(n, {}) else "–" for w in worlds))
        for n, label in (
            ("new_group_member", "new_group, a member (all W ranks)"),
            ("new_group_other", "new_group, not a member (W − 1 others)"),
            ("new_group_lazy", "new_group, a member, `TORCH_GLOO_LAZY_INIT=1`"),
            ("lazy_first_agreement", "that lazy group's first agreement (connects the pairs it uses)"),
        )
    ]
    body = [
        f"Worlds of W gloo processes on this machine's 2 cores (from W = 4 several processes share a core: "
        f"every collective waits for the scheduler, so the slope below is this machine's, an upper bound on a "
        f"network's per-peer latency for small messages rather than a measure of it). Slowest rank's mean over "
        f"{REPS} repetitions after {WARMUP}, in ms:",
        "",
        *table("op | " + " | ".join(f"W = {w}" for w in worlds), rows + group_rows),
        "Fit t = a + b (dp − 1) per op, extrapolated (ms), and the dp at which it no longer hides behind a step "
        "(its time per step ≥ the step):",
        "",
        *table(
            "op | a ms | b µs per leader | dp 128 ms | dp 1,024 ms | exceeds a 1 s step at dp | exceeds a 5 s step at dp",
            fit_rows,
        ),
    ]
    body += verdict(fits)
    body += blocks(per, worlds, fits)
    results = {
        "meta": run.meta(worlds=list(worlds), blocks=list(BLOCKS), rows=ROWS, seq=SEQ, pieces=PIECES, reps=REPS),
        "per": per,
    }
    run.write(
        "leader_collectives_quick" if a.quick else "leader_collectives",
        "The leaders' per-step collectives",
        results,
        body,
    )
    return 0


def verdict(fits: dict[str, tuple[float, float]]) -> list[str]:
    """What the fit says at dp 1,024, and how it moves with a network's latency."""
    a, b = fits["total"]
    at = a + b * 1023
    holds = [f"{'does not hold' if at >= s else 'holds'} behind a {s:.0f} s step" for s in STEPS]
    return [
        f"**Balancing at dp 1,024**: the three take {at:.2f} s per step by this fit, so it {holds[0]} and "
        f"{holds[1]} on this machine's figures; the agreement alone (every run pays it) reaches 1 s at dp "
        f"{reach(*fits['agreement'], 1.0)}.",
        "",
        "Why each grows with dp: gloo's all-reduce is a ring by default, 2 (dp − 1) hops of 24 B; `all_gather_object` is two "
        "ring all-gathers (the sizes, then the pickles), 2 (dp − 1) hops, and every leader unpickles dp objects; "
        "the exchange is one all-to-all, dp − 1 messages per leader whose bytes together stay the leader's rows "
        "(128 KiB). Each is latency-bound at these sizes, so b is (hops per leader) × the per-hop latency, "
        "measured here on 2 shared cores; where a hop is k times faster (a network with a core per process), "
        "every dp limit above is k times larger.",
        "",
    ]


def blocks(
    per: dict[str, dict[int, float]], worlds: tuple[int, ...], fits: dict[str, tuple[float, float]]
) -> list[str]:
    """``Balance(replicas=k)``: a block's collectives measured in each world, and the model of a step."""

    def cell(name: str, k: int, w: int) -> str:
        at = per.get(name if w > k else name.split("_")[0], {}).get(w)  # W = k: the world of k leaders
        return "–" if at is None or w < k else f"{at * 1e3:.2f}"

    measured = [
        (f"{label}, blocks of {k}{how}", *(cell(f"{op}_{k}{key}", k, w) for w in worlds))
        for k in BLOCKS
        for op, label in (("gather", "gather"), ("exchange", "exchange"))
        for key, how in (("", ", every block at once"), ("_alone", ", block 0 alone"))
    ] + [
        (f"building every block's group of {k} (W / k `new_group` calls)", *(cell(f"build_{k}", k, w) for w in worlds))
        for k in BLOCKS
    ]
    a, b = fits["agreement"]
    lines = {"all leaders (k = dp)": ("–", fits["total"])}  # the three fitted together above
    for k in (k for k in MODEL_BLOCKS if k in worlds):
        block = per["gather"][k] + per["exchange"][k]
        lines[f"blocks of k = {k}"] = (f"{block * 1e3:.1f}", (a + block, b))
    model = [
        (label, at)
        + tuple(f"{(a_ + b_ * (dp - 1)) * 1e3:,.0f}" for dp in (128, 1024, 4096))
        + tuple(reach(a_, b_, s) for s in STEPS)
        for label, (at, (a_, b_)) in lines.items()
    ]
    k8 = per["gather"][8] + per["exchange"][8] + a + b * 1023
    return [
        "## Balancing in blocks of replicas: `Balance(replicas=k)`",
        "",
        "Each block of k consecutive replicas gathers and exchanges among its own k leaders; every rank "
        "builds every block's group. Measured in worlds of W leaders (ms, slowest rank; the W = k column "
        "is the world of k leaders above):",
        "",
        *table("op | " + " | ".join(f"W = {w}" for w in worlds), measured),
        "Every block at once, the W processes share 2 cores, so a block's time grows with W here from the "
        "scheduler alone; block 0 alone (the others wait) is what a block costs on cores of its own, as on a "
        "cluster, and stays near the world of k's.",
        "",
        "A step with blocks of k: the agreement over every leader (its fit at dp) plus a block's gather and "
        "exchange as measured in the world of k leaders (ms):",
        "",
        *table(
            "balancing | a block's gather + exchange ms | dp 128 ms | dp 1,024 ms | dp 4,096 ms | "
            "exceeds a 1 s step at dp | exceeds a 5 s step at dp",
            model,
        ),
        f"**Blocks at dp 1,024**: with k = 8 a step's collectives take {k8:.2f} s by this model, and what "
        "grows with dp is the agreement alone, which every run pays. The placement's CPU time shrinks too: it "
        "places k replicas' pieces instead of dp's (bench/results/balance.md has its time against dp).",
        "",
    ]


if __name__ == "__main__":
    sys.exit(main())
