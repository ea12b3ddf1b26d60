"""The per-document split end to end over a real gloo world: a plain ``DataLoader`` of packed rows
shaped as the text packer's (``position_ids`` restarting at 0, per-row ``cu_seqlens``,
``sequence_id``) through ``CollectiveLoader``, with broadcast and scatter, over cp, dp x cp, cp x sp
and pp x cp, the documents read from ``cu_seqlens`` or from ``position_ids``.

Every rank's batch is checked with the package's invariants (its piece, metadata included, and
the pieces reassembling each key exactly), and the shard ranks' attention, computed from what
they received, equals per-document SDPA (:func:`packed_documents.check_attention`).
"""

from __future__ import annotations

import pytest
import ranks
import torch
import torch.distributed as dist
from packed_documents import SEQ_KEYS, check_attention, packed_batch, packed_row
from torch.utils.data import DataLoader, Dataset

from collective_loader import CollectiveLoader, PerDocument, mesh_place
from collective_loader.plan.routing import Routing
from collective_loader.testing import invariants

SAMPLES, BATCH = 16, 2
PAD = {"labels": -100, "loss_mask": 0, "sequence_id": -1}
SPLITS = {
    "cu_seqlens": PerDocument(cu_seqlens="cu_seqlens", positions="position_ids", pad_values=PAD),
    "position_ids": PerDocument(positions="position_ids", pad_values=PAD),
}


class Rows(Dataset):
    """Replica ``dp_rank``'s strided share of the packed rows (``keys`` of each)."""

    def __init__(self, dp_rank: int, dp_size: int, keys: tuple[str, ...]) -> None:
        self.ids = list(range(dp_rank, SAMPLES, dp_size))
        self.keys = keys

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v for k, v in packed_row(self.ids[i]).items() if k in self.keys}


def routing_for(boundary: str) -> Routing:
    inputs = tuple(k for k in ("input_ids", "position_ids", "sequence_id", "q", "k", "v", "sample_id") if k != boundary)
    return Routing(
        inputs,
        ("labels", "loss_mask", "sample_id"),
        {k: 1 for k in SEQ_KEYS},
        SPLITS[boundary],
        every_stage=(boundary,),
    )


def run_rank(dims, shape, boundary: str, **options):
    mesh = ranks.make_mesh(dims, shape)
    place = mesh_place(mesh, dist.get_rank())
    routing = routing_for(boundary)

    def source():
        return DataLoader(Rows(place.dp_rank, place.dp_size, routing.keys), batch_size=BATCH)

    loader = CollectiveLoader(
        source,
        mesh,
        inputs=routing.inputs,
        labels=routing.labels,
        every_stage=routing.every_stage,
        seq_dims=routing.seq_dims,
        split=routing.split,
        timeout=60,
        **options,
    )
    steps = [dict(batch) for batch in loader]
    loader.close()
    return {
        "rank": dist.get_rank(),
        "dp_rank": place.dp_rank,
        "stage": place.stage,
        "shard": place.shard,
        "steps": steps,
    }


def verify(records, boundary: str) -> None:
    routing = routing_for(boundary)
    split = routing.split
    assert isinstance(split, PerDocument)
    dp_size = len({r["dp_rank"] for r in records})
    assert {len(r["steps"]) for r in records} == {SAMPLES // dp_size // BATCH}
    by_record = [invariants.RankRecord(r["rank"], r["dp_rank"], r["stage"], r["shard"], r["steps"]) for r in records]
    verdicts = invariants.check(by_record, routing, lambda ids: packed_batch(ids, routing.keys), range(SAMPLES))
    failed = [f"{v.name}: {v.detail}" for v in verdicts if not v.ok]
    assert not failed, "\n".join(failed)
    # attention: the shard ranks of each replica's stage that holds q, k, v and the labels
    sizes = [size for size, _ in records[0]["shard"]]
    for dp_rank in range(dp_size):
        holders = [r for r in records if r["dp_rank"] == dp_rank and r["stage"] == "both"]
        if not holders:  # pp > 1: q, k, v on the first stage, labels on the last
            first = {r["shard"]: r for r in records if r["dp_rank"] == dp_rank and r["stage"] == "first"}
            last = {r["shard"]: r for r in records if r["dp_rank"] == dp_rank and r["stage"] == "last"}
            holders = [
                {**first[s], "steps": [a | b for a, b in zip(first[s]["steps"], last[s]["steps"])]} for s in first
            ]
        by_shard = {r["shard"]: r for r in holders}  # replicate peers hold the same (checked above)
        ordered = [by_shard[s] for s in sorted(by_shard, key=lambda s: tuple(i for _, i in s))]
        for step in range(len(ordered[0]["steps"])):
            pieces = [r["steps"][step] for r in ordered]
            ids = pieces[0]["sample_id"].tolist()
            check_attention(pieces, sizes, packed_batch(ids), split)


@pytest.fixture(scope="module")
def world(worlds):
    return worlds.get(4)


@pytest.mark.parametrize("delivery", ["broadcast", "scatter"])
def test_cp4_per_row_offsets(world, delivery):
    records = world.run(run_rank, ("cp",), (4,), "cu_seqlens", delivery=delivery, timeout=120)
    verify(records, "cu_seqlens")
    # every document was padded to a multiple of 8 somewhere: the shapes really vary per step
    assert len({r["steps"][0]["input_ids"].shape for r in records}) == 1
    assert len({b["input_ids"].shape for b in records[0]["steps"]}) > 1


def test_dp2_cp2_position_ids_scatter(world):
    records = world.run(run_rank, ("dp", "cp"), (2, 2), "position_ids", delivery="scatter", timeout=120)
    verify(records, "position_ids")


def test_cp2_sp2_composed_broadcast_device_transport(world):
    records = world.run(
        run_rank, ("cp", "sp"), (2, 2), "cu_seqlens", delivery="broadcast", transport="device", timeout=120
    )
    verify(records, "cu_seqlens")
    assert {r["shard"] for r in records} == {((2, c), (2, s)) for c in range(2) for s in range(2)}


def test_pp2_cp2_every_stage_gets_its_metadata(world):
    records = world.run(run_rank, ("pp", "cp"), (2, 2), "cu_seqlens", delivery="scatter", timeout=120)
    verify(records, "cu_seqlens")
    last = next(r for r in records if r["stage"] == "last")
    assert {"q", "input_ids"}.isdisjoint(last["steps"][0]) and "cu_seqlens_padded" in last["steps"][0]


def test_a_malformed_boundary_key_fails_on_every_rank(world):
    records = world.run(run_malformed, timeout=120)
    assert all("the document boundaries 'cu_seqlens' decrease in row 0" in r for r in records), records


def run_malformed():
    mesh = ranks.make_mesh(("cp",), (4,))
    routing = routing_for("cu_seqlens")

    def source():
        batch = packed_batch([0, 1], routing.keys)
        batch["cu_seqlens"][0, 1:] = batch["cu_seqlens"][0, 1:].flip(0)
        return [batch]

    loader = CollectiveLoader(
        source,
        mesh,
        inputs=routing.inputs,
        labels=routing.labels,
        every_stage=routing.every_stage,
        seq_dims=routing.seq_dims,
        split=routing.split,
        timeout=60,
    )
    try:
        next(iter(loader))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        loader.close()
    return "no error"
