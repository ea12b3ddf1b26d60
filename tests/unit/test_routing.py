"""Unit tests for :mod:`collective_loader.plan.routing` (stage selection, batch checks, per-rank pieces)."""

from __future__ import annotations

import pytest
import torch

from collective_loader.errors import BatchError
from collective_loader.plan.routing import Routing
from collective_loader.plan.split import RowSplit


def routing(split="zigzag", shard_dims=(("cp", 2),), seq_dims=None, inputs=("ids", "pos"), labels=("labels", "pos")):
    seq = {"ids": 1, "labels": 1} if seq_dims is None else seq_dims
    return Routing(inputs, labels, seq, RowSplit(split), shard_dims)


def batch(length=8):
    return {
        "labels": torch.arange(2 * length).view(2, length) + 100,
        "pos": torch.arange(length),
        "ids": torch.arange(2 * length).view(2, length),
    }


# --- construction -----------------------------------------------------------------------------


def test_keys_dedup_in_order():
    assert routing().keys == ("ids", "pos", "labels")


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(seq_dims={"other": 1}), ValueError, "other"),
        (dict(seq_dims={"ids": 1.0}), TypeError, "ids"),
        (dict(seq_dims={"ids": True}), TypeError, "ids"),
        (dict(seq_dims={"ids": "1"}), TypeError, "ids"),
        (dict(inputs="ids"), TypeError, "inputs"),
        (dict(labels="labels"), TypeError, "labels"),
        (dict(inputs=(1,)), TypeError, "inputs"),
        (dict(inputs=(), labels=(), seq_dims={}), ValueError, "all empty"),
        (dict(split="ring"), ValueError, "split"),
    ],
)
def test_constructor_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        routing(**kwargs)


def test_labels_only_and_inputs_only_are_valid():
    assert Routing((), ("y",), {}, RowSplit("contiguous")).keys == ("y",)
    assert Routing(("x",), (), {"x": 0}, RowSplit("contiguous")).keys == ("x",)


# --- select -----------------------------------------------------------------------------------


def test_select_stages_in_batch_order():
    r = routing()
    b = batch()
    assert list(r.select(b, "first")) == ["pos", "ids"]
    assert list(r.select(b, "last")) == ["labels", "pos"]
    assert list(r.select(b, "both")) == ["labels", "pos", "ids"]
    assert r.select(b, "middle") == {}
    for stage in ("first", "last", "both"):
        for k, v in r.select(b, stage).items():
            assert v is b[k]


def test_select_key_in_both_goes_to_both_stages():
    r = Routing(("x", "shared"), ("shared", "y"), {}, RowSplit("contiguous"))
    b = {"y": 1, "shared": 2, "x": 3}
    assert r.select(b, "first") == {"shared": 2, "x": 3}
    assert r.select(b, "last") == {"y": 1, "shared": 2}


def test_every_stage_keys_reach_every_stage_middle_included():
    r = Routing(("x",), ("y",), {"cu": 0}, RowSplit("contiguous"), every_stage=("cu",))
    b = {"cu": torch.tensor([0, 3, 8]), "y": 1, "x": 3}
    assert r.keys == ("x", "y", "cu")
    assert list(r.select(b, "first")) == ["cu", "x"]
    assert list(r.select(b, "last")) == ["cu", "y"]
    assert list(r.select(b, "middle")) == ["cu"]
    assert list(r.select(b, "both")) == ["cu", "y", "x"]
    r.check(b)  # every_stage keys count as listed keys


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(inputs=("x", "cu")), ValueError, r"\['cu'\] are in every_stage and also"),
        (dict(every_stage="cu"), TypeError, "every_stage"),
        (dict(seq_dims={"z": 0}), ValueError, "none of inputs, labels and every_stage"),
    ],
)
def test_every_stage_errors(kwargs, exc, match):
    args = dict(inputs=("x",), labels=("y",), seq_dims={}, split=RowSplit("contiguous"), every_stage=("cu",)) | kwargs
    with pytest.raises(exc, match=match):
        Routing(**args)


def test_every_stage_alone_is_valid():
    assert Routing((), (), {}, RowSplit("contiguous"), every_stage=("cu",)).select({"cu": 1}, "middle") == {"cu": 1}


# --- check ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [[("ids", 1)], torch.ones(2), "ids", None])
def test_check_rejects_non_mapping(value):
    with pytest.raises(BatchError, match="mapping"):
        routing().check(value)


def test_check_missing_key_named():
    b = batch()
    del b["labels"]
    with pytest.raises(BatchError, match=r"missing keys \['labels'\]"):
        routing().check(b)


def test_check_extra_key_named():
    b = batch()
    b["extra"] = torch.ones(1)
    with pytest.raises(BatchError, match=r"keys \['extra'\]"):
        routing().check(b)


# the shape checks do not depend on the shard size: a batch refused at cp=2 is refused at cp=1
SHARD_SIZES = pytest.mark.parametrize("shard_dims", [(), (("cp", 1),), (("cp", 2),)], ids=["none", "cp1", "cp2"])


