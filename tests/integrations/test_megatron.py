"""collective_loader.integrations.megatron over real gloo worlds: every stage's ``get_batch`` holds exactly the
tensors Megatron's pretrain step uses there, from the right micro-batch, split over cp; packed
sequence offsets and a dense attention mask reach middle stages too."""

from __future__ import annotations

import pytest
import ranks
import torch
import torch.distributed as dist

from collective_loader import mesh_place
from collective_loader.integrations.megatron import (
    MegatronBatch,
    get_batch,
    megatron_loader,
)
from collective_loader.plan import sharding

SEQ, MICRO, SAMPLES = 16, 2, 24


def micro_batch(ids: list[int]) -> dict:
    """Megatron-shaped micro-batch of ``ids``: each row packs two documents, split at ``cut``."""
    ids_t = torch.tensor(ids)
    pos = torch.arange(SEQ)
    tokens = ids_t[:, None] * 1000 + pos
    cut = ids_t % (SEQ - 1) + 1  # first position of each row's second document
    q, k = pos[:, None], pos[None, :]
    # True = masked out (Megatron's convention): the future, and the other document
    mask = (k > q) | ((k < cut[:, None, None]) & (q >= cut[:, None, None]))
    lengths = torch.stack([cut, SEQ - cut], 1).flatten()
    return {
        "tokens": tokens,
        "labels": tokens + 1,
        "loss_mask": (tokens % 3 != 0).float(),
        "position_ids": pos.expand(len(ids), SEQ).clone(),
        "attention_mask": mask[:, None],
        "cu_seqlens": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).int(),
        "max_seqlen": int(lengths.max()),
    }


def replica_ids(dp_rank: int, dp_size: int) -> list[list[int]]:
    mine = list(range(dp_rank, SAMPLES, dp_size))
    return [mine[i : i + MICRO] for i in range(0, len(mine) - MICRO + 1, MICRO)]


def run_rank(dims, shape, attention_mask: bool, packed: bool):
    mesh = ranks.make_mesh(dims, shape)
    place = mesh_place(mesh, dist.get_rank())

    drop = set() if attention_mask else {"attention_mask"}
    drop |= set() if packed else {"cu_seqlens", "max_seqlen"}

    def source():
        return [{k: v for k, v in micro_batch(ids).items() if k not in drop} for ids in replica_ids(place.dp_rank, place.dp_size)]

    try:
        loader = megatron_loader(source, mesh, attention_mask=attention_mask, packed=packed, timeout=60)
    except ValueError as e:
        return {"error": str(e)}
    data_iterator = iter(loader)
    steps = []
    while True:
        try:
            steps.append(get_batch(data_iterator))
        except StopIteration:
            break
    loader.close()
    return {"rank": dist.get_rank(), "dp_rank": place.dp_rank, "dp_size": place.dp_size, "stage": place.stage,
            "shard": place.shard, "steps": steps}


NEEDS = {
    "first": {"tokens", "position_ids"},
    "last": {"labels", "loss_mask"},
    "both": {"tokens", "position_ids", "labels", "loss_mask"},
    "middle": set(),
}
SPLIT = {"tokens": 1, "labels": 1, "loss_mask": 1, "position_ids": 1, "attention_mask": 2}


def check(records, attention_mask: bool, packed: bool) -> None:
    every = ({"attention_mask"} if attention_mask else set()) | ({"cu_seqlens", "max_seqlen"} if packed else set())
    for rec in records:
        want_steps = replica_ids(rec["dp_rank"], rec["dp_size"])
        assert len(rec["steps"]) == len(want_steps), rec["rank"]
        for step, (got, ids) in enumerate(zip(rec["steps"], want_steps)):
            assert isinstance(got, MegatronBatch)
            full = micro_batch(ids)
            present = {f for f in MegatronBatch._fields if getattr(got, f) is not None}
            where = f"rank {rec['rank']} ({rec['stage']}) step {step}"
            assert present == NEEDS[rec["stage"]] | every, where
            for field in present:
                want = full[field]
                if field in SPLIT and rec["shard"]:
                    want = sharding.shard(want, SPLIT[field], rec["shard"], "zigzag")
                value = getattr(got, field)
                assert (value == want) if field == "max_seqlen" else torch.equal(value, want), f"{where}: {field}"


@pytest.fixture(scope="module")
def world(worlds):
    return worlds.get(8)


def test_packed_offsets_and_mask_reach_middle_stages(world):
    dims, shape = ("pp", "dp"), (4, 2)
    records = world.run(run_rank, dims, shape, True, True, timeout=120)
    check(records, attention_mask=True, packed=True)
    assert sum(r["stage"] == "middle" for r in records) == 4


def test_context_parallel_split_like_megatron(world):
    dims, shape = ("pp", "cp", "tp"), (2, 2, 2)
    records = world.run(run_rank, dims, shape, True, False, timeout=120)
    check(records, attention_mask=True, packed=False)
    assert {r["shard"] for r in records} == {((2, 0),), ((2, 1),)}


def test_causal_only_gives_no_mask(world):
    records = world.run(run_rank, ("pp", "dp", "tp"), (2, 2, 2), False, False, timeout=120)
    check(records, attention_mask=False, packed=False)
    assert all(b.attention_mask is None and b.cu_seqlens is None for r in records for b in r["steps"])


def test_packed_with_context_parallel_is_refused_on_every_rank(world):
    records = world.run(run_rank, ("pp", "cp", "tp"), (2, 2, 2), False, True, timeout=120)
    assert all("packed=True with a context-parallel degree of 2" in r["error"] for r in records)
