"""The ranks' side of ``bench/elastic.py``'s per-step cost: what ``QuorumData.step()`` adds over a
plain ``CollectiveLoader`` delivering the same bytes, on the leader and on a non-leader.

One 2-rank gloo world, mesh ``tp=2`` (rank 0 the leader, rank 1 a tp peer that receives a copy),
torchft's ``Manager`` stood in for by :class:`FixedQuorum` (participant 0 of 2 every step, every
step committing: the quorum RPCs are torchft's, the same for any loader, and left out).

- **QuorumData**: per step ``start_quorum()``, ``data.step()`` iterated to its end, ``end_step``:
  the share is computed after the quorum, the leader reads the step's samples by index and the
  group's ``CollectiveLoader`` delivers them in an epoch of that step alone.
- **plain**: one ``CollectiveLoader`` epoch over a source that reads the same samples the same
  way (the same windows of the same global order, the same collate) and yields the same
  micro-batches, one after another: ``next()`` as many times per step.

The time per step is the wall time inside those data calls on each rank. Two loops: back to back
(the data path alone) and with 20 ms of host-idle work per step (a sleep: the plain loader
prefetches meanwhile, ``QuorumData`` cannot read ahead of the quorum). Variants alternate within
each round (:func:`harness.rotated`); each rank keeps one record per round.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

import harness  # bench/harness.py: run as python bench/<name>.py
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import default_collate

from collective_loader import CollectiveLoader
from collective_loader.integrations.torchft import QuorumData
from collective_loader.plan.quorum import GlobalOrder, step_share

PARTICIPANTS = 2  # the group is participant 0 of 2: half of every global batch
SKIP = 5  # warm-up steps of every run
COMPUTE = 0.020  # seconds of host-idle work per step in the second loop
TIMEOUT = 120.0


@dataclasses.dataclass(frozen=True)
class Payload:
    """Samples of ``width`` float32 values (``x``), a float32 label and an int64 id;
    ``global_batch`` and ``micro_batch`` as QuorumData's."""

    name: str
    width: int
    global_batch: int
    micro_batch: int
    samples: int = 256

    def step_bytes(self) -> int:
        return self.global_batch // PARTICIPANTS * (self.width * 4 + 4 + 8)  # the group's half


@dataclasses.dataclass(frozen=True)
class Settings:
    payloads: tuple[Payload, ...]
    steps: int
    rounds: int
    out: str


class FixedQuorum:
    """What ``QuorumData`` asks of torchft's ``Manager``: the same quorum every step, every step committed."""

    def __init__(self) -> None:
        self.step = 0

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        pass

    def start_quorum(self) -> None:
        pass

    def participating_rank(self) -> int:
        return 0

    def num_participants(self) -> int:
        return PARTICIPANTS

    def is_participating(self) -> bool:
        return True

    def current_step(self) -> int:
        return self.step

    def should_commit(self) -> bool:
        self.step += 1
        return True


class Rows:
    """Sample ``i``: ``x`` (``width`` float32), ``y`` and its id, from one tensor built once."""

    def __init__(self, p: Payload) -> None:
        self.x = torch.randn(p.samples, p.width, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.x[i, 0], "sample_id": i}


class PlainSource:
    """The same micro-batches as ``QuorumData`` yields, read the same way, one after another."""

    def __init__(self, dataset: Rows, p: Payload) -> None:
        self.dataset, self.p = dataset, p
        self.order = GlobalOrder(len(dataset), seed=5)
        self.steps = 0  # set before iter(): the epoch's steps

    def __iter__(self) -> Iterator[dict]:
        for k in range(self.steps):
            share = step_share(k * self.p.global_batch, self.p.global_batch, 0, PARTICIPANTS, 0, 1, self.p.micro_batch)
            for lo, hi in share.micro_batches:
                yield default_collate([self.dataset[i] for i in self.order.indices(lo, hi)])


def quorum_steps(data: QuorumData, manager: FixedQuorum, steps: int, compute: float) -> list[float]:
    """Seconds inside the data calls per step (``QuorumData``)."""
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        manager.start_quorum()
        for batch in data.step():
            del batch
        data.end_step(manager.should_commit())
        out.append(time.perf_counter() - start)
        if compute:
            time.sleep(compute)
    return out


def plain_steps(
    loader: CollectiveLoader, source: PlainSource, per_step: int, steps: int, compute: float
) -> list[float]:
    """Seconds inside ``next()`` per step (``per_step`` micro-batches) of one plain epoch."""
    source.steps = steps
    it = iter(loader)
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        for _ in range(per_step):
            next(it)
        out.append(time.perf_counter() - start)
        if compute:
            time.sleep(compute)
    for _ in it:  # the epoch's end, on every rank alike
        pass
    return out


def payload_case(s: Settings, mesh: Any, p: Payload) -> dict[str, Any]:
    """Every round of one payload on this rank: per loop, per variant, the per-step times."""
    dataset = Rows(p)
    manager = FixedQuorum()
    data = QuorumData(
        dataset, mesh, manager, global_batch=p.global_batch, micro_batch=p.micro_batch, seed=5,
        inputs=("x", "sample_id"), labels=("y",), timeout=TIMEOUT,
    )  # fmt: skip
    source = PlainSource(dataset, p)  # read on the leader only
    plain = CollectiveLoader(lambda: source, mesh, inputs=("x", "sample_id"), labels=("y",), timeout=TIMEOUT)
    per_step = len(step_share(0, p.global_batch, 0, PARTICIPANTS, 0, 1, p.micro_batch).micro_batches)
    runs = {
        "quorum": lambda c: quorum_steps(data, manager, SKIP + s.steps, c)[SKIP:],
        "plain": lambda c: plain_steps(plain, source, per_step, SKIP + s.steps, c)[SKIP:],
    }
    rounds: list[dict[str, Any]] = []
    for r in range(s.rounds):
        record: dict[str, Any] = {}
        for loop, compute in (("back_to_back", 0.0), ("compute_20ms", COMPUTE)):
            for name in harness.rotated(list(runs), r):
                gc.collect()  # not inside another variant's timed steps
                dist.barrier()
                record[f"{loop}/{name}"] = statistics.median(runs[name](compute))
        rounds.append(record)
    data.close()
    plain.close()
    return {"payload": p.name, "step_bytes": p.step_bytes(), "micro_batches": per_step, "rounds": rounds}


def world_main(s: Settings) -> int:
    """Rank entry: every payload, every round; each rank keeps its record."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    record = {"rank": dist.get_rank(), "load_before": os.getloadavg()[0], "payloads": []}
    for p in s.payloads:
        record["payloads"].append(payload_case(s, mesh, p))
    record["load_after"] = os.getloadavg()[0]
    harness.keep(s.out, record)
    return 0
