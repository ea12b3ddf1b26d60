"""TorchTitan and torchdata: ``TitanDataLoader`` on a mesh built by TorchTitan's ``ParallelDims``,
fed by torchdata's ``StatefulDataLoader`` (what TorchTitan uses), checkpointed through
``torch.distributed.checkpoint`` as TorchTitan's checkpointer does, and resumed exactly; and a
``StatefulDataLoader`` with worker processes as a plain CollectiveLoader source."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from collective_loader import CollectiveLoader, mesh_place
from collective_loader.titan import TitanDataLoader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from pipeline_parity import titan_dims  # noqa: E402  TorchTitan's mesh on a CPU machine

SEQ, BATCH, SAMPLES = 8, 2, 48
PP, DP, TP = 2, 2, 2


class Tokens(Dataset):
    """Sample ``i``: ``input[s] = 1000 i + s`` and ``labels = input + 1``, so any rank's labels name the sample."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = 1000 * i + torch.arange(SEQ)
        return {"input": tokens, "labels": tokens + 1}


def source(num_workers: int):
    """The replica's StatefulDataLoader, built on leaders only (the loader calls it there)."""
    place = mesh_place(_mesh(), dist.get_rank())
    sampler = DistributedSampler(Tokens(), num_replicas=place.dp_size, rank=place.dp_rank, shuffle=True, seed=5)
    # forkserver: forked workers of a process with gloo threads start slowly here (README, "DataLoader workers")
    context = {"multiprocessing_context": "forkserver"} if num_workers else {}
    return StatefulDataLoader(Tokens(), batch_size=BATCH, sampler=sampler, num_workers=num_workers, **context)


_MESHES: dict = {}


def _mesh():
    """One TorchTitan mesh per rank process (it builds its groups once)."""
    if "mesh" not in _MESHES:
        dims = titan_dims(PP, DP, TP)
        _MESHES["mesh"] = dims.get_optional_mesh(["pp", "batch", "cp", "tp"], include_singleton_axes=True)
    return _MESHES["mesh"]


def _titan(num_workers: int) -> TitanDataLoader:
    return TitanDataLoader(lambda: source(num_workers), _mesh(), timeout=60)


def _steps(pairs, limit=None) -> list[dict]:
    out = []
    for input_dict, labels in pairs:
        ids = (labels[:, 0] // 1000).tolist()
        out.append({"ids": ids, "inputs_ok": all(torch.equal(v, labels - 1) for v in input_dict.values()),
                    "keys": sorted(input_dict)})
        if limit is not None and len(out) == limit:
            break
    return out


def titan_epoch_and_states():
    """An epoch of (input_dict, labels) on this rank, plus the adapter's Stateful behaviours."""
    loader = _titan(0)
    place = loader.loader.place
    steps = _steps(loader)
    state = loader.state_dict()
    behaviours = {"stateful": isinstance(loader, Stateful), "keys": sorted(state),
                  "world_size": state["world_size"], "entry_is_bytes": isinstance(state[f"dp_rank_{place.dp_rank}"], bytes)}
    loader.load_state_dict({})  # TorchTitan: an empty state is valid
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader.load_state_dict({"dp_rank_9": b"", "world_size": DP})
    behaviours["missing_warns"] = any("dp_rank_" in str(w.message) for w in caught)
    try:
        loader.load_state_dict({f"dp_rank_{place.dp_rank}": b"", "world_size": DP + 1})
        behaviours["mismatch"] = "accepted"
    except ValueError as e:
        behaviours["mismatch"] = str(e)
    loader.close()
    return {"rank": dist.get_rank(), "stage": place.stage, "dp_rank": place.dp_rank, "steps": steps, **behaviours}


def titan_resume_through_dcp(num_workers: int, stop_after: int, checkpoint: str):
    """Ids of an uninterrupted epoch, and of one checkpointed by DCP after ``stop_after`` steps,
    with the loader and its StatefulDataLoader built anew and loaded from the checkpoint."""
    full = _steps(_titan(num_workers))
    first = _titan(num_workers)
    head = _steps(first, limit=stop_after)
    dcp.save({"dataloader": first}, checkpoint_id=checkpoint)
    first.close()
    second = _titan(num_workers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.load({"dataloader": second}, checkpoint_id=checkpoint)
        tail = _steps(second)
    second.close()
    return {"full": [s["ids"] for s in full], "head": [s["ids"] for s in head], "tail": [s["ids"] for s in tail],
            "warnings": [str(w.message) for w in caught if "skipping" in str(w.message)]}


def plain_resume(stop_after: int):
    """CollectiveLoader straight over a StatefulDataLoader; the state through torch.save and
    ``torch.load(weights_only=True)``."""
    def build():
        return CollectiveLoader(lambda: source(0), _mesh(), inputs=("input",), labels=("labels",), timeout=60)

    def ids(batch):
        key = "input" if "input" in batch else "labels"
        return (batch[key][:, 0] // 1000).tolist()

    full = [ids(b) for b in build()]
    first = build()
    it = iter(first)
    head = [ids(next(it)) for _ in range(stop_after)]
    state = first.state_dict()
    first.close()
    path = f"/tmp/cl_titan_state_{dist.get_rank()}.pt"
    torch.save(state, path)
    second = build()
    second.load_state_dict(torch.load(path, weights_only=True))
    os.remove(path)
    tail = [ids(b) for b in second]
    second.close()
    return {"full": full, "head": head, "tail": tail}


@pytest.fixture(scope="module")
def world(worlds):
    return worlds.get(PP * DP * TP)


def test_every_rank_gets_its_samples_and_labels_and_stateful_behaves(world):
    records = world.run(titan_epoch_and_states, timeout=180)
    steps = SAMPLES // DP // BATCH
    by_dp: dict[int, list] = {}
    for rec in records:
        assert len(rec["steps"]) == steps, rec["rank"]
        assert all(s["keys"] == (["input"] if rec["stage"] == "first" else []) for s in rec["steps"]), rec["rank"]
        assert all(s["inputs_ok"] for s in rec["steps"]), rec["rank"]  # first stage: labels = input + 1
        ids = [s["ids"] for s in rec["steps"]]
        assert by_dp.setdefault(rec["dp_rank"], ids) == ids, f"rank {rec['rank']} saw other samples than its replica"
        assert rec["stateful"] and rec["keys"] == sorted([f"dp_rank_{rec['dp_rank']}", "world_size"])
        assert rec["world_size"] == DP and rec["entry_is_bytes"]
        assert rec["missing_warns"]
        assert "saved with 3 data-parallel ranks and this run has 2" in rec["mismatch"]
    flat = sorted(i for ids in by_dp.values() for step in ids for i in step)
    assert flat == list(range(SAMPLES))  # replicas disjoint, covering the dataset once


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume_through_torch_distributed_checkpoint(world, tmp_path, num_workers):
    k = 3
    records = world.run(titan_resume_through_dcp, num_workers, k, str(tmp_path / "ckpt"), timeout=240)
    for rec in records:
        assert rec["head"] == rec["full"][:k]
        assert rec["tail"] == rec["full"][k:], "the resumed run must continue exactly"
        assert not rec["warnings"], rec["warnings"]  # the StatefulDataLoader's own state was used


def test_stateful_dataloader_as_a_plain_source(world):
    k = 4
    for rec in world.run(plain_resume, k, timeout=240):
        assert rec["head"] == rec["full"][:k] and rec["tail"] == rec["full"][k:]
