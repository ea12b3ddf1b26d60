"""Packed rows placed over the data-parallel replicas by attention cost, step by step.

Every packed row holds ``seq_len + 1`` tokens, but attention over a row costs about the sum of
the squares of its document pieces' lengths, so one replica's rows can cost many times another's,
and every replica waits for the slowest at the gradient reduction. Each leader packs its rows
as without balancing; then the leaders share the lengths of every row's pieces, and every leader
computes the same :func:`place`-ment of all the step's pieces onto (replica, row). A replica's
rows still hold ``seq_len + 1`` tokens each (shapes stay fixed, so pipeline stages are
unaffected), and the step's multiset of tokens is the one without balancing: only *where* a piece
trains changes. Resume is therefore the packing's own (:mod:`collective_loader.text.resume`).

The cost model of a row is ``sum(L**2) + c * sum(L)`` over its pieces' lengths ``L``: the
attention scores grow with ``L**2``, the rest of the model (projections, MLP) with the number of
tokens. Per token a transformer layer spends about ``24 * d**2`` FLOPs in its projections and
MLP (``d``: the model width, MLP 4d) and ``4 * d`` per key it attends to, so a piece of ``L``
tokens costs about ``2 * d * L**2`` in causal attention (a kernel that skips the masked half) and
``24 * d**2 * L`` outside it: ``c ~ 12 * d`` (``6 * d`` when the masked half is computed too), as
for :class:`~collective_loader.plan.balanced.BalancedDocuments`. Every replica's rows hold the
same number of tokens, so ``c`` changes a replica's cost but not which replica is the slowest,
except at an epoch's padded end; it is there to report figures in the units of the whole step.
Pure: nothing here talks to ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Balance:
    """Balance packed rows over the data-parallel replicas (``Packing(balance=Balance())``).

    Args:
        linear_cost: ``c`` in a row's cost ``sum(L**2) + c * sum(L)`` (about ``12 * d_model``
            under a causal kernel that skips the masked half; 0 compares attention alone).
        valid_tokens: a key under which every rank's batch gets the step's global count of label
            tokens that are not ignored, over every replica (an int64 tensor of shape ``()``), to
            normalize the loss across replicas; deliver it to every stage with ``every_stage``.
            ``None``: no such key.
        rows: how many of a step's rows are placed together: ``None``, all of them (the most even);
            ``k``, each block of ``k`` rows (rows ``0..k-1`` of every leader, then ``k..2k-1``, ...)
            on its own, so that a loader whose steps are micro-batches of ``k`` rows places rows
            as one whose steps hold several micro-batches (TorchTitan's pipeline loads one
            micro-batch per step: ``rows=1`` trains pp = 1's rows under pp = 2).

    >>> Balance(linear_cost=12 * 4096).linear_cost
    49152.0
    """

    linear_cost: float = 0.0
    valid_tokens: str | None = None
    rows: int | None = None

    def __post_init__(self) -> None:
        c = self.linear_cost
        if isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0:
            raise ValueError(f"Balance(linear_cost=...) must be a number >= 0, got {c!r}")
        object.__setattr__(self, "linear_cost", float(c))
        if self.valid_tokens is not None and (not isinstance(self.valid_tokens, str) or not self.valid_tokens):
            raise ValueError(f"Balance(valid_tokens=...) must be a key (str) or None, got {self.valid_tokens!r}")
        if self.rows is not None and (isinstance(self.rows, bool) or not isinstance(self.rows, int) or self.rows < 1):
            raise ValueError(f"Balance(rows=...) must be a positive int or None, got {self.rows!r}")


class Piece(NamedTuple):
    """Tokens ``[start, start + length)`` of row ``row`` of leader ``leader``'s unbalanced rows."""

    leader: int
    row: int
    start: int
    length: int


def row_cost(lengths: Sequence[int], linear_cost: float) -> float:
    """``sum(L**2) + c * sum(L)`` over a row's piece lengths.

    >>> row_cost([3, 1], 0.5)
    12.0
    """
    return float(sum(n * n for n in lengths) + linear_cost * sum(lengths))


def replica_costs(rows: Sequence[Sequence[Sequence[int]]], linear_cost: float) -> list[float]:
    """Each replica's cost: the sum of its rows' :func:`row_cost`; ``rows[d][r]``: the piece
    lengths of row ``r`` of replica ``d``."""
    return [sum(row_cost(row, linear_cost) for row in replica) for replica in rows]


def place(
    rows: Sequence[Sequence[Sequence[int]]], batch_rows: int, capacity: int, linear_cost: float = 0.0
) -> list[list[list[Piece]]]:
    """One step's pieces placed onto ``len(rows)`` replicas of ``batch_rows`` rows each.

    ``rows[j]``: leader ``j``'s unbalanced rows, each the lengths of its pieces in order (at most
    ``batch_rows`` rows, each at most ``capacity`` tokens). Returns ``out[d][r]``, the pieces of
    row ``r`` of replica ``d``, each row at most ``capacity`` tokens; every token of the input is
    in exactly one piece. A deterministic function of its arguments: every leader computes the
    same placement.

    Pieces go whole, longest first, to the replica that costs least so far, into its fullest row
    that still holds them (longest-processing-time scheduling); what fits nowhere whole fills the
    remaining room, cut where the room ends (as the packer cuts at a row's edge). When that is no
    better than the rows as packed (its most costly replica costs as much or more), the rows stay
    where they were.

    >>> packed = [[[9], [9]], [[3, 3, 3], [5, 4]]]  # leader 0: two 9-token documents; leader 1: short ones
    >>> replica_costs(packed, 0)
    [162.0, 68.0]
    >>> out = place(packed, batch_rows=2, capacity=9)
    >>> [[sum(p.length for p in row) for row in replica] for replica in out]  # every row still full
    [[9, 9], [9, 9]]
    >>> replica_costs([[[p.length for p in row] for row in replica] for replica in out], 0)
    [116.0, 110.0]
    """
    replicas = len(rows)
    for j, leader_rows in enumerate(rows):
        if len(leader_rows) > batch_rows or any(sum(row) > capacity for row in leader_rows):
            raise ValueError(f"leader {j} has more than {batch_rows} rows or a row over {capacity} tokens")
    pieces = [
        Piece(j, r, start, n)
        for j, leader_rows in enumerate(rows)
        for r, row in enumerate(leader_rows)
        for start, n in zip(_starts(row), row)
        if n
    ]
    out: list[list[list[Piece]]] = [[[] for _ in range(batch_rows)] for _ in range(replicas)]
    room = [[capacity] * batch_rows for _ in range(replicas)]
    cost = [0.0] * replicas
    left: list[Piece] = []
    for piece in sorted(pieces, key=lambda p: (-p.length, p)):
        best: tuple[float, int, int, int] | None = None  # (replica cost, room after, replica, row)
        for d in range(replicas):
            fits = [(room[d][r] - piece.length, r) for r in range(batch_rows) if room[d][r] >= piece.length]
            if fits:
                after, r = min(fits)
                if best is None or (cost[d], after, d, r) < best:
                    best = (cost[d], after, d, r)
        if best is None:
            left.append(piece)
            continue
        _, _, d, r = best
        _put(out, room, cost, d, r, piece, linear_cost)
    for piece in left:  # longest first: cut each into the room left, least costly replica first
        while piece.length:
            d = min((d for d in range(replicas) if any(room[d])), key=lambda d: (cost[d], d))
            r = max(range(batch_rows), key=lambda r: (room[d][r], -r))
            k = min(room[d][r], piece.length)
            _put(out, room, cost, d, r, piece._replace(length=k), linear_cost)
            piece = piece._replace(start=piece.start + k, length=piece.length - k)
    for replica in out:
        for row in replica:
            row.sort()  # a row's pieces in the order the leaders packed them
    as_packed = [
        [[Piece(j, r, s, n) for s, n in zip(_starts(row), row) if n] for r, row in enumerate(leader_rows)]
        + [[] for _ in range(batch_rows - len(leader_rows))]
        for j, leader_rows in enumerate(rows)
    ]
    if max(cost) >= max(replica_costs(rows, linear_cost)):
        return as_packed
    return out


def place_in_blocks(
    rows: Sequence[Sequence[Sequence[int]]], batch_rows: int, capacity: int, linear_cost: float, block: int | None
) -> list[list[list[Piece]]]:
    """:func:`place` over each block of ``block`` rows on its own (``None``: one block of every
    row): rows ``b * block ..`` of every leader are placed onto rows ``b * block ..`` of every
    replica. ``Piece.row`` stays the row in its leader's step.

    >>> out = place_in_blocks([[[4], [1, 1, 1, 1]], [[2, 2], [4]]], 2, 4, 0.0, block=1)
    >>> [[sorted(p.length for p in row) for row in replica] for replica in out]
    [[[4], [1, 1, 1, 1]], [[2, 2], [4]]]
    """
    size = block or batch_rows
    out: list[list[list[Piece]]] = [[] for _ in rows]
    for first in range(0, batch_rows, size):
        n = min(size, batch_rows - first)
        part = place([leader[first : first + n] for leader in rows], n, capacity, linear_cost)
        for d, replica in enumerate(part):
            out[d] += [[p._replace(row=p.row + first) for p in row] for row in replica]
    return out


def _starts(lengths: Sequence[int]) -> list[int]:
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += n
    return starts


def _put(
    out: list[list[list[Piece]]],
    room: list[list[int]],
    cost: list[float],
    d: int,
    r: int,
    piece: Piece,
    linear_cost: float,
) -> None:
    out[d][r].append(piece)
    room[d][r] -= piece.length
    cost[d] += piece.length * piece.length + linear_cost * piece.length
