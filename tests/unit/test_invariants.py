"""The invariant checks pass on correct deliveries and catch each kind of wrong one."""

from __future__ import annotations

import copy

import pytest
from packed_documents import packed_batch
from ranks import KEYS, id_batches, sample_batch

from collective_loader.plan.documents import PerDocument
from collective_loader.plan.mesh import MeshLayout
from collective_loader.plan.routing import Routing
from collective_loader.plan.split import RowSplit
from collective_loader.testing.invariants import RankRecord, check

DIMS, SHAPE = ("pp", "dp", "cp", "tp"), (3, 2, 2, 2)
SEQ, N, B = 16, 16, 2


def _records(layout="zigzag", every_stage=()) -> tuple[list[RankRecord], Routing]:
    """What a correct delivery gives every rank, computed without processes."""
    mesh = MeshLayout.build(DIMS, SHAPE, range(24))
    shard_dims = (("cp", 2),)
    routing = Routing(KEYS["inputs"], KEYS["labels"], KEYS["seq_dims"], RowSplit(layout), shard_dims, every_stage)
    records = []
    for rank in range(24):
        place = mesh.place(rank)
        steps = [
            routing.piece(routing.select(batch, place.stage), place.shard)
            for batch in id_batches(place.dp_rank, 2, N, B, SEQ, packed=bool(every_stage))
        ]
        records.append(RankRecord(rank, place.dp_rank, place.stage, place.shard, steps))
    return records, routing


def _failed(records, routing) -> set[str]:
    verdicts = check(records, routing, lambda ids: sample_batch(ids, SEQ, bool(routing.every_stage)), range(N))
    return {v.name[:3] for v in verdicts if not v.ok}


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_correct_delivery_passes(layout):
    records, routing = _records(layout)
    assert _failed(records, routing) == set()


def _first(records, stage, **where):
    return next(r for r in records if r.stage == stage and all(getattr(r, k) == v for k, v in where.items()))


def test_labels_from_another_step_fail_c():
    records, routing = _records()
    last = [r for r in records if r.stage == "last" and r.dp_rank == 0]
    for rec in last:  # the seed's bug: the last stage computes loss on another batch's labels
        rec.steps[0]["labels"], rec.steps[1]["labels"] = rec.steps[1]["labels"], rec.steps[0]["labels"]
    assert _failed(records, routing) == {"(c)"}


def test_wrong_samples_at_last_stage_fail_c():
    records, routing = _records()
    rec = _first(records, "last", dp_rank=1)
    rec.steps[2]["sample_id"] = rec.steps[2]["sample_id"] + 2
    assert "(c)" in _failed(records, routing)


def test_swapped_shards_fail_b():
    records, routing = _records()
    a = _first(records, "first", dp_rank=0, shard=((2, 0),))
    b = _first(records, "first", dp_rank=0, shard=((2, 1),))
    a.steps[0]["input_ids"], b.steps[0]["input_ids"] = b.steps[0]["input_ids"], a.steps[0]["input_ids"]
    assert "(b)" in _failed(records, routing)


def test_replica_peer_differs_fails_a():
    records, routing = _records()
    rec = [r for r in records if r.stage == "first" and r.dp_rank == 0][1]
    rec.steps[0]["position_ids"] = rec.steps[0]["position_ids"] + 1
    assert "(a)" in _failed(records, routing) or "(b)" in _failed(records, routing)
    rec.steps[0]["extra"] = 1
    assert "(a)" in _failed(records, routing)


def test_duplicate_or_lost_samples_fail_d():
    records, routing = _records()
    # replica 1 receives replica 0's samples: duplicated and lost at once
    zero = [r for r in records if r.dp_rank == 0]
    for rec in records:
        if rec.dp_rank == 1:
            twin = next(z for z in zero if z.stage == rec.stage and z.shard == rec.shard)
            rec.steps = copy.deepcopy(twin.steps)
    assert _failed(records, routing) == {"(d)"}


def test_middle_stage_with_data_or_extra_step_fails_e():
    records, routing = _records()
    _first(records, "middle").steps[0]["input_ids"] = 1
    assert "(e)" in _failed(records, routing)
    records, routing = _records()
    _first(records, "first").steps.append({})
    assert "(e)" in _failed(records, routing)


