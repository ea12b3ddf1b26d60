"""collective_loader.integrations.megatron over real gloo worlds: every stage's ``get_batch`` holds exactly the
tensors Megatron's pretrain step uses there, from the right micro-batch, split over cp; packed
sequence offsets and a dense attention mask reach middle stages too. Packed documents under cp
come out as TransformerEngine's THD helpers make them (``pad_thd_sequences_for_cp``,
``generate_positional_ids_for_cp``, ``get_batch_on_this_cp_rank``; re-implemented below from
their documented behaviour, TE is not installed here)."""

from __future__ import annotations

import itertools

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
    """Megatron-shaped micro-batch of ``ids``: each row packs two documents, split at ``cut``;
    position ids restart at 0 at each document."""
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
        "position_ids": torch.where(pos < cut[:, None], pos, pos - cut[:, None]),
        "attention_mask": mask[:, None],
        "cu_seqlens": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).int(),
    }


def te_thd(batch: dict, cp: int, cp_rank: int) -> dict:
    """What TransformerEngine's THD helpers give cp rank ``cp_rank``: the micro-batch flattened,
    every document padded to a multiple of 2 x cp (token 0, label -100, loss mask 0, position ids
    0, 1, ... through the padding; none at cp = 1), then chunks r and 2cp-1-r of every document,
    (1, tokens / cp)."""
    cu = batch["cu_seqlens"].tolist()
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    multiple = 2 * cp if cp > 1 else 1
    padded = [-(-n // multiple) * multiple for n in lengths]
    out = {}
    for key, pad in (("tokens", 0), ("labels", -100), ("loss_mask", 0), ("position_ids", None)):
        flat = batch[key].flatten()
        docs = []
        for start, n, p in zip(cu, lengths, padded):
            filler = torch.arange(n, p) if pad is None else torch.full((p - n,), pad)
            doc = torch.cat([flat[start : start + n], filler.to(flat.dtype)])
            if cp == 1:
                docs.append(doc)
                continue
            chunk = p // (2 * cp)
            late = 2 * cp - 1 - cp_rank
            docs += [doc[cp_rank * chunk : (cp_rank + 1) * chunk], doc[late * chunk : (late + 1) * chunk]]
        out[key] = torch.cat(docs).unsqueeze(0)
    out["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    out["cu_seqlens_padded"] = torch.tensor([0, *itertools.accumulate(padded)], dtype=torch.int32)
    out["max_seqlen"] = max(padded)
    return out


def replica_ids(dp_rank: int, dp_size: int) -> list[list[int]]:
    mine = list(range(dp_rank, SAMPLES, dp_size))
    return [mine[i : i + MICRO] for i in range(0, len(mine) - MICRO + 1, MICRO)]


def run_rank(dims, shape, attention_mask: bool, packed: bool, **options):
    mesh = ranks.make_mesh(dims, shape)
    place = mesh_place(mesh, dist.get_rank())

    drop = set() if attention_mask else {"attention_mask"}
    drop |= set() if packed else {"cu_seqlens"}

    def source():
        return [
            {k: v for k, v in micro_batch(ids).items() if k not in drop}
            for ids in replica_ids(place.dp_rank, place.dp_size)
        ]

    try:
        loader = megatron_loader(source, mesh, attention_mask=attention_mask, packed=packed, timeout=60, **options)
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
    return {
        "rank": dist.get_rank(),
        "dp_rank": place.dp_rank,
        "dp_size": place.dp_size,
        "stage": place.stage,
        "shard": place.shard,
        "steps": steps,
    }


NEEDS = {
    "first": {"tokens", "position_ids"},
    "last": {"labels", "loss_mask"},
    "both": {"tokens", "position_ids", "labels", "loss_mask"},
    "middle": set(),
}
SPLIT = {"tokens": 1, "labels": 1, "loss_mask": 1, "position_ids": 1, "attention_mask": 2}
PACKED = {"cu_seqlens", "cu_seqlens_padded", "max_seqlen"}


def check(records, attention_mask: bool, packed: bool) -> None:
    every = ({"attention_mask"} if attention_mask else set()) | (PACKED if packed else set())
    for rec in records:
        want_steps = replica_ids(rec["dp_rank"], rec["dp_size"])
        assert len(rec["steps"]) == len(want_steps), rec["rank"]
        for step, (got, ids) in enumerate(zip(rec["steps"], want_steps)):
            assert isinstance(got, MegatronBatch)
            full = micro_batch(ids)
            present = {f for f in MegatronBatch._fields if getattr(got, f) is not None}
            where = f"rank {rec['rank']} ({rec['stage']}) step {step}"
            assert present == NEEDS[rec["stage"]] | every, where
            if packed:
                cp, cp_rank = rec["shard"][0] if rec["shard"] else (1, 0)
                full = te_thd(full, cp, cp_rank)
            for field in present:
                want = full[field]
                if field in SPLIT and rec["shard"] and not packed:
                    want = sharding.shard(want, SPLIT[field], rec["shard"], "zigzag")
                value = getattr(got, field)
                assert (value == want) if field == "max_seqlen" else torch.equal(value, want), f"{where}: {field}"


@pytest.fixture(scope="module")
def world(worlds):
    return worlds.get(8)


def test_packed_offsets_reach_middle_stages(world):
    dims, shape = ("pp", "dp"), (4, 2)
    records = world.run(run_rank, dims, shape, False, True, timeout=120)
    check(records, attention_mask=False, packed=True)
    assert sum(r["stage"] == "middle" for r in records) == 4


def test_dense_mask_reaches_middle_stages(world):
    dims, shape = ("pp", "dp"), (4, 2)
    records = world.run(run_rank, dims, shape, True, False, timeout=120)
    check(records, attention_mask=True, packed=False)


def test_context_parallel_split_like_megatron(world):
    dims, shape = ("pp", "cp", "tp"), (2, 2, 2)
    records = world.run(run_rank, dims, shape, True, False, timeout=120)
    check(records, attention_mask=True, packed=False)
    assert {r["shard"] for r in records} == {((2, 0),), ((2, 1),)}


def test_causal_only_gives_no_mask(world):
    records = world.run(run_rank, ("pp", "dp", "tp"), (2, 2, 2), False, False, timeout=120)
    check(records, attention_mask=False, packed=False)
    assert all(b.attention_mask is None and b.cu_seqlens is None for r in records for b in r["steps"])


@pytest.mark.parametrize("delivery", ["broadcast", "scatter"])
def test_packed_documents_under_cp_are_transformer_engines_thd(world, delivery):
    records = world.run(run_rank, ("pp", "cp", "tp"), (2, 2, 2), False, True, delivery=delivery, timeout=120)
    check(records, attention_mask=False, packed=True)
    first = next(r for r in records if r["stage"] == "first")
    assert first["steps"][0].tokens.shape[0] == 1  # one THD stream per micro-batch


def test_packed_documents_under_cp4(world):
    records = world.run(run_rank, ("cp", "dp"), (4, 2), False, True, delivery="scatter", timeout=120)
    check(records, attention_mask=False, packed=True)


def test_packed_with_a_dense_mask_is_refused_on_every_rank(world):
    records = world.run(run_rank, ("pp", "cp", "tp"), (2, 2, 2), True, True, timeout=120)
    assert all("packed=True with attention_mask=True" in r["error"] for r in records)
