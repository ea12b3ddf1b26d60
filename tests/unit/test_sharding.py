"""Unit and property tests for :mod:`collective_loader.plan.sharding` (chunks, divisor, shard, unshard).

Expected pieces are recomputed here from index lists, independently of the module's code.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collective_loader.plan import sharding
from collective_loader.plan.sharding import chunks, divisor, shard, unshard

LAYOUTS = ("contiguous", "zigzag")
PROPS = settings(max_examples=80, deadline=None)


def ref_positions(length: int, levels, layout: str) -> list[int]:
    """Positions along the sequence that the rank at ``levels`` keeps, from first principles."""
    pos = list(range(length))
    for size, index in levels:
        if size == 1:
            continue
        if layout == "contiguous":
            n = len(pos) // size
            pos = pos[index * n : (index + 1) * n]
        else:
            n = len(pos) // (2 * size)
            blocks = [pos[i * n : (i + 1) * n] for i in range(2 * size)]
            pos = blocks[index] + blocks[2 * size - 1 - index]
    return pos


def all_levels(sizes):
    """Every rank's levels, row-major over the shard dims (outermost slowest)."""
    return [list(zip(sizes, idx)) for idx in itertools.product(*(range(s) for s in sizes))]


# --- chunks / divisor -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "length, size, index, expected",
    [
        (8, 2, 0, [(0, 2), (6, 8)]),
        (8, 2, 1, [(2, 4), (4, 6)]),
        (12, 3, 0, [(0, 2), (10, 12)]),
        (12, 3, 1, [(2, 4), (8, 10)]),
        (12, 3, 2, [(4, 6), (6, 8)]),
        (16, 4, 3, [(6, 8), (8, 10)]),
        (16, 4, 0, [(0, 2), (14, 16)]),
        (4, 2, 1, [(1, 2), (2, 3)]),
        (7, 1, 0, [(0, 7)]),
    ],
)
def test_chunks_zigzag(length, size, index, expected):
    assert chunks(length, size, index, "zigzag") == expected


@pytest.mark.parametrize(
    "length, size, index, expected",
    [
        (8, 2, 0, [(0, 4)]),
        (8, 2, 1, [(4, 8)]),
        (12, 3, 1, [(4, 8)]),
        (12, 4, 3, [(9, 12)]),
        (7, 1, 0, [(0, 7)]),
    ],
)
def test_chunks_contiguous(length, size, index, expected):
    assert chunks(length, size, index, "contiguous") == expected


