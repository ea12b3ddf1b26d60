"""Unit and property tests for :mod:`collective_loader.plan.documents` (the per-document split)
and its place in :class:`~collective_loader.plan.routing.Routing`.

Expected pieces are recomputed here from first principles (TransformerEngine's rule: pad every
document to a multiple of 2n, rank r keeps chunks r and 2n-1-r of each; composed dims zigzag each
rank's part again), with Python lists, independently of the module's code.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collective_loader.delivery.config import LoaderConfig
from collective_loader.errors import BatchError
from collective_loader.plan.documents import PerDocument
from collective_loader.plan.routing import Routing

PROPS = settings(max_examples=60, deadline=None)
SIZES = [(1,), (2,), (4,), (3,), (2, 2), (2, 3), (1, 2)]
SEQ_DIMS = {"ids": 1, "labels": 1, "positions": 1, "mask": 1, "emb": 1}
FORMS = ("cu_seqlens_flat", "cu_seqlens_rows", "positions")


def all_levels(sizes):
    return [list(zip(sizes, idx)) for idx in itertools.product(*(range(s) for s in sizes))]


def zigzag_positions(length: int, levels) -> list[int]:
    """Positions of a padded document that the rank at ``levels`` keeps (composed zigzag)."""
    pos = list(range(length))
    for size, index in levels:
        if size > 1:
            c = len(pos) // (2 * size)
            blocks = [pos[i * c : (i + 1) * c] for i in range(2 * size)]
            pos = blocks[index] + blocks[2 * size - 1 - index]
    return pos


def reference(doc_lengths: list[int], levels) -> list[tuple[int | None, int, int]]:
    """Per own token: (index into the flattened stream or None for padding, document, position)."""
    n = math.prod(size for size, _ in levels)
    multiple = 2 * n if n > 1 else 1
    out, start = [], 0
    for doc, length in enumerate(doc_lengths):
        padded = -(-length // multiple) * multiple
        out += [(start + k if k < length else None, doc, k) for k in zigzag_positions(padded, levels)]
        start += length
    return out


@st.composite
def packed(draw, max_rows=3, max_len=40):
    """(rows of document lengths, row length): every row holds the same number of tokens."""
    rows = draw(st.integers(1, max_rows))
    length = draw(st.integers(1, max_len))
    layout = []
    for _ in range(rows):
        cuts = sorted(draw(st.sets(st.integers(1, length - 1), max_size=min(6, length - 1))) if length > 1 else [])
        edges = [0, *cuts, length]
        layout.append([b - a for a, b in zip(edges, edges[1:])])
    return layout, length


def make_batch(layout, length, form):
    rows = len(layout)
    ids = torch.arange(rows * length).view(rows, length) + 1000
    positions = torch.cat([torch.arange(n) for row in layout for n in row]).view(rows, length)
    batch = {
        "ids": ids,
        "labels": ids + 1,
        "positions": positions,
        "mask": (ids % 3 != 0).float(),
        "emb": torch.stack([ids, -ids, ids * 2], dim=-1).double(),
    }
    if form == "cu_seqlens_flat":
        lengths = torch.tensor([n for row in layout for n in row])
        batch["cu"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).int()
    elif form == "cu_seqlens_rows":
        width = max(len(row) for row in layout) + 2  # filled by repeating the row length
        offsets = [[0, *itertools.accumulate(row)] for row in layout]
        batch["cu"] = torch.tensor([o + [length] * (width - len(o)) for o in offsets])
    return batch


def split_for(form):
    if form == "positions":
        return PerDocument(positions="positions", pad_values={"labels": -100, "mask": 0, "emb": 7.5})
    return PerDocument(cu_seqlens="cu", positions="positions", pad_values={"labels": -100, "mask": 0, "emb": 7.5})


def routing_for(form, shard_dims):
    split = split_for(form)
    boundary = ("cu",) if form != "positions" else ("positions",)
    inputs = tuple(k for k in ("ids", "positions", "mask", "emb") if k not in boundary)
    return Routing(inputs, ("labels",), SEQ_DIMS, split, shard_dims, boundary)


# --- what each rank keeps ---------------------------------------------------------------------


@given(case=packed(), sizes=st.sampled_from(SIZES), form=st.sampled_from(FORMS))
@PROPS
def test_every_rank_keeps_its_chunks_of_every_document(case, sizes, form):
    layout, length = case
    doc_lengths = [n for row in layout for n in row]
    batch = make_batch(layout, length, form)
    routing = routing_for(form, tuple((f"d{i}", s) for i, s in enumerate(sizes)))
    routing.check(batch)
    flat = {k: batch[k].reshape(-1, *batch[k].shape[2:]) for k in SEQ_DIMS}
    pad = {"ids": 0, "labels": -100, "mask": 0.0, "emb": 7.5}
    for levels in all_levels(sizes):
        got = routing.piece(batch, levels)
        ref = reference(doc_lengths, levels)
        assert got["document_ids"].tolist() == [[d for _, d, _ in ref]]
        assert got["document_positions"].tolist() == [[k for _, _, k in ref]]
        for key in SEQ_DIMS:
            assert got[key].shape == (1, len(ref), *batch[key].shape[2:]), key
            assert got[key].dtype == batch[key].dtype, key
            want = [
                flat[key][source]
                if source is not None
                else torch.tensor(k)
                if key == "positions"  # counts on through the padding
                else torch.full_like(flat[key][0], pad[key])
                for source, _, k in ref
            ]
            if want:
                assert torch.equal(got[key][0], torch.stack(want).to(got[key].dtype)), key
        assert "cu" not in got


@given(case=packed(), sizes=st.sampled_from(SIZES), form=st.sampled_from(FORMS))
@PROPS
def test_metadata_follows_te_and_olmo_core_conventions(case, sizes, form):
    layout, length = case
    doc_lengths = [n for row in layout for n in row]
    n = math.prod(sizes)
    multiple = 2 * n if n > 1 else 1
    padded = [-(-x // multiple) * multiple for x in doc_lengths]
    batch = make_batch(layout, length, form)
    routing = routing_for(form, tuple((f"d{i}", s) for i, s in enumerate(sizes)))
    for levels in all_levels(sizes):
        got = routing.piece(batch, levels)
        assert got["cu_seqlens"].tolist() == [0, *itertools.accumulate(doc_lengths)]
        assert got["cu_seqlens_padded"].tolist() == [0, *itertools.accumulate(padded)]
        assert got["cu_seqlens_local"].tolist() == [0, *itertools.accumulate(p // n for p in padded)]
        assert got["max_seqlen"] == max(padded) and got["max_seqlen_local"] == max(padded) // n
        for key in ("cu_seqlens", "cu_seqlens_padded", "cu_seqlens_local"):
            assert got[key].dtype == torch.int32 and got[key].dim() == 1
        # every rank holds the same number of tokens: what scatter's equal-size messages need
        assert got["ids"].shape[1] == sum(padded) // n


@given(case=packed(), sizes=st.sampled_from(SIZES), form=st.sampled_from(FORMS))
@PROPS
def test_pieces_reassemble_and_keep_every_valid_token(case, sizes, form):
    layout, length = case
    batch = make_batch(layout, length, form)
    routing = routing_for(form, tuple((f"d{i}", s) for i, s in enumerate(sizes)))
    split = routing.split
    assert isinstance(split, PerDocument)
    pieces = [routing.piece(batch, levels) for levels in all_levels(sizes)]
    for key in SEQ_DIMS:
        rebuilt = split.unshard([p[key] for p in pieces], sizes, 1, batch)
        assert torch.equal(rebuilt.reshape(batch[key].shape), batch[key]), key
    assert sum(int((p["labels"] != -100).sum()) for p in pieces) == batch["labels"].numel()
    assert sum(float(p["mask"].sum()) for p in pieces) == float(batch["mask"].sum())


@given(case=packed(), sizes=st.sampled_from(SIZES))
@PROPS
def test_the_three_boundary_forms_agree(case, sizes):
    layout, length = case
    outs = []
    for form in FORMS:
        batch = make_batch(layout, length, form)
        routing = routing_for(form, tuple((f"d{i}", s) for i, s in enumerate(sizes)))
        outs.append([routing.piece(batch, levels) for levels in all_levels(sizes)])
    for a, b in itertools.combinations(outs, 2):
        for pa, pb in zip(a, b):
            assert pa.keys() == pb.keys()
            assert all(torch.equal(pa[k], pb[k]) if isinstance(pa[k], torch.Tensor) else pa[k] == pb[k] for k in pa)


def test_one_shard_rank_flattens_without_padding():
    batch = make_batch([[3, 5], [8]], 8, "cu_seqlens_rows")
    got = routing_for("cu_seqlens_rows", ()).piece(batch, ())
    assert torch.equal(got["ids"], batch["ids"].reshape(1, 16))
    assert got["cu_seqlens"].tolist() == got["cu_seqlens_padded"].tolist() == [0, 3, 8, 16]
    assert got["document_ids"].tolist() == [[0] * 3 + [1] * 5 + [2] * 8]


def test_a_row_starting_inside_a_document_keeps_its_positions():
    """TorchTitan's windows: a row may begin mid-document (positions not at 0); the padding counts on
    from there, and document_positions count from the row's first token."""
    positions = torch.tensor([[5, 6, 7, 0, 1]])
    batch = {"positions": positions, "ids": torch.arange(5).view(1, 5)}
    split = PerDocument(positions="positions")
    got = split.piece(batch, {"positions": 1, "ids": 1}, [(2, 1)])  # documents 3, 2 -> 4, 4; chunks 1, 2
    assert got["positions"].tolist() == [[6, 7, 1, 2]]
    assert got["document_positions"].tolist() == [[1, 2, 1, 2]]


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cu, match",
    [
        ([0, 3, 2, 8], "decrease in row 0 at index 2"),
        ([1, 3, 8], "start at 1"),
        ([0, 3, 7], "end at 7"),
        ([[0, 3, 8], [0, 2, 7]], "end at different offsets"),
        ([[0, 3, 8], [0, 5, 4]], "decrease in row 1"),
        ([[0, 8, 0], [0, 4, 8]], "fill a row's offsets by repeating its length"),
        ([0.0, 3.0, 8.0], "integer offsets, got dtype torch.float32"),
        ([[[0, 8]]], r"got shape \(1, 1, 2\)"),
        (torch.zeros(0, dtype=torch.int32), r"got shape \(0,\)"),
        ("not a tensor", "must be a tensor of offsets, got a str"),
    ],
)
def test_malformed_offsets_name_the_key(cu, match):
    routing = routing_for("cu_seqlens_flat", (("cp", 2),))
    batch = make_batch([[4], [4]], 4, "cu_seqlens_flat")  # 2 rows of 4 tokens
    batch["cu"] = cu if isinstance(cu, (str, torch.Tensor)) else torch.tensor(cu)
    with pytest.raises(BatchError, match=match) as e:
        routing.check(batch)
    assert "'cu'" in str(e.value)


