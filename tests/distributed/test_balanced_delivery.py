"""``BalancedDocuments`` end to end over a real gloo world of 4: a plain ``DataLoader`` of packed
rows (documents of 1 to 24 tokens, :func:`packed_documents.packed_row`) through
``CollectiveLoader``, with broadcast and scatter over dp x cp, and scatter over pp x cp.

Every rank's batch is its piece of the batch its leader loaded, metadata included (the package's
invariants), the pieces reassemble each key exactly, and the shard ranks' attention, computed from
what they received (whole documents over their own keys and values, split ones with their peers'),
equals per-document SDPA (:func:`packed_documents.check_balanced_attention`). A bad option ends
every rank with an error that names it.
"""

from __future__ import annotations

import pytest
import ranks
import torch.distributed as dist
from packed_documents import SEQ_KEYS, Rows, check_balanced_attention, packed_batch
from torch.utils.data import DataLoader

from collective_loader import BalancedDocuments, CollectiveLoader, ConstructionError, mesh_place
from collective_loader.plan.routing import Routing
from collective_loader.testing import invariants

SAMPLES, BATCH = 16, 2
PAD = {"labels": -100, "loss_mask": 0, "sequence_id": -1}
# micro-batches of 48 tokens: a share of 0.5 keeps documents of up to about 12 tokens whole at cp 2
SPLIT = BalancedDocuments(cu_seqlens="cu_seqlens", positions="position_ids", pad_values=PAD, split_share=0.5)
INPUTS = ("input_ids", "position_ids", "sequence_id", "q", "k", "v", "sample_id")


def routing_for(split: BalancedDocuments = SPLIT) -> Routing:
    return Routing(
        INPUTS, ("labels", "loss_mask", "sample_id"), dict.fromkeys(SEQ_KEYS, 1), split, every_stage=("cu_seqlens",)
    )


def make_loader(mesh, routing: Routing, **options) -> CollectiveLoader:
    place = mesh_place(mesh, dist.get_rank())

    def source():
        return DataLoader(Rows(place.dp_rank, place.dp_size, routing.keys, SAMPLES), batch_size=BATCH)

    keys = dict(
        inputs=routing.inputs, labels=routing.labels, every_stage=routing.every_stage, seq_dims=routing.seq_dims
    )
    return CollectiveLoader(source, mesh, **{**keys, "split": routing.split, "timeout": 60, **options})


def run_rank(dims, shape, **options):
    mesh = ranks.make_mesh(dims, shape)
    loader = make_loader(mesh, routing_for(), **options)
    place = loader.place
    steps = [dict(batch) for batch in loader]
    loader.close()
    return {
        "rank": dist.get_rank(),
        "dp_rank": place.dp_rank,
        "stage": place.stage,
        "shard": place.shard,
        "steps": steps,
        "leader": place.is_leader,
        "stats": loader.stats(),
    }


