"""Packed documents over the shard ranks, balanced by cost: short ones whole, long ones split.

:class:`~collective_loader.plan.documents.PerDocument` cuts every document into ``2n`` chunks
(TransformerEngine's rule). A document of a few tokens is then mostly padding, and the padding
always falls in the last chunks, which belong to the low ranks: on documents of 1-30 tokens the
cp ranks' attention work is up to 1.7 x the mean at cp = 8, with half the slots padding. Megatron's
"dynamic CP" gives short sequences whole to single ranks instead; :class:`BalancedDocuments` does
that within each micro-batch:

1. read the documents as ``PerDocument`` does (``cu_seqlens`` offsets or restarting positions;
   the rows flattened into one stream, row 0's first);
2. price each document of ``L`` tokens at ``L**2 + c * L`` (the cost model: attention grows with
   ``L**2``, projections and MLP with ``L``; ``c`` is ``linear_cost``);
3. split a document over all ``n`` shard ranks (``n``: the product of the shard dims' sizes) when
   its cost exceeds ``split_share`` x the mean cost per rank, or its length ``split_share`` x the
   mean tokens per rank: exactly as ``PerDocument`` does, padded to a multiple of ``2n``, rank
   ``r`` keeping chunks ``r`` and ``2n-1-r`` (composed over several shard dims);
4. give every other document whole to one rank: longest-processing-time first (by cost, ties by
   stream order), each to the rank whose larger of cost and whole-document tokens, each relative
   to its mean per rank, stays the smallest (ties: the lower cost, then the lower rank). Every
   whole document is then at most ``split_share`` of a rank's mean in both, so neither the cost
   nor the tokens can end far from their means;
5. lay out each rank's tokens as ``[its chunks of the split documents, in stream order][its whole
   documents, in stream order][a padding segment]``; the padding segment fills every rank's whole
   part to the longest one's, so every rank holds the same number of tokens (scatter sends
   equal-size messages). It is a document of its own (``document_ids`` -1): labels take the
   ignore index, and it attends to nothing real, nor anything real to it;
6. add each rank's attention metadata (``BalancedDocuments.metadata``): TransformerEngine's THD keys for the
   split documents (``split_*``: context-parallel attention, with the K/V the peers hold), and
   varlen offsets for the rank's whole documents (``whole_*``: local attention, nothing from the
   peers). Every key has the same shape on every rank of a shard group.

The assignment is a deterministic function of the document lengths and ``n``, so every rank
computes the same one from the same batch. Pure tensor code; nothing here talks to
``torch.distributed``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from collective_loader.plan import sharding
from collective_loader.plan.documents import (
    DOCUMENT_IDS,
    DOCUMENT_POSITIONS,
    DocumentKeys,
    Documents,
    ZigzagPart,
    default_pad_values,
    offsets,
    starts,
    zigzag_work,
)
from collective_loader.plan.sharding import Levels
from collective_loader.plan.split import ShardWork

# what the split adds to every rank's batch (its ``metadata``), the same shape on every rank of a
# shard group (see the module docstring and docs/context-parallel.md); S: documents split, K: the most whole
# documents any rank holds
SPLIT_DOCUMENTS = "split_documents"  # (S,) int64: the split documents' ids in the stream, ascending
SPLIT_CU_SEQLENS = "split_cu_seqlens"  # (S + 1,) int32: their real lengths, global (TE cu_seqlens_q / _kv)
SPLIT_CU_SEQLENS_PADDED = "split_cu_seqlens_padded"  # (S + 1,) int32: padded to 2n, global (TE *_padded)
SPLIT_MAX_SEQLEN = "split_max_seqlen"  # int: the longest padded split document (TE max_seqlen_q / _kv)
SPLIT_CU_SEQLENS_LOCAL = "split_cu_seqlens_local"  # (S + 1,) int32: padded / n, this rank's offsets
SPLIT_MAX_SEQLEN_LOCAL = "split_max_seqlen_local"  # int: split_max_seqlen / n
WHOLE_DOCUMENTS = "whole_documents"  # (K,) int64: this rank's whole documents' ids in the stream, then -1
WHOLE_CU_SEQLENS = "whole_cu_seqlens"  # (K + 2,) int32: offsets in the whole part (see below)
WHOLE_MAX_SEQLEN = "whole_max_seqlen"  # int: the longest whole document or padding segment of any rank
# DOCUMENT_IDS (1, tokens held) int64: each own token's document in the stream, -1 in the padding
# segment; DOCUMENT_POSITIONS (1, tokens held) int64: its position in its (padded) document


@dataclass(frozen=True)
class BalancedDocuments:
    """Give short packed documents whole to one shard rank, balanced by cost; split long ones.

    Reads the documents as :class:`~collective_loader.plan.documents.PerDocument` does
    (``cu_seqlens``, ``positions``, ``pad_values`` mean the same), and takes the same
    ``CollectiveLoader(..., split=...)`` place. ``linear_cost``: ``c`` in a document's cost
    ``L**2 + c * L``. Per token a transformer layer spends about ``24 * d**2`` FLOPs in its
    projections and MLP (``d``: the model width, MLP 4d) and ``4 * d`` per key it attends to, so
    a document costs about ``2 * d * L**2`` in causal attention (a kernel that skips the masked
    half) and ``24 * d**2 * L`` outside it: ``c ~ 12 * d`` (``6 * d`` when the masked half is
    computed too; less with grouped-query attention, more with a wider MLP). ``0`` (the default)
    balances attention alone. ``split_share``: a document is split over the ranks when its cost
    exceeds ``split_share`` x the mean cost per rank, or its length ``split_share`` x the mean
    tokens per rank (a whole document larger than that could leave one rank that much over the
    mean); smaller splits more documents, each padded to ``2n``.

    >>> split = BalancedDocuments(cu_seqlens="cu_seqlens", split_share=0.5)
    >>> batch = {"ids": torch.arange(1, 17).view(1, 16), "cu_seqlens": torch.tensor([0, 8, 10, 13, 16])}
    >>> rank0, rank1 = (split.piece(batch, {"ids": 1}, [(2, r)]) for r in range(2))
    >>> rank0["ids"], rank1["ids"]  # document 0 split (chunks 0, 3 | 1, 2); 1, 2 | 3 whole; padding 0
    (tensor([[ 1,  2,  7,  8,  9, 10, 11, 12, 13]]), tensor([[ 3,  4,  5,  6, 14, 15, 16,  0,  0]]))
    >>> rank1["document_ids"], rank1["document_positions"]
    (tensor([[ 0,  0,  0,  0,  3,  3,  3, -1, -1]]), tensor([[2, 3, 4, 5, 0, 1, 2, 0, 1]]))
    >>> rank1["split_cu_seqlens_local"], rank1["whole_documents"], rank1["whole_cu_seqlens"]
    (tensor([0, 4], dtype=torch.int32), tensor([ 3, -1]), tensor([0, 3, 5, 5], dtype=torch.int32))
    """

    cu_seqlens: str | None = None
    positions: str | None = None
    pad_values: Mapping[str, int | float] = field(default_factory=default_pad_values)
    linear_cost: float = 0.0
    split_share: float = 0.05
    document_keys: DocumentKeys = field(init=False, repr=False, compare=False)

    # what piece() adds to every rank's batch (the module docstring, 6)
    metadata: ClassVar[tuple[str, ...]] = (
        SPLIT_DOCUMENTS,
        SPLIT_CU_SEQLENS,
        SPLIT_CU_SEQLENS_PADDED,
        SPLIT_MAX_SEQLEN,
        SPLIT_CU_SEQLENS_LOCAL,
        SPLIT_MAX_SEQLEN_LOCAL,
        WHOLE_DOCUMENTS,
        WHOLE_CU_SEQLENS,
        WHOLE_MAX_SEQLEN,
        DOCUMENT_IDS,
        DOCUMENT_POSITIONS,
    )
    reshapes: ClassVar[bool] = True  # one stream and the metadata at one shard rank too

    def __post_init__(self) -> None:
        keys = DocumentKeys(type(self).__name__, self.cu_seqlens, self.positions, self.pad_values)
        object.__setattr__(self, "document_keys", keys)
        object.__setattr__(self, "pad_values", keys.pad_values)
        for name, low in (("linear_cost", "a number >= 0"), ("split_share", "a number > 0")):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
                or (name == "split_share" and value == 0)
            ):
                raise ValueError(f"BalancedDocuments({name}=...) must be {low}, got {value!r}")
            object.__setattr__(self, name, float(value))

    @property
    def boundaries(self) -> str:
        """The key the documents are read from."""
        return self.document_keys.boundaries

    def documents(self, batch: Mapping[str, Any]) -> Documents:
        """The documents ``batch`` holds (:meth:`~collective_loader.plan.documents.DocumentKeys.documents`)."""
        return self.document_keys.documents(batch)

    def validate(self, seq_dims: Mapping[str, int], every_stage: Sequence[str], keys: Sequence[str]) -> None:
        """Raise ``ValueError`` unless the loader's keys fit this split (at construction)."""
        self.document_keys.validate(repr(self), self.metadata, seq_dims, every_stage, keys)

    def check(
        self, batch: Mapping[str, Any], seq_dims: Mapping[str, int], shard_dims: Sequence[tuple[str, int]]
    ) -> None:
        """Raise :class:`~collective_loader.BatchError` unless ``batch``'s boundaries and sequence
        keys fit together."""
        self.document_keys.check(batch, seq_dims)

    def piece(self, selected: Mapping[str, Any], seq_dims: Mapping[str, int], levels: Levels) -> dict[str, Any]:
        """What the rank at ``levels`` keeps of ``selected``: its tokens of the ``seq_dims`` keys,
        ``(1, tokens held, ...)`` laid out as the module docstring says, other keys as they are,
        the ``cu_seqlens`` key replaced by :attr:`metadata`."""
        device = selected[self.boundaries].device
        docs = self.documents(selected)
        deal = Deal.of(docs.lengths, [size for size, _ in levels], self.linear_cost, self.split_share)
        own = deal.rank(_flat(levels))
        out: dict[str, Any] = {}
        for key, value in selected.items():
            if key == self.cu_seqlens:
                continue
            out[key] = self._fill(key, value, own) if key in seq_dims else value
        out.update(deal.metadata_for(own, device))
        return out

    def unshard(
        self, pieces: Sequence[torch.Tensor], sizes: Sequence[int], dim: int, batch: Mapping[str, Any]
    ) -> torch.Tensor:
        """The stream ``(1, tokens, ...)`` from every rank's piece of one key, padding dropped;
        ``pieces`` ordered row-major over the shard dims' indices, ``batch`` holds the documents'
        boundaries (``dim`` is 1). The inverse of :meth:`piece`."""
        n = math.prod(sizes)
        if len(pieces) != n:
            raise ValueError(f"need {n} pieces for sizes {list(sizes)}, got {len(pieces)}")
        docs = self.documents(batch)
        deal = Deal.of(docs.lengths, sizes, self.linear_cost, self.split_share)
        first = pieces[0]
        stream = first.new_zeros((docs.tokens, *first.shape[2:]))
        for index, piece in enumerate(pieces):  # row-major: the flat index
            own = deal.rank(index)
            if tuple(piece.shape[:2]) != (1, len(own.source)):
                raise ValueError(f"a piece of shape {tuple(piece.shape)}; this rank keeps (1, {len(own.source)}, ...)")
            real = own.real.to(piece.device)
            stream[own.source.to(piece.device)[real]] = piece[0][real]
        return stream.unsqueeze(0)

    def work(self, batch: Mapping[str, Any], sizes: Sequence[int]) -> ShardWork:
        """Each shard rank's cost (at this split's ``linear_cost``) and slots for ``batch``'s
        documents dealt over shard dims of ``sizes``: what the loader's ``stats()`` reports."""
        docs = self.documents(batch)
        deal = Deal.of(docs.lengths, sizes, self.linear_cost, self.split_share)
        whole = deal.owner >= 0
        length = deal.lengths[whole].double()
        costs = torch.zeros(deal.n, dtype=torch.float64)
        costs.index_add_(0, deal.owner[whole], length * length + self.linear_cost * length)
        split_costs, chunks = zigzag_work(deal.lengths[deal.split], sizes, self.linear_cost)
        total = tuple(float(c) + s for c, s in zip(costs.tolist(), split_costs))
        return ShardWork(total, chunks + deal.width, docs.tokens)

    def _fill(self, key: str, value: torch.Tensor, own: RankPart) -> torch.Tensor:
        flat = value.reshape(-1, *value.shape[2:])
        out = flat.index_select(0, own.source.to(value.device))
        pad = ~own.real
        if not bool(pad.any()):
            return out.unsqueeze(0)
        if key == self.positions:
            # a split document's padding counts on (TE's convention); the padding segment counts
            # from 0, a document of its own
            shape = (-1, *[1] * (out.dim() - 1))
            tail = own.beyond.to(value.device, out.dtype).view(shape)
            segment = (own.document < 0).to(value.device).view(shape)
            out = torch.where(segment, own.position.to(value.device, out.dtype).view(shape), out + tail)
        else:
            out[pad.to(value.device)] = self.pad_values.get(key, 0)
        return out.unsqueeze(0)


