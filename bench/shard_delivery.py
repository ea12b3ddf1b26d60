"""Scatter vs broadcast-then-slice for shard dims, token-sized and large payloads.

    python bench/shard_delivery.py            # writes bench/results/shard_delivery.{json,md}

Each configuration starts a gloo world on this machine, delivers the same pre-built batch for
``steps`` steps (no loading cost, prefetch on) and reports the steady-state time per step seen by
the slowest rank. Both delivery modes run in the same world, one after the other, alternating.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from collective_loader import CollectiveLoader
from collective_loader.testing import launch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@dataclass(frozen=True)
class Case:
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    payload_bytes: int
    steps: int
    rounds: int = 3


def _batch(payload_bytes: int) -> dict[str, torch.Tensor]:
    # 4 sequences of int64 tokens, inputs and labels: payload_bytes in total
    seq = max(64, payload_bytes // (2 * 4 * 8) // 64 * 64)
    ids = torch.randint(0, 32000, (4, seq))
    return {"input_ids": ids, "labels": ids.roll(-1, 1)}


def _time_epoch(case: Case, delivery: str, mesh) -> float:
    batch = _batch(case.payload_bytes)
    loader = CollectiveLoader(
        [batch] * (case.steps + 5),
        mesh,
        inputs=("input_ids",),
        labels=("labels",),
        seq_dims={"input_ids": 1, "labels": 1},
        split="zigzag",
        delivery=delivery,
    )
    it = iter(loader)
    for _ in range(5):  # warm-up
        next(it)
    dist.barrier()
    start = time.perf_counter()
    for _ in it:
        pass
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    loader.close()
    return elapsed.item() / case.steps


def rank_main(case: Case) -> int:
    mesh = init_device_mesh("cpu", case.shape, mesh_dim_names=case.dims)
    times: dict[str, list[float]] = {"broadcast": [], "scatter": []}
    for _ in range(case.rounds):
        for delivery in times:
            times[delivery].append(_time_epoch(case, delivery, mesh))
    if dist.get_rank() == 0:
        out = {d: statistics.median(t) for d, t in times.items()}
        with open(os.environ["BENCH_OUT"], "a") as f:
            f.write(
                json.dumps(
                    {
                        "dims": case.dims,
                        "shape": case.shape,
                        "payload_bytes": case.payload_bytes,
                        "seconds_per_step": out,
                    }
                )
                + "\n"
            )
    return 0


def main() -> int:
    os.makedirs(RESULTS, exist_ok=True)
    raw = os.path.join(RESULTS, "shard_delivery.jsonl")
    if os.path.exists(raw):
        os.remove(raw)
    os.environ["BENCH_OUT"] = raw
    cases = [
        Case(("pp", "cp", "tp"), (2, 2, 2), 64 << 10, 200),
        Case(("pp", "cp", "tp"), (2, 2, 2), 16 << 20, 20),
        Case(("cp", "tp"), (4, 2), 64 << 10, 200),
        Case(("cp", "tp"), (4, 2), 16 << 20, 20),
    ]
    for case in cases:
        code = launch.run(rank_main, case, math.prod(case.shape), timeout=600)
        if code:
            return code
    rows = [json.loads(line) for line in open(raw)]
    lines = [
        "# Scatter vs broadcast-then-slice (gloo, this machine)",
        "",
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, torch {torch.__version__}. "
        "Median of 3 rounds; time per step of the slowest rank, steady state, no compute.",
        "",
        "| mesh | payload | broadcast ms/step | scatter ms/step | scatter / broadcast |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        b, s = r["seconds_per_step"]["broadcast"], r["seconds_per_step"]["scatter"]
        mesh = ",".join(f"{n}={k}" for n, k in zip(r["dims"], r["shape"]))
        lines.append(f"| {mesh} | {r['payload_bytes'] / 1024:.0f} KiB | {b * 1e3:.3f} | {s * 1e3:.3f} | {s / b:.2f} |")
    with open(os.path.join(RESULTS, "shard_delivery.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
