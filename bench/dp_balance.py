"""Packed rows over the data-parallel replicas: attention cost per replica, as packed and balanced.

    python bench/dp_balance.py            # bench/results/dp_balance.{json,md} (run time: bench/README.md)
    python bench/dp_balance.py --quick    # fewer steps, one round of the end-to-end measure

1. Arithmetic, on the library's own code: each of ``dp`` leaders packs its own stream of
   documents drawn from a mix (:class:`~collective_loader.text.packing.Packer`, rows of
   ``seq_len + 1`` tokens, ``ROWS`` rows per replica and step), then
   :func:`~collective_loader.text.balance.place` places the step's pieces over the replicas. A
   replica's cost is the sum over its rows of ``sum(L**2) + c * sum(L)`` over the rows' pieces.
   Per step the balance is max / mean cost over the replicas (1.0: no replica waits for another);
   the table gives its mean over the steps, as packed and as placed, with ``c = 0`` (attention
   alone) and ``c = 6 * 4096`` (a 4096-wide model). Padding overhead = token slots / real tokens - 1
   (the same with and without balancing: rows stay full).
2. End to end: a gloo world of dp = 2 leaders streaming a real MDS dataset of the long-tail mix
   through :class:`~collective_loader.CollectiveLoader`; the "model" sleeps in proportion to its
   batch's attention cost (``sum(L**2)`` from ``cu_seqlens``), then all-reduces a gradient-sized
   tensor (every replica waits for the slowest, as in training). Steps per second, balancing off vs
   on, alternating over rounds.

Targets (issue 29): mean max/mean over replicas <= 1.05 on every mix at dp 2, 4 and 8; the
balanced end-to-end run faster on the long-tail mix.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from harness import Run, keep, runs_of, table, worlds_in_rounds  # bench/harness.py: run as python bench/<name>.py

from collective_loader.testing import launch
from collective_loader.text.balance import place, place_in_blocks, replica_costs
from collective_loader.text.packing import Packer

TARGET = 1.05
DPS = (2, 4, 8)
ROWS = 4  # rows per replica and step
WIDE = 6 * 4096  # c for a 4096-wide model (see text/balance.py)


def mixes() -> dict[str, tuple[str, int, object]]:
    """name -> (description, seq_len, draw(rng) -> one document's length)."""
    return {
        "tiny": ("uniform 1-30 tokens", 8192, lambda rng: int(rng.integers(1, 31))),
        "all short": ("uniform 64-1024 tokens", 8192, lambda rng: int(rng.integers(64, 1025))),
        "log-normal": (
            "log-normal, median 665 tokens, sigma 1.5, 16 to 8192",
            8192,
            lambda rng: int(np.clip(rng.lognormal(6.5, 1.5), 16, 8192)),
        ),
        "one long + many short": (
            "one of 4096 tokens in 16, else uniform 64-1024",
            8192,
            lambda rng: 4096 if rng.random() < 1 / 16 else int(rng.integers(64, 1025)),
        ),
        "single document": ("every document fills a row", 8192, lambda rng: 8193),
        "long tail": (
            "log-normal, median 1000 tokens, sigma 1.2, at most 32768 (rows of 32k)",
            32768,
            lambda rng: int(np.clip(rng.lognormal(np.log(1000), 1.2), 1, 32768)),
        ),
    }


def packed_steps(draw, seq_len: int, dp: int, steps: int, seed: int) -> list[list[list[list[int]]]]:
    """``steps`` steps of every leader's rows (piece lengths) as its own packer cuts them."""
    out: list[list[list[list[int]]]] = [[] for _ in range(steps)]
    for leader in range(dp):
        rng = np.random.default_rng([seed, leader])
        packer = Packer(seq_len)
        for k in range(steps):
            rows = []
            while len(rows) < ROWS:
                row = packer.next_row()
                if row is None:
                    packer.add(None, np.zeros(draw(rng), np.int64))
                    continue
                rows.append(row.pieces)
            out[k].append(rows)
    return out


def ratio(costs: list[float]) -> float:
    return max(costs) / statistics.fmean(costs)


def arithmetic(steps: int) -> list[dict]:
    records = []
    for name, (_, seq_len, draw) in mixes().items():
        for dp in DPS:
            record = {"mix": name, "dp": dp, "steps": steps}
            per_step = packed_steps(draw, seq_len, dp, steps, seed=dp)
            for label, c in (("attention", 0.0), ("wide", float(WIDE))):
                packed, placed = [], []
                for rows in per_step:
                    out = place(rows, ROWS, seq_len + 1, c)
                    packed.append(ratio(replica_costs(rows, c)))
                    placed.append(ratio(replica_costs([[[p.length for p in r] for r in rep] for rep in out], c)))
                record[f"{label}_packed"] = statistics.fmean(packed)
                record[f"{label}_placed"] = statistics.fmean(placed)
                record[f"{label}_placed_worst"] = max(placed)
            by_row = []  # Balance(rows=1), as TorchTitan's --dataloader.balance places them
            for rows in per_step:
                out = place_in_blocks(rows, ROWS, seq_len + 1, 0.0, 1)
                by_row.append(ratio(replica_costs([[[p.length for p in r] for r in rep] for rep in out], 0.0)))
            record["attention_by_row"] = statistics.fmean(by_row)
            slots = steps * dp * ROWS * (seq_len + 1)
            real = sum(n for rows in per_step for leader in rows for row in leader for n in row)
            record["padding"] = slots / real - 1
            records.append(record)
    return records


# --- end to end -----------------------------------------------------------------------------------

SECONDS_PER_COST = 1e-10  # the "model": a 32k-token document alone sleeps 107 ms


def long_tail_dataset(path: str, tokens: int) -> None:
    from collective_loader.testing.data import write_token_documents

    rng = np.random.default_rng(11)
    draw = mixes()["long tail"][2]
    docs, total = [], 0
    while total < tokens:
        n = draw(rng)  # type: ignore[operator]
        docs.append(rng.integers(1, 60000, size=n).astype(np.int64))
        total += n
    write_token_documents(path, docs, "bytes", "uint16", shard_bytes=1 << 22)


def rank_main(args: tuple[str, str, str]) -> int:
    """On every rank of a dp = 2 world: one epoch, balancing off or on; keeps seconds per step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from collective_loader import CollectiveLoader
    from collective_loader.streaming import StreamingSource
    from collective_loader.text import Balance, Packing, TokenColumn

    path, variant, out = args
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    packing = Packing(32768, "drop", ("cu_seqlens",), Balance() if variant == "on" else None)
    source = StreamingSource(
        mesh,
        local=path,
        batch_size=2,
        shuffle=True,
        shuffle_seed=5,
        layout=TokenColumn(dtype="uint16"),
        packing=packing,
        documents_per_batch=64,
    )
    loader = CollectiveLoader(source, mesh, inputs=("input_ids",), labels=("labels",), every_stage=("cu_seqlens",))
    grad = torch.zeros(1 << 18)
    seconds, costs = [], []
    start = time.perf_counter()
    for batch in loader:
        lengths = batch["cu_seqlens"].diff(dim=1).double()
        cost = float((lengths**2).sum())
        time.sleep(cost * SECONDS_PER_COST)  # forward and backward, in proportion to attention
        dist.all_reduce(grad)  # every replica waits for the slowest
        costs.append(cost)
        now = time.perf_counter()
        seconds.append(now - start)
        start = now
    loader.close()
    keep(out, {"variant": variant, "seconds": seconds[1:], "costs": costs})
    return 0


def end_to_end(rounds: int, tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path, out = os.path.join(tmp, "long_tail"), os.path.join(tmp, "records")
        long_tail_dataset(path, tokens)
        code = worlds_in_rounds(
            ("off", "on"), rounds, lambda v, r: launch.run(rank_main, (path, v, out), 2, timeout=900)
        )
        if code:
            raise SystemExit(code)
        runs = runs_of(out)
    result: dict = {"off": {"steps_per_second": []}, "on": {"steps_per_second": []}}
    for ranks in runs:
        mine, variant = ranks[0], ranks[0]["variant"]
        result[variant]["steps_per_second"].append(len(mine["seconds"]) / sum(mine["seconds"]))
        result[variant]["steps"] = len(mine["seconds"]) + 1
        # the model's time alone: each step waits for the costlier replica
        slowest = [max(costs) for costs in zip(*(r["costs"] for r in ranks))][1:]
        result[variant]["model_seconds"] = sum(slowest) * SECONDS_PER_COST
        result[variant]["seconds"] = sum(mine["seconds"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20 steps per case, one round end to end")
    args = parser.parse_args()
    run = Run("dp_balance.py")
    steps = 20 if args.quick else 100
    records = arithmetic(steps)
    e2e = end_to_end(1 if args.quick else 3, 1_500_000 if args.quick else 6_000_000)
    rows = []
    for r in records:
        met = "met" if r["attention_placed"] <= TARGET else "**not met**"
        rows.append(
            (
                r["mix"],
                r["dp"],
                f"{r['attention_packed']:.3f}",
                f"{r['attention_placed']:.3f}",
                f"{r['attention_placed_worst']:.3f}",
                f"{r['attention_by_row']:.3f}",
                f"{r['wide_packed']:.3f}",
                f"{r['wide_placed']:.3f}",
                f"{r['padding']:.2%}",
                met,
            )
        )
    off, on = (statistics.median(e2e[k]["steps_per_second"]) for k in ("off", "on"))
    body = [
        f"Arithmetic: each of dp leaders packs its own documents of the mix ({ROWS} rows per replica and step, "
        f"{steps} steps, seed = dp); the step's pieces are placed by `text.balance.place`. Balance = max / mean "
        "replica cost per step, mean over the steps (worst step beside it); cost = sum(L^2) + c sum(L) per row; "
        f"c = 0 (attention) and c = {WIDE} (6 x 4096); *row by row*: `Balance(rows=1)`, each row slot placed on its own, as "
        "TorchTitan's `--dataloader.balance` does. Padding = slots / real tokens - 1, the same either way. "
        f"Target: balanced <= {TARGET} with c = 0.",
        "",
        *table(
            "mix | dp | packed (c=0) | balanced (c=0) | worst step | row by row (c=0) | packed (c=6d) | balanced (c=6d) "
            "| padding | target",
            rows,
        ),
        "Mixes: " + "; ".join(f"*{name}*: {desc}" for name, (desc, _, _) in mixes().items()) + ".",
        "",
        f"End to end (long tail, rows of 32768, 2 rows per replica, dp = 2, {e2e['off']['steps']} steps per epoch): "
        f"each step sleeps {SECONDS_PER_COST:g} s per unit of sum(L^2) of its batch, then all-reduces 1 MiB. "
        f"Steps per second per round, off: {', '.join(f'{x:.2f}' for x in e2e['off']['steps_per_second'])}; "
        f"on: {', '.join(f'{x:.2f}' for x in e2e['on']['steps_per_second'])}. Median {off:.2f} vs {on:.2f}: "
        f"balanced {on / off - 1:+.1%}. Of the last round's {e2e['off']['seconds']:.2f} s (off) and "
        f"{e2e['on']['seconds']:.2f} s (on), the model's sleep of the costlier replica was "
        f"{e2e['off']['model_seconds']:.2f} s and {e2e['on']['model_seconds']:.2f} s; the rest is loading, delivery and "
        "the all-reduce.",
    ]
    results = {"meta": run.meta(steps=steps, rows=ROWS), "arithmetic": records, "end_to_end": e2e}
    run.write(
        "dp_balance", "Packed rows over the data-parallel replicas: cost per replica, packed vs balanced", results, body
    )


if __name__ == "__main__":
    sys.exit(main())
