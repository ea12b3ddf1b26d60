"""Attention under the per-document split, computed on a CPU from what each rank was delivered.

Every shard rank computes causal attention for its own queries against the keys and values of
every rank (what ring attention or an all-gather brings it), masking only with what it was
delivered, in both conventions the split delivers (document ids and positions; TE's THD offsets
with the rank's chunks): see :func:`packed_documents.check_attention`. The outputs, reassembled in
the original order, equal ``scaled_dot_product_attention`` on each document alone; labels and
loss masks reassemble exactly; the count of valid tokens is unchanged. Random document-length
mixes (hypothesis) at cp = 2 and 4, and cp x Ulysses sp composed.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from packed_documents import attend, check_attention, per_document_sdpa, random_batch

from collective_loader.plan.documents import PerDocument
from collective_loader.plan.routing import Routing

SIZES = [(2,), (4,), (2, 2), (2, 3)]  # cp, or cp x sp in mesh order


@st.composite
def mixes(draw):
    """Rows of document lengths (one row length), and a seed for q, k, v and labels."""
    rows = draw(st.integers(1, 2))
    length = draw(st.integers(1, 48))
    layout = []
    for _ in range(rows):
        style = draw(st.sampled_from(["one", "few", "many"]))
        if style == "one" or length == 1:
            cuts: list[int] = []
        else:
            cuts = sorted(draw(st.sets(st.integers(1, length - 1), max_size=2 if style == "few" else length - 1)))
        edges = [0, *cuts, length]
        layout.append([b - a for a, b in zip(edges, edges[1:])])
    return layout, length, draw(st.integers(0, 2**31 - 1))


def routing_for(sizes):
    split = PerDocument(cu_seqlens="cu_seqlens", pad_values={"labels": -100, "loss_mask": 0})
    seq_dims = {k: 1 for k in ("q", "k", "v", "labels", "loss_mask")}
    shard_dims = tuple(zip(("cp", "sp", "xp"), sizes))
    return Routing(("q", "k", "v"), ("labels", "loss_mask"), seq_dims, split, shard_dims, ("cu_seqlens",))


@given(mix=mixes(), sizes=st.sampled_from(SIZES))
@settings(max_examples=40, deadline=None)
def test_sharded_attention_equals_per_document_sdpa(mix, sizes):
    batch = random_batch(*mix)
    routing = routing_for(sizes)
    assert isinstance(routing.split, PerDocument)
    routing.check(batch)
    pieces = [routing.piece(batch, list(zip(sizes, index))) for index in itertools.product(*(range(s) for s in sizes))]
    check_attention(pieces, sizes, batch, routing.split)


def test_a_mask_from_the_rows_positions_lets_documents_see_each_other():
    """Why the split delivers document ids and offsets: a causal mask over the row (what the
    whole-row split gives a rank to work with) lets the second document attend to the first."""
    batch = random_batch([[3, 5]], 8, 0)
    q, k, v = (batch[x][0] for x in ("q", "k", "v"))
    pos = torch.arange(8)
    causal_row = attend(q, k, v, pos[None, :] <= pos[:, None]).unsqueeze(0)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(causal_row, per_document_sdpa(batch, [3, 5]))
