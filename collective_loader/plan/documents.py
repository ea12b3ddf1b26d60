"""Packed documents under context parallelism: every document split on its own, load-balanced.

A packed row holds several documents, and attention never crosses a document's edge. Cutting the
whole row into ``2n`` chunks (``zigzag``) balances causal-attention work only when the row is one
document, and leaves a rank without the boundaries of its own tokens. The per-document split
(``CollectiveLoader(split=PerDocument(...))``) does what Megatron / TransformerEngine (THD layout,
``thd_get_partitioned_indices``) and OLMo-core (``batch_shard_by_document``) do:

1. read the micro-batch's documents from one key: ``cu_seqlens`` offsets, or positions that
   restart at 0 at each document;
2. flatten the micro-batch's rows into one stream of documents, row 0's first (the THD layout:
   every ``seq_dims`` key ``(rows, length, ...)`` becomes ``(1, tokens / n, ...)``);
3. pad every document to a multiple of ``2n`` (``n``: the product of the shard dims' sizes; no
   padding when ``n == 1``): ``labels`` with the ignore index -100, the ``positions`` key counting
   on through the padding, other keys as ``pad_values`` says (0 by default);
4. cut every padded document into ``2n`` chunks; shard rank ``r`` keeps chunks ``r`` and
   ``2n-1-r`` of every document, concatenated document after document. Several shard dims
   (cp x Ulysses sp) compose in mesh order, as in :mod:`~collective_loader.plan.sharding`: the
   outer dim zigzags each document, the inner one zigzags each rank's part of it again;
5. add what each rank's attention needs (``PerDocument.metadata``): the global ``cu_seqlens`` and
   ``cu_seqlens_padded`` with ``max_seqlen`` (TransformerEngine's THD convention), the local
   ``cu_seqlens_local`` and ``max_seqlen_local`` (padded / n: OLMo-core's), and the document id
   and position of each of the rank's tokens.

Every rank of a shard group holds the same number of tokens (each padded document gives each
rank ``padded / n``), so scatter sends equal-size messages; the number changes from step to step
with the padding. Pure tensor code; nothing here talks to ``torch.distributed``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from collective_loader.errors import BatchError
from collective_loader.plan import sharding
from collective_loader.plan.sharding import Levels
from collective_loader.plan.split import ShardWork

IGNORE_INDEX = -100  # what padded labels hold: the default ignore_index of torch's cross entropy

# what the split adds to every rank's batch (its ``metadata``; see the module docstring and
# docs/context-parallel.md)
CU_SEQLENS = "cu_seqlens"  # (documents + 1,) int32: real lengths, global (TE cu_seqlens_q / _kv)
CU_SEQLENS_PADDED = "cu_seqlens_padded"  # (documents + 1,) int32: padded lengths, global (TE *_padded)
MAX_SEQLEN = "max_seqlen"  # int: the longest padded document (TE max_seqlen_q / _kv)
CU_SEQLENS_LOCAL = "cu_seqlens_local"  # (documents + 1,) int32: cu_seqlens_padded / n (OLMo-core cu_doc_lens)
MAX_SEQLEN_LOCAL = "max_seqlen_local"  # int: max_seqlen / n (OLMo-core max_doc_len)
DOCUMENT_IDS = "document_ids"  # (1, tokens / n) int64: each own token's document, 0-based in the stream
DOCUMENT_POSITIONS = "document_positions"  # (1, tokens / n) int64: its position in the padded document


@dataclass(frozen=True)
class Documents:
    """The documents of one micro-batch, in stream order (rows flattened, row 0 first).

    ``lengths``: (documents,) int64 on the CPU, each at least 1; ``rows``, ``length``: the shape
    every ``seq_dims`` key has before its sequence dim, or ``None`` when the boundaries do not say
    (offsets over the flattened rows).
    """

    lengths: torch.Tensor
    rows: int | None = None
    length: int | None = None

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


def default_pad_values() -> dict[str, int | float]:
    """What padding holds unless told: the ignore index in ``labels``, 0 elsewhere."""
    return {"labels": IGNORE_INDEX}


@dataclass(frozen=True)
class DocumentKeys:
    """Where a batch marks its packed documents and what their padding holds: the options a
    per-document split reads (:class:`PerDocument` and
    :class:`~collective_loader.plan.balanced_documents.BalancedDocuments` each hold one).

    ``owner``: the split's name, for messages; the others as :class:`PerDocument` says.

    >>> keys = DocumentKeys("PerDocument", positions="pos")
    >>> keys.boundaries, keys.documents({"pos": torch.tensor([[0, 1, 0, 1, 2]])}).lengths
    ('pos', tensor([2, 3]))
    """

    owner: str
    cu_seqlens: str | None = None
    positions: str | None = None
    pad_values: Mapping[str, int | float] = field(default_factory=default_pad_values)

    def __post_init__(self) -> None:
        name = self.owner
        if self.cu_seqlens is None and self.positions is None:
            raise ValueError(f"{name} needs the key that marks the documents: cu_seqlens=KEY or positions=KEY")
        for option in ("cu_seqlens", "positions"):
            key = getattr(self, option)
            if key is not None and not isinstance(key, str):
                raise TypeError(f"{name}({option}=...) must be a str key, got {key!r}")
        for key, value in self.pad_values.items():
            if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name}(pad_values=...) maps str keys to numbers, got {key!r}: {value!r}")
        # sorted, so that every rank's config text (the loader's agreement) reads the same
        object.__setattr__(self, "pad_values", dict(sorted(self.pad_values.items())))

    @property
    def boundaries(self) -> str:
        """The key the documents are read from."""
        return self.cu_seqlens if self.cu_seqlens is not None else str(self.positions)

    def validate(
        self,
        me: str,
        metadata: Sequence[str],
        seq_dims: Mapping[str, int],
        every_stage: Sequence[str],
        keys: Sequence[str],
    ) -> None:
        """Raise ``ValueError``, naming the split ``me``, unless the loader's keys fit a split that
        adds ``metadata`` (:meth:`~collective_loader.plan.split.Split.validate`)."""
        if self.boundaries not in every_stage:
            raise ValueError(
                f"{me}: list {self.boundaries!r} in every_stage (and not in inputs or labels): every stage's "
                "attention needs the document boundaries, and each stage computes its metadata from them"
            )
        if self.cu_seqlens is not None and self.cu_seqlens in seq_dims:
            raise ValueError(f"{me}: {self.cu_seqlens!r} holds offsets, not one value per token: drop it from seq_dims")
        if self.positions is not None and self.positions not in seq_dims:
            raise ValueError(
                f"{me}: the positions key {self.positions!r} holds one value per token: add it to seq_dims"
            )
        other_dims = {k: d for k, d in seq_dims.items() if d != 1}
        if other_dims:
            raise ValueError(
                f"{me}: seq_dims {other_dims}: it reads every sequence key as "
                "(rows, length, ...) and flattens its rows, so each key's sequence dim must be 1"
            )
        taken = sorted((set(metadata) & set(keys)) - {self.cu_seqlens})
        if taken:
            raise ValueError(
                f"{me}: keys {taken} are what the split computes for every rank; drop them from the batch "
                "and from inputs, labels and every_stage"
            )
        unknown = sorted(set(self.pad_values) - set(seq_dims))
        if unknown:
            raise ValueError(f"{me}: pad_values names keys {unknown} that are not in seq_dims")
        if self.positions in self.pad_values:
            raise ValueError(
                f"{me}: the positions key {self.positions!r} counts on through the padding; drop it from pad_values"
            )

    def documents(self, batch: Mapping[str, Any]) -> Documents:
        """The documents ``batch`` holds, read from :attr:`boundaries`; :class:`BatchError` when
        that key is malformed."""
        key = self.boundaries
        if self.cu_seqlens is not None:
            return _from_offsets(key, batch[key])
        return _from_positions(key, batch[key])

    def check(self, batch: Mapping[str, Any], seq_dims: Mapping[str, int]) -> None:
        """Raise :class:`BatchError` unless ``batch``'s boundaries and sequence keys fit together."""
        docs = self.documents(batch)
        shapes = {key: tuple(batch[key].shape[:2]) for key in seq_dims}
        for key, shape in shapes.items():
            if len(shape) < 2:
                raise BatchError(
                    f"{key!r} has shape {tuple(batch[key].shape)}; the {self.owner} split needs (rows, length, ...)"
                )
        if docs.rows is not None:
            want = (docs.rows, docs.length)
            for key, shape in shapes.items():
                if shape != want:
                    raise BatchError(
                        f"{key!r} has shape {tuple(batch[key].shape)}, but {self.boundaries!r} describes "
                        f"{want[0]} rows of {want[1]} tokens: (rows, length, ...) must match"
                    )
            return
        if len(set(shapes.values())) > 1:
            raise BatchError(f"sequence keys differ in (rows, length): {shapes}")
        for key, (rows, length) in shapes.items():
            if rows * length != docs.tokens:
                raise BatchError(
                    f"{key!r} holds {rows} x {length} = {rows * length} tokens, but the offsets in "
                    f"{self.boundaries!r} end at {docs.tokens}; they must cover the rows flattened"
                )


