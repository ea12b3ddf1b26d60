"""The per-document split end to end over a real gloo world: a plain ``DataLoader`` of packed rows
shaped as the text packer's (``position_ids`` restarting at 0, per-row ``cu_seqlens``,
``sequence_id``) through ``CollectiveLoader``, with broadcast and scatter, over cp, dp x cp, cp x sp
and pp x cp, the documents read from ``cu_seqlens`` or from ``position_ids``; and the packer's own
rows, from an MDS dataset of documents through ``StreamingSource(packing=...)``.

Every rank's batch is checked with the package's invariants (its piece, metadata included, and
the pieces reassembling each key exactly), and the shard ranks' attention, computed from what
they received, equals per-document SDPA (:func:`packed_documents.check_attention`).
"""

from __future__ import annotations

import numpy as np
import pytest
import ranks
import torch
import torch.distributed as dist
from packed_documents import SEQ_KEYS, Rows, check_attention, packed_batch
from torch.utils.data import DataLoader

from collective_loader import CollectiveLoader, PerDocument, mesh_place
from collective_loader.plan.routing import Routing
from collective_loader.streaming import StreamingSource
from collective_loader.testing import invariants
from collective_loader.text import Packing

SAMPLES, BATCH = 16, 2
PAD = {"labels": -100, "loss_mask": 0, "sequence_id": -1}
SPLITS = {
    "cu_seqlens": PerDocument(cu_seqlens="cu_seqlens", positions="position_ids", pad_values=PAD),
    "position_ids": PerDocument(positions="position_ids", pad_values=PAD),
}


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
        return DataLoader(Rows(place.dp_rank, place.dp_size, routing.keys, SAMPLES), batch_size=BATCH)

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


# --- the packer's rows through StreamingSource ------------------------------------------------

DOCUMENTS, ROW = 40, 24


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """An MDS dataset of documents (``tokens`` of 1 to 40 ids each, every id unique)."""
    from streaming import MDSWriter

    out = str(tmp_path_factory.mktemp("documents") / "mds")
    lengths = np.random.default_rng(5).integers(1, 41, size=DOCUMENTS)
    with MDSWriter(out=out, columns={"tokens": "ndarray:int32"}, size_limit=1 << 12) as writer:
        for i, n in enumerate(lengths):
            writer.write({"tokens": (i * 100 + np.arange(n) + 1).astype(np.int32)})
    return out


class Recorded:
    """A leader's stream, keeping a copy of every batch it hands to the loader."""

    def __init__(self, stream) -> None:
        self.stream, self.batches = stream, []

    def __iter__(self):
        for batch in self.stream:
            self.batches.append({k: v.clone() for k, v in batch.items()})
            yield batch

    def close(self) -> None:
        self.stream.close()


PACKER_SPLIT = PerDocument(cu_seqlens="cu_seqlens", positions="position_ids")


def packer_routing() -> Routing:
    seq_dims = {"input_ids": 1, "position_ids": 1, "labels": 1}
    return Routing(("input_ids", "position_ids"), ("labels",), seq_dims, PACKER_SPLIT, every_stage=("cu_seqlens",))


def run_packer_rank(path: str, dims, shape):
    mesh = ranks.make_mesh(dims, shape)
    source = StreamingSource(
        mesh,
        local=path,
        batch_size=2,
        shuffle=False,
        num_canonical_nodes=1,
        packing=Packing(ROW, boundaries=("position_ids", "cu_seqlens")),
    )
    recorded: list[Recorded] = []

    def leader_source():
        recorded.append(Recorded(source()))
        return recorded[0]

    routing = packer_routing()
    loader = CollectiveLoader(
        leader_source,
        mesh,
        inputs=routing.inputs,
        labels=routing.labels,
        every_stage=routing.every_stage,
        seq_dims=routing.seq_dims,
        split=routing.split,
        delivery="scatter",
        timeout=120,
    )
    place = loader.place
    steps = [dict(batch) for batch in loader]
    loader.close()
    dist.barrier()
    return {
        "dp_rank": place.dp_rank,
        "stage": place.stage,
        "shard": place.shard,
        "steps": steps,
        "sent": recorded[0].batches if recorded else None,
    }


def test_the_packers_rows_through_streaming_source(world, documents):
    records = world.run(run_packer_rank, documents, ("dp", "cp"), (2, 2), timeout=240)
    routing = packer_routing()
    steps = {len(r["steps"]) for r in records}
    assert len(steps) == 1 and steps != {0}, steps  # every replica stops at the same step
    # a leader may have loaded one batch more than the replicas agreed to train on
    sent = {r["dp_rank"]: r["sent"][: min(steps)] for r in records if r["sent"] is not None}
    assert sorted(sent) == [0, 1]
    real_labels = 0
    for dp_rank, batches in sent.items():
        mine = [r for r in records if r["dp_rank"] == dp_rank]
        for step, batch in enumerate(batches):
            assert batch["cu_seqlens"].dim() == 2  # the packer's per-row offsets
            for r in mine:  # each rank's piece of the very batch its leader loaded
                want = routing.piece(routing.select(batch, r["stage"]), r["shard"])
                got = r["steps"][step]
                assert got.keys() == want.keys()
                assert all(
                    torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k]
                    for k in want
                )
            ordered = sorted(mine, key=lambda r: r["shard"])
            for key in routing.seq_dims:
                pieces = [r["steps"][step][key] for r in ordered]
                rebuilt = PACKER_SPLIT.unshard(pieces, [2], 1, batch)
                assert torch.equal(rebuilt.reshape(batch[key].shape), batch[key]), (dp_rank, step, key)
            real_labels += sum(int((r["steps"][step]["labels"] != -100).sum()) for r in ordered)
    # the valid tokens the leaders loaded are the valid tokens the cp ranks hold, each once
    assert real_labels == sum(int((b["labels"] != -100).sum()) for bs in sent.values() for b in bs)
