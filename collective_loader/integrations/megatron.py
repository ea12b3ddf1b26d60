"""Megatron-style batches: a ``get_batch(data_iterator)`` for a pretrain step, on every stage.

Megatron's ``pretrain_gpt.get_batch`` loads or broadcasts, per pipeline stage, the tuple
``(tokens, labels, loss_mask, attention_mask, position_ids)``; stages that do not need a tensor
get ``None``. :func:`megatron_loader` builds a :class:`~collective_loader.CollectiveLoader` that
routes those keys the same way (tokens and position ids to the first stage, labels and loss mask
to the last), and sends what every transformer layer reads to *every* stage, middle ones
included: a dense ``attention_mask`` when the source has one, or, for packed documents, the
offsets Megatron's ``PackedSeqParams`` takes (THD format).

Under context parallelism every tensor is split along the sequence. Unpacked rows are cut into
2 x cp chunks, cp rank r keeping chunks r and 2cp-1-r (``split="zigzag"``; ``attention_mask``
along its query dim), as Megatron's ``get_batch_on_this_cp_rank`` does. Packed documents
(``packed=True``) are split one by one (:class:`~collective_loader.plan.documents.PerDocument`),
as TransformerEngine's ``thd_get_partitioned_indices`` does: the micro-batch's rows flattened into
one THD stream, every document padded to a multiple of 2 x cp (labels -100, loss mask 0, position
ids counting on), cp rank r keeping chunks r and 2cp-1-r of every document; every stage gets the
global ``cu_seqlens``, ``cu_seqlens_padded`` and ``max_seqlen``, which TE's attention takes as is
at any cp::

    b = get_batch(data_iterator)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=b.cu_seqlens, cu_seqlens_kv=b.cu_seqlens,
                             cu_seqlens_q_padded=b.cu_seqlens_padded, cu_seqlens_kv_padded=b.cu_seqlens_padded,
                             max_seqlen_q=b.max_seqlen, max_seqlen_kv=b.max_seqlen)

Each loader step is one micro-batch, as Megatron's data iterator yields them: the source's batch
size is the micro-batch size, and a training step consumes ``num_microbatches`` steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh

from collective_loader.loader import CollectiveLoader
from collective_loader.plan.documents import IGNORE_INDEX, PerDocument

INPUTS = ("tokens", "position_ids")
LABELS = ("labels", "loss_mask")
# packed documents: read from cu_seqlens, split one by one like TransformerEngine's THD layout
PACKED = PerDocument(
    cu_seqlens="cu_seqlens", positions="position_ids", pad_values={"labels": IGNORE_INDEX, "loss_mask": 0}
)


class MegatronBatch(NamedTuple):
    """One micro-batch as one stage sees it; what a stage does not need is ``None``.

    ``tokens``, ``labels``, ``loss_mask``, ``position_ids``: (micro_batch, seq / cp); packed:
    (1, padded tokens / cp), the micro-batch's documents in one THD stream, as TransformerEngine's
    ``get_batch_on_this_cp_rank`` returns them;
    ``attention_mask``: (micro_batch, 1, seq / cp, seq), or None for a causal mask;
    packed only: ``cu_seqlens`` and ``cu_seqlens_padded``, (documents + 1,) int32 offsets of the
    documents' real and padded lengths in the whole stream (every cp rank holds the same), and
    ``max_seqlen``, the longest padded document.
    Megatron's five-tuple is ``batch[:5]``.
    """

    tokens: torch.Tensor | None
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    cu_seqlens_padded: torch.Tensor | None = None


def megatron_loader(
    source: Iterable[Mapping[str, Any]] | Callable[[], Iterable[Mapping[str, Any]]],
    mesh: DeviceMesh,
    *,
    attention_mask: bool = False,
    packed: bool = False,
    **options: Any,
) -> CollectiveLoader:
    """A CollectiveLoader for Megatron-style micro-batches; call on every rank.

    ``source`` yields mappings with ``tokens``, ``labels``, ``loss_mask``, ``position_ids``
    (each (micro_batch, seq)), plus ``attention_mask`` when ``attention_mask=True``, or
    ``cu_seqlens`` when ``packed=True``: the documents' offsets, (documents + 1,) over the rows
    flattened or (micro_batch, n) per row (``max_seqlen`` is computed: leave it out). ``options``
    pass through to :class:`~collective_loader.CollectiveLoader` (``delivery``, ``timeout``,
    ``roles``, ...). A dense mask and packed documents do not go together: THD attention reads
    the offsets.

    Example (every rank)::

        loader = megatron_loader(lambda: DataLoader(ds, batch_size=micro_batch), mesh, packed=True)
        data_iterator = iter(loader)
        tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)[:5]
    """
    seq_dims = {key: 1 for key in INPUTS + LABELS}
    every_stage: tuple[str, ...] = ()
    if packed:  # the same on every rank: every rank raises
        if attention_mask:
            raise ValueError(
                "packed=True with attention_mask=True: packed documents are attended in THD format, which reads "
                "cu_seqlens, not a dense mask; drop the mask"
            )
        if "split" in options:
            raise ValueError("packed=True splits every document on its own; leave split= out")
        every_stage, options = ("cu_seqlens",), {**options, "split": PACKED}
    elif attention_mask:
        every_stage, seq_dims = ("attention_mask",), seq_dims | {"attention_mask": 2}
    return CollectiveLoader(
        source, mesh, inputs=INPUTS, labels=LABELS, every_stage=every_stage, seq_dims=seq_dims, **options
    )


def get_batch(data_iterator: Iterator[Mapping[str, Any]]) -> MegatronBatch:
    """The next micro-batch from ``iter(megatron_loader(...))``, as this rank's stage sees it.

    >>> get_batch(iter([{"labels": torch.ones(1, 4), "loss_mask": torch.ones(1, 4)}]))[:5]
    (None, tensor([[1., 1., 1., 1.]]), tensor([[1., 1., 1., 1.]]), None, None)
    """
    batch = next(data_iterator)
    return MegatronBatch(*(batch.get(field) for field in MegatronBatch._fields))
