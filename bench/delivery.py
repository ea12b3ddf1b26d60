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
* Scale: constructor time and 1 KiB step time on 2 to 16 ranks; groups and collectives per step
  from the layout code for meshes up to pp=16, dp=128, cp=2, tp=4 (no processes).
* Shard ranks: sequences split over cp, delivered by broadcast-then-slice and by scatter, on
  8-rank meshes ``pp=2,cp=2,tp=2`` and ``cp=4,tp=2``, token-sized (64 KiB) and large (16 MiB)
  batches; both loaders (and their process groups) built once per world.
* Small tensors (``--small-tensors``, alone): 6 tensors of 1, 4 and 16 MiB in all (each under
  ``APART_MIN_BYTES`` up to 4 MiB, so copied into the message), ``prefetch=1``, against one raw
  ``dist.broadcast`` of the same bytes, mesh (dp, tp) = (1, 4), ``SMALL_ROUNDS`` rounds: the
  threshold ``APART_MIN_BYTES`` as the package has it, and either side of it (every tensor copied
  into the message, every tensor apart), one loader whose host broadcast mode's ``apart_min`` the
  benchmark sets before each epoch.
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
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from harness import (  # bench/harness.py: run as python bench/<name>.py
    KIB,
    MIB,
    RESULTS,
    Repeat,
    Run,
    Steps,
    gather,
    in_rounds,
    keep,
    kept,
    size,
    slowest,
    table,
    timed_steps,
)
from torch.distributed.device_mesh import init_device_mesh

from collective_loader import CollectiveLoader
from collective_loader.delivery.buffers import BufferPool
from collective_loader.delivery.modes import APART_MIN_BYTES, HostBroadcast
from collective_loader.plan import wire
from collective_loader.plan.mesh import MeshLayout, group_count
from collective_loader.plan.wire import Header, Kind
from collective_loader.testing import launch

MIXED = (torch.int64, torch.int32, torch.float32, torch.bfloat16, torch.bool, torch.float16)
SKIP = 2  # warm-up steps left out at the start of every epoch
TIMEOUT = 120.0  # seconds a loader waits in one collective
DELIVERY_MESH = (("dp", "tp"), (1, 4))  # one leader (rank 0), three receivers
LEADER = 0
SCALE_MESHES = {2: (1, 1, 2), 4: (2, 1, 2), 8: (2, 2, 2), 16: (4, 2, 2)}  # world -> (pp, dp, tp)
LAYOUT_MESHES = (  # (pp, dp, cp, tp)
    (1, 1, 1, 8),
    (3, 2, 2, 2),
    (1, 8, 1, 8),
    (2, 4, 1, 8),
    (4, 8, 2, 4),
    (8, 32, 2, 4),
    (16, 64, 2, 4),
    (16, 128, 2, 4),
)
LOADERS = {  # variant -> CollectiveLoader options
    "loader_p1": {"prefetch": 1},
    "loader_default": {},
    "loader_device": {"transport": "device"},
}
LABELS = {
    "loader_p1": "loader, prefetch=1",
    "loader_default": "loader, default prefetch",
    "loader_device": "loader, transport=device",
    "raw": "raw broadcast",
    "raw_pair": "raw header + payload",
    "per_tensor": "per-tensor pattern",
}


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


# --- batches and variants -------------------------------------------------------------------