@SHARD_SIZES
def test_check_seq_key_not_a_tensor(shard_dims):
    b = batch()
    b["ids"] = [[1, 2, 3, 4]]
    with pytest.raises(BatchError, match=r"seq_dims\['ids'\] = 1.*list"):
        routing(shard_dims=shard_dims).check(b)


@SHARD_SIZES
@pytest.mark.parametrize("dim", [2, -3, 5])
def test_check_seq_dim_out_of_range(shard_dims, dim):
    with pytest.raises(BatchError, match=rf"seq_dims\['ids'\] = {dim}.*\(2, 8\)"):
        routing(seq_dims={"ids": dim}, shard_dims=shard_dims).check(batch())


@pytest.mark.parametrize(
    "layout, shard_dims, length, need",
    [
        ("zigzag", (("cp", 2),), 6, 4),
        ("zigzag", (("cp", 2),), 2, 4),
        ("zigzag", (("cp", 2), ("sp", 2)), 12, 8),
        ("zigzag", (("cp", 2), ("sp", 2)), 4, 8),
        ("contiguous", (("cp", 2), ("sp", 2)), 6, 4),
        ("contiguous", (("cp", 3),), 4, 3),
        ("zigzag", (("cp", 1), ("sp", 3)), 9, 6),
    ],
)
def test_check_length_not_divisible(layout, shard_dims, length, need):
    over = " x ".join(f"{n}={s}" for n, s in shard_dims)
    with pytest.raises(BatchError) as e:
        routing(split=layout, shard_dims=shard_dims).check(batch(length))
    msg = str(e.value)
    assert "'ids'" in msg and f"length {length}" in msg and f"multiple of {need}" in msg
    assert over in msg and layout in msg


@pytest.mark.parametrize(
    "layout, shard_dims, length",
    [
        ("zigzag", (("cp", 2),), 4),
        ("zigzag", (("cp", 2),), 12),
        ("zigzag", (("cp", 2), ("sp", 2)), 8),
        ("zigzag", (("cp", 2), ("sp", 2)), 16),
        ("contiguous", (("cp", 2), ("sp", 2)), 4),
        ("contiguous", (("cp", 3),), 6),
        ("zigzag", (("cp", 1), ("sp", 3)), 12),
    ],
)
def test_check_divisible_passes(layout, shard_dims, length):
    assert routing(split=layout, shard_dims=shard_dims).check(batch(length)) is None


def test_check_negative_seq_dim_in_range():
    r = routing(seq_dims={"ids": -1})
    r.check(batch(4))
    with pytest.raises(BatchError, match="length 6"):
        r.check(batch(6))


@pytest.mark.parametrize("shard_dims", [(), (("cp", 1),), (("cp", 1), ("sp", 1))])
def test_check_no_divisibility_when_shard_dims_trivial(shard_dims):
    r = routing(shard_dims=shard_dims)
    r.check(batch(7))


def test_check_only_seq_keys_need_divisibility():
    r = routing(seq_dims={"ids": 1})
    b = batch(8)
    b["labels"] = torch.ones(2, 7)  # not a seq key: any length
    b["pos"] = "plain"
    r.check(b)


# --- piece ------------------------------------------------------------------------------------


def test_piece_shards_seq_keys_only():
    r = routing(seq_dims={"ids": 1})
    b = batch(8)
    out = r.piece(b, [(2, 1)])
    assert list(out) == ["labels", "pos", "ids"]
    assert out["ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert out["labels"] is b["labels"]
    assert out["pos"] is b["pos"]


def test_piece_two_levels_zigzag():
    r = Routing(("ids",), (), {"ids": 0}, RowSplit("zigzag"), (("cp", 2), ("sp", 2)))
    out = r.piece({"ids": torch.arange(16)}, [(2, 0), (2, 1)])
    assert out["ids"].tolist() == [2, 3, 12, 13]


def test_piece_contiguous_and_plain_values():
    r = Routing(("ids", "meta"), ("labels",), {"ids": 0, "labels": 0}, RowSplit("contiguous"), (("cp", 4),))
    sel = {"ids": torch.arange(8), "meta": {"a": 1}, "labels": torch.arange(8) * 10}
    out = r.piece(sel, [(4, 3)])
    assert out["ids"].tolist() == [6, 7]
    assert out["labels"].tolist() == [60, 70]
    assert out["meta"] is sel["meta"]


@pytest.mark.parametrize("levels", [[], [(1, 0)], [(1, 0), (1, 0)]])
def test_piece_trivial_levels_pass_through(levels):
    r = routing()
    b = batch(7)
    out = r.piece(b, levels)
    assert out == b and out is not b
    assert all(out[k] is b[k] for k in b)


def test_docstring_example():
    r = Routing(("ids",), ("labels",), {"ids": 1, "labels": 1}, RowSplit("contiguous"), (("cp", 2),))
    b = {"ids": torch.arange(8).view(2, 4), "labels": torch.arange(8).view(2, 4)}
    out = r.piece(r.select(b, "first"), [(2, 1)])
    assert list(out) == ["ids"]
    assert out["ids"].tolist() == [[2, 3], [6, 7]]