def verify(records) -> int:
    """Check every rank's batches; returns how many documents arrived whole (to see both kinds)."""
    routing = routing_for()
    dp_size = len({r["dp_rank"] for r in records})
    assert {len(r["steps"]) for r in records} == {SAMPLES // dp_size // BATCH}
    by_record = [invariants.RankRecord(r["rank"], r["dp_rank"], r["stage"], r["shard"], r["steps"]) for r in records]
    verdicts = invariants.check(by_record, routing, lambda ids: packed_batch(ids, routing.keys), range(SAMPLES))
    failed = [f"{v.name}: {v.detail}" for v in verdicts if not v.ok]
    assert not failed, "\n".join(failed)
    sizes = [size for size, _ in records[0]["shard"]]
    whole = 0
    for dp_rank in range(dp_size):
        holders = [r for r in records if r["dp_rank"] == dp_rank and r["stage"] == "both"]
        if not holders:  # pp > 1: q, k, v on the first stage, labels on the last
            first = {r["shard"]: r for r in records if r["dp_rank"] == dp_rank and r["stage"] == "first"}
            last = {r["shard"]: r for r in records if r["dp_rank"] == dp_rank and r["stage"] == "last"}
            holders = [
                {**first[s], "steps": [a | b for a, b in zip(first[s]["steps"], last[s]["steps"])]} for s in first
            ]
        ordered = sorted(holders, key=lambda r: tuple(i for _, i in r["shard"]))
        for step in range(len(ordered[0]["steps"])):
            pieces = [r["steps"][step] for r in ordered]
            check_balanced_attention(pieces, sizes, packed_batch(pieces[0]["sample_id"].tolist()), SPLIT)
            whole += sum(int((p["whole_documents"] >= 0).sum()) for p in pieces)
    return whole


def shard_work(records, dp_rank: int) -> dict[str, float]:
    """What a leader's ``stats()`` must say of its replica's work over the cp ranks, recomputed
    from the pieces the cp ranks received: per rank ``2k + 1 + c`` over its real tokens (``k``:
    the token's position in its document), max / mean per step, and every slot over the real tokens."""
    ordered = sorted((r for r in records if r["dp_rank"] == dp_rank), key=lambda r: r["shard"])
    balances, slots, tokens = [], 0, 0
    for pieces in zip(*(r["steps"] for r in ordered)):
        lengths = SPLIT.documents(packed_batch(pieces[0]["sample_id"].tolist())).lengths
        costs = []
        for p in pieces:
            doc, pos = p["document_ids"][0], p["document_positions"][0]
            real = (doc >= 0) & (pos < lengths[doc.clamp(min=0)])
            costs.append(float((2 * pos[real] + 1).sum()) + SPLIT.linear_cost * int(real.sum()))
            slots += doc.numel()
        balances.append(max(costs) / (sum(costs) / len(costs)))
        tokens += int(lengths.sum())
    return {
        "cp_micro_batches": len(balances),
        "cp_cost_max_over_mean": sum(balances) / len(balances),
        "cp_cost_max_over_mean_worst": max(balances),
        "cp_padding": slots / tokens - 1,
    }


@pytest.fixture(scope="module")
def world(worlds):
    return worlds.get(4)


@pytest.mark.parametrize("delivery", ["broadcast", "scatter"])
def test_dp2_cp2(world, delivery):
    records = world.run(run_rank, ("dp", "cp"), (2, 2), delivery=delivery, timeout=120)
    assert verify(records) > 0
    split = [int(len(p["split_documents"])) for r in records for p in r["steps"]]
    assert sum(split) > 0  # both kinds of document travelled
    for leader in (r for r in records if r["leader"]):
        want = shard_work(records, leader["dp_rank"])
        assert leader["stats"]["cp_micro_batches"] == want["cp_micro_batches"]
        for key in ("cp_cost_max_over_mean", "cp_cost_max_over_mean_worst", "cp_padding"):
            assert leader["stats"][key] == pytest.approx(want[key], abs=1e-4), (key, leader["stats"], want)
    assert not any("cp_padding" in r["stats"] for r in records if not r["leader"])  # leaders only


def test_pp2_cp2_scatter_every_stage_gets_its_metadata(world):
    records = world.run(run_rank, ("pp", "cp"), (2, 2), delivery="scatter", timeout=120)
    verify(records)
    last = next(r for r in records if r["stage"] == "last")
    assert {"q", "input_ids"}.isdisjoint(last["steps"][0]) and "whole_cu_seqlens" in last["steps"][0]


def run_bad_option(case: str):
    mesh = ranks.make_mesh(("dp", "cp"), (2, 2))
    routing = routing_for()
    options = {}
    if case == "ranks disagree":  # rank 3 alone asks for another share
        options["split"] = BalancedDocuments(
            cu_seqlens="cu_seqlens",
            positions="position_ids",
            pad_values=PAD,
            split_share=0.25 if dist.get_rank() == 3 else 0.5,
        )
    elif case == "boundaries not on every stage":
        options.update(inputs=(*routing.inputs, "cu_seqlens"), every_stage=())
    else:  # a negative cost, made on every rank
        try:
            BalancedDocuments(cu_seqlens="cu_seqlens", linear_cost=-1.0)
        except ValueError as e:
            return f"ValueError: {e}"
        return "no error"
    try:
        make_loader(mesh, routing, **options).close()
    except ConstructionError as e:  # ConfigMismatchError is one
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize(
    "case,needle",
    [
        ("ranks disagree", "ConfigMismatchError"),
        ("boundaries not on every stage", "ConstructionError"),
        ("negative cost", "ValueError: BalancedDocuments(linear_cost=...) must be a number >= 0, got -1.0"),
    ],
)
def test_a_bad_option_ends_every_rank_with_an_error_naming_it(world, case, needle):
    records = world.run(run_bad_option, case, timeout=120)
    assert all(needle in r for r in records), records
    if case == "ranks disagree":
        assert all("split_share" in r for r in records), records
    if case == "boundaries not on every stage":
        assert all("list 'cu_seqlens' in every_stage" in r for r in records), records
