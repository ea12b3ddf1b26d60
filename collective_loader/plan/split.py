"""What a split is: how a batch's sequence keys are cut over the shard dims, and its inverse.

:class:`Split` declares what the loader asks of one. Four implement it, as peers:

* :class:`RowSplit` (``RowSplit("zigzag")``, ``RowSplit("contiguous")``): every row cut as a
  whole (:mod:`~collective_loader.plan.sharding`);
* :class:`~collective_loader.plan.documents.PerDocument`: every packed document cut on its own,
  each rank's attention metadata added;
* :class:`~collective_loader.plan.balanced_documents.BalancedDocuments`: short documents whole to one rank
  by cost, long ones cut.

A user gives ``split="zigzag"`` (or ``"contiguous"``) or a split object; :func:`as_split` turns
the name into its object once, when the config is made. Pure: nothing here talks to
``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from collective_loader.errors import BatchError
from collective_loader.plan import sharding
from collective_loader.plan.sharding import Levels, SplitName


@dataclass(frozen=True)
class ShardWork:
    """One micro-batch's work per shard rank, as a split reports it (:meth:`Split.work`).

    ``costs``: (n,) each rank's cost, ``2k + 1 + c`` summed over its real query tokens (``k``: the
    query's position in its document; a document of ``L`` tokens costs ``L**2 + c * L`` in all);
    ``slots``: the tokens each rank holds, padding included; ``tokens``: the micro-batch's real tokens.

    >>> work = ShardWork(costs=(3.0, 1.0), slots=4, tokens=6)
    >>> work.max_over_mean, round(work.padding, 3)
    (1.5, 0.333)
    """

    costs: tuple[float, ...]
    slots: int
    tokens: int

    @property
    def max_over_mean(self) -> float:
        """The costliest rank's cost over the mean: 1.0 when no rank waits for another."""
        mean = sum(self.costs) / len(self.costs)
        return max(self.costs) / mean if mean > 0 else 1.0

    @property
    def padding(self) -> float:
        """Padding overhead: every rank's slots over the real tokens, minus 1."""
        return len(self.costs) * self.slots / self.tokens - 1 if self.tokens else 0.0


@runtime_checkable
class Split(Protocol):
    """How the ``seq_dims`` keys of a batch are cut over the shard dims, and what else a rank gets.

    ``levels`` is a rank's ``(size, index)`` per shard dim, outermost first; ``sizes`` those
    dims' sizes. Every rank of the world must describe its split alike: ``str(split)`` is part of
    the config the ranks agree on. The checks of :mod:`collective_loader.testing.invariants` ask
    two more members (its ``Reassembling``: ``reshapes`` and the inverse, ``unshard``), which the
    package's splits have and the loader never calls. Example, a split written from scratch::

        >>> from dataclasses import dataclass
        >>> @dataclass(frozen=True)
        ... class Whole:  # every rank keeps every token: a split that cuts nothing
        ...     metadata = ()
        ...     def validate(self, seq_dims, every_stage, keys): pass
        ...     def check(self, batch, seq_dims, shard_dims): pass
        ...     def piece(self, selected, seq_dims, levels): return dict(selected)
        ...     def work(self, batch, sizes): return None
        >>> isinstance(Whole(), Split)
        True
    """

    metadata: ClassVar[tuple[str, ...]]
    """The keys :meth:`piece` adds to every rank's batch; a source must not send them."""

    def validate(self, seq_dims: Mapping[str, int], every_stage: Sequence[str], keys: Sequence[str]) -> None:
        """Raise ``ValueError`` unless the loader's keys fit this split (when the routing is made)."""

    def check(
        self, batch: Mapping[str, Any], seq_dims: Mapping[str, int], shard_dims: Sequence[tuple[str, int]]
    ) -> None:
        """Raise :class:`~collective_loader.BatchError` unless the leader can cut ``batch`` over
        ``shard_dims`` (``(name, size)``, outermost first); its keys are checked already."""

    def piece(self, selected: Mapping[str, Any], seq_dims: Mapping[str, int], levels: Levels) -> dict[str, Any]:
        """What the rank at ``levels`` keeps of ``selected`` (one stage's keys), metadata added."""

    def work(self, batch: Mapping[str, Any], sizes: Sequence[int]) -> ShardWork | None:
        """Each shard rank's work for ``batch`` (the loader's ``stats()``), or ``None`` when this
        split reports none."""


@dataclass(frozen=True)
class RowSplit:
    """Cut every row as a whole: ``"zigzag"`` (``2n`` chunks, rank ``r`` keeping ``r`` and
    ``2n-1-r``) or ``"contiguous"`` (``n`` chunks); see :mod:`~collective_loader.plan.sharding`.

    >>> split = RowSplit("zigzag")
    >>> split.piece({"ids": torch.arange(8).view(1, 8), "n": 3}, {"ids": 1}, [(2, 1)])
    {'ids': tensor([[2, 3, 4, 5]]), 'n': 3}
    >>> str(split)
    'zigzag'
    """

    name: SplitName

    metadata: ClassVar[tuple[str, ...]] = ()
    reshapes: ClassVar[bool] = False  # for testing.invariants.Reassembling, as unshard

    def __post_init__(self) -> None:
        if self.name not in sharding.SPLITS:
            raise ValueError(f"split must be one of {sharding.SPLITS} or a split object, got {self.name!r}")

    def __str__(self) -> str:
        return self.name

    def validate(self, seq_dims: Mapping[str, int], every_stage: Sequence[str], keys: Sequence[str]) -> None:
        """Any keys fit a whole-row split."""

    def check(
        self, batch: Mapping[str, Any], seq_dims: Mapping[str, int], shard_dims: Sequence[tuple[str, int]]
    ) -> None:
        need = sharding.divisor([(size, 0) for _, size in shard_dims], self.name)
        if need == 1:  # nothing is split: any length will do
            return
        over = " x ".join(f"{n}={s}" for n, s in shard_dims)
        for key, dim in seq_dims.items():
            length = batch[key].shape[dim]
            if length % need:
                raise BatchError(
                    f"key {key!r} has length {length} along dim {dim}; the {self.name} split over {over} "
                    f"needs a multiple of {need}"
                )

    def piece(self, selected: Mapping[str, Any], seq_dims: Mapping[str, int], levels: Levels) -> dict[str, Any]:
        if all(size == 1 for size, _ in levels):
            return dict(selected)
        return {
            k: sharding.shard(v, seq_dims[k], levels, self.name) if k in seq_dims else v for k, v in selected.items()
        }

    def unshard(
        self, pieces: Sequence[torch.Tensor], sizes: Sequence[int], dim: int, batch: Mapping[str, Any]
    ) -> torch.Tensor:
        return sharding.unshard(pieces, dim, sizes, self.name)

    def work(self, batch: Mapping[str, Any], sizes: Sequence[int]) -> ShardWork | None:
        """A whole-row split reports no work figures."""
        return None


def as_split(value: str | Split) -> Split:
    """The split a config names: ``"zigzag"`` and ``"contiguous"`` become :class:`RowSplit`\\ s,
    a split object stays itself; anything else raises (``ValueError`` for an unknown name).

    >>> as_split("contiguous")
    RowSplit(name='contiguous')
    """
    if isinstance(value, str):
        return RowSplit(value)  # type: ignore[arg-type]  # RowSplit checks the name
    if not isinstance(value, Split):
        raise TypeError(f"split must be 'zigzag', 'contiguous' or a split object, got {value!r}")
    return value
