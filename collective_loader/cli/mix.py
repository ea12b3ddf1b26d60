"""``demo --mix``: three sources whose documents differ tenfold in length, mixed on a two-phase
schedule in tokens by :class:`~collective_loader.streaming.MixtureSource`, beside streaming's own
mixing (``Stream(proportion=...)``, what users do today) of the same sources.

Every token's value says its source, so rank 0 counts each source's real tokens per phase over
every replica and checks every 8-step window against the allocator's bound (``docs/mixtures.md``).
Exit code 0 when every window is within it, 1 otherwise.
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
from collective_loader.text import MixtureSchedule, Packing, TokenColumn
from collective_loader.text.packing import IGNORE_INDEX

# name -> (first token value, document lengths low-high): lengths tenfold apart
SOURCES = {"short": (1, 10, 60), "medium": (20000, 100, 600), "long": (40000, 1000, 6000)}
FIRST, SECOND = {"short": 0.5, "medium": 0.3, "long": 0.2}, {"short": 0.2, "medium": 0.3, "long": 0.5}
TOKENS_PER_SOURCE, STEPS, WINDOW = 60_000, 32, 8  # STEPS per phase, two phases


def write_sources(out: str) -> None:
    """Three MDS datasets of uint16 token documents under ``out``, one per source."""
    rng = np.random.default_rng(0)
    for name, (base, low, high) in SOURCES.items():
        docs, total = [], 0
        while total < TOKENS_PER_SOURCE:
            docs.append(base + rng.integers(0, 19000, size=int(rng.integers(low, high + 1))))
            total += len(docs[-1])
        write_token_documents(os.path.join(out, name), docs, "bytes", "uint16")


def counts(batch: dict[str, Any]) -> Counter[str]:
    """Real tokens per source in one batch: the labels that are tokens, by their value."""
    labels = batch["labels"]
    bases = sorted((base, name) for name, (base, _, _) in SOURCES.items())
    return Counter(max(b for b in bases if t >= b[0])[1] for t in labels[labels != IGNORE_INDEX].tolist())


def mix_main(a: DemoArgs) -> int:
    """One rank of ``demo --mix`` (``launch.run`` calls it on every one); rank 0's verdict."""
    if not a.data:  # under torchrun
        return on_node_data(a, "mix", write_sources, mix_main)
    mesh = init_device_mesh("cpu", a.shape, mesh_dim_names=a.dims)
    place = mesh_place(mesh, dist.get_rank(), placement=a.placement)
    common: dict[str, Any] = dict(
        batch_size=a.batch_size, packing=Packing(a.seq_len, a.at_end), layout=TokenColumn(dtype="uint16")
    )
    common |= dict(placement=a.placement, shuffle=True, shuffle_seed=SHUFFLE_SEED)
    paths = {name: os.path.join(a.data, name) for name in SOURCES}
    # FIRST in tokens, then, after STEPS steps, SECOND (a step change)
    schedule = MixtureSchedule(
        (
            MixtureSchedule.Phase(0, FIRST),
            MixtureSchedule.Phase(STEPS * place.dp_size * a.batch_size * a.seq_len, SECOND),
        )
    )
    mixture = MixtureSource(mesh, {n: {"local": p} for n, p in paths.items()}, schedule, clean_stale=True, **common)
    keys: dict[str, Any] = dict(inputs=("input_ids", "position_ids"), delivery=a.delivery, placement=a.placement)
    ours = _counts(CollectiveLoader(mixture, mesh, labels=("labels", "source_id"), **keys))

    from streaming import Stream  # what users do today: streaming mixes samples in fixed proportions

    naive_source = StreamingSource(
        mesh, streams=[Stream(local=paths[n], proportion=w) for n, w in FIRST.items()], **common
    )
    naive = _counts(CollectiveLoader(naive_source, mesh, labels=("labels",), **keys))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (place.dp_rank, place.shard, ours, naive))  # the demo's bookkeeping
    code = torch.tensor([_report(a, place.dp_size, gathered) if dist.get_rank() == 0 else 0])
    dist.broadcast(code, src=0)
    return int(code)


def _counts(loader: CollectiveLoader) -> list[Counter[str]] | None:
    """Real tokens per source in each of 2 x STEPS steps on a rank that holds labels, else None."""
    last = loader.is_last_stage
    out = [counts(batch) if last else Counter() for batch in islice(loader, 2 * STEPS)]
    loader.close()
    return out if last else None


def _report(a: DemoArgs, dp: int, gathered: list[Any]) -> int:
    """Rank 0: each phase's share of real tokens per source, ours and streaming's, and the windows."""
    ours: list[Counter[str]] = [Counter() for _ in range(2 * STEPS)]
    naive: list[Counter[str]] = [Counter() for _ in range(2 * STEPS)]
    pieces = {(dp_rank, shard): (mine, theirs) for dp_rank, shard, mine, theirs in gathered if mine is not None}
    for mine, theirs in pieces.values():  # one copy of each piece of each replica
        for step, (c, n) in enumerate(zip(mine, theirs)):
            ours[step] += c
            naive[step] += n
    mesh = dict(zip(a.dims, a.shape))
    print(
        f"\ncollective_loader demo --mix: mesh {mesh}, {dp} replicas x {a.batch_size} rows of {a.seq_len} tokens per step"
    )
    print("sources (document lengths in tokens): " + ", ".join(f"{n} {lo}-{hi}" for n, (_, lo, hi) in SOURCES.items()))
    print(
        "share of real tokens trained, per phase (target / MixtureSource / streaming's Stream(proportion=target of phase 1)):"
    )
    for phase, target in enumerate((FIRST, SECOND)):
        steps = slice(phase * STEPS, (phase + 1) * STEPS)
        got, base = sum(ours[steps], Counter()), sum(naive[steps], Counter())
        shares = [
            f"{target[n]:.2f} / {got[n] / max(got.total(), 1):.3f} / {base[n] / max(base.total(), 1):.3f}"
            for n in SOURCES
        ]
        line = ", ".join(f"{n} {share}" for n, share in zip(SOURCES, shares))
        print(f"  phase {phase + 1} (steps {phase * STEPS + 1}-{(phase + 1) * STEPS}): {line}")
    # the allocator's bound: over all replicas, within 2 - 1/(n-1) rows of the target in any window
    bound, row = 2 - 1 / (len(SOURCES) - 1), a.seq_len + 1
    worst, failed = 0.0, []
    for start in (s for s in range(2 * STEPS - WINDOW + 1) if not s < STEPS < s + WINDOW):  # within one phase
        window, target = sum(ours[start : start + WINDOW], Counter()), FIRST if start < STEPS else SECOND
        for n in SOURCES:
            off = abs(window[n] - target[n] * window.total()) / row
            worst = max(worst, off)
            if off > bound:
                failed.append(
                    f"steps {start + 1}-{start + WINDOW}: {n} {window[n]} tokens, target {target[n] * window.total():.0f}"
                )
    print(
        f"every {WINDOW}-step window within one phase: worst {worst:.2f} rows (over all {dp} replicas) off its target (bound {bound:.2f})"
    )
    for line in failed:
        print(f"  [FAILED] {line}")
    print("all checks passed" if not failed else "some checks FAILED")
    return 0 if not failed else 1