def make_batch(nbytes: int, n_tensors: int) -> dict[str, torch.Tensor]:
    """``n_tensors`` tensors of shape (2, L) sharing about ``nbytes``, dtypes from :data:`MIXED`."""
    batch = {}
    for i, dtype in enumerate(MIXED[:n_tensors]):
        length = max(1, nbytes // n_tensors // (2 * torch.empty(0, dtype=dtype).element_size()))
        if dtype == torch.bool:
            value = torch.rand(2, length) < 0.5
        elif dtype.is_floating_point:
            value = torch.randn(2, length).to(dtype)
        else:
            value = torch.randint(0, 32000, (2, length), dtype=dtype)
        batch[f"t{i}_{str(dtype).removeprefix('torch.')}"] = value
    return batch


def tensor_bytes(batch: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in batch.values())


Epoch = Callable[[int], Iterable[Any]]  # n -> something that yields once per delivered step


def loader_epochs(loader: CollectiveLoader, source: Repeat) -> Epoch:
    """An epoch of the loader: ``n`` batches from its source, then the end of data."""

    def epoch(n: int) -> Iterable[Any]:
        source.steps = n
        return loader

    return epoch


def raw_epochs(nbytes: int, group: dist.ProcessGroup) -> Epoch:
    """One ``dist.broadcast`` of ``nbytes`` per step into a buffer allocated once: the limit."""
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    return lambda n: (dist.broadcast(buf, LEADER, group=group) for _ in range(n))


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


# --- timing ---------------------------------------------------------------------------------


def timed_epoch(epoch: Epoch, n: int, compute: float = 0.0) -> Steps:
    """This rank's ``n`` steps after ``SKIP`` of warm-up; ``compute`` seconds of sleep follow every
    step (the training loop's work)."""
    gc.collect()  # the last run's garbage is not collected inside this run's timed steps
    dist.barrier()
    return timed_steps(epoch(n + SKIP), SKIP, each=(lambda i, batch: time.sleep(compute)) if compute else None)


def slowest_steps(epoch: Epoch, n: int, compute: float = 0.0) -> list[float]:
    """Per step, the slowest rank's step time."""
    return slowest(gather(timed_epoch(epoch, n, compute).steps))


def summary(seconds: list[float]) -> dict[str, float]:
    return {
        "p50": float(np.percentile(seconds, 50)),
        "p95": float(np.percentile(seconds, 95)),
        "mean": float(np.mean(seconds)),
    }


def stats_per_step(loader: CollectiveLoader, source: Repeat) -> dict[str, Any]:
    """This rank's role and ``loader.stats()`` per step: the difference of two untimed epochs of
    2 and 6 steps, so each epoch's end-of-data header cancels out."""
    totals = []
    for n in (2, 6):
        before = loader.stats()
        source.steps = n
        for _ in loader:
            pass
        totals.append({k: v - before[k] for k, v in loader.stats().items()})
    role = "leader" if loader.is_leader else loader.place.stage
    return {"rank": dist.get_rank(), "role": role, **{k: (totals[1][k] - totals[0][k]) / 4 for k in totals[0]}}


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
        header = Header.decode(buf[: wire.HEADER_BYTES].view(torch.int64), 1 << 32)
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


# --- the small-tensor world ------------------------------------------------------------------

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


# --- the scale worlds -----------------------------------------------------------------------


def scale_main(s: Settings) -> int:
    """Rank entry of a scale world: constructor time and 1 KiB step time for both prefetch settings."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", SCALE_MESHES[world], mesh_dim_names=("pp", "dp", "tp"))
    ids = torch.randint(0, 32000, (2, 32))  # 512 bytes of inputs and 512 of labels: 1 KiB per step
    source = Repeat({"input_ids": ids, "labels": ids.roll(-1, 1)})
    record: dict[str, Any] = {"kind": "scale", "world": world, "shape": SCALE_MESHES[world], "steps": s.max_steps}

    def run(options: dict[str, Any]) -> dict[str, Any]:
        dist.barrier()
        start = time.perf_counter()
        loader = CollectiveLoader(source, mesh, inputs=("input_ids",), labels=("labels",), timeout=TIMEOUT, **options)
        built = max(gather(time.perf_counter() - start))
        record["group_count"] = loader.group_count
        stats = gather(stats_per_step(loader, source))
        steps = slowest_steps(loader_epochs(loader, source), s.max_steps)
        loader.close()
        return {"construct": built, "steps": steps, "stats": stats}

    record["rounds"] = in_rounds({name: (lambda o=o: run(o)) for name, o in LOADERS.items()}, s.rounds)
    if dist.get_rank() == 0:
        keep(s.out, record)
        print(f"scale: {world} ranks done", flush=True)
    return 0


# --- the shard worlds: broadcast or scatter ----------------------------------------------------

SHARD_MODES = ("broadcast", "scatter")


def shard_batch(nbytes: int) -> dict[str, torch.Tensor]:
    """4 sequences of int64 tokens, ``input_ids`` and ``labels``: about ``nbytes`` together."""
    seq = max(64, nbytes // (2 * 4 * 8) // 64 * 64)
    ids = torch.randint(0, 32000, (4, seq))
    return {"input_ids": ids, "labels": ids.roll(-1, 1)}


def shard_main(args: tuple[Settings, tuple[str, ...], tuple[int, ...]]) -> int:
    """Rank entry of a shard world: sequences split over cp (zigzag), delivered by broadcast-then-
    slice and by scatter, every payload in rounds. Both loaders, and so their process groups, are
    built once per world."""
    s, dims, shape = args
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    source = Repeat({})
    loaders = {
        mode: CollectiveLoader(
            source,
            mesh,
            inputs=("input_ids",),
            labels=("labels",),
            seq_dims={"input_ids": 1, "labels": 1},
            split="zigzag",
            delivery=mode,
            timeout=TIMEOUT,
        )
        for mode in SHARD_MODES
    }
    for nbytes, n in s.shard_payloads:
        source.batch = shard_batch(nbytes)
        runs = {
            mode: (lambda mode=mode, n=n: slowest_steps(loader_epochs(loaders[mode], source), n)) for mode in loaders
        }
        record = {"kind": "shard", "dims": dims, "shape": shape, "payload": nbytes, "steps": n}
        record["rounds"] = in_rounds(runs, s.rounds)
        if dist.get_rank() == 0:
            keep(s.out, record)
            print(f"shard: {dict(zip(dims, shape))}, {size(nbytes)} done", flush=True)
    for loader in loaders.values():
        loader.close()
    return 0


# --- buffer cost (this process, no world) -------------------------------------------------


BUFFERS = ("reused", "fresh_freed", "fresh_kept")


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


# --- layout table (no processes) ------------------------------------------------------------


def layout_row(pp: int, dp: int, cp: int, tp: int) -> dict[str, Any]:
    """Groups and collectives per step of a mesh, from the layout code.

    A leader runs one all-reduce among the leaders (when there are several), then one message
    collective per delivery group (first and last stage; steady state: batch sizes repeat); a
    receiver takes part in its own group's collective. Without every_stage keys the middle stages
    are outside delivery: no collective (one store read per prefetch window if they iterate)."""
    layout = MeshLayout.build(("pp", "dp", "cp", "tp"), (pp, dp, cp, tp), range(pp * dp * cp * tp))
    named = [name for name, _ in layout.replica_groups()[0].all()]
    per_group = {name: 1 for name in named if name != "middle"}
    return {
        "pp": pp,
        "dp": dp,
        "cp": cp,
        "tp": tp,
        "gpus": pp * dp * cp * tp,
        "groups": group_count(layout.dp_size, layout.pp_size),
        "leader": int(len(layout.leaders()) > 1) + sum(per_group.values()),
        "receiver": {**per_group, **({"middle": 0} if "middle" in named else {})},
    }


# --- report ---------------------------------------------------------------------------------


def ratio(rounds: dict[str, list[list[float]]], num: str, den: str) -> float:
    """Median over rounds of the per-round ratio of p50s."""
    return statistics.median(summary(a)["p50"] / summary(b)["p50"] for a, b in zip(rounds[num], rounds[den]))


def p50_p95(series: list[list[float]]) -> str:
    """``p50 (p95)`` in ms, each the median over rounds."""
    p50 = statistics.median(summary(r)["p50"] for r in series)
    p95 = statistics.median(summary(r)["p95"] for r in series)
    return f"{p50 * 1e3:.3f} ({p95 * 1e3:.3f})"


def per_role(stats: list[dict[str, Any]], key: str = "collectives") -> str:
    """``role: value`` for each distinct role, e.g. ``leader 2, both 2``."""
    roles: dict[str, set[float]] = {}
    for s in stats:
        roles.setdefault(s["role"], set()).add(s[key])
    return ", ".join(f"{role} {'/'.join(f'{v:g}' for v in sorted(vs))}" for role, vs in roles.items())


def delivery_tables(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for n_tensors in sorted({r["n_tensors"] for r in rows}):
        dtypes = ", ".join(str(d).removeprefix("torch.") for d in MIXED[:n_tensors])
        mine = [(r, r["rounds"]) for r in rows if r["n_tensors"] == n_tensors]
        plural = "s" if n_tensors > 1 else ""
        lines += [f"### {n_tensors} tensor{plural} ({dtypes}): vs the limit", ""]
        lines += table(
            "payload | wire bytes | steps | loader p=1 | loader default | loader device | raw broadcast | "
            "raw header + payload | p=1 / raw | default / raw | device / raw | p=1 / raw header + payload | "
            "collectives per step (stats)",
            [
                (
                    size(r["payload"]),
                    r["wire_bytes"],
                    r["steps"],
                    *(p50_p95(rd[v]) for v in ("loader_p1", "loader_default", "loader_device", "raw", "raw_pair")),
                    *(f"{ratio(rd, v, 'raw'):.2f}" for v in ("loader_p1", "loader_default", "loader_device")),
                    f"{ratio(rd, 'loader_p1', 'raw_pair'):.2f}",
                    per_role(r["stats"]["loader_p1"]),
                )
                for r, rd in mine
            ],
        )
        lines += [
            f"### {n_tensors} tensor{plural}: vs the per-tensor pattern ({n_tensors + 1} collectives per step)",
            "",
        ]
        lines += table(
            "payload | per-tensor | loader p=1 | loader default | per-tensor / p=1 | per-tensor / default",
            [
                (
                    size(r["payload"]),
                    *(p50_p95(rd[v]) for v in ("per_tensor", "loader_p1", "loader_default")),
                    f"{ratio(rd, 'per_tensor', 'loader_p1'):.2f}",
                    f"{ratio(rd, 'per_tensor', 'loader_default'):.2f}",
                )
                for r, rd in mine
            ],
        )
    return lines


def median_p50(series: list[list[float]]) -> float:
    """The median over rounds of the p50, in ms."""
    return statistics.median(summary(x)["p50"] for x in series) * 1e3


def profile_table(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        prof = r["rounds"]["profile"]
        med = {k: median_p50([p[k] for p in prof]) for k in prof[0]}
        loader, raw = median_p50(r["rounds"]["loader_p1"]), median_p50(r["rounds"]["raw"])
        phases = (med["pack"], med["message"], med["unpack"], med["step"], loader, raw)
        out.append(
            (f"{r['n_tensors']} t", size(r["payload"]), *(f"{x:.3f}" for x in phases), f"{loader - med['step']:+.3f}")
        )
    header = (
        "batch | payload | leader pack | leader message bcast | receiver unpack | rebuilt step | "
        "loader p=1 step | raw broadcast | loader p=1 - rebuilt"
    )
    return table(header, out)


def overlap_summary(r: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per run: mean and p95 exposed wait, as a fraction of the synchronous delivery time."""
    sync = r["overlap"]["sync_delivery"]
    return {
        name: {
            "mean": statistics.median(summary(w)["mean"] for w in waits) / sync,
            "p95": statistics.median(summary(w)["p95"] for w in waits) / sync,
        }
        for name, waits in r["overlap"]["waits"].items()
    }


PREFETCH = {"loader_p1": "1", "loader_default": "default (2)", "loader_device": "default (2), device"}


def overlap_table(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        sync = r["overlap"]["sync_delivery"]
        sync_mean = statistics.median(summary(x)["mean"] for x in r["rounds"]["loader_p1"])
        for name, frac in overlap_summary(r).items():
            variant, factor = name.split(" x")
            out.append(
                (
                    size(r["payload"]),
                    f"{sync * 1e3:.3f} ms",
                    f"{sync_mean * 1e3:.3f} ms",
                    f"{factor} x sync = {int(factor) * sync * 1e3:.3f} ms",
                    PREFETCH[variant],
                    f"{frac['mean'] * sync * 1e3:.3f} ms",
                    f"{frac['mean']:.1%}",
                    f"{frac['p95']:.1%}",
                )
            )
    header = (
        "payload | sync delivery (p=1 p50) | its mean | compute / step | prefetch | exposed wait, mean | "
        "mean / sync | p95 / sync"
    )
    return table(header, out)


def scale_table(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        rd = r["rounds"]
        built = {n: statistics.median(x["construct"] for x in rd[n]) * 1e3 for n in LOADERS}
        steps = {n: [x["steps"] for x in rd[n]] for n in LOADERS}
        pp, dp, tp = r["shape"]
        derived = layout_row(pp, dp, 1, tp)
        receivers = ", ".join(f"{name} {k}" for name, k in derived["receiver"].items())
        out.append(
            (
                r["world"],
                tuple(r["shape"]),
                r["group_count"],
                f"{built['loader_p1']:.1f} / {built['loader_default']:.1f} ms",
                p50_p95(steps["loader_p1"]),
                p50_p95(steps["loader_default"]),
                per_role(rd["loader_p1"][0]["stats"]),
                f"leader {derived['leader']}, {receivers}",
            )
        )
    header = (
        "ranks | mesh (pp, dp, tp) | groups | constructor p=1 / default (median) | step p=1 p50 (p95) | "
        "step default p50 (p95) | collectives per step, measured (stats) | from the layout code"
    )
    return table(header, out)


def buffer_table(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        ms = {mode: statistics.median(r[mode]) * 1e3 for mode in BUFFERS}
        out.append(
            (
                size(r["payload"]),
                *(f"{ms[mode]:.2f} ms" for mode in BUFFERS),
                f"{ms['fresh_freed'] / ms['reused']:.1f}",
                f"{ms['fresh_kept'] / ms['reused']:.1f}",
            )
        )
    header = "payload | buffer allocated once | fresh, freed each step | fresh, kept | freed / once | kept / once"
    return table(header, out)


def layout_table(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        recv = r["receiver"]
        last = recv.get("last", "(= first)" if r["pp"] == 1 else "-")
        groups = (r["gpus"], r["pp"], r["dp"], r["cp"], r["tp"], r["groups"], r["leader"])
        out.append((*groups, recv.get("first", "-"), last, recv.get("middle", "-")))
    header = (
        "GPUs | pp | dp | cp | tp | groups (`group_count`) | leader | first-stage receiver | "
        "last-stage receiver | middle-stage receiver"
    )
    return table(header, out)


def targets(delivery: list[dict[str, Any]]) -> list[str]:
    """One line per target: met or missed, with the measured ratios."""

    def line(name: str, values: list[tuple[str, float]], ok: Callable[[float], bool]) -> str:
        if not values:
            return f"- {name}: not measured in this run"
        verdict = "met" if all(ok(v) for _, v in values) else "MISSED"
        return f"- {name}: **{verdict}** ({', '.join(f'{k} {v:.2f}' for k, v in values)})"

    def ratios(pick: Callable[[dict], bool], num: str, den: str) -> list[tuple[str, float]]:
        return [(f"{r['n_tensors']}t {size(r['payload'])}", ratio(r["rounds"], num, den)) for r in delivery if pick(r)]

    waits = [
        (f"{size(r['payload'])} {name}", frac["mean"])
        for r in delivery
        if "overlap" in r
        for name, frac in overlap_summary(r).items()
    ]
    return [
        line(
            "loader (p=1) <= 1.15x raw broadcast at >= 1 MiB",
            ratios(lambda r: r["payload"] >= MIB, "loader_p1", "raw"),
            lambda v: v <= 1.15,
        ),
        line(
            "loader (p=1) <= 2x raw broadcast at 1 KiB",
            ratios(lambda r: r["payload"] == KIB, "loader_p1", "raw"),
            lambda v: v <= 2,
        ),
        line(
            "per-tensor / loader (p=1) >= 3 for 6 small tensors (<= 16 KiB)",
            ratios(lambda r: r["n_tensors"] == 6 and r["payload"] <= 16 * KIB, "per_tensor", "loader_p1"),
            lambda v: v >= 3,
        ),
        line(
            "exposed wait (mean) <= 10% of synchronous delivery when compute >= delivery time",
            waits,
            lambda v: v <= 0.10,
        ),
        "",
    ]


def markdown(results: dict[str, Any]) -> list[str]:
    """The report's body, under the title and header ``harness.Run.write`` adds."""
    meta = results["meta"]
    delivery = results["delivery"]
    return [
        (
            "Every figure compared is measured side by side in one world: each variant runs one epoch in turn, "
            f"{meta['rounds']} rounds, the order rotating each round. A step's time is the slowest rank's time "
            f"between two consecutive batches (first {SKIP} steps of each epoch left out); p50 (p95) in ms, each the "
            "median over rounds; ratios are medians over rounds of the per-round ratio of p50s. No compute, no "
            "loading: the source yields one pre-built batch. `gc.collect()` runs before every epoch, outside the "
            "timed steps."
        ),
        "",
        "## Targets",
        "",
        *targets(delivery),
        "## Delivery vs raw broadcast and vs the per-tensor pattern",
        "",
        (
            "Mesh (dp, tp) = (1, 4): one leader, three receivers, one delivery group of 4 ranks. *raw broadcast*: "
            "one `dist.broadcast` of the batch's tensor bytes per step over a `dist.new_group` of the same 4 ranks, "
            "into a buffer allocated once (the transport's limit). *raw header + payload*: a 64-byte broadcast then "
            "that one, both into buffers allocated once (the floor of the earlier protocol that sent a header then a payload). *per-tensor*: "
            "Megatron's `get_batch_on_this_tp_rank` pattern, one int64 broadcast of the shapes then one broadcast "
            "per tensor into fresh tensors (n + 1 collectives). *loader p=1*: `prefetch=1`, the synchronous "
            "delivery time; *loader default*: `prefetch=2`. Collectives per step come from `loader.stats()` "
            "(difference of a 2- and a 6-step epoch)."
        ),
        "",
        *delivery_tables(delivery),
        "## Where a step's time goes",
        "",
        (
            "One synchronous steady-state step rebuilt in the benchmark from the package's pieces (`wire.encode`, "
            "`Encoded.write` into a `BufferPool` buffer, `Header.decode`, `wire.decode`) and one "
            "`dist.broadcast` over the raw group, timed by phase with `time.perf_counter` (p50 ms, median over rounds, run in "
            "the same rotation as the variants above). *rebuilt step* is the slowest rank's whole step; the last "
            "column is what the loader adds on top (its transfer thread, queue hand-off, routing)."
        ),
        "",
        *profile_table(delivery),
        (
            "What a fresh buffer costs: writing a payload into a `torch.empty(n)` made each step (what the leader's "
            "pack did before `BufferPool`; receivers received into one) vs into a buffer allocated once (what the "
            "raw broadcast and the pool do). "
            "A fresh buffer is either freed at once (the loader's, once the loop drops the batch) or kept until the "
            "end (a loop that holds on to its batches). Worker thread, one torch thread, in the parent process after "
            "the worlds ended; median of 10 copies, median over rounds."
        ),
        "",
        *buffer_table(results["buffers"]),
        "## Overlap",
        "",
        (
            "The training loop sleeps a fixed time per step: 1x and 2x the synchronous delivery time (the p=1 p50 "
            "above, measured just before in the same world). The exposed wait is the time spent inside `next(it)`, "
            "slowest rank per step, over the synchronous delivery time. 6-tensor batches."
        ),
        "",
        *overlap_table([r for r in delivery if "overlap" in r]),
        "## Scale",
        "",
        (
            "Constructor time (slowest rank, `CollectiveLoader(...)` alone) and 1 KiB step time (512 B of inputs "
            "to the first stage, 512 B of labels to the last) as the world grows. These worlds run 2 to 16 processes "
            f"on {os.cpu_count()} cores, so times past 2 ranks measure oversubscription as much as the loader. The "
            "stats column counts the message collectives of the delivery groups per rank role; the leaders' "
            "all-reduce (dp > 1) is not in `stats()`."
        ),
        "",
        *scale_table(results["scale"]),
        "### Groups and collectives per step, from the layout code",
        "",
        (
            "No processes: `layout.group_count(dp, pp)` and `MeshLayout(...).replica_groups()`. Derivation: a "
            "leader does 1 all-reduce among leaders (when dp > 1), plus one message collective per delivery group: "
            "first stage and last stage (with pp = 1 they are one group); middle stages, without every_stage keys, "
            "are outside delivery (0 collectives); a receiver "
            "does 1. That is the steady state, while batch sizes repeat: a batch larger than the previous one on "
            "its channel costs one more collective. None of this grows with tp or cp."
        ),
        "",
        *layout_table(results["layout"]),
        "## Broadcast or scatter for shard ranks",
        "",
        (
            'Sequences split over cp (`split="zigzag"`): 4 sequences of int64 `input_ids` and `labels`, inputs to '
            'the first stage, labels to the last; the loader with `delivery="broadcast"` (every rank of a delivery '
            'group gets the whole batch and slices its own piece) and with `delivery="scatter"` (each rank is sent '
            "its piece), default prefetch, no compute. Both loaders are built once per world and take turns in "
            "rounds; step times of the slowest rank as above, and their mean, medians over rounds."
        ),
        "",
        *shard_table(results["shard"]),
    ]


def shard_table(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        rd = r["rounds"]
        mesh = ",".join(f"{d}={k}" for d, k in zip(r["dims"], r["shape"]))
        mean = [statistics.median(summary(x)["mean"] for x in rd[m]) * 1e3 for m in SHARD_MODES]
        out.append(
            (
                mesh,
                size(r["payload"]),
                r["steps"],
                *(p50_p95(rd[m]) for m in SHARD_MODES),
                *(f"{x:.3f}" for x in mean),
                f"{ratio(rd, 'scatter', 'broadcast'):.2f}",
            )
        )
    header = (
        "mesh | payload | steps | broadcast p50 (p95) | scatter p50 (p95) | broadcast mean | scatter mean | "
        "scatter / broadcast (p50)"
    )
    return table(header, out)


def plot_payloads(plt: Any, delivery: list[dict[str, Any]], path: str) -> None:
    """p50 per step vs payload for every variant, and the ratios to raw broadcast."""
    kinds = sorted({r["n_tensors"] for r in delivery})
    fig, axes = plt.subplots(2, len(kinds), figsize=(6 * len(kinds), 8), squeeze=False)
    variants = ("loader_p1", "loader_default", "loader_device", "raw", "raw_pair", "per_tensor")
    for col, n_tensors in enumerate(kinds):
        rows = [r for r in delivery if r["n_tensors"] == n_tensors]
        x = [r["payload"] for r in rows]
        for v in variants:
            y = [median_p50(r["rounds"][v]) for r in rows]
            axes[0][col].loglog(x, y, marker="o", label=LABELS[v])
            if v != "raw":
                ratios = [ratio(r["rounds"], v, "raw") for r in rows]
                axes[1][col].semilogx(x, ratios, marker="o", label=f"{LABELS[v]} / raw broadcast")
        for target in (1.15, 2.0):
            axes[1][col].axhline(target, color="grey", linestyle=":", linewidth=1)
        axes[0][col].set(title=f"{n_tensors} tensor(s), 4 ranks, gloo", ylabel="ms per step (p50)")
        axes[1][col].set(xlabel="payload (bytes)", ylabel="ratio to raw broadcast (p50)")
        for ax in axes[:, col]:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scale(plt: Any, scale: list[dict[str, Any]], path: str) -> None:
    """Constructor time and 1 KiB step time vs world size."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    worlds = [r["world"] for r in scale]
    for name in LOADERS:
        built = [statistics.median(x["construct"] for x in r["rounds"][name]) * 1e3 for r in scale]
        step = [median_p50([x["steps"] for x in r["rounds"][name]]) for r in scale]
        axes[0].plot(worlds, built, marker="o", label=LABELS[name])
        axes[1].plot(worlds, step, marker="o", label=LABELS[name])
    axes[0].set(xlabel="ranks", ylabel="constructor ms (slowest rank)", title="CollectiveLoader(...)")
    axes[1].set(xlabel="ranks", ylabel="ms per step (p50)", title="1 KiB batch")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny version, under a minute")
    parser.add_argument("--small-tensors", action="store_true", help="the small-tensor case alone")
    args = parser.parse_args(argv)
    if args.small_tensors:
        return small_tensors(argv)
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


def small_tensors(argv: list[str] | None) -> int:
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


if __name__ == "__main__":
    sys.exit(main())
