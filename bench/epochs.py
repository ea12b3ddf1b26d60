"""Epochs of a loader or of raw broadcasts, timed per step, and their statistics over rounds: what
the delivery benchmarks share (``delivery.py``, ``delivery_scale.py``, ``delivery_small_tensors.py``).

An *epoch* is ``n -> iterable``: something that yields once per delivered step. :func:`timed_epoch`
runs one after ``SKIP`` warm-up steps on every rank; a run's figure per step is the slowest rank's
(:func:`slowest_steps`); tables give the median over rounds of each round's p50 (:func:`p50_p95`,
:func:`median_p50`) and ratios as the median over rounds of the per-round ratio of p50s
(:func:`ratio`).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from harness import Repeat, Steps, gather, slowest, timed_steps  # bench/harness.py: run as python bench/<name>.py

from collective_loader import CollectiveLoader

MIXED = (torch.int64, torch.int32, torch.float32, torch.bfloat16, torch.bool, torch.float16)
SKIP = 2  # warm-up steps left out at the start of every epoch
TIMEOUT = 120.0  # seconds a loader waits in one collective
LEADER = 0  # the leader's rank in the delivery worlds
DELIVERY_MESH = (("dp", "tp"), (1, 4))  # one leader (rank 0), three receivers
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

Epoch = Callable[[int], Iterable[Any]]  # n -> something that yields once per delivered step


# --- batches and epochs -----------------------------------------------------------------------


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


# --- statistics over rounds -------------------------------------------------------------------


def summary(seconds: list[float]) -> dict[str, float]:
    return {
        "p50": float(np.percentile(seconds, 50)),
        "p95": float(np.percentile(seconds, 95)),
        "mean": float(np.mean(seconds)),
    }


def ratio(rounds: dict[str, list[list[float]]], num: str, den: str) -> float:
    """Median over rounds of the per-round ratio of p50s."""
    return statistics.median(summary(a)["p50"] / summary(b)["p50"] for a, b in zip(rounds[num], rounds[den]))


def p50_p95(series: list[list[float]]) -> str:
    """``p50 (p95)`` in ms, each the median over rounds."""
    p50 = statistics.median(summary(r)["p50"] for r in series)
    p95 = statistics.median(summary(r)["p95"] for r in series)
    return f"{p50 * 1e3:.3f} ({p95 * 1e3:.3f})"


def median_p50(series: list[list[float]]) -> float:
    """The median over rounds of the p50, in ms."""
    return statistics.median(summary(x)["p50"] for x in series) * 1e3


def per_role(stats: list[dict[str, Any]], key: str = "collectives") -> str:
    """``role: value`` for each distinct role, e.g. ``leader 2, both 2``."""
    roles: dict[str, set[float]] = {}
    for s in stats:
        roles.setdefault(s["role"], set()).add(s[key])
    return ", ".join(f"{role} {'/'.join(f'{v:g}' for v in sorted(vs))}" for role, vs in roles.items())
