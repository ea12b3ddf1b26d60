"""Soak: many steps with prefetch on an 8-rank mesh. Per rank, RSS stays flat after warm-up, open
file descriptors and threads do not grow, and /dev/shm holds nothing new afterwards.

The default run does 500 steps; the long version (10,000 steps, a few minutes) is marked slow:
``python -m pytest -m slow tests/distributed/test_soak.py``.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import ranks
import torch.distributed as dist

from collective_loader import CollectiveLoader

MESH = (("pp", "dp", "cp", "tp"), (2, 2, 2, 1))  # shard peers, two stages, two replicas
BATCH, SEQ = 4, 1024  # 96 KiB to the first stage, 40 KiB to the last, per replica and step
MIB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads(ended: frozenset[int] = frozenset()) -> int:
    """The OS thread count, less the ``ended`` ones: the native ids of Python threads that have
    ended, whose OS thread may still be listed in /proc while it finishes exiting (seen as +2 on
    a loaded machine). A leaked thread, native or Python, is counted."""
    return len(set(os.listdir("/proc/self/task")) - {str(t) for t in ended})


def _loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("collective_loader")]


def _ours() -> int:
    return len(_loader_threads())


def soak(steps: int):
    """One epoch of ``steps`` steps of fresh batches; RSS sampled every 1% of the steps."""
    mesh = ranks.make_mesh(*MESH)
    dp = ranks.mesh_place(mesh, dist.get_rank()).dp_rank
    loader = CollectiveLoader(
        lambda: ranks.id_batches(dp, 2, steps * BATCH * 2, BATCH, SEQ), mesh, **ranks.KEYS, timeout=120
    )
    fds0, threads0 = _fds(), _threads()
    warm = steps // 10
    samples, in_epoch, epoch_threads = [], None, frozenset()
    n = 0
    for n, _ in enumerate(loader, 1):
        if n == warm:
            in_epoch = (_fds(), _threads(), _ours())
            epoch_threads = frozenset(t.native_id for t in _loader_threads())
        if n >= warm and n % max(1, steps // 100) == 0:
            samples.append((n, _rss()))
    # the epoch's threads have ended (``ours`` checks it): their OS threads are not counted
    end_of_epoch = (_fds(), _threads(epoch_threads), _ours())
    loader.close()
    steps_at, rss = np.array(samples, dtype=np.float64).T
    slope = float(np.polyfit(steps_at, rss, 1)[0])  # bytes per step
    return {
        "rank": dist.get_rank(),
        "steps": n,
        "slope": slope,
        "growth": float(rss[-1] - rss[0]),
        "fds": (fds0, *[x[0] for x in (in_epoch, end_of_epoch)]),
        "threads": (threads0, *[x[1] for x in (in_epoch, end_of_epoch)]),
        "ours": (in_epoch[2], end_of_epoch[2]),
        "leader": ranks.mesh_place(mesh, dist.get_rank()).is_leader,
    }


def _check(records, steps, max_growth, max_slope):
    for r in records:
        assert r["steps"] == steps, r
        assert r["growth"] < max_growth and r["slope"] < max_slope, r
        fds0, fds_mid, fds_end = r["fds"]
        assert fds0 == fds_mid == fds_end, r  # nothing opened per step or per epoch
        # in the epoch: the transfer thread and, on leaders, its stall watchdog; both gone after it
        assert r["ours"] == (2 if r["leader"] else 1, 0), r
        threads0, threads_mid, threads_end = r["threads"]
        assert threads_mid <= threads0 + r["ours"][0] and threads_end <= threads0, r


def _shm() -> set[str]:
    """/dev/shm entries, less the semaphores of the test world's own multiprocessing queues."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {n for n in names if not n.startswith("sem.mp-")}


def test_soak_500_steps(worlds):
    before = _shm()
    records = worlds.get(8).run(soak, 500, timeout=240)
    # a batch leaked per step would be >= 40 KiB per step, 18 MiB over the 450 measured steps;
    # the slope of so short a run is mostly warm-up (measured here: up to 4 KiB per step)
    _check(records, 500, max_growth=8 * MIB, max_slope=float("inf"))
    assert _shm() <= before


@pytest.mark.slow
def test_soak_10000_steps(worlds):
    before = _shm()
    records = worlds.get(8).run(soak, 10_000, timeout=1800)
    # measured here: at most 1.1 MiB of growth and 22-33 bytes per step over 9,000 steps
    _check(records, 10_000, max_growth=8 * MIB, max_slope=256)
    assert _shm() <= before
    figures = ", ".join(f"rank {r['rank']} {r['growth'] / MIB:.1f} MiB ({r['slope']:+.1f} B/step)" for r in records)
    print(f"\nRSS growth after warm-up over 10,000 steps: {figures}")
