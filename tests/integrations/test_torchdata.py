"""torchdata's ``StatefulDataLoader`` as a CollectiveLoader source: checkpoint and exact resume.

On a (pp, dp, tp) = (2, 2, 2) mesh of 8 gloo ranks, each replica's leader builds a
``StatefulDataLoader`` over its own partition of a map-style dataset of sample ids. A run is
stopped after ``STOP`` steps, its ``loader.state_dict()`` (taken on every rank) goes through
``torch.save`` / ``torch.load(weights_only=True)``, and a new CollectiveLoader over a new
``StatefulDataLoader`` resumes from it. Every rank (both pipeline stages, both tp peers) must get
exactly the batches of an uninterrupted run from step ``STOP + 1`` on, with no sample before the
checkpoint delivered again, and without the "skipping batches" fallback (which means the
source's own state was not used). A plain ``DataLoader`` over the same sampler is the control:
it resumes by skipping, and the test sees its warning.
"""

from __future__ import annotations

import io
import warnings

import pytest
import ranks
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from collective_loader import CollectiveLoader, mesh_place

MESH = (("pp", "dp", "tp"), (2, 2, 2))
SAMPLES, BATCH, SEQ = 40, 2, 8  # 20 samples per replica: 10 steps an epoch
STOP = 3
SEED = 7
STEPS = SAMPLES // MESH[1][1] // BATCH


class Samples(Dataset):
    """Sample ``i``: ``sample_id = i``, ``input_ids[s] = 1000 i + s``, ``labels = input_ids + 1``."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {key: value[0] for key, value in ranks.sample_batch([i], SEQ).items()}


def make_source(kind: str, num_workers: int, dp_rank: int, dp_size: int):
    """The replica's data loader (called on leaders only, by the CollectiveLoader)."""
    ds = Samples()
    sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=SEED)
    # forkserver: forked workers of a process with gloo threads start slowly (docs/streaming.md, "DataLoader workers")
    context = {"multiprocessing_context": "forkserver"} if num_workers else {}
    cls = DataLoader if kind == "plain" else StatefulDataLoader
    return cls(ds, batch_size=BATCH, sampler=sampler, num_workers=num_workers, **context)


def build(kind: str, num_workers: int) -> CollectiveLoader:
    mesh = ranks.make_mesh(*MESH)
    place = mesh_place(mesh, dist.get_rank())
    return CollectiveLoader(
        lambda: make_source(kind, num_workers, place.dp_rank, place.dp_size), mesh, timeout=60, **ranks.KEYS
    )


