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

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

FILLS = (0.0, 0.1, 0.25, 0.5)
"""The tries of :func:`place`: each the share of a step's tokens kept back as fillers (0: every
piece placed longest first, the plain greedy). Which share does best depends on the step."""

PARTNERS = 8
"""How many of the least costly replicas the costliest one trades pieces with, per exchange."""

EXCHANGES = 128
"""The most exchanges per try: bounds :func:`place`'s work at a large dp."""

BIG_PER_ROW = 16
"""At most this many pieces per row of the step are placed before the fillers (and exchanged):
bounds the exchanges' work when documents are tiny."""


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
        replicas: how many replicas are placed together: ``None``, all of them (each step's
            gather and all-to-all span every leader, so their time grows with dp: about 5 s per
            step at dp 1,024 in bench/results/leader_collectives.md); ``k``, each block of ``k``
            consecutive dp ranks on its own, its collectives among its ``k`` leaders only (``k``
            must divide dp): a step costs what it costs at dp = ``k`` and balances as evenly.
            Not with ``valid_tokens``, a count over every replica: that needs a collective over
            every leader each step, the cost the blocks remove (count the labels of each
            replica's batch and all-reduce them over dp in the training step instead).

    >>> Balance(linear_cost=12 * 4096).linear_cost
    49152.0
    >>> Balance(replicas=8).blocks(16)
    [range(0, 8), range(8, 16)]
    """

    linear_cost: float = 0.0
    valid_tokens: str | None = None
    rows: int | None = None
    replicas: int | None = None

    def __post_init__(self) -> None:
        c = self.linear_cost
        if isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0:
            raise ValueError(f"Balance(linear_cost=...) must be a number >= 0, got {c!r}")
        object.__setattr__(self, "linear_cost", float(c))
        if self.valid_tokens is not None and (not isinstance(self.valid_tokens, str) or not self.valid_tokens):
            raise ValueError(f"Balance(valid_tokens=...) must be a key (str) or None, got {self.valid_tokens!r}")
        if self.rows is not None and (isinstance(self.rows, bool) or not isinstance(self.rows, int) or self.rows < 1):
            raise ValueError(f"Balance(rows=...) must be a positive int or None, got {self.rows!r}")
        k = self.replicas
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"Balance(replicas=...) must be a positive int or None, got {k!r}")
        if k is not None and self.valid_tokens is not None:
            raise ValueError(
                "Balance(valid_tokens=...) counts labels over every replica, a collective over every leader each "
                "step, which Balance(replicas=...) is there to avoid: give one of them (with replicas, all-reduce "
                "each replica's count of labels over dp in the training step)"
            )

    def blocks(self, dp: int) -> list[range]:
        """The dp ranks placed together, in order: ``replicas`` consecutive ones each (``None``: one
        block of all ``dp``). ``ValueError`` when ``replicas`` does not divide ``dp``: pure
        arithmetic, so every rank refuses at construction, before any group is created."""
        k = self.replicas or dp
        if dp % k:
            raise ValueError(f"Balance(replicas={k}) must divide the data-parallel degree, dp = {dp}")
        return [range(first, first + k) for first in range(0, dp, k)]


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
    in exactly one piece. A deterministic function of its arguments (integer arithmetic, every tie
    broken by index): every leader computes the same placement.

    Each try of :data:`FILLS` keeps that share of the step's tokens, its shortest pieces, as
    *fillers*, and places the longer pieces whole first, longest first, each onto the replica
    whose cost is least so far, into its fullest row that still holds it (longest-processing-time
    scheduling). A replica's cost counts the room it leaves at the fillers' mean cost per token,
    since every row ends full: a replica of long pieces is then given a small share of tokens of
    them. Exchanges follow: the costliest replica moves one piece to, or swaps one for a lighter
    one of, one of the :data:`PARTNERS` least costly ones while that lowers the costlier of the
    two (at most :data:`EXCHANGES` times). Then the fillers, and what fit nowhere before, go
    whole the same way by cost as it stands, and what fits nowhere whole fills the remaining
    room, cut where the room ends (as the packer cuts at a row's edge): as in the plain greedy
    (the try of share 0), a piece is cut only where, counting the pieces before it (longest
    first), no row holds it whole; the exchanges keep to that (none frees a row's room under a
    piece left to be cut). The try whose most costly replica costs least is kept (the first of
    equals); if none beats the rows as packed, they stay where they were. Work per try: about
    ``pieces * log(dp)`` to place, and per exchange ``dp`` plus ``PARTNERS`` times the pieces of
    two replicas (``log`` of a row's pieces each).

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
    pieces = sorted(
        (
            Piece(j, r, start, n)
            for j, leader_rows in enumerate(rows)
            for r, row in enumerate(leader_rows)
            for start, n in zip(_starts(row), row)
            if n
        ),
        key=_rank,
    )
    best = [
        [[Piece(j, r, s, n) for s, n in zip(_starts(row), row) if n] for r, row in enumerate(leader_rows)]
        + [[] for _ in range(batch_rows - len(leader_rows))]
        for j, leader_rows in enumerate(rows)
    ]
    least = max(replica_costs(rows, linear_cost))
    for share in FILLS:
        tried = _try(pieces, replicas, batch_rows, capacity, share)
        cost = max(replica_costs([[[p.length for p in row] for row in replica] for replica in tried], linear_cost))
        if cost < least:  # strictly better: a tie keeps the earlier, so every leader keeps the same
            best, least = tried, cost
    for replica in best:
        for row in replica:
            row.sort()  # a row's pieces in the order the leaders packed them
    return best


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


def _rank(piece: Piece) -> tuple[int, Piece]:
    """A piece's place in the order :func:`place` takes them: longest first, ties by the piece."""
    return (-piece.length, piece)


def _starts(lengths: Sequence[int]) -> list[int]:
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += n
    return starts


def _try(pieces: list[Piece], replicas: int, batch_rows: int, capacity: int, share: float) -> list[list[list[Piece]]]:
    """One try of :func:`place`: ``pieces`` (longest first) with the shortest ``share`` of their
    tokens as fillers."""
    budget, big = share * sum(p.length for p in pieces), len(pieces)
    while big and pieces[big - 1].length <= budget:
        budget -= pieces[big - 1].length
        big -= 1
    big = min(big, BIG_PER_ROW * replicas * batch_rows)
    layout = _Layout(replicas, batch_rows, capacity, pieces[big:])
    left = layout.put_whole(pieces[:big])
    if big < len(pieces):  # without fillers every row is full or holds no more piece: nothing to trade
        layout.skipped = left
        layout.exchange()
    # the fillers by cost as it stands: by the key, a piece shorter than the fillers' mean lowers
    # its replica's, which would then take every short piece and leave the long ones to the others
    layout.fill_sq, layout.fill_tokens = 0, 1
    left = layout.put_whole(left + pieces[big:])  # what fit nowhere may fit after the exchanges
    layout.cut(sorted(left, key=_rank))
    return layout.rows


class _Layout:
    """Pieces in (replica, row) and each row's room. A replica's *key* is its cost as it will end:
    its pieces' ``sum(L**2)`` plus its room at the fillers' cost per token (``fill_sq / fill_tokens``),
    times ``fill_tokens`` to stay in integers (no float ties: the same order on every leader).
    ``linear_cost`` has no part: rows end full, so every replica's ``c * sum(L)`` is the same.

    >>> layout = _Layout(2, 1, 10, [Piece(0, 0, 0, 2), Piece(0, 0, 2, 2)])  # fillers: 4 tokens, 2 per token
    >>> layout.put_whole([Piece(1, 0, 0, 6)])
    []
    >>> [layout.key(d) for d in range(2)]  # (36 + 2 * 4) * 4 and 2 * 10 * 4
    [176, 80]
    """

    def __init__(self, replicas: int, batch_rows: int, capacity: int, fillers: Sequence[Piece]) -> None:
        self.rows: list[list[list[Piece]]] = [[[] for _ in range(batch_rows)] for _ in range(replicas)]
        self.capacity = capacity
        self.room = [[capacity] * batch_rows for _ in range(replicas)]
        self.skipped: list[Piece] = []  # pieces no row held at their turn: the exchanges keep it so
        self.sq = [0] * replicas
        self.fill_tokens = max(sum(p.length for p in fillers), 1)
        self.fill_sq = sum(p.length * p.length for p in fillers)

    def key(self, d: int) -> int:
        return self.sq[d] * self.fill_tokens + self.fill_sq * sum(self.room[d])

    def weight(self, n: int) -> int:
        """What a piece of ``n`` tokens adds to its replica's key."""
        return n * n * self.fill_tokens - self.fill_sq * n

    def put(self, d: int, r: int, piece: Piece) -> None:
        self.rows[d][r].append(piece)
        self.room[d][r] -= piece.length
        self.sq[d] += piece.length * piece.length

    def take(self, d: int, r: int, i: int) -> Piece:
        piece = self.rows[d][r].pop(i)
        self.room[d][r] += piece.length
        self.sq[d] -= piece.length * piece.length
        return piece

    def put_whole(self, pieces: Sequence[Piece]) -> list[Piece]:
        """Each piece (longest first) onto the least costly replica with a row that holds it, into
        its fullest such row; returns those no row holds.

        Two heaps keep this near ``len(pieces) * log(replicas)``: by key, the replicas whose
        largest room held the last piece; by largest room, the others, back in the first once
        the pieces are short enough (rooms only shrink here, and pieces only get shorter).
        """
        heap = [(self.key(d), d) for d in range(len(self.rows))]
        heapq.heapify(heap)
        waiting: list[tuple[int, int]] = []  # (-largest room, replica)
        left: list[Piece] = []
        for piece in pieces:
            while waiting and -waiting[0][0] >= piece.length:
                d = heapq.heappop(waiting)[1]
                heapq.heappush(heap, (self.key(d), d))
            while heap:
                d = heapq.heappop(heap)[1]
                if max(self.room[d]) < piece.length:
                    heapq.heappush(waiting, (-max(self.room[d]), d))
                    continue
                fits = [(room - piece.length, r) for r, room in enumerate(self.room[d]) if room >= piece.length]
                self.put(d, min(fits)[1], piece)
                heapq.heappush(heap, (self.key(d), d))
                break
            else:
                left.append(piece)
        return left

    def exchange(self) -> None:
        """Up to :data:`EXCHANGES` times: the trade between the costliest replica and one of the
        :data:`PARTNERS` least costly ones that leaves the costlier of the two least: a piece of
        one row moved to a row of the other, or swapped for a lighter one of that row. Stops when
        no trade lowers the pair's maximum; each lowers it strictly, so no state repeats."""
        replicas = len(self.rows)
        for _ in range(EXCHANGES):
            keys = [self.key(d) for d in range(replicas)]
            a = max(range(replicas), key=lambda d: (keys[d], -d))
            partners = heapq.nsmallest(PARTNERS, (d for d in range(replicas) if d != a), key=lambda d: (keys[d], d))
            best = self._trade(a, partners, keys)
            if best is None:
                return
            _, b, x, i, y, j = best
            mine = self.take(a, x, i)
            if j >= 0:
                self.put(a, x, self.take(b, y, j))
            self.put(b, y, mine)

    def _trade(self, a: int, partners: list[int], keys: list[int]) -> tuple[int, ...] | None:
        """The best trade of a piece of replica ``a`` for a lighter one of a partner's, or none:
        ``(pair's max after, b, x, i, y, j)``, piece ``i`` of row ``x`` of ``a`` for piece ``j`` of
        row ``y`` of ``b`` (-1: moved, nothing back); ``None`` if no trade lowers the pair's max."""
        best: tuple[int, ...] | None = None
        own = [[bundle for bundle in self._bundles(row) if bundle[0] > 0] for row in self.rows[a]]
        for b in partners:  # least costly first: the pair's max after a trade is above keys[b]
            if best is not None and best[0] <= keys[b]:
                break
            gap = keys[a] - keys[b]
            for y, other in enumerate(self.rows[b]):
                bundles = self._bundles(other)  # theirs, lightest first, and none at all
                weights = [w for w, _, _ in bundles]
                for x, bundles_x in enumerate(own):
                    for w, n, i in bundles_x:
                        # the pair's max after is least for the piece nearest to gap / 2 lighter:
                        # the nearest on each side that leaves both rows room enough
                        lo = bisect.bisect_right(weights, w - gap)
                        hi = bisect.bisect_left(weights, w, lo)
                        near = bisect.bisect_left(weights, w - gap // 2, lo, hi)
                        for side in (range(near - 1, lo - 1, -1), range(near, hi)):
                            for k in side:
                                v, m, j = bundles[k]
                                if (
                                    self.room[b][y] + m >= n
                                    and self.room[a][x] + n >= m
                                    and self._keeps_skipped(a, x, i, b, y, j)
                                ):
                                    trade = (max(keys[a] - w + v, keys[b] + w - v), b, x, i, y, j)
                                    best = trade if best is None or trade < best else best
                                    break
        return best

    def _keeps_skipped(self, a: int, x: int, i: int, b: int, y: int, j: int) -> bool:
        """Whether trading piece ``i`` of row ``x`` of ``a`` for piece ``j`` of row ``y`` of ``b``
        (-1: nothing back) leaves every :attr:`skipped` piece where no row could have held it: each
        row still holds more than ``capacity - L`` tokens of the pieces ranked before it (longest
        first). A trade that opened that room would have the piece cut where, at its turn, a row
        held it whole."""
        mine = self.rows[a][x][i]
        theirs = self.rows[b][y][j] if j >= 0 else None
        for row, out, into in ((self.rows[a][x], mine, theirs), (self.rows[b][y], theirs, mine)):
            for piece in self.skipped:
                turn = _rank(piece)
                lost = (out.length if out is not None and _rank(out) < turn else 0) - (
                    into.length if into is not None and _rank(into) < turn else 0
                )
                if lost > 0 and sum(p.length for p in row if _rank(p) < turn) - lost <= self.capacity - piece.length:
                    return False
        return True

    def _bundles(self, row: list[Piece]) -> list[tuple[int, int, int]]:
        """``(weight, length, index)`` of one piece of ``row`` per length (the others trade the
        same), and ``(0, 0, -1)``: none, lightest first."""
        first: dict[int, int] = {}
        for i, piece in enumerate(row):
            first.setdefault(piece.length, i)
        return sorted([(0, 0, -1), *((self.weight(n), n, i) for n, i in first.items())])

    def cut(self, left: Sequence[Piece]) -> None:
        """Each piece (longest first) cut into the room left: the least costly replica with room
        first, its fullest row, as much as it holds."""
        heap = [(self.key(d), d) for d in range(len(self.rows)) if any(self.room[d])]
        heapq.heapify(heap)
        for piece in left:
            while piece.length:
                _, d = heapq.heappop(heap)
                r = max(range(len(self.room[d])), key=lambda r: (self.room[d][r], -r))
                k = min(self.room[d][r], piece.length)
                self.put(d, r, piece._replace(length=k))
                piece = piece._replace(start=piece.start + k, length=piece.length - k)
                if any(self.room[d]):
                    heapq.heappush(heap, (self.key(d), d))
