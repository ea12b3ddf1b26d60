"""Megatron-style batches: a ``get_batch(data_iterator)`` for a pretrain step, on every stage.

Megatron's ``pretrain_gpt.get_batch`` loads or broadcasts, per pipeline stage, the tuple
``(tokens, labels, loss_mask, attention_mask, position_ids)``; stages that do not need a tensor
get ``None``. :func:`megatron_loader` builds a :class:`~collective_loader.CollectiveLoader` that
routes those keys the same way (tokens and position ids to the first stage, labels and loss mask
to the last), and sends what every transformer layer reads to *every* stage, middle ones
included: a dense ``attention_mask`` when the source has one, and the packed-sequence offsets
``cu_seqlens`` with ``max_seqlen`` (Megatron's ``PackedSeqParams``, THD format). Under context
parallelism every tensor is split along the sequence (``attention_mask`` along its query dim),
as Megatron's ``get_batch_on_this_cp_rank`` does with its 2 x cp load-balanced chunks
(``split="zigzag"``).

Each loader step is one micro-batch, as Megatron's data iterator yields them: the source's batch
size is the micro-batch size, and a training step consumes ``num_microbatches`` steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh

from collective_loader.loader import CollectiveLoader
from collective_loader.plan.mesh import MeshLayout

INPUTS = ("tokens", "position_ids")
LABELS = ("labels", "loss_mask")
PACKED = ("cu_seqlens", "max_seqlen")


class MegatronBatch(NamedTuple):
    """One micro-batch as one stage sees it; what a stage does not need is ``None``.

    ``tokens``, ``labels``, ``loss_mask``, ``position_ids``: (micro_batch, seq / cp);
    ``attention_mask``: (micro_batch, 1, seq / cp, seq), or None for a causal mask;
    ``cu_seqlens``: (documents + 1,) int32 offsets into the flattened micro-batch, and
    ``max_seqlen`` the longest document, when sequences are packed.
    Megatron's five-tuple is ``batch[:5]``.
    """

    tokens: torch.Tensor | None
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None


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
    (each (micro_batch, seq)), plus ``attention_mask`` when ``attention_mask=True`` and
    ``cu_seqlens``, ``max_seqlen`` when ``packed=True``. ``options`` pass through to
    :class:`~collective_loader.CollectiveLoader` (``layout``, ``timeout``, ``roles``, ...).

    Packed sequences under context parallelism need each document split on its own (what
    Transformer Engine's THD attention expects), not each row: that is refused here.

    Example (every rank)::

        loader = megatron_loader(lambda: DataLoader(ds, batch_size=micro_batch), mesh, packed=True)
        data_iterator = iter(loader)
        tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)[:5]
    """
    layout = MeshLayout.from_mesh(mesh, options.get("roles"))
    cp = math.prod(size for size, role in zip(layout.shape, layout.roles) if role == "shard")
    if packed and cp > 1:  # the same on every rank: every rank raises
        raise ValueError(
            f"packed=True with a context-parallel degree of {cp}: packed documents must be split one by one "
            "over the cp ranks (Transformer Engine's THD layout), which this loader does not do; "
            "use packed=False with cp, or cp=1 with packed sequences"
        )
    every_stage = (("attention_mask",) if attention_mask else ()) + (PACKED if packed else ())
    seq_dims = {key: 1 for key in INPUTS + LABELS} | ({"attention_mask": 2} if attention_mask else {})
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