@dataclass(frozen=True)
class RankPart:
    """What one rank holds, one entry per own token: ``source``, the stream token it copies (for
    padding, any); ``beyond``: 0, or ``k`` for the ``k``-th padding token of a split document;
    ``document``: its document in the stream (-1 in the padding segment); ``position``: its
    position in its padded document (or in the padding segment). ``whole``: the stream ids of the
    rank's whole documents, ascending."""

    source: torch.Tensor
    beyond: torch.Tensor
    document: torch.Tensor
    position: torch.Tensor
    whole: torch.Tensor

    @property
    def real(self) -> torch.Tensor:
        """(tokens,) bool: the tokens copied from the stream (not padding)."""
        return (self.beyond == 0) & (self.document >= 0)


@dataclass(frozen=True)
class Deal:
    """One micro-batch's deal over the shard ranks. ``lengths``: (documents,) int64 in stream
    order; ``sizes``: the shard dims' sizes, outermost first (a rank's flat index is row-major over
    them); ``owner``: (documents,) int64, the rank that holds a document whole, -1 when it is
    split; ``held``: (n,) int64, each rank's tokens of whole documents."""

    lengths: torch.Tensor
    sizes: tuple[int, ...]
    owner: torch.Tensor
    held: torch.Tensor

    @staticmethod
    def of(lengths: torch.Tensor, sizes: Sequence[int], linear_cost: float, split_share: float) -> Deal:
        """Which documents split, and which rank gets each other one (module docstring, 3-4)."""
        return _dealt(tuple(lengths.tolist()), tuple(sizes), linear_cost, split_share)

    @property
    def n(self) -> int:
        return math.prod(self.sizes)

    @property
    def split(self) -> torch.Tensor:
        """(S,) int64: the split documents' stream ids, ascending."""
        return (self.owner < 0).nonzero().flatten()

    @property
    def width(self) -> int:
        """The longest whole part of any rank: every rank's is padded to it."""
        return int(self.held.max())

    def rank(self, index: int) -> RankPart:
        """What the rank of flat ``index`` holds: split part, whole part, padding segment."""
        first_token, split = starts(self.lengths), self.split
        whole = (self.owner == index).nonzero().flatten()
        used, pad = int(self.held[index]), self.width - int(self.held[index])
        zeros = torch.zeros(used + pad, dtype=torch.int64)
        document = torch.cat([whole.repeat_interleave(self.lengths[whole]), torch.full((pad,), -1)])
        position = torch.cat(
            [
                torch.arange(used) - starts(self.lengths[whole]).repeat_interleave(self.lengths[whole]),
                torch.arange(pad),
            ]
        )
        source = torch.where(document >= 0, first_token[document.clamp(min=0)] + position, 0)
        columns = [(source, zeros, document, position)]
        if self.n > 1 and len(split):
            own = ZigzagPart.of(Documents(self.lengths[split]), _levels(self.sizes, index))
            doc = split[own.document]
            first = first_token[doc] + torch.minimum(own.position, self.lengths[doc] - 1)
            columns.insert(0, (first, own.beyond, doc, own.position))
        source, beyond, document, position = (torch.cat(column) for column in zip(*columns))
        return RankPart(source, beyond, document, position, whole)

    def metadata_for(self, own: RankPart, device: torch.device) -> dict[str, Any]:
        """The keys of :attr:`BalancedDocuments.metadata` for the rank holding ``own``: every
        tensor the same shape on every rank, every int the same value."""
        split, whole = self.split, self.owner >= 0
        multiple = sharding.divisor([(self.n, 0)], "zigzag")  # 2n, or 1 when nothing is split
        real = self.lengths[split]
        padded = (real + multiple - 1) // multiple * multiple
        most = int(torch.bincount(self.owner[whole], minlength=self.n).max()) if bool(whole.any()) else 0
        mine = self.lengths[own.whole]
        # own documents, the padding segment, then empty segments up to the most any rank holds
        segments = torch.cat(
            [mine, torch.tensor([self.width - int(mine.sum())]), torch.zeros(most - len(mine), dtype=torch.int64)]
        )
        longest = max([self.width - int(self.held.min()), *self.lengths[whole].tolist()])
        max_padded = int(padded.max()) if len(padded) else 0
        return {
            SPLIT_DOCUMENTS: split.to(device),
            SPLIT_CU_SEQLENS: offsets(real).to(device),
            SPLIT_CU_SEQLENS_PADDED: offsets(padded).to(device),
            SPLIT_MAX_SEQLEN: max_padded,
            SPLIT_CU_SEQLENS_LOCAL: offsets(padded // self.n).to(device),
            SPLIT_MAX_SEQLEN_LOCAL: max_padded // self.n,
            WHOLE_DOCUMENTS: torch.cat([own.whole, torch.full((most - len(own.whole),), -1)]).to(device),
            WHOLE_CU_SEQLENS: offsets(segments).to(device),
            WHOLE_MAX_SEQLEN: longest,
            DOCUMENT_IDS: own.document.unsqueeze(0).to(device),
            DOCUMENT_POSITIONS: own.position.unsqueeze(0).to(device),
        }


# a scattering leader cuts every rank's piece of the same micro-batch: deal it once (the deal's
# tensors are only read, never handed out)
@functools.lru_cache(maxsize=4)
def _dealt(lengths: tuple[int, ...], sizes: tuple[int, ...], linear_cost: float, split_share: float) -> Deal:
    n, length = math.prod(sizes), torch.tensor(lengths, dtype=torch.int64)
    owner = torch.zeros(len(lengths), dtype=torch.int64)  # one rank: every document whole, no padding
    if n > 1 and lengths:
        owner = _deal(length, sizes, linear_cost, split_share)
    held = torch.zeros(n, dtype=torch.int64)
    whole = owner >= 0
    held.index_add_(0, owner[whole], length[whole])
    return Deal(length, sizes, owner, held)


def _flat(levels: Levels) -> int:
    """The flat index of the rank at ``levels``: row-major over the shard dims."""
    index = 0
    for size, i in levels:
        index = index * size + i
    return index


def _levels(sizes: Sequence[int], index: int) -> list[tuple[int, int]]:
    """``(size, index)`` per shard dim of the rank of flat ``index`` (row-major, outermost first)."""
    out = []
    for size in reversed(sizes):
        index, i = divmod(index, size)
        out.append((size, i))
    return out[::-1]


def _deal(lengths: torch.Tensor, sizes: Sequence[int], linear_cost: float, split_share: float) -> torch.Tensor:
    """(documents,) int64: the owner of each whole document, -1 for a split one (module
    docstring, 3-4); ``n > 1`` ranks."""
    n = math.prod(sizes)
    length = lengths.double()
    cost = length * length + linear_cost * length
    mean_cost, mean_tokens = float(cost.sum()) / n, float(length.sum()) / n
    split = (cost > split_share * mean_cost) | (length > split_share * mean_tokens)
    owner = torch.full((len(lengths),), -1, dtype=torch.int64)
    loads, _ = zigzag_work(lengths[split], sizes, linear_cost)  # each rank's real work in its chunks
    tokens = [0] * n
    whole_mean = float(length[~split].sum()) / n or 1.0  # whole-document tokens per rank
    costs, counts = cost.tolist(), lengths.tolist()
    for doc in sorted((~split).nonzero().flatten().tolist(), key=lambda d: (-costs[d], d)):
        best = min(
            range(n),
            key=lambda r: (
                max((loads[r] + costs[doc]) / mean_cost, (tokens[r] + counts[doc]) / whole_mean),
                loads[r],
                r,
            ),
        )
        owner[doc] = best
        loads[best] += costs[doc]
        tokens[best] += counts[doc]
    return owner
