"""``close()`` ends a source's DataLoader workers at once, also an epoch left early and
``persistent_workers=True``; a new epoch after one left early starts with fresh workers.

Without it the workers of an epoch left early lived until the iterator was garbage-collected
(torchdata's ``__del__`` then took 10.4-10.8 s per leader), and persistent ones until exit.
"""

from __future__ import annotations

import multiprocessing

import pytest
import ranks
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from collective_loader import CollectiveLoader

BATCHES = 8


class Samples(Dataset):
    def __len__(self) -> int:
        return 2 * BATCHES

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((4,), i), "y": torch.full((4,), -i)}


JOIN = 60.0  # seconds a stopped worker gets to exit: a bound for a hang, not a measure (it exits at once)


def close_early(kind: str, persistent: bool) -> dict:
    mesh = ranks.make_mesh(("dp", "tp"), (1, 2))
    make = StatefulDataLoader if kind == "torchdata" else DataLoader
    source = make(Samples(), batch_size=2, num_workers=2, multiprocessing_context="fork", persistent_workers=persistent)
    loader = CollectiveLoader(source, mesh, inputs=("x",), labels=("y",), timeout=60)
    out = {"rank": dist.get_rank(), "leader": loader.is_leader}
    it = iter(loader)
    next(it), next(it)
    if persistent:  # a new epoch after one left early: every batch, from fresh workers
        out["second_epoch"] = [b["x"][:, 0].tolist() for b in loader]
    it = iter(loader)
    next(it)
    workers = multiprocessing.active_children()
    out["workers_mid_epoch"] = len(workers)
    loader.close()
    # ``it`` still refers to the epoch: nothing but close() has ended the workers. Each exits by
    # itself once told to (exit code 0); one that the DataLoader's shutdown had to terminate after
    # waiting for it (its 5 s join: the slow close of old) exits -15, one never told runs on
    for w in workers:
        w.join(JOIN)
    out["exit_codes"] = [w.exitcode for w in workers]
    out["workers_after_close"] = len(multiprocessing.active_children())
    del it
    return out


@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent_workers"])
@pytest.mark.parametrize("kind", ["torch", "torchdata"])
def test_close_stops_the_workers_at_once(worlds, kind, persistent):
    records = worlds.get(2).run(close_early, kind, persistent, timeout=120)
    leader = next(r for r in records if r["leader"])
    assert leader["workers_mid_epoch"] == 2, leader  # the check below looks at real workers
    assert leader["exit_codes"] == [0, 0] and leader["workers_after_close"] == 0, leader
    if persistent:
        want = [[2 * i, 2 * i + 1] for i in range(BATCHES)]
        assert all(r["second_epoch"] == want for r in records), records
