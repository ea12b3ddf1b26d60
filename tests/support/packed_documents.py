"""Packed rows of documents and the attention check of the per-document split, shared by the
unit tests and the tests over real worlds.

A row (``packed_row(i)``) packs documents whose lengths follow from its id; it carries what the
packer (:mod:`collective_loader.text.packing`) gives per row: ``position_ids`` restarting at 0 at
each document, ``cu_seqlens`` (fixed width, filled by repeating the row length), ``sequence_id``
(each token's document in its row), and queries, keys and values for the attention check.

:func:`check_attention`: every shard rank attends with its own queries to the keys and values of
every rank, masking only with what it was delivered (document ids and positions; and, as
TransformerEngine's kernels do, the global ``cu_seqlens`` with the local offsets and the rank's
chunks); the outputs, reassembled in the original order, must equal causal
``scaled_dot_product_attention`` on each document alone. :func:`check_balanced_attention` does the
same for :class:`BalancedDocuments`: a rank attends over its whole documents with its own keys and
values alone, and over the split documents with every rank's keys and values of those.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.data

from collective_loader.plan.balanced_documents import BalancedDocuments
from collective_loader.plan.documents import PerDocument

HEADS, DIM = 2, 4
LENGTH, WIDTH = 24, 9  # tokens per row; cu_seqlens entries per row (at most WIDTH - 1 documents)
SEQ_KEYS = ("input_ids", "labels", "position_ids", "sequence_id", "loss_mask", "q", "k", "v")


def row_documents(sample_id: int, length: int = LENGTH, most: int = WIDTH - 1) -> list[int]:
    """The document lengths of row ``sample_id``: a few cut points that depend on the id."""
    rng = np.random.default_rng(sample_id)
    cuts = sorted(set(rng.integers(1, length, size=int(rng.integers(0, most))).tolist()))
    edges = [0, *cuts, length]
    return [b - a for a, b in zip(edges, edges[1:])]


def packed_row(sample_id: int, length: int = LENGTH, width: int = WIDTH) -> dict[str, torch.Tensor]:
    """One packed row, as a packer emits it (plus q, k, v for the attention check)."""
    docs = row_documents(sample_id, length, width - 1)
    gen = torch.Generator().manual_seed(sample_id)
    ids = torch.arange(length) + sample_id * 1000
    offsets = [0, *itertools.accumulate(docs)]
    return {
        "input_ids": ids,
        "labels": ids + 1,
        "position_ids": torch.cat([torch.arange(n) for n in docs]),
        "sequence_id": torch.cat([torch.full((n,), i) for i, n in enumerate(docs)]),
        "loss_mask": (ids % 5 != 0).float(),
        "cu_seqlens": torch.tensor(offsets + [length] * (width - len(offsets)), dtype=torch.int32),
        "sample_id": torch.tensor(sample_id),
        **{x: torch.randn(length, HEADS, DIM, generator=gen, dtype=torch.float64) for x in ("q", "k", "v")},
    }


def packed_batch(ids: Sequence[int], keys: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """The batch a DataLoader's default collate makes of these rows (only ``keys``, if given)."""
    rows = [packed_row(i) for i in ids]
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0] if keys is None or k in keys}


def random_batch(layout: Sequence[Sequence[int]], length: int, seed: int) -> dict[str, torch.Tensor]:
    """Rows of documents of the lengths in ``layout`` (each row's summing to ``length``): random
    float64 ``q``, ``k``, ``v`` of shape ``(rows, length, HEADS, DIM)``, ``labels`` (10% already
    -100), a ``loss_mask`` and the fixed-width ``cu_seqlens`` of the rows."""
    rows = len(layout)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(rows, length, HEADS, DIM, generator=gen, dtype=torch.float64) for _ in range(3))
    labels = torch.randint(0, 1000, (rows, length), generator=gen)
    labels[torch.rand(rows, length, generator=gen) < 0.1] = -100  # already ignored: must stay so
    width = max(len(row) for row in layout) + 1
    offsets = [[0, *itertools.accumulate(row)] for row in layout]
    return {
        "q": q,
        "k": k,
        "v": v,
        "labels": labels,
        "loss_mask": (labels % 5 != 0).float(),
        "cu_seqlens": torch.tensor([o + [length] * (width - len(o)) for o in offsets], dtype=torch.int32),
    }


class Rows(torch.utils.data.Dataset):
    """Replica ``dp_rank``'s strided share of the packed rows ``0 .. samples - 1`` (``keys`` of each)."""

    def __init__(self, dp_rank: int, dp_size: int, keys: tuple[str, ...], samples: int) -> None:
        self.ids = list(range(dp_rank, samples, dp_size))
        self.keys = keys

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v for k, v in packed_row(self.ids[i]).items() if k in self.keys}