def record(batch: dict, stage: str) -> dict:
    """What the test compares of one delivered batch: its sample ids, keys, and whether every
    delivered tensor is the one derived from those ids."""
    ids = batch["sample_id"]
    tokens = ids[:, None] * 1000 + torch.arange(SEQ)
    expected = {
        "first": {"input_ids": tokens, "position_ids": torch.arange(SEQ).expand(len(ids), SEQ)},
        "last": {"labels": tokens + 1},
    }[stage]
    ok = all(torch.equal(batch[k], v) for k, v in expected.items())
    return {"ids": ids.tolist(), "keys": sorted(batch), "ok": ok}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def plain(value):
    """``value`` with tensors as lists, to compare states across ranks in the test process."""
    if isinstance(value, torch.Tensor):
        return [str(value.dtype), value.tolist()]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def resume_run(kind: str, num_workers: int, stop_after: int) -> dict:
    """An uninterrupted epoch; a run stopped after ``stop_after`` steps, its state round-tripped
    through torch.save/torch.load(weights_only=True); and a new loader resumed from that state."""
    full_loader = build(kind, num_workers)
    stage = full_loader.place.stage
    full = [record(b, stage) for b in full_loader]
    full_loader.close()

    first = build(kind, num_workers)
    it = iter(first)
    head = [record(next(it), stage) for _ in range(stop_after)]
    state = first.state_dict()  # every rank, after the same step
    first.close()

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)

    second = build(kind, num_workers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second.load_state_dict(loaded)
        tail = [record(b, stage) for b in second]
    second.close()
    place = second.place
    return {
        "rank": dist.get_rank(),
        "dp_rank": place.dp_rank,
        "stage": stage,
        "coords": place.coords,
        "is_leader": place.is_leader,
        "full": full,
        "head": head,
        "tail": tail,
        "steps": state["steps"],
        "state": plain(state),
        "round_trip": same(state, loaded),
        "skipping": [str(w.message) for w in caught if "skipping" in str(w.message)],
    }


@pytest.fixture(scope="module")
def world(worlds):
    return worlds.get(8)


def expected_ids(dp_rank: int) -> list[list[int]]:
    """The replica's batches of sample ids, from the sampler alone."""
    order = list(DistributedSampler(Samples(), num_replicas=2, rank=dp_rank, shuffle=True, seed=SEED))
    return [order[i : i + BATCH] for i in range(0, len(order), BATCH)]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "kind, num_workers",
    [("stateful", 0), ("stateful", 2), ("plain", 0)],
    ids=["0-workers", "2-workers", "plain-dataloader-control"],
)
def test_exact_resume(world, kind, num_workers):
    records = world.run(resume_run, kind, num_workers, STOP, timeout=150)
    by_dp: dict[int, list] = {}
    states: dict[int, dict] = {}
    seen = set()
    for rec in records:
        rank, full, head, tail = rec["rank"], rec["full"], rec["head"], rec["tail"]
        keys = ["input_ids", "position_ids", "sample_id"] if rec["stage"] == "first" else ["labels", "sample_id"]
        assert len(full) == STEPS, (rank, len(full))
        assert all(r["keys"] == keys and r["ok"] for r in full + head + tail), (rank, full, head, tail)
        ids = [r["ids"] for r in full]
        # every rank of a replica (both stages, both tp peers) gets the replica's batches
        assert by_dp.setdefault(rec["dp_rank"], ids) == ids, f"rank {rank} got other samples than its replica"
        assert ids == expected_ids(rec["dp_rank"]), (rank, ids)  # the sampler's shuffled order
        seen.add(rec["coords"])
        # the resumed run continues exactly where the stopped one was
        assert rec["steps"] == STOP
        assert head == full[:STOP], (rank, head, full)
        assert tail == full[STOP:], (rank, tail, full)
        before = {i for r in head for i in r["ids"]}
        assert not before & {i for r in tail for i in r["ids"]}, (rank, head, tail)
        assert rec["round_trip"], f"rank {rank}: the state changed through torch.save/torch.load(weights_only=True)"
        # the leader shares its state: every rank of a replica holds the same one
        assert states.setdefault(rec["dp_rank"], rec["state"]) == rec["state"], rank
        if kind == "plain":  # control: no source state, the leader skips (and says so)
            assert rec["state"]["source"] is None
            assert bool(rec["skipping"]) == rec["is_leader"], (rank, rec["skipping"])
        else:
            assert rec["state"]["source"] is not None, rank
            assert not rec["skipping"], (rank, rec["skipping"])
    assert len(seen) == 8
    # the replicas are disjoint and cover the dataset once
    assert sorted(i for ids in by_dp.values() for step in ids for i in step) == list(range(SAMPLES))


def test_stateful_dataloader_state_is_taken_per_consumed_batch():
    """Without any world: a StatefulDataLoader's state_dict() right after batch k is a snapshot
    that later batches do not change (the leader keeps the state of the last consumed batch while
    it prefetches ahead), and it survives torch.save/torch.load(weights_only=True)."""
    dl = make_source("stateful", 0, 0, 2)
    it = iter(dl)
    head = [next(it)["sample_id"].tolist() for _ in range(STOP)]
    state = dl.state_dict()
    kept = plain(state)
    rest = [b["sample_id"].tolist() for b in it]
    assert plain(state) == kept, "a later batch changed an earlier state"
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    again = make_source("stateful", 0, 0, 2)
    again.load_state_dict(torch.load(buf, weights_only=True))
    assert [b["sample_id"].tolist() for b in again] == rest
    assert head + rest == expected_ids(0)
