"""Which keys each stage gets and which piece of them each rank keeps.

Pure logic over batches (mappings of str to tensors and plain values); no communication.

* keys in ``inputs`` go to the first pipeline stage, keys in ``labels`` to the last stage (a key
  may be in both), keys in ``every_stage`` to every stage, middle ones included (packed-sequence
  metadata such as ``cu_seqlens``, which every layer's attention reads); with one stage every
  rank gets all keys, middle stages get only the ``every_stage`` keys;
* keys in ``seq_dims`` are split along that dim over the shard dims; every other key is
  replicated. ``split`` says how (a :class:`~collective_loader.plan.split.Split`):
  ``RowSplit("zigzag")`` or ``RowSplit("contiguous")`` cut every row as a whole
  (:mod:`collective_loader.plan.sharding`); a :class:`~collective_loader.plan.documents.PerDocument`
  cuts every packed document on its own and adds each rank's attention metadata
  (:mod:`collective_loader.plan.documents`);
  :class:`~collective_loader.plan.balanced_documents.BalancedDocuments` gives short documents whole to one
  rank, by cost, and cuts only the long ones (:mod:`collective_loader.plan.balanced_documents`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from collective_loader.errors import BatchError
from collective_loader.plan.mesh import Stage
from collective_loader.plan.split import ShardWork, Split


def str_keys(name: str, keys: Any) -> tuple[str, ...]:
    """``keys`` as a tuple; ``TypeError`` naming the option ``name`` unless it is a sequence of str
    (a lone str is refused: ``inputs="ids"`` would mean the keys ``i`` and ``d``).

    >>> str_keys("inputs", ["input_ids"])
    ('input_ids',)
    """
    if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
        raise TypeError(f"{name} must be a sequence of str keys, got {keys!r}")
    return tuple(keys)


@dataclass(frozen=True)
class Routing:
    """What goes where. ``shard_dims`` lists ``(name, size)`` of the shard dims, outermost first;
    ``every_stage`` lists the keys every pipeline stage receives.

    Example::

        >>> from collective_loader.plan.split import RowSplit
        >>> split = RowSplit("contiguous")
        >>> r = Routing(("ids",), ("labels",), {"ids": 1, "labels": 1}, split, (("cp", 2),))
        >>> batch = {"ids": torch.arange(8).view(2, 4), "labels": torch.arange(8).view(2, 4)}
        >>> r.piece(r.select(batch, "first"), [(2, 1)])
        {'ids': tensor([[2, 3],
                [6, 7]])}
    """

    inputs: tuple[str, ...]
    labels: tuple[str, ...]
    seq_dims: Mapping[str, int]
    split: Split
    shard_dims: tuple[tuple[str, int], ...] = field(default=())
    every_stage: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("inputs", "labels", "every_stage"):
            object.__setattr__(self, name, str_keys(name, getattr(self, name)))
        if not self.inputs and not self.labels and not self.every_stage:
            raise ValueError("inputs, labels and every_stage are all empty: nothing would be delivered")
        twice = sorted(set(self.every_stage) & (set(self.inputs) | set(self.labels)))
        if twice:
            raise ValueError(
                f"keys {twice} are in every_stage and also in inputs or labels; every_stage already "
                "reaches the first and last stages, so list them there only"
            )
        unknown = sorted(set(self.seq_dims) - set(self.keys))
        if unknown:
            raise ValueError(f"seq_dims names keys {unknown} that are in none of inputs, labels and every_stage")
        for key, dim in self.seq_dims.items():
            if not isinstance(dim, int) or isinstance(dim, bool):
                raise TypeError(f"seq_dims[{key!r}] must be an int dim, got {dim!r}")
        self.split.validate(self.seq_dims, self.every_stage, self.keys)

    @cached_property
    def keys(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.inputs + self.labels + self.every_stage))

    @cached_property
    def _stage_keys(self) -> dict[Stage, frozenset[str]]:
        """The keys each stage receives (see :meth:`select`); looked up once per step and stage."""
        return {
            Stage.FIRST: frozenset(self.inputs + self.every_stage),
            Stage.LAST: frozenset(self.labels + self.every_stage),
            Stage.BOTH: frozenset(self.keys),
            Stage.MIDDLE: frozenset(self.every_stage),
        }

    def check(self, batch: Any) -> None:
        """Raise :class:`BatchError` unless ``batch`` can be delivered whole to every rank."""
        if not isinstance(batch, Mapping):
            raise BatchError(f"a batch must be a mapping of str to tensors, got {type(batch).__qualname__}")
        missing = [k for k in self.keys if k not in batch]
        if missing:
            raise BatchError(f"batch is missing keys {missing} (it has {sorted(map(str, batch))})")
        known = self._stage_keys[Stage.BOTH]
        extra = [k for k in batch if k not in known]
        computed = [k for k in extra if k in self.split.metadata]
        if computed:
            raise BatchError(
                f"batch has keys {computed}, which the {type(self.split).__name__} split computes for every rank; "
                "drop them in the source"
            )
        if extra:
            raise BatchError(
                f"batch has keys {extra} that are in none of inputs={self.inputs}, labels={self.labels} and "
                f"every_stage={self.every_stage}; list each key a stage needs, or drop it in the source"
            )
        for key, dim in self.seq_dims.items():
            _check_seq_value(key, dim, batch[key])
        self.split.check(batch, self.seq_dims, self.shard_dims)

    def select(self, batch: Mapping[str, Any], stage: Stage) -> dict[str, Any]:
        """The keys a stage receives, in batch order."""
        wanted = self._stage_keys[stage]
        return {k: v for k, v in batch.items() if k in wanted}

    def piece(self, selected: Mapping[str, Any], levels: Sequence[tuple[int, int]]) -> dict[str, Any]:
        """The part of ``selected`` a rank at shard ``levels`` keeps; other keys pass through.

        Under a split that adds metadata, also at one shard rank (a per-document split: the rows
        flattened, the documents padded, the metadata added).
        """
        return self.split.piece(selected, self.seq_dims, levels)

    def work(self, batch: Mapping[str, Any]) -> ShardWork | None:
        """Each shard rank's work for ``batch`` (:meth:`~collective_loader.plan.split.Split.work`);
        ``None`` when nothing is cut or the split reports none."""
        sizes = [size for _, size in self.shard_dims]
        if math.prod(sizes) == 1:
            return None
        return self.split.work(batch, sizes)


def _check_seq_value(key: str, dim: int, value: Any) -> None:
    """Refuse a ``seq_dims`` value that has no ``dim``, whatever the shard size: a batch that
    works at cp=1 must not start failing when the same job runs at cp=2."""
    if not isinstance(value, torch.Tensor):
        raise BatchError(
            f"seq_dims[{key!r}] = {dim} needs a tensor, but the batch holds a {type(value).__qualname__} there; "
            f"make {key!r} a tensor in the source or drop it from seq_dims"
        )
    if not -value.dim() <= dim < value.dim():
        raise BatchError(
            f"seq_dims[{key!r}] = {dim}, but {key!r} has shape {tuple(value.shape)}; "
            f"give the dim of {key!r} that holds the sequence"
        )
