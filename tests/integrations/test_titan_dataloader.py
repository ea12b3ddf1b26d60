"""``TitanDataLoader`` on meshes built by TorchTitan's own ``ParallelDims``, fed by torchdata's
``StatefulDataLoader`` (what TorchTitan uses), checkpointed through ``torch.distributed.checkpoint``
as TorchTitan's checkpointer does, and resumed exactly."""

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

from collective_loader import mesh_place
from collective_loader.integrations.titan import TitanDataLoader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from pipeline_parity import titan_dims  # noqa: E402  TorchTitan's ParallelDims on a CPU machine

SEQ, BATCH, SAMPLES, SEED, STOP = 8, 2, 24, 5, 2
MESHES = {"pp2-dp2-tp2": (2, 2, 2), "pp4-dp2": (4, 2, 1)}  # (pp, dp, tp); pp4 has middle stages


class Tokens(Dataset):
    """Sample ``i``: ``input[s] = 1000 i + s`` and ``labels = input + 1``, so labels name the sample."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = 1000 * i + torch.arange(SEQ)
        return {"input": tokens, "labels": tokens + 1}


def expected_ids(dp: int, dp_rank: int) -> list[list[int]]:
    """The batches of sample ids replica ``dp_rank`` must see in one epoch."""
    ids = list(DistributedSampler(Tokens(), num_replicas=dp, rank=dp_rank, shuffle=True, seed=SEED))
    return [ids[i : i + BATCH] for i in range(0, len(ids), BATCH)]


_MESHES: dict = {}


def titan_mesh(pp: int, dp: int, tp: int):
    """TorchTitan's data-loading mesh on CPU, built once per rank process and degrees."""
    if (pp, dp, tp) not in _MESHES:
        dims = titan_dims(pp, dp, tp)
        _MESHES[pp, dp, tp] = dims.get_optional_mesh(["pp", "batch", "cp", "tp"], include_singleton_axes=True)
    return _MESHES[pp, dp, tp]


def titan_loader(mesh) -> TitanDataLoader:
    place = mesh_place(mesh, dist.get_rank())
    sampler = DistributedSampler(Tokens(), num_replicas=place.dp_size, rank=place.dp_rank, shuffle=True, seed=SEED)
    return TitanDataLoader(lambda: StatefulDataLoader(Tokens(), batch_size=BATCH, sampler=sampler), mesh, timeout=60)


def seen(pairs, limit: int | None = None) -> list[list[int]]:
    """Sample ids per step, checking each (input_dict, labels) against the sample they name."""
    out = []
    for input_dict, labels in pairs:
        ids = (labels[:, 0] // 1000).tolist()
        tokens = 1000 * torch.tensor(ids)[:, None] + torch.arange(SEQ)
        assert sorted(input_dict) == ["input"], sorted(input_dict)
        assert torch.equal(labels, tokens + 1) and torch.equal(input_dict["input"], tokens), ids
        out.append(ids)
        if len(out) == limit:
            break
    return out


def titan_run(degrees: tuple[int, int, int], checkpoint: str) -> dict:
    """On this rank: an epoch, the Stateful behaviours, and a resume through DCP after STOP steps."""
    mesh = titan_mesh(*degrees)
    full_loader = titan_loader(mesh)
    place = full_loader.loader.place
    full = seen(full_loader)
    state = full_loader.state_dict()
    rec = {
        "stage": place.stage,
        "dp_rank": place.dp_rank,
        "full": full,
        "stateful": isinstance(full_loader, Stateful),
        "state": {k: type(v).__name__ for k, v in state.items()},
        "world_size": state["world_size"],
    }
    full_loader.load_state_dict({})  # as in TorchTitan: an empty state is valid
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        full_loader.load_state_dict({"dp_rank_9": b"", "world_size": place.dp_size})
    rec["missing"] = [str(w.message) for w in caught]
    try:
        full_loader.load_state_dict({**state, "world_size": place.dp_size + 1})
    except ValueError as e:
        rec["mismatch"] = str(e)
    full_loader.close()

    first = titan_loader(mesh)
    head = seen(first, limit=STOP)
    dcp.save({"dataloader": first}, checkpoint_id=checkpoint)  # as TorchTitan's checkpointer does
    first.close()
    dataloader = titan_loader(mesh)
    dcp.load({"dataloader": dataloader}, checkpoint_id=checkpoint)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tail = seen(dataloader)
    dataloader.close()
    return {**rec, "head": head, "tail": tail, "resume_warnings": [str(w.message) for w in caught]}


@pytest.fixture(scope="module")
def world(worlds):
    return worlds.get(8)


@pytest.mark.parametrize("name", MESHES)
def test_every_rank_gets_its_samples_and_resumes_through_dcp(world, tmp_path, name):
    pp, dp, tp = MESHES[name]
    records = world.run(titan_run, MESHES[name], str(tmp_path / "checkpoint"), timeout=180)
    assert sorted({r["stage"] for r in records}) == sorted({"first", "last"} | ({"middle"} if pp > 2 else set()))
    for rank, rec in enumerate(records):
        want = expected_ids(dp, rec["dp_rank"])
        assert rec["full"] == want, f"rank {rank} ({rec['stage']} stage)"
        assert rec["stateful"] and rec["state"] == {f"dp_rank_{rec['dp_rank']}": "bytes", "world_size": "int"}
        assert rec["world_size"] == dp
        assert len(rec["missing"]) == 1 and "'dp_rank_" in rec["missing"][0]
        assert f"world_size={dp + 1} data-parallel ranks and this run has {dp}" in rec["mismatch"]
        assert rec["head"] == want[:STOP] and rec["tail"] == want[STOP:], (
            f"rank {rank}: the resume must continue exactly"
        )
        assert not rec["resume_warnings"], rec["resume_warnings"]  # no "skipping batches": the source's state was used
    assert sorted(i for d in range(dp) for step in expected_ids(dp, d) for i in step) == list(range(SAMPLES))


def test_options_that_contradict_the_trainer_are_refused():
    with pytest.raises(ValueError, match="takes no seq_dims="):  # refused before the mesh is touched
        TitanDataLoader([], None, seq_dims={"input": 1})