@given(n=st.integers(2, 16), per=st.integers(1, 8), data=st.data())
@PROPS
def test_chunks_zigzag_pairs(n, per, data):
    r = data.draw(st.integers(0, n - 1))
    length = 2 * n * per
    assert chunks(length, n, r, "zigzag") == [(r * per, (r + 1) * per), ((2 * n - 1 - r) * per, (2 * n - r) * per)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("index", [-1, 2, 5])
def test_chunks_index_out_of_range(layout, index):
    with pytest.raises(ValueError, match="out of range"):
        chunks(8, 2, index, layout)


@pytest.mark.parametrize(
    "levels, contiguous, zigzag",
    [
        ([], 1, 1),
        ([(1, 0)], 1, 1),
        ([(2, 1)], 2, 4),
        ([(3, 0)], 3, 6),
        ([(4, 2)], 4, 8),
        ([(1, 0), (1, 0)], 1, 1),
        ([(2, 0), (2, 1)], 4, 8),
        ([(2, 0), (3, 0)], 6, 12),
        ([(1, 0), (4, 0)], 4, 8),
        ([(4, 0), (1, 0)], 4, 8),
        ([(3, 2), (4, 3)], 12, 24),
    ],
)
def test_divisor(levels, contiguous, zigzag):
    assert divisor(levels, "contiguous") == contiguous
    assert divisor(levels, "zigzag") == zigzag


@pytest.mark.parametrize("layout", ["Zigzag", "ring", "", None])
def test_bad_split_raises(layout):
    t = torch.arange(8)
    with pytest.raises(ValueError, match="split must be one of"):
        divisor([(2, 0)], layout)
    with pytest.raises(ValueError, match="split must be one of"):
        chunks(8, 2, 0, layout)
    with pytest.raises(ValueError, match="split must be one of"):
        shard(t, 0, [(2, 0)], layout)
    with pytest.raises(ValueError, match="split must be one of"):
        unshard([t[:4], t[4:]], 0, [2], layout)


def test_layouts_constant():
    assert sharding.SPLITS == ("contiguous", "zigzag")


# --- shard / unshard --------------------------------------------------------------------------


def test_shard_hand_computed():
    t = torch.arange(16)
    assert shard(t, 0, [(2, 0)], "zigzag").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard(t, 0, [(2, 1)], "zigzag").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert shard(t, 0, [(2, 0), (2, 1)], "zigzag").tolist() == [2, 3, 12, 13]
    assert shard(t, 0, [(2, 1), (2, 0)], "zigzag").tolist() == [4, 5, 10, 11]
    assert shard(t, 0, [(2, 1), (2, 1)], "contiguous").tolist() == [12, 13, 14, 15]
    assert shard(t, 0, [(1, 0), (4, 3)], "contiguous").tolist() == [12, 13, 14, 15]
    two_d = torch.arange(16).view(2, 8)
    assert shard(two_d, 1, [(2, 1)], "zigzag").tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert shard(two_d, -1, [(4, 0)], "contiguous").tolist() == [[0, 1], [8, 9]]


def test_shard_without_levels_is_identity():
    t = torch.arange(6).view(2, 3)
    for layout in LAYOUTS:
        assert torch.equal(shard(t, 1, [], layout), t)
        assert torch.equal(shard(t, 1, [(1, 0), (1, 0)], layout), t)


def test_shard_returns_contiguous():
    t = torch.arange(32).view(4, 8)
    for layout in LAYOUTS:
        piece = shard(t, 1, [(2, 1)], layout)
        assert piece.is_contiguous()


@pytest.mark.parametrize("layout, length", [("zigzag", 6), ("contiguous", 5)])
def test_shard_asserts_divisibility(layout, length):
    with pytest.raises(AssertionError):
        shard(torch.arange(length), 0, [(2, 0)], layout)


def test_unshard_piece_count_checked():
    with pytest.raises(ValueError, match="need 4 pieces"):
        unshard([torch.arange(2)] * 3, 0, [2, 2], "zigzag")


def test_unshard_without_sizes_returns_the_piece():
    t = torch.arange(5)
    assert torch.equal(unshard([t], 0, [], "zigzag"), t)


DTYPES = [torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.complex64, torch.uint8]


@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=2),
    mult=st.integers(1, 3),
    dim=st.sampled_from([0, 1, -1]),
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from(DTYPES),
)
@PROPS
def test_shard_unshard_roundtrip(sizes, mult, dim, layout, dtype):
    length = mult * divisor([(s, 0) for s in sizes], layout)
    shape = [2, 3, 2]
    shape[dim] = length
    numel = math.prod(shape)
    ids = torch.arange(numel).view(shape)
    t = ids.to(dtype) if dtype != torch.bool else (ids % 3 == 0)
    pieces = [shard(t, dim, levels, layout) for levels in all_levels(sizes)]
    for levels, piece in zip(all_levels(sizes), pieces):
        expected = t.index_select(dim, torch.tensor(ref_positions(length, levels, layout), dtype=torch.long))
        assert piece.dtype == dtype
        assert torch.equal(piece, expected), levels
        assert piece.shape[dim] == length // math.prod(sizes)
    assert torch.equal(unshard(pieces, dim, sizes, layout), t)
    # the pieces partition the elements: every id exactly once
    id_pieces = [shard(ids, dim, levels, layout) for levels in all_levels(sizes)]
    assert sorted(torch.cat([p.reshape(-1) for p in id_pieces]).tolist()) == list(range(numel))


@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=2), mult=st.integers(1, 4), layout=st.sampled_from(LAYOUTS)
)
@PROPS
def test_positions_partition_sequence(sizes, mult, layout):
    length = mult * divisor([(s, 0) for s in sizes], layout)
    seen = []
    for levels in all_levels(sizes):
        got = shard(torch.arange(length), 0, levels, layout).tolist()
        assert got == ref_positions(length, levels, layout)
        seen += got
    assert sorted(seen) == list(range(length))


# --- load balance -----------------------------------------------------------------------------


def _chunk_ids(length, n, r, layout):
    step = length // (2 * n)  # chunk = 1/(2n) of the sequence
    ids = []
    for start, stop in chunks(length, n, r, layout):
        ids += list(range(start // step, stop // step))
    return ids


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_zigzag_balances_causal_work(n):
    """Causal work of chunk c is proportional to c (+ const); zigzag gives every rank the same total."""
    length = 2 * n * 5
    totals = [sum(_chunk_ids(length, n, r, "zigzag")) for r in range(n)]
    assert totals == [2 * n - 1] * n
    owned = sorted(c for r in range(n) for c in _chunk_ids(length, n, r, "zigzag"))
    assert owned == list(range(2 * n))
    contiguous = [sum(_chunk_ids(length, n, r, "contiguous")) for r in range(n)]
    assert len(set(contiguous)) == n  # the contiguous split is not balanced
