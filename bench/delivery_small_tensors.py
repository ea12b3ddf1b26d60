"""``python bench/delivery.py --small-tensors``: six small tensors against one raw broadcast.

6 tensors of 1, 4 and 16 MiB in all (each under ``APART_MIN_BYTES`` up to 4 MiB, so copied into
the message), ``prefetch=1``, against one raw ``dist.broadcast`` of the same bytes, mesh (dp, tp) =
(1, 4), ``SMALL_ROUNDS`` rounds: the threshold ``APART_MIN_BYTES`` as the package has it, and either
side of it (every tensor copied into the message, every tensor apart), one loader whose host
broadcast mode's ``apart_min`` the benchmark sets before each epoch. Writes
``bench/results/delivery_small_tensors.{json,md}``.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from epochs import (  # bench/epochs.py: run as python bench/<name>.py
    DELIVERY_MESH,
    MIXED,
    SKIP,
    TIMEOUT,
    Epoch,
    loader_epochs,
    make_batch,
    median_p50,
    ratio,
    raw_epochs,
    slowest_steps,
    summary,
    tensor_bytes,
)
from harness import KIB, MIB, Repeat, Run, in_rounds, keep, kept, size, table
from torch.distributed.device_mesh import init_device_mesh

from collective_loader import CollectiveLoader
from collective_loader.delivery.modes import APART_MIN_BYTES, HostBroadcast
from collective_loader.testing import launch

SMALL_PAYLOADS = ((MIB, 60), (4 * MIB, 40), (16 * MIB, 12))  # (payload of 6 tensors, measured steps)
SMALL_ROUNDS = 15
# variant -> HostBroadcast.apart_min during its epochs
SMALL_VARIANTS: dict[str, int | None] = {
    "loader": APART_MIN_BYTES,  # the package as it is
    "loader_copied": None,  # every tensor copied into the message
    "loader_apart": 64 * KIB,  # every tensor apart, none copied
}


def mode_epochs(epoch: Epoch, apart_min: int | None) -> Epoch:
    """``epoch`` with the host broadcast mode's ``apart_min`` set for its steps (the leader's
    transfer thread reads it at each pack; it ends with the epoch)."""

    def run(n: int) -> Iterable[Any]:
        HostBroadcast.apart_min = apart_min
        return epoch(n)

    return run


def small_tensors_main(args: tuple[int, str]) -> int:
    """Rank entry of the small-tensor world: every variant and the raw broadcast, in ``rounds``;
    rank 0 keeps a record per payload in ``out``."""
    rounds, out = args
    names, shape = DELIVERY_MESH
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    group = dist.new_group(list(range(dist.get_world_size())))
    for nbytes, n in SMALL_PAYLOADS:
        batch = make_batch(nbytes, len(MIXED))
        source = Repeat(batch)
        loader = CollectiveLoader(source, mesh, inputs=tuple(batch), labels=(), timeout=TIMEOUT, prefetch=1)
        epochs = {name: mode_epochs(loader_epochs(loader, source), v) for name, v in SMALL_VARIANTS.items()}
        epochs["raw"] = raw_epochs(tensor_bytes(batch), group)
        record = {
            "kind": "small_tensors",
            "payload": nbytes,
            "tensor_bytes": tensor_bytes(batch),
            "largest_tensor": max(t.numel() * t.element_size() for t in batch.values()),
            "steps": n,
            "load": [os.getloadavg()[0]],
            "rounds": in_rounds({name: (lambda e=e, n=n: slowest_steps(e, n)) for name, e in epochs.items()}, rounds),
        }
        record["load"].append(os.getloadavg()[0])
        loader.close()
        if dist.get_rank() == 0:
            keep(out, record)
            print(f"small tensors: {size(nbytes)} done", flush=True)
    return 0


def small_tensors_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The small-tensor case's report."""
    variants = (*SMALL_VARIANTS, "raw")
    out = []
    for r in rows:
        rd = r["rounds"]
        per_round = [summary(a)["p50"] / summary(b)["p50"] for a, b in zip(rd["loader"], rd["raw"])]
        out.append(
            (
                size(r["payload"]),
                size(r["largest_tensor"]),
                r["steps"],
                *(f"{median_p50(rd[v]):.3f}" for v in variants),
                *(f"{ratio(rd, v, 'raw'):.2f}" for v in SMALL_VARIANTS),
                f"{min(per_round):.2f}-{max(per_round):.2f}",
                "-".join(f"{x:.1f}" for x in r["load"]),
            )
        )
    header = (
        "payload (6 tensors) | largest tensor | steps | loader p50 | all copied p50 | all apart p50 | "
        "raw broadcast p50 | loader / raw | all copied / raw | all apart / raw | loader / raw, per round | "
        "1-min load, start-end"
    )
    return [
        (
            f"Mesh (dp, tp) = (1, 4), one leader and three receivers, gloo. 6 tensors (int64, int32, float32, "
            f"bfloat16, bool, float16) of the payload in all, `prefetch=1`, against one raw `dist.broadcast` of "
            f"the same bytes per step into a buffer allocated once. {SMALL_ROUNDS} rounds, the order rotating; a "
            "step's time is the slowest rank's time between two consecutive batches; p50 in ms, the median over "
            "rounds; ratios are ours / raw, the median over rounds of the per-round ratio of p50s."
        ),
        "",
        (
            f"*loader*: the package as it is (`HostBroadcast`: host tensors of at least {size(APART_MIN_BYTES)} "
            "travel apart, the others are copied into the message). *all copied*: no tensor apart. *all apart*: "
            "every tensor in a broadcast of its own (`apart_min` 64 KiB), none copied. The three are one loader "
            "whose `HostBroadcast.apart_min` the benchmark sets before each epoch."
        ),
        "",
        *table(header, out),
    ]


def main(argv: list[str] | None) -> int:
    """``--small-tensors``: one world, bench/results/delivery_small_tensors.{json,md}."""
    run = Run("delivery.py", argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "records")
        code = launch.run(small_tensors_main, (SMALL_ROUNDS, out), math.prod(DELIVERY_MESH[1]), timeout=1800)
        if code:
            return code
        rows = kept(out)[0]
    results = {"meta": run.meta(rounds=SMALL_ROUNDS, skip=SKIP), "small_tensors": rows}
    run.write(
        "delivery_small_tensors",
        "Six small tensors vs a raw broadcast (gloo, this machine)",
        results,
        small_tensors_markdown(rows),
    )
    return 0
