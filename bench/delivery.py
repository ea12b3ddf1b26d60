"""Delivery time of CollectiveLoader against its limits, on this machine (gloo, CPU ranks).

    python bench/delivery.py            # bench/results/delivery.{json,md} + plots
    python bench/delivery.py --quick    # a tiny version: bench/results/delivery_quick.* (git-ignored)
    python bench/delivery.py --small-tensors  # one case: bench/results/delivery_small_tensors.{json,md}

(Run times: bench/README.md.)

Figures that are compared are measured side by side: in one world, every variant runs one epoch
in turn, for several rounds (the order rotates each round), and the tables give the median over
rounds. A step's time is the slowest rank's time between two consecutive batches; the first
``SKIP`` steps of every epoch are warm-up and left out. Sources yield one pre-built batch, so no
loading cost is measured.

* Delivery vs the limit: CollectiveLoader with ``prefetch=1``, with the default, and with
  ``transport="device"`` (tensor bytes posted by the training thread; gloo here), against one
  raw ``dist.broadcast`` of the batch's bytes over a group of the same ranks (mesh dp=1, tp=4:
  one leader, three receivers), and against a raw header broadcast followed by that one (the earlier protocol's floor), for
  1 tensor and for 6 tensors of mixed dtypes.
* Delivery vs the per-tensor pattern (Megatron's ``get_batch_on_this_tp_rank``): one broadcast
  of the shapes, then one synchronous broadcast per tensor.
* Overlap: a loop that sleeps 1x and 2x the synchronous delivery time per step (``prefetch=1``
  delivery, measured just before in the same world); the time spent inside ``next(it)`` is the
  exposed wait.
* Profile: one synchronous step rebuilt from the package's wire pieces, timed by phase; and what
  writing a payload into a fresh buffer costs against a reused one (this process, no world).
* Scale and shard ranks (``delivery_scale.py``): constructor and step time on 2 to 16 ranks,
  groups and collectives per step from the layout code, broadcast or scatter to cp shard ranks.
* Small tensors (``--small-tensors``, alone: ``delivery_small_tensors.py``).

What the delivery benchmarks share (the epochs, the timing, the statistics over rounds):
``bench/epochs.py``; what every benchmark shares: ``bench/harness.py``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import delivery_small_tensors
import torch
import torch.distributed as dist
from delivery_report import BUFFERS, markdown, plot_payloads
from delivery_scale import LAYOUT_MESHES, layout_row, plot_scale, scale_main, shard_main
from epochs import (  # bench/epochs.py, bench/harness.py: run as python bench/<name>.py
    DELIVERY_MESH,
    LEADER,
    LOADERS,
    MIXED,
    SKIP,
    TIMEOUT,
    Epoch,
    loader_epochs,
    make_batch,
    raw_epochs,
    slowest_steps,
    stats_per_step,
    summary,
    tensor_bytes,
    timed_epoch,
)
from harness import KIB, MIB, RESULTS, Repeat, Run, gather, in_rounds, keep, kept, slowest
from torch.distributed.device_mesh import init_device_mesh

from collective_loader import CollectiveLoader
from collective_loader.delivery.buffers import BufferPool
from collective_loader.plan import wire
from collective_loader.plan.wire import Header, Kind
from collective_loader.testing import launch


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one run measures; ``--quick`` shrinks every part."""

    payloads: tuple[int, ...]
    overlap_payloads: tuple[int, ...]  # measured with the 6-tensor batch
    world_sizes: tuple[int, ...]
    rounds: int
    max_steps: int  # measured steps per epoch for small payloads
    min_steps: int
    world_timeout: float  # seconds one launched world may run
    shard_meshes: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]  # (dims, shape) of the shard worlds
    shard_payloads: tuple[tuple[int, int], ...]  # (payload, measured steps) in each shard world
    out: str = ""  # the records' path (harness.keep): rank 0 keeps one per case

    def steps(self, nbytes: int) -> int:
        """Measured steps per epoch: about 256 MiB per epoch, within [min_steps, max_steps]."""
        return max(self.min_steps, min(self.max_steps, (256 * MIB) // nbytes))


FULL = Settings(
    payloads=(KIB, 16 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB),
    overlap_payloads=(16 * KIB, MIB, 16 * MIB),
    world_sizes=(2, 4, 8, 16),
    rounds=3,
    max_steps=100,
    min_steps=8,
    world_timeout=1800,
    shard_meshes=((("pp", "cp", "tp"), (2, 2, 2)), (("cp", "tp"), (4, 2))),
    shard_payloads=((64 * KIB, 200), (16 * MIB, 20)),
)
QUICK = Settings(
    payloads=(KIB, MIB),
    overlap_payloads=(KIB,),
    world_sizes=(2,),
    rounds=2,
    max_steps=12,
    min_steps=6,
    world_timeout=600,
    shard_meshes=((("cp", "tp"), (4, 2)),),
    shard_payloads=((64 * KIB, 20),),
)


# --- variants -------------------------------------------------------------------------------


def raw_pair_epochs(nbytes: int, group: dist.ProcessGroup) -> Epoch:
    """A header-sized broadcast (``wire.HEADER_WORDS`` int64 words), then one of ``nbytes``, both into
    buffers allocated once: the floor of any protocol that sends a header and a payload per step."""
    header = torch.zeros(wire.HEADER_WORDS, dtype=torch.int64)
    buf = torch.zeros(nbytes, dtype=torch.uint8)

    def step() -> None:
        dist.broadcast(header, LEADER, group=group)
        dist.broadcast(buf, LEADER, group=group)

    return lambda n: (step() for _ in range(n))


def per_tensor_step(batch: dict[str, torch.Tensor], group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Megatron's ``get_batch_on_this_tp_rank`` pattern: the shapes in one int64 broadcast, then one
    synchronous broadcast per tensor into a fresh tensor. Receivers know the keys and dtypes."""
    if dist.get_rank() == LEADER:
        dist.broadcast(torch.tensor([list(t.shape) for t in batch.values()]), LEADER, group=group)
        for t in batch.values():
            dist.broadcast(t, LEADER, group=group)
        return batch
    shapes = torch.empty(len(batch), 2, dtype=torch.int64)
    dist.broadcast(shapes, LEADER, group=group)
    out = {}
    for (key, t), shape in zip(batch.items(), shapes.tolist()):
        out[key] = torch.empty(shape, dtype=t.dtype)
        dist.broadcast(out[key], LEADER, group=group)
    return out


def per_tensor_epochs(batch: dict[str, torch.Tensor], group: dist.ProcessGroup) -> Epoch:
    return lambda n: (per_tensor_step(batch, group) for _ in range(n))


# --- the delivery world ---------------------------------------------------------------------


def profile_step(batch: dict[str, torch.Tensor], group: dist.ProcessGroup, pool: BufferPool) -> dict[str, float]:
    """One synchronous steady-state step of the loader's protocol, rebuilt from ``wire`` and timed
    by phase: the leader packs header and payload into one reused buffer and broadcasts it;
    receivers receive into a reused buffer (the wait includes the leader's pack), decode the
    header and unpack."""
    t0 = time.perf_counter()
    plan = wire.encode(batch)
    nbytes = wire.HEADER_BYTES + plan.nbytes
    buf = pool.take(nbytes)
    if dist.get_rank() == LEADER:
        plan.write(buf, Kind.DATA, 0)
        t1 = time.perf_counter()
        dist.broadcast(buf, LEADER, group=group)
        t2 = t3 = time.perf_counter()
    else:
        t1 = t0
        dist.broadcast(buf, LEADER, group=group)
        t2 = time.perf_counter()
        header = Header.read(buf, 1 << 32)
        payload = buf[wire.HEADER_BYTES : nbytes]
        wire.decode(payload, header.meta_nbytes).batch(payload)
        t3 = time.perf_counter()
    return {"pack": t1 - t0, "message": t2 - t1, "unpack": t3 - t2, "step": t3 - t0}


def profile_epoch(batch: dict[str, torch.Tensor], group: dist.ProcessGroup, n: int) -> dict[str, list[float]]:
    """Per step: the leader's pack and broadcast times, the slowest receiver's unpack, and the
    slowest rank's whole step."""
    gc.collect()
    pool = BufferPool(2)
    dist.barrier()
    mine = [profile_step(batch, group, pool) for _ in range(n + SKIP)][SKIP:]
    ranks = gather(mine)
    receivers = [r for i, r in enumerate(ranks) if i != LEADER]
    out = {phase: [s[phase] for s in ranks[LEADER]] for phase in ("pack", "message")}
    out["unpack"] = [max(r[i]["unpack"] for r in receivers) for i in range(n)]
    out["step"] = [max(r[i]["step"] for r in ranks) for i in range(n)]
    return out


def delivery_case(s: Settings, mesh: Any, group: dist.ProcessGroup, nbytes: int, n_tensors: int) -> dict[str, Any]:
    """Every variant for one batch, in rounds; then the overlap runs for the overlap payloads."""
    batch = make_batch(nbytes, n_tensors)
    sources = {name: Repeat(batch) for name in LOADERS}
    loaders = {
        name: CollectiveLoader(sources[name], mesh, inputs=tuple(batch), labels=(), timeout=TIMEOUT, **options)
        for name, options in LOADERS.items()
    }
    stats = {name: gather(stats_per_step(loaders[name], sources[name])) for name in LOADERS}
    epochs = {name: loader_epochs(loaders[name], sources[name]) for name in LOADERS}
    epochs["raw"] = raw_epochs(tensor_bytes(batch), group)
    epochs["raw_pair"] = raw_pair_epochs(tensor_bytes(batch), group)
    epochs["per_tensor"] = per_tensor_epochs(batch, group)
    n = s.steps(nbytes)
    runs: dict[str, Callable[[], Any]] = {name: (lambda e=e: slowest_steps(e, n)) for name, e in epochs.items()}
    runs["profile"] = lambda: profile_epoch(batch, group, max(s.min_steps, n // 2))
    record: dict[str, Any] = {
        "kind": "delivery",
        "payload": nbytes,
        "n_tensors": n_tensors,
        "tensor_bytes": tensor_bytes(batch),
        "wire_bytes": wire.encode(batch).nbytes,
        "steps": n,
        "stats": stats,
        "rounds": in_rounds(runs, s.rounds),
    }
    if n_tensors == len(MIXED) and nbytes in s.overlap_payloads:
        record["overlap"] = overlap(s, epochs, record["rounds"]["loader_p1"], nbytes)
    for loader in loaders.values():
        loader.close()
    return record


def overlap(s: Settings, epochs: dict[str, Epoch], sync_rounds: list[list[float]], nbytes: int) -> dict[str, Any]:
    """Slowest-rank wait inside ``next`` per step, with 1x and 2x the synchronous delivery time of
    compute per step; that time is the median over rounds of the ``prefetch=1`` p50."""
    sync = statistics.median(summary(r)["p50"] for r in sync_rounds)
    n = max(s.min_steps, s.steps(nbytes) // 2)
    runs = {
        f"{name} x{factor}": (lambda e=epochs[name], c=factor * sync: slowest(gather(timed_epoch(e, n, c).waits)))
        for name in LOADERS
        for factor in (1, 2)
    }
    return {"sync_delivery": sync, "steps": n, "waits": in_rounds(runs, s.rounds)}


def delivery_main(s: Settings) -> int:
    """Rank entry of the 4-rank world: every payload, 1 tensor then 6 mixed tensors."""
    names, shape = DELIVERY_MESH
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    group = dist.new_group(list(range(dist.get_world_size())))  # the ranks of the loader's delivery group
    for n_tensors in (1, len(MIXED)):
        for nbytes in s.payloads:
            record = delivery_case(s, mesh, group, nbytes, n_tensors)
            if dist.get_rank() == 0:
                keep(s.out, record)
                print(f"delivery: {nbytes} bytes, {n_tensors} tensors done", flush=True)
    return 0


# --- buffer cost (this process, no world) -------------------------------------------------


def copy_time(nbytes: int, mode: str, steps: int = 10) -> float:
    """Median time to write ``nbytes`` into a buffer allocated once (``reused``), or into a fresh one
    each step that is freed at once (``fresh_freed``) or kept until the end (``fresh_kept``: as a loop
    that holds on to its batches, or a reference cycle, keeps them)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    reused = torch.zeros(nbytes, dtype=torch.uint8)
    kept, times = [], []
    for _ in range(steps + SKIP):
        start = time.perf_counter()
        buf = reused if mode == "reused" else torch.empty(nbytes, dtype=torch.uint8)
        buf.copy_(src)
        times.append(time.perf_counter() - start)
        if mode == "fresh_kept":
            kept.append(buf)
    return statistics.median(times[SKIP:])


def buffer_costs(s: Settings) -> list[dict[str, Any]]:
    """Each buffer mode for the payloads of 1 MiB or more, on a worker thread (the loader packs and
    receives on its transfer thread) with one torch thread like the ranks; the modes alternate."""
    torch.set_num_threads(1)
    rows = []
    with concurrent.futures.ThreadPoolExecutor(1) as worker:
        for n in (n for n in s.payloads if n >= MIB):
            runs = {mode: (lambda n=n, mode=mode: worker.submit(copy_time, n, mode).result()) for mode in BUFFERS}
            rows.append({"payload": n, **in_rounds(runs, s.rounds)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny version, under a minute")
    parser.add_argument("--small-tensors", action="store_true", help="the small-tensor case alone")
    args = parser.parse_args(argv)
    if args.small_tensors:
        return delivery_small_tensors.main(argv)
    import matplotlib  # only the parent plots; ranks never import it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = "delivery_quick" if args.quick else "delivery"
    run = Run("delivery.py", argv)
    with tempfile.TemporaryDirectory() as tmp:
        s = dataclasses.replace(QUICK if args.quick else FULL, out=os.path.join(tmp, "records"))
        worlds: list[tuple[Callable[[Any], int], Any, int]] = [(delivery_main, s, 4)]
        worlds += [(scale_main, s, n) for n in s.world_sizes]
        worlds += [(shard_main, (s, dims, shape), math.prod(shape)) for dims, shape in s.shard_meshes]
        for fn, arg, world in worlds:
            code = launch.run(fn, arg, world, timeout=s.world_timeout)
            if code:
                return code
        records = kept(s.out)[0]
    results = {
        "meta": run.meta(rounds=s.rounds, skip=SKIP, settings=dataclasses.asdict(s) | {"out": None}),
        "delivery": [r for r in records if r["kind"] == "delivery"],
        "scale": sorted((r for r in records if r["kind"] == "scale"), key=lambda r: r["world"]),
        "shard": [r for r in records if r["kind"] == "shard"],
        "layout": [layout_row(*m) for m in LAYOUT_MESHES],
        "buffers": buffer_costs(s),
    }
    run.write(name, "Delivery time (gloo, this machine)", results, markdown(results))
    plot_payloads(plt, results["delivery"], os.path.join(RESULTS, f"{name}_vs_payload.png"))
    plot_scale(plt, results["scale"], os.path.join(RESULTS, f"{name}_scale.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
