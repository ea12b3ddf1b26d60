"""``demo --mix``: three sources whose documents differ tenfold in length, mixed on a two-phase
schedule counted in tokens by :class:`~collective_loader.streaming.MixtureSource`, beside
streaming's own mixing (``Stream(proportion=...)``, what users do today) of the same sources.

Every token says which source it came from (its value's range), so rank 0 counts the real tokens
each source contributed to each phase over every replica and checks every window of 8 steps
against the allocator's bound (:mod:`collective_loader.text.mixture`). Exit code 0 when every
window is within it, 1 otherwise.
"""

from __future__ import annotations

import os
from collections import Counter
from itertools import islice
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from collective_loader.cli.args import SHUFFLE_SEED, DemoArgs
from collective_loader.cli.run import on_node_data
from collective_loader.loader import CollectiveLoader
from collective_loader.plan.mesh import mesh_place
from collective_loader.streaming import MixtureSource, StreamingSource
from collective_loader.testing.data import write_token_documents
from collective_loader.text import MixtureSchedule, Packing, Phase, TokenColumn
from collective_loader.text.packing import IGNORE_INDEX

# name -> (first token value, document lengths low-high): lengths tenfold apart
SOURCES = {"short": (1, 10, 60), "medium": (20000, 100, 600), "long": (40000, 1000, 6000)}
TOKENS_PER_SOURCE = 60_000
STEPS = 32  # per phase, two phases
WINDOW = 8


def write_sources(out: str) -> None:
    """Three MDS datasets of uint16 token documents under ``out``, one per source."""
    rng = np.random.default_rng(0)
    for name, (base, low, high) in SOURCES.items():
        docs, total = [], 0
        while total < TOKENS_PER_SOURCE:
            n = int(rng.integers(low, high + 1))
            docs.append(base + rng.integers(0, 19000, size=n))
            total += n
        write_token_documents(os.path.join(out, name), docs, "bytes", "uint16")


FIRST = {"short": 0.5, "medium": 0.3, "long": 0.2}
SECOND = {"short": 0.2, "medium": 0.3, "long": 0.5}


def schedule_for(a: DemoArgs, dp: int) -> MixtureSchedule:
    """FIRST in tokens, then, after STEPS steps, SECOND (a step change)."""
    return MixtureSchedule((Phase(0, FIRST), Phase(STEPS * dp * a.batch_size * a.seq_len, SECOND)))


def source_of(token: int) -> str:
    return max((base, name) for name, (base, _, _) in SOURCES.items() if token >= base)[1]


def counts(batch: dict[str, Any]) -> Counter[str]:
    """Real tokens per source in one batch: the labels that are tokens, by their value."""
    labels = batch["labels"]
    real = labels[labels != IGNORE_INDEX]
    return Counter(source_of(int(t)) for t in real.tolist())


def mix_main(a: DemoArgs) -> int:
    """One rank of ``demo --mix`` (``launch.run`` calls it on every one); rank 0's verdict."""
    if not a.data:  # under torchrun
        return on_node_data(a, "mix", write_sources, mix_main)
    mesh = init_device_mesh("cpu", a.shape, mesh_dim_names=a.dims)
    place = mesh_place(mesh, dist.get_rank(), placement=a.placement)
    packing = Packing(a.seq_len, a.at_end)
    common: dict[str, Any] = dict(
        batch_size=a.batch_size, packing=packing, layout=TokenColumn(dtype="uint16"), placement=a.placement
    )
    paths = {name: os.path.join(a.data, name) for name in SOURCES}
    sources = {name: {"local": path, "shuffle": True, "shuffle_seed": SHUFFLE_SEED} for name, path in paths.items()}
    mixture = MixtureSource(mesh, sources, schedule_for(a, place.dp_size), clean_stale=True, **common)
    keys: dict[str, Any] = dict(inputs=("input_ids", "position_ids"), delivery=a.delivery, placement=a.placement)
    ours = _counts(CollectiveLoader(mixture, mesh, labels=("labels", "source_id"), **keys))

    from streaming import Stream  # what users do today: streaming mixes samples in fixed proportions

    streams = [Stream(local=paths[name], proportion=w) for name, w in FIRST.items()]
    naive_source = StreamingSource(mesh, streams=streams, shuffle=True, shuffle_seed=SHUFFLE_SEED, **common)
    naive = _counts(CollectiveLoader(naive_source, mesh, labels=("labels",), **keys))
    gathered: list[Any] = [None] * dist.get_world_size()
    record = (place.dp_rank, place.shard, ours, naive)
    dist.all_gather_object(gathered, record)  # the demo's bookkeeping, not the data path
    code = torch.tensor([_report(a, place.dp_size, gathered) if dist.get_rank() == 0 else 0])
    dist.broadcast(code, src=0)
    return int(code)