@pytest.mark.parametrize(
    "positions, match",
    [
        ([[0, 1, 3, 0]], "row 0 goes from 1 to 3 at index 2"),
        ([[0, 1, 2, 2]], "row 0 goes from 2 to 2 at index 3"),
        ([[0, -1, 0, 1]], "goes from 0 to -1"),
        ([0, 1, 2, 3], r"'positions' has shape \(4,\)"),
    ],
)
def test_malformed_positions_name_the_key(positions, match):
    routing = routing_for("positions", (("cp", 2),))
    batch = make_batch([[4]], 4, "positions")
    batch["positions"] = torch.tensor(positions)
    with pytest.raises(BatchError, match=match) as e:
        routing.check(batch)
    assert "'positions'" in str(e.value)


def test_sequence_keys_must_match_the_boundaries():
    routing = routing_for("cu_seqlens_rows", (("cp", 2),))
    batch = make_batch([[3, 5], [8]], 8, "cu_seqlens_rows")
    batch["labels"] = batch["labels"][:, :6]
    with pytest.raises(BatchError, match=r"'labels' has shape \(2, 6\), but 'cu' describes 2 rows of 8 tokens"):
        routing.check(batch)
    batch = make_batch([[3, 5], [8]], 8, "cu_seqlens_flat")
    batch["cu"] = torch.tensor([0, 3, 8, 12], dtype=torch.int32)
    with pytest.raises(BatchError, match=r"'ids' holds 2 x 8 = 16 tokens, but the offsets in 'cu' end at 12"):
        routing.check(batch)


