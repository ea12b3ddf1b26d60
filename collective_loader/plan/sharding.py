"""Sequence splits over shard dims (context / Ulysses sequence parallel) and their inverse.

Two splits cut a sequence of length ``L`` over ``n`` ranks:

* ``contiguous``: ``n`` equal chunks; rank ``r`` keeps chunk ``r``. Needs ``L % n == 0``.
* ``zigzag``: ``2n`` equal chunks; rank ``r`` keeps chunks ``r`` and ``2n-1-r``, concatenated.
  This balances causal-attention work across ranks (Megatron's and TorchTitan's load balancer).
  Needs ``L % 2n == 0``.

Several shard dims compose in mesh order: the outermost dim splits the sequence, then the next
dim splits that rank's piece with the same split, and so on. ``levels`` is the list of
``(size, index)`` pairs of those dims, outermost first.

Pure tensor code; nothing here talks to ``torch.distributed``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

SplitName = Literal["contiguous", "zigzag"]  # the whole-row splits (:class:`~collective_loader.plan.split.RowSplit`)
SPLITS: tuple[SplitName, ...] = ("contiguous", "zigzag")

Levels = Sequence[tuple[int, int]]


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def divisor(levels: Levels, split: SplitName) -> int:
    """The number a sequence length must be a multiple of for ``levels`` under ``split``.

    >>> divisor([(2, 0)], "zigzag"), divisor([(2, 0), (3, 0)], "contiguous")
    (4, 6)
    """
    _check_split(split)
    n = math.prod(size for size, _ in levels)
    return 2 * n if split == "zigzag" and n > 1 else n


def chunks(length: int, size: int, index: int, split: SplitName) -> list[tuple[int, int]]:
    """``(start, stop)`` ranges, in order, that rank ``index`` of ``size`` keeps of ``length``.

    >>> chunks(8, 2, 0, "zigzag")
    [(0, 2), (6, 8)]
    """
    _check_split(split)
    if not 0 <= index < size:
        raise ValueError(f"shard index {index} out of range for size {size}")
    if size == 1:
        return [(0, length)]
    if split == "contiguous":
        step = length // size
        return [(index * step, (index + 1) * step)]
    step = length // (2 * size)
    late = 2 * size - 1 - index
    return [(index * step, (index + 1) * step), (late * step, (late + 1) * step)]


def shard(tensor: torch.Tensor, dim: int, levels: Levels, split: SplitName) -> torch.Tensor:
    """The piece of ``tensor`` along ``dim`` that the rank at ``levels`` keeps (contiguous copy).

    The caller checks divisibility first (:func:`divisor`); this function asserts it.
    """
    piece = tensor
    for size, index in levels:
        length = piece.shape[dim]
        assert length % divisor([(size, 0)], split) == 0, (length, size, split)
        parts = [piece.narrow(dim, start, stop - start) for start, stop in chunks(length, size, index, split)]
        piece = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
    return piece.contiguous()


def unshard(pieces: Sequence[torch.Tensor], dim: int, sizes: Sequence[int], split: SplitName) -> torch.Tensor:
    """Reassemble the full tensor from every rank's piece.

    ``pieces`` is ordered row-major over the shard dims' indices (outermost dim slowest), and
    ``sizes`` lists those dims' sizes. The inverse of :func:`shard`.
    """
    _check_split(split)
    if len(pieces) != math.prod(sizes):
        raise ValueError(f"need {math.prod(sizes)} pieces for sizes {list(sizes)}, got {len(pieces)}")
    if not sizes:
        return pieces[0]
    outer, inner = sizes[0], list(sizes[1:])
    per_outer = math.prod(inner)
    outer_pieces = [unshard(pieces[i * per_outer : (i + 1) * per_outer], dim, inner, split) for i in range(outer)]
    if outer == 1:
        return outer_pieces[0]
    if split == "contiguous":
        return torch.cat(outer_pieces, dim=dim)
    half = outer_pieces[0].shape[dim] // 2
    early = [p.narrow(dim, 0, half) for p in outer_pieces]
    late = [p.narrow(dim, half, half) for p in outer_pieces]
    return torch.cat(early + late[::-1], dim=dim)