def _counts(loader: CollectiveLoader) -> list[Counter[str]] | None:
    """Real tokens per source in each of 2 x STEPS steps on a rank that holds labels, else None."""
    out = [counts(batch) for batch in islice(loader, 2 * STEPS)] if loader.is_last_stage else None
    if not loader.is_last_stage:
        for _ in islice(loader, 2 * STEPS):
            pass
    loader.close()
    return out


def _report(a: DemoArgs, dp: int, gathered: list[Any]) -> int:
    """Rank 0: each phase's share of real tokens per source, ours and streaming's, and the windows."""
    ours: list[Counter[str]] = [Counter() for _ in range(2 * STEPS)]
    naive: list[Counter[str]] = [Counter() for _ in range(2 * STEPS)]
    seen: set[tuple[int, Any]] = set()
    for dp_rank, shard, mine, theirs in gathered:
        if mine is None or (dp_rank, shard) in seen:  # one copy of each piece of each replica
            continue
        seen.add((dp_rank, shard))
        for step, (c, n) in enumerate(zip(mine, theirs)):
            ours[step] += c
            naive[step] += n
    names = tuple(SOURCES)
    print(
        f"\ncollective_loader demo --mix: mesh {dict(zip(a.dims, a.shape))}, {dp} replicas x {a.batch_size} rows of {a.seq_len} tokens per step"
    )
    print("sources (document lengths in tokens): " + ", ".join(f"{n} {lo}-{hi}" for n, (_, lo, hi) in SOURCES.items()))
    print(
        "share of real tokens trained, per phase (target / MixtureSource / streaming's Stream(proportion=target of phase 1)):"
    )
    for phase, (target, steps) in enumerate(((FIRST, ours[:STEPS]), (SECOND, ours[STEPS:]))):
        theirs = naive[:STEPS] if phase == 0 else naive[STEPS:]
        got, base = sum(steps, Counter()), sum(theirs, Counter())
        line = ", ".join(
            f"{n} {target[n]:.2f} / {got[n] / max(sum(got.values()), 1):.3f} / {base[n] / max(sum(base.values()), 1):.3f}"
            for n in names
        )
        print(f"  phase {phase + 1} (steps {phase * STEPS + 1}-{(phase + 1) * STEPS}): {line}")
    # the allocator's bound: over all replicas, within 2 - 1/(n-1) rows of the target in any window
    slack = (2 - 1 / (len(names) - 1)) * (a.seq_len + 1)
    worst, failed = 0.0, []
    for start in range(0, 2 * STEPS - WINDOW + 1):
        if start < STEPS < start + WINDOW:
            continue  # a window across the step change has no single target
        window = sum(ours[start : start + WINDOW], Counter())
        total = sum(window.values())
        target = FIRST if start < STEPS else SECOND
        for n in names:
            off = abs(window[n] - target[n] * total)
            worst = max(worst, off / (a.seq_len + 1))
            if off > slack:
                failed.append(
                    f"steps {start + 1}-{start + WINDOW}: {n} {window[n]} tokens, target {target[n] * total:.0f}"
                )
    print(
        f"every {WINDOW}-step window within one phase: worst {worst:.2f} rows (over all {dp} replicas) off its target (bound {slack / (a.seq_len + 1):.2f})"
    )
    for line in failed:
        print(f"  [FAILED] {line}")
    print("all checks passed" if not failed else "some checks FAILED")
    return 0 if not failed else 1