@dataclass(frozen=True)
class PerDocument:
    """Split each packed document over the shard dims (zigzag within the document).

    ``cu_seqlens``: the key holding the document boundaries as offsets, either
    ``(documents + 1,)`` over the micro-batch's rows flattened (Megatron's packed micro-batch) or
    ``(rows, n)`` per row (each row ``0, ..., length``; repeat ``length`` to fill a row with fewer
    documents); it must be in ``every_stage`` and is replaced by :attr:`metadata`.
    ``positions``: the ``seq_dims`` key holding each token's position; its padding counts on
    (TransformerEngine's convention), and without ``cu_seqlens`` it marks the documents: one starts
    at each row's first token and wherever the position is 0, and counts up by 1 within.
    ``pad_values``: what padding holds per ``seq_dims`` key (0 for keys not named).

    >>> split = PerDocument(cu_seqlens="cu_seqlens")
    >>> batch = {"ids": torch.tensor([[1, 2, 3, 4, 5]]), "labels": torch.tensor([[2, 3, 4, 5, 6]]),
    ...          "cu_seqlens": torch.tensor([0, 3, 5])}
    >>> rank0 = split.piece(batch, {"ids": 1, "labels": 1}, [(2, 0)])  # documents 3 + 2 -> 4 + 4
    >>> rank0["ids"], rank0["labels"], rank0["document_positions"]
    (tensor([[1, 0, 4, 0]]), tensor([[   2, -100,    5, -100]]), tensor([[0, 3, 0, 3]]))
    >>> rank0["cu_seqlens"], rank0["cu_seqlens_padded"], rank0["cu_seqlens_local"], rank0["max_seqlen"]
    (tensor([0, 3, 5], dtype=torch.int32), tensor([0, 4, 8], dtype=torch.int32), tensor([0, 2, 4], dtype=torch.int32), 4)
    """

    cu_seqlens: str | None = None
    positions: str | None = None
    pad_values: Mapping[str, int | float] = field(default_factory=default_pad_values)
    document_keys: DocumentKeys = field(init=False, repr=False, compare=False)

    # what piece() adds to every rank's batch (the module docstring, 5)
    metadata: ClassVar[tuple[str, ...]] = (
        CU_SEQLENS,
        CU_SEQLENS_PADDED,
        MAX_SEQLEN,
        CU_SEQLENS_LOCAL,
        MAX_SEQLEN_LOCAL,
        DOCUMENT_IDS,
        DOCUMENT_POSITIONS,
    )
    reshapes: ClassVar[bool] = True  # one stream and the metadata at one shard rank too

    def __post_init__(self) -> None:
        keys = DocumentKeys(type(self).__name__, self.cu_seqlens, self.positions, self.pad_values)
        object.__setattr__(self, "document_keys", keys)
        object.__setattr__(self, "pad_values", keys.pad_values)

    @property
    def boundaries(self) -> str:
        """The key the documents are read from."""
        return self.document_keys.boundaries

    def documents(self, batch: Mapping[str, Any]) -> Documents:
        """The documents ``batch`` holds (:meth:`DocumentKeys.documents`)."""
        return self.document_keys.documents(batch)

    def validate(self, seq_dims: Mapping[str, int], every_stage: Sequence[str], keys: Sequence[str]) -> None:
        """Raise ``ValueError`` unless the loader's keys fit this split (at construction)."""
        self.document_keys.validate(repr(self), self.metadata, seq_dims, every_stage, keys)

    def check(
        self, batch: Mapping[str, Any], seq_dims: Mapping[str, int], shard_dims: Sequence[tuple[str, int]]
    ) -> None:
        """Raise :class:`BatchError` unless ``batch``'s boundaries and sequence keys fit together
        (padding makes any document divide)."""
        self.document_keys.check(batch, seq_dims)

    def piece(self, selected: Mapping[str, Any], seq_dims: Mapping[str, int], levels: Levels) -> dict[str, Any]:
        """What the rank at ``levels`` keeps of ``selected``: its tokens of every document of the
        ``seq_dims`` keys, ``(1, tokens / n, ...)``, other keys as they are, the ``cu_seqlens`` key
        replaced by :attr:`metadata`. ``selected`` holds the boundaries key (it is in every_stage)."""
        boundary = selected[self.boundaries]
        docs = self.documents(selected)
        own = ZigzagPart.of(docs, levels)
        out: dict[str, Any] = {}
        for key, value in selected.items():
            if key == self.cu_seqlens:
                continue
            out[key] = self._take(key, value, own) if key in seq_dims else value
        n = math.prod(size for size, _ in levels)
        out.update(self._metadata(docs, own, n, boundary.device))
        return out

    def unshard(
        self, pieces: Sequence[torch.Tensor], sizes: Sequence[int], dim: int, batch: Mapping[str, Any]
    ) -> torch.Tensor:
        """The stream ``(1, tokens, ...)`` from every rank's piece of one key, padding dropped.

        ``pieces`` is ordered row-major over the shard dims' indices (outermost slowest), ``sizes``
        their sizes, ``batch`` holds the documents' boundaries (``dim`` is 1);
        ``reshape(rows, length, ...)`` gives back the batch's shape. The inverse of :meth:`piece`
        for one key.
        """
        if len(pieces) != math.prod(sizes):
            raise ValueError(f"need {math.prod(sizes)} pieces for sizes {list(sizes)}, got {len(pieces)}")
        docs = self.documents(batch)
        owns = [ZigzagPart.of(docs, list(zip(sizes, index))) for index in itertools.product(*(range(s) for s in sizes))]
        first = pieces[0]
        stream = first.new_zeros((owns[0].padded_total, *first.shape[2:]))
        for own, piece in zip(owns, pieces):
            if tuple(piece.shape[:2]) != (1, len(own.padded_index)):
                raise ValueError(
                    f"a piece of shape {tuple(piece.shape)}; this rank keeps (1, {len(own.padded_index)}, ...)"
                )
            stream[own.padded_index.to(stream.device)] = piece[0]
        return stream[owns[0].real_index.to(stream.device)].unsqueeze(0)

    def work(self, batch: Mapping[str, Any], sizes: Sequence[int]) -> ShardWork:
        """Each shard rank's attention work and slots for ``batch``'s documents split over shard
        dims of ``sizes``: what the loader's ``stats()`` reports (``c = 0``: attention alone)."""
        docs = self.documents(batch)
        costs, slots = zigzag_work(docs.lengths, sizes, 0.0)
        return ShardWork(tuple(costs), slots, docs.tokens)

    def _take(self, key: str, value: torch.Tensor, own: ZigzagPart) -> torch.Tensor:
        flat = value.reshape(-1, *value.shape[2:])
        out = flat.index_select(0, own.source.to(value.device))
        if own.padding:
            beyond = own.beyond.to(value.device)
            if key == self.positions:
                out = out + beyond.view(-1, *[1] * (out.dim() - 1)).to(out.dtype)
            else:
                out[beyond > 0] = self.pad_values.get(key, 0)
        return out.unsqueeze(0)

    @staticmethod
    def _metadata(docs: Documents, own: ZigzagPart, n: int, device: torch.device) -> dict[str, Any]:
        max_padded = int(own.padded.max()) if len(own.padded) else 0
        return {
            CU_SEQLENS: offsets(docs.lengths).to(device),
            CU_SEQLENS_PADDED: offsets(own.padded).to(device),
            MAX_SEQLEN: max_padded,
            CU_SEQLENS_LOCAL: offsets(own.padded // n).to(device),
            MAX_SEQLEN_LOCAL: max_padded // n,
            DOCUMENT_IDS: own.document.unsqueeze(0).to(device),
            DOCUMENT_POSITIONS: own.position.unsqueeze(0).to(device),
        }


@dataclass(frozen=True)
class ZigzagPart:
    """What one rank keeps of a micro-batch's padded stream when every document is zigzagged
    over the shard dims (:class:`PerDocument`), one entry per own token.

    ``padded_index``: where the token sits in the padded stream; ``source``: the stream token it
    copies (for padding, its document's last real token); ``beyond``: 0 for a real token, ``k``
    for the ``k``-th padding token of its document; ``document``, ``position``: its document and
    its position in the padded document. ``padded``: (documents,) padded lengths.

    >>> part = ZigzagPart.of(Documents(torch.tensor([3])), [(2, 1)])  # padded to 4: chunks 1, 2
    >>> part.position.tolist(), part.beyond.tolist()
    ([1, 2], [0, 0])
    """

    padded_index: torch.Tensor
    source: torch.Tensor
    beyond: torch.Tensor
    document: torch.Tensor
    position: torch.Tensor
    padded: torch.Tensor
    real_index: torch.Tensor  # every real token's place in the padded stream, in stream order

    @property
    def padded_total(self) -> int:
        return int(self.padded.sum())

    @property
    def padding(self) -> bool:
        return bool(self.beyond.any())

    @staticmethod
    def of(docs: Documents, levels: Levels) -> ZigzagPart:
        multiple = sharding.divisor(levels, "zigzag")  # 2n, or 1 when nothing is split
        # the composed zigzag of a document padded to `multiple` x u keeps whole chunks of length u,
        # the same chunks whatever u: shard the chunk numbers once
        units = sharding.shard(torch.arange(multiple), 0, levels, "zigzag")
        lengths = docs.lengths
        padded = (lengths + multiple - 1) // multiple * multiple
        unit = padded // multiple
        count = len(lengths)
        seg_doc = torch.arange(count).repeat_interleave(len(units))
        seg_len = unit[seg_doc]
        seg_first = units.repeat(count) * seg_len  # where each kept chunk starts in its document
        token_seg = torch.arange(len(seg_doc)).repeat_interleave(seg_len)
        within = torch.arange(len(token_seg)) - starts(seg_len)[token_seg]
        document = seg_doc[token_seg]
        position = seg_first[token_seg] + within
        last = lengths[document] - 1
        padded_start = starts(padded)
        real_index = (
            padded_start.repeat_interleave(lengths)
            + torch.arange(docs.tokens)
            - starts(lengths).repeat_interleave(lengths)
        )
        return ZigzagPart(
            padded_index=padded_start[document] + position,
            source=starts(lengths)[document] + torch.minimum(position, last),
            beyond=(position - last).clamp(min=0),
            document=document,
            position=position,
            padded=padded,
            real_index=real_index,
        )


def zigzag_work(lengths: torch.Tensor, sizes: Sequence[int], linear_cost: float) -> tuple[list[float], int]:
    """Each shard rank's cost, and the slots each holds, when every document of ``lengths`` is
    split over shard dims of ``sizes`` as :class:`PerDocument` splits it. A rank's cost is
    ``2k + 1 + linear_cost`` summed over its real tokens at position ``k``: over positions
    ``[a, b)`` of a document, ``b**2 - a**2 + linear_cost * (b - a)``, so each of the ``m``
    chunks of every document is priced in closed form (``O(documents x m)``, no token lists).

    >>> # chunks of 1 token, rank 0 keeping chunks 0 and 3, rank 1 chunks 1 and 2; the second
    >>> # document's chunk 3 is padding: rank 0 costs (1 + 7) + 1, rank 1 (3 + 5) + (3 + 5)
    >>> zigzag_work(torch.tensor([4, 3]), [2], 0.0)
    ([9.0, 16.0], 4)
    """
    levels = [(size, 0) for size in sizes]
    multiple = sharding.divisor(levels, "zigzag")
    unit = (lengths + multiple - 1) // multiple
    edges = torch.minimum(torch.arange(multiple + 1) * unit[:, None], lengths[:, None]).double()
    per_chunk = (edges[:, 1:] ** 2 - edges[:, :-1] ** 2 + linear_cost * (edges[:, 1:] - edges[:, :-1])).sum(0)
    costs = []
    for index in itertools.product(*(range(size) for size in sizes)):
        held = sharding.shard(torch.arange(multiple), 0, list(zip(sizes, index)), "zigzag")
        costs.append(float(per_chunk[held].sum()))
    return costs, int(unit.sum()) * multiple // math.prod(sizes)


def starts(lengths: torch.Tensor) -> torch.Tensor:
    """Where each of consecutive segments of ``lengths`` starts.

    >>> starts(torch.tensor([3, 1, 2]))
    tensor([0, 3, 4])
    """
    return torch.cumsum(lengths, 0) - lengths


def offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` of segments of ``lengths``: int32 offsets from 0, one more than the segments.

    >>> offsets(torch.tensor([3, 1]))
    tensor([0, 3, 4], dtype=torch.int32)
    """
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)]).to(torch.int32)


def _integers(key: str, value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise BatchError(
            f"the document boundaries {key!r} must be a tensor of {what}, got a {type(value).__qualname__}"
        )
    if value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex:
        raise BatchError(f"the document boundaries {key!r} must hold integer {what}, got dtype {value.dtype}")
    return value.detach().to("cpu", torch.int64)


def _from_offsets(key: str, value: Any) -> Documents:
    offsets = _integers(key, value, "offsets")
    if offsets.dim() not in (1, 2) or offsets.shape[-1] == 0:
        raise BatchError(
            f"the document boundaries {key!r} must be offsets (documents + 1,) over the rows flattened or "
            f"(rows, n) per row, got shape {tuple(offsets.shape)}"
        )
    rows = offsets.view(1, -1) if offsets.dim() == 1 else offsets
    first = (rows[:, 0] != 0).nonzero()
    if len(first):
        r = int(first[0])
        raise BatchError(f"the document boundaries {key!r} start at {int(rows[r, 0])} in row {r}; offsets start at 0")
    steps = rows.diff(dim=1)
    down = (steps < 0).nonzero()
    if len(down):
        r, i = down[0].tolist()
        raise BatchError(
            f"the document boundaries {key!r} decrease in row {r} at index {i + 1} ({int(rows[r, i])} -> "
            f"{int(rows[r, i + 1])}); offsets never decrease (fill a row's offsets by repeating its length)"
        )
    lengths = steps.flatten()
    lengths = lengths[lengths > 0]
    if offsets.dim() == 1:
        return Documents(lengths)
    ends = rows[:, -1]
    if not bool((ends == ends[0]).all()):
        raise BatchError(
            f"the rows of {key!r} end at different offsets {ends.tolist()}; each row's offsets end at the row length"
        )
    return Documents(lengths, rows=rows.shape[0], length=int(ends[0]))


def _from_positions(key: str, value: Any) -> Documents:
    positions = _integers(key, value, "positions")
    if positions.dim() != 2:
        raise BatchError(
            f"the document boundaries {key!r} must be positions (rows, length), got shape {tuple(positions.shape)}"
        )
    rows, length = positions.shape
    # a document starts at each row's first token and wherever the position is 0
    start = positions == 0
    start[:, :1] = True
    counts_on = positions[:, 1:] == positions[:, :-1] + 1
    wrong = (~(start[:, 1:] | counts_on)).nonzero()
    if len(wrong):
        r, i = wrong[0].tolist()
        raise BatchError(
            f"the document boundaries {key!r} must restart at 0 at each document and count up by 1 within it; "
            f"row {r} goes from {int(positions[r, i])} to {int(positions[r, i + 1])} at index {i + 1}"
        )
    first = start.flatten().nonzero().flatten()
    lengths = torch.diff(first, append=torch.tensor([rows * length]))
    return Documents(lengths, rows=rows, length=length)