def test_every_stage_keys_checked_on_middle_stages():
    records, routing = _records(every_stage=("cu_seqlens",))
    assert _failed(records, routing) == set()
    middle = _first(records, "middle", dp_rank=1)
    middle.steps[1]["cu_seqlens"] = records[0].steps[0]["cu_seqlens"]  # another step's offsets
    assert _failed(records, routing) == {"(a)"}
    del middle.steps[1]["cu_seqlens"]
    assert _failed(records, routing) == {"(e)"}


# --- the per-document split -------------------------------------------------------------------


def _per_document_records() -> tuple[list[RankRecord], Routing]:
    """A correct per-document delivery on pp=3 x dp=2 x cp=2 x tp=2 (every rank reshaped, metadata added)."""
    split = PerDocument(cu_seqlens="cu_seqlens", positions="position_ids")
    seq_dims = {"input_ids": 1, "position_ids": 1, "labels": 1}
    routing = Routing(KEYS["inputs"], KEYS["labels"], seq_dims, split, (("cp", 2),), ("cu_seqlens",))
    mesh = MeshLayout.build(DIMS, SHAPE, range(24))
    records = []
    for rank in range(24):
        place = mesh.place(rank)
        mine = list(range(place.dp_rank, N, 2))
        batches = [packed_batch(mine[i : i + B], routing.keys) for i in range(0, len(mine), B)]
        steps = [routing.piece(routing.select(b, place.stage), place.shard) for b in batches]
        records.append(RankRecord(rank, place.dp_rank, place.stage, place.shard, steps))
    return records, routing


def _failed_per_document(records, routing) -> set[str]:
    verdicts = check(records, routing, lambda ids: packed_batch(ids, routing.keys), range(N))
    return {v.name[:3] for v in verdicts if not v.ok}


def test_per_document_delivery_passes_and_wrong_pieces_fail():
    records, routing = _per_document_records()
    assert _failed_per_document(records, routing) == set()
    a = _first(records, "first", dp_rank=0, shard=((2, 0),))
    b = _first(records, "first", dp_rank=0, shard=((2, 1),))
    a.steps[0]["input_ids"], b.steps[0]["input_ids"] = b.steps[0]["input_ids"], a.steps[0]["input_ids"]
    assert "(b)" in _failed_per_document(records, routing)


def test_per_document_metadata_is_checked_on_every_stage():
    records, routing = _per_document_records()
    middle = _first(records, "middle", dp_rank=1)
    middle.steps[1]["cu_seqlens_padded"] = middle.steps[0]["cu_seqlens_padded"]  # another step's
    assert _failed_per_document(records, routing) == {"(a)"}
    records, routing = _per_document_records()
    last = _first(records, "last", dp_rank=0, shard=((2, 1),))
    labels = last.steps[0]["labels"].clone()
    labels[0, int((labels[0] != -100).nonzero()[0])] = -100  # a valid label lost
    last.steps[0]["labels"] = labels
    assert "(c)" in _failed_per_document(records, routing)


def test_a_split_without_the_checks_members_is_refused_by_name():
    """A split that implements only the loader's protocol works in a loader; the checks, which
    reassemble pieces, refuse it by name instead of failing on a missing attribute."""
    from dataclasses import dataclass

    from collective_loader import Split
    from collective_loader.testing.invariants import Reassembling

    @dataclass(frozen=True)
    class Whole:
        metadata = ()

        def validate(self, seq_dims, every_stage, keys):
            pass

        def check(self, batch, seq_dims, shard_dims):
            pass

        def piece(self, selected, seq_dims, levels):
            return dict(selected)

        def work(self, batch, sizes):
            return None

    assert isinstance(Whole(), Split) and not isinstance(Whole(), Reassembling)
    assert isinstance(RowSplit("zigzag"), Reassembling) and isinstance(PerDocument(cu_seqlens="c"), Reassembling)
    records, _ = _records()
    routing = Routing(KEYS["inputs"], KEYS["labels"], KEYS["seq_dims"], Whole(), (("cp", 2),))
    with pytest.raises(TypeError, match="Whole needs reshapes and unshard"):
        check(records, routing, lambda ids: sample_batch(ids, SEQ, False), range(N))