def own_chunks(levels: Sequence[tuple[int, int]]) -> list[int]:
    """The chunk numbers (of 2n per padded document) the rank at ``levels`` holds, in order: r and
    2cp-1-r for one dim; each further dim zigzags the previous one's part again."""
    n = math.prod(size for size, _ in levels)
    chunks = list(range(2 * n))
    for size, index in levels:
        per = len(chunks) // (2 * size)
        parts = [chunks[i * per : (i + 1) * per] for i in range(2 * size)]
        chunks = parts[index] + parts[2 * size - 1 - index]
    return chunks


def te_positions(
    piece: Mapping[str, Any], levels: Sequence[tuple[int, int]], prefix: str = ""
) -> tuple[torch.Tensor, ...]:
    """Each own token's (document, position, real) from the THD metadata alone, as TE's kernels
    find them: the document from the local offsets, the position from the rank's chunks. The
    keys are ``{prefix}cu_seqlens_local`` and ``{prefix}cu_seqlens`` (``split_`` for the split
    documents of :class:`BalancedDocuments`, whose documents are then numbered among those)."""
    local = piece[f"{prefix}cu_seqlens_local"].long()
    real_lengths = piece[f"{prefix}cu_seqlens"].long().diff()
    chunks = torch.tensor(own_chunks(levels))
    j = torch.arange(int(local[-1]))
    doc = torch.searchsorted(local, j, right=True) - 1
    offset = j - local[doc]
    chunk_len = local.diff()[doc] // len(chunks)
    position = chunks[offset // chunk_len] * chunk_len + offset % chunk_len
    return doc, position, position < real_lengths[doc]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Own queries (t, H, D) against every rank's keys (T, H, D); mask (t, T), True = attend."""
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


def per_document_sdpa(batch: Mapping[str, torch.Tensor], lengths: Sequence[int]) -> torch.Tensor:
    """The reference: causal SDPA on each document alone, in stream order, (1, tokens, H, D)."""
    q, k, v = (batch[x].reshape(-1, HEADS, DIM) for x in ("q", "k", "v"))
    outs, start = [], 0
    for n in lengths:
        doc = [t[start : start + n].transpose(0, 1) for t in (q, k, v)]  # (H, n, D)
        outs.append(F.scaled_dot_product_attention(*doc, is_causal=True).transpose(0, 1))
        start += n
    return torch.cat(outs).unsqueeze(0)


def check_attention(
    pieces: Sequence[Mapping[str, Any]], sizes: Sequence[int], batch: Mapping[str, torch.Tensor], split: PerDocument
) -> None:
    """Assert the per-document split's promise on one micro-batch; ``pieces`` are the shard ranks'
    batches, row-major over the shard dims of ``sizes``, each holding q, k, v, labels, loss_mask."""
    ranks = [list(zip(sizes, index)) for index in itertools.product(*(range(s) for s in sizes))]
    # what an all-gather over the shard ranks brings every rank: keys, values and their metadata
    keys, values = (torch.cat([p[x][0] for p in pieces]) for x in ("k", "v"))
    key_doc = torch.cat([p["document_ids"][0] for p in pieces])
    key_pos = torch.cat([p["document_positions"][0] for p in pieces])
    te = [te_positions(p, levels) for p, levels in zip(pieces, ranks)]
    te_doc, te_pos, te_real = (torch.cat(parts) for parts in zip(*te))
    by_ids, by_te = [], []
    for piece, (doc, pos, _) in zip(pieces, te):
        assert torch.equal(doc, piece["document_ids"][0]) and torch.equal(pos, piece["document_positions"][0])
        q = piece["q"][0]
        mine_doc, mine_pos = piece["document_ids"][0][:, None], piece["document_positions"][0][:, None]
        by_ids.append(attend(q, keys, values, (key_doc == mine_doc) & (key_pos <= mine_pos)).unsqueeze(0))
        te_mask = (te_doc == doc[:, None]) & (te_pos <= pos[:, None]) & te_real
        by_te.append(attend(q, keys, values, te_mask).unsqueeze(0))
    docs = split.documents(batch)
    want = per_document_sdpa(batch, docs.lengths.tolist())
    for outs in (by_ids, by_te):
        torch.testing.assert_close(split.unshard(outs, sizes, 1, batch), want, rtol=1e-9, atol=1e-9)
    for key in ("labels", "loss_mask"):
        assert torch.equal(
            split.unshard([p[key] for p in pieces], sizes, 1, batch).reshape(batch[key].shape), batch[key]
        )
    assert sum(int((p["labels"] != -100).sum()) for p in pieces) == int((batch["labels"] != -100).sum())
    assert sum(float(p["loss_mask"].sum()) for p in pieces) == float(batch["loss_mask"].sum())


def whole_segments(piece: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each token of a :class:`BalancedDocuments` rank's whole part, from ``whole_cu_seqlens``
    alone, as a varlen kernel reads it: (segment, position in it), and where the part starts."""
    start = int(piece["split_cu_seqlens_local"][-1])
    offsets = piece["whole_cu_seqlens"].long()
    j = torch.arange(int(offsets[-1]))
    segment = torch.searchsorted(offsets, j, right=True) - 1
    return segment, j - offsets[segment], start


def check_balanced_attention(
    pieces: Sequence[Mapping[str, Any]],
    sizes: Sequence[int],
    batch: Mapping[str, torch.Tensor],
    split: BalancedDocuments,
) -> None:
    """Assert :class:`BalancedDocuments`' promise on one micro-batch; ``pieces`` as for
    :func:`check_attention`. Each rank computes, from only what it received plus the split
    documents' keys and values its peers hold (what ring attention brings): its split part's
    output by TE's metadata (``split_*`` and its chunks), its whole part's by ``whole_cu_seqlens``
    over its own keys and values; and, as a second route, every own query by ``document_ids`` /
    ``document_positions`` against every rank's keys. Both, reassembled, equal per-document SDPA."""
    ranks = [list(zip(sizes, index)) for index in itertools.product(*(range(s) for s in sizes))]
    tokens = {p["q"].shape[1] for p in pieces}
    assert len(tokens) == 1, f"ranks hold different numbers of tokens {tokens}"
    for key, value in pieces[0].items():  # scatter's equal-size messages: the same shapes everywhere
        if isinstance(value, torch.Tensor):
            assert {tuple(p[key].shape) for p in pieces} == {tuple(value.shape)}, key
        elif key.startswith(("split_", "whole_")):
            assert {p[key] for p in pieces} == {value}, key
    starts = [int(p["split_cu_seqlens_local"][-1]) for p in pieces]
    # the split parts' keys and values, gathered over the ranks, with where TE's kernels place them
    te = [te_positions(p, levels, "split_") for p, levels in zip(pieces, ranks)]
    split_doc, split_pos, split_real = (torch.cat(parts) for parts in zip(*te))
    split_k, split_v = (torch.cat([p[x][0][:s] for p, s in zip(pieces, starts)]) for x in ("k", "v"))
    every_k, every_v = (torch.cat([p[x][0] for p in pieces]) for x in ("k", "v"))
    every_doc = torch.cat([p["document_ids"][0] for p in pieces])
    every_pos = torch.cat([p["document_positions"][0] for p in pieces])
    by_meta, by_ids = [], []
    for piece, (doc, pos, _), s in zip(pieces, te, starts):
        q, k, v = (piece[x][0] for x in ("q", "k", "v"))
        ids, positions = piece["document_ids"][0], piece["document_positions"][0]
        # the split part: TE's metadata names each token's split document, which document_ids names
        assert torch.equal(piece["split_documents"][doc], ids[:s]) and torch.equal(pos, positions[:s])
        split_out = attend(
            q[:s], split_k, split_v, (split_doc == doc[:, None]) & (split_pos <= pos[:, None]) & split_real
        )
        # the whole part: segments of whole_cu_seqlens, own keys and values only
        segment, within, _ = whole_segments(piece)
        owned = torch.cat([piece["whole_documents"], torch.tensor([-1])])  # then the padding segment
        assert torch.equal(owned[segment], ids[s:]) and torch.equal(within, positions[s:])
        whole_out = attend(q[s:], k[s:], v[s:], (segment == segment[:, None]) & (within <= within[:, None]))
        by_meta.append(torch.cat([split_out, whole_out]).unsqueeze(0))
        by_ids.append(
            attend(q, every_k, every_v, (every_doc == ids[:, None]) & (every_pos <= positions[:, None])).unsqueeze(0)
        )
    docs = split.documents(batch)
    want = per_document_sdpa(batch, docs.lengths.tolist())
    for outs in (by_meta, by_ids):
        torch.testing.assert_close(split.unshard(outs, sizes, 1, batch), want, rtol=1e-9, atol=1e-9)
    for key in ("labels", "loss_mask"):
        assert torch.equal(
            split.unshard([p[key] for p in pieces], sizes, 1, batch).reshape(batch[key].shape), batch[key]
        )
    assert sum(int((p["labels"] != -100).sum()) for p in pieces) == int((batch["labels"] != -100).sum())
    assert sum(float(p["loss_mask"].sum()) for p in pieces) == float(batch["loss_mask"].sum())