def test_computed_keys_in_the_batch_are_refused_by_name():
    routing = routing_for("cu_seqlens_flat", (("cp", 2),))
    batch = make_batch([[3, 5]], 8, "cu_seqlens_flat") | {"max_seqlen": 5}
    with pytest.raises(BatchError, match=r"\['max_seqlen'\], which the PerDocument split computes"):
        routing.check(batch)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(every_stage=()), "list 'cu' in every_stage"),
        (dict(seq_dims={"ids": 1, "cu": 1}), "'cu' holds offsets, not one value per token"),
        (dict(split=PerDocument(positions="pos"), every_stage=("pos",)), "add it to seq_dims"),
        (dict(seq_dims={"ids": 2}), "each key's sequence dim must be 1"),
        (dict(inputs=("ids", "max_seqlen")), r"keys \['max_seqlen'\] are what the split computes"),
        (dict(split=PerDocument(cu_seqlens="cu", pad_values={"lables": -100})), r"pad_values names keys \['lables'\]"),
        (
            dict(split=PerDocument(cu_seqlens="cu", positions="ids", pad_values={"ids": 0})),
            "counts on through the padding",
        ),
    ],
)
def test_construction_errors(kwargs, match):
    args = (
        dict(
            inputs=("ids",),
            labels=("labels",),
            seq_dims={"ids": 1, "labels": 1},
            split=PerDocument(cu_seqlens="cu"),
            shard_dims=(("cp", 2),),
            every_stage=("cu",),
        )
        | kwargs
    )
    with pytest.raises(ValueError, match=match):
        Routing(**args)


def test_a_split_name_is_a_whole_row_split_only():
    with pytest.raises(ValueError, match=r"one of \('contiguous', 'zigzag'\) or a split object"):
        LoaderConfig(split="per_document")


@pytest.mark.parametrize(
    "kwargs, exc",
    [(dict(), ValueError), (dict(cu_seqlens=3), TypeError), (dict(cu_seqlens="cu", pad_values={"x": True}), TypeError)],
)
def test_per_document_needs_a_boundary_key(kwargs, exc):
    with pytest.raises(exc):
        PerDocument(**kwargs)


def test_pad_values_are_sorted_so_every_rank_describes_the_split_alike():
    a = PerDocument(cu_seqlens="cu", pad_values={"labels": -100, "loss_mask": 0})
    b = PerDocument(cu_seqlens="cu", pad_values={"loss_mask": 0, "labels": -100})
    assert repr(a) == repr(b)


def test_metadata_names():
    assert PerDocument.metadata == (
        "cu_seqlens",
        "cu_seqlens_padded",
        "max_seqlen",
        "cu_seqlens_local",
        "max_seqlen_local",
        "document_ids",
        "document_positions",
    )
