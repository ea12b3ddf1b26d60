"""``python -m collective_loader demo``: deliver one epoch on a 4-D-capable mesh and check it.

Every replica's leader loads synthetic token samples (each carrying its id); every rank records
what it received; rank 0 prints each rank's role and first batch, the bytes moved, and the
verdict of the invariant checks (see :mod:`collective_loader.invariants`). Exit code 1 if any
check fails.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from collective_loader import invariants, launch
from collective_loader.layout import mesh_place
from collective_loader.loader import CollectiveLoader

INPUTS = ("input_ids", "position_ids", "sample_id")
LABELS = ("labels", "sample_id")
SEQ_DIMS = {"input_ids": 1, "position_ids": 1, "labels": 1}
VOCAB = 32000


@dataclass(frozen=True)
class DemoArgs:
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    samples: int
    batch_size: int
    seq_len: int
    layout: str
    delivery: str


def parse_mesh(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``"pp=2,dp=2,tp=2"`` -> ``(("pp", "dp", "tp"), (2, 2, 2))``."""
    try:
        pairs = [item.split("=") for item in text.split(",")]
        return tuple(n.strip() for n, _ in pairs), tuple(int(s) for _, s in pairs)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh wants name=size pairs like pp=2,dp=2,tp=2, got {text!r}") from None


def sample(sample_id: int, seq_len: int) -> dict[str, torch.Tensor]:
    """One synthetic tokenized sample; its tokens are a function of its id."""
    tokens = (sample_id * 7919 + torch.arange(seq_len + 1) * 31) % VOCAB
    return {"input_ids": tokens[:-1], "labels": tokens[1:], "position_ids": torch.arange(seq_len)}


def collate(ids: list[int], seq_len: int) -> dict[str, torch.Tensor]:
    samples = [sample(i, seq_len) for i in ids]
    batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    batch["sample_id"] = torch.tensor(ids)
    return batch


def replica_batches(dp_rank: int, dp_size: int, a: DemoArgs) -> Iterator[dict[str, torch.Tensor]]:
    mine = list(range(dp_rank, a.samples, dp_size))
    for start in range(0, len(mine) - a.batch_size + 1, a.batch_size):
        yield collate(mine[start : start + a.batch_size], a.seq_len)


def _describe(batch: dict[str, Any]) -> str:
    if not batch:
        return "{} (nothing: middle stage)"
    parts = []
    for k, v in batch.items():
        parts.append(f"{k}={v.tolist()}" if k == "sample_id" else f"{k}{list(v.shape)}")
    return " ".join(parts)


def rank_main(a: DemoArgs) -> int:
    mesh = init_device_mesh("cpu", a.shape, mesh_dim_names=a.dims)
    place = mesh_place(mesh, dist.get_rank())
    start = time.perf_counter()
    loader = CollectiveLoader(
        lambda: replica_batches(place.dp_rank, place.dp_size, a),
        mesh, inputs=INPUTS, labels=LABELS, seq_dims=SEQ_DIMS, layout=a.layout, delivery=a.delivery,
    )
    steps = [batch for batch in loader]
    seconds = time.perf_counter() - start
    received = sum(v.numel() * v.element_size() for b in steps for v in b.values())
    record = invariants.RankRecord(place.rank, place.dp_rank, place.stage, place.shard, steps)
    info = (record, place.coords, loader.is_leader, received, seconds, loader.group_count)
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(info, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return 0
    return report(a, loader, gathered)


def report(a: DemoArgs, loader: CollectiveLoader, gathered: list[Any]) -> int:
    print(f"collective_loader demo: mesh [{loader.mesh_layout.describe()}], {a.samples} samples, "
          f"batch {a.batch_size} x seq {a.seq_len}, layout={a.layout}, delivery={a.delivery}")
    print(f"{loader.dp_size} replicas, {loader.group_count} process groups per loader\n")
    print(f"{'rank':>4}  {'coords':<{4 * len(a.dims) + 8}} {'role':<32} first batch received")
    for record, coords, is_leader, _, _, _ in gathered:
        where = " ".join(f"{n}={c}" for n, c in zip(a.dims, coords))
        role = ("leader, " if is_leader else "") + {"both": "all stages"}.get(record.stage, f"{record.stage} stage")
        role += f", dp_rank {record.dp_rank}"
        first = record.steps[0] if record.steps else {}
        print(f"{record.rank:>4}  {where:<{4 * len(a.dims) + 8}} {role:<32} {_describe(first)}")
    steps = len(gathered[0][0].steps)
    total = sum(g[3] for g in gathered)
    slowest = max(g[4] for g in gathered)
    print(f"\n{steps} steps per rank; {total / 2**20:.2f} MiB delivered to all ranks together; "
          f"slowest rank {slowest:.2f}s (groups, epoch and shutdown included)")
    verdicts = invariants.check(
        [g[0] for g in gathered], loader.routing, lambda ids: collate(ids, a.seq_len),
        range(a.samples // (loader.dp_size * a.batch_size) * loader.dp_size * a.batch_size),
    )
    print("\nverdict:")
    for v in verdicts:
        print(f"  [{'ok' if v.ok else 'FAIL'}] {v.name}" + (f": {v.detail}" if v.detail else ""))
    ok = all(v.ok for v in verdicts)
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m collective_loader demo", description=__doc__.split("\n")[0])
    p.add_argument("--mesh", type=parse_mesh, default=parse_mesh("pp=2,dp=2,cp=2"),
                   help="dims in mesh order, outermost first (default pp=2,dp=2,cp=2)")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4, help="per-replica batch size")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    p.add_argument("--delivery", choices=("broadcast", "scatter"), default="broadcast")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the local world is stopped")
    ns = p.parse_args(argv)
    dims, shape = ns.mesh
    a = DemoArgs(dims, shape, ns.samples, ns.batch_size, ns.seq_len, ns.layout, ns.delivery)
    return launch.run(rank_main, a, math.prod(shape), ns.timeout)
