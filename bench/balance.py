"""Balanced packing: attention cost per data-parallel replica and per cp rank, off vs on.

    python bench/balance.py            # bench/results/balance.{json,md} (run time: bench/README.md)
    python bench/balance.py --quick    # fewer steps, one round of the end-to-end measure

1. Arithmetic, on the library's own code: each of ``dp`` leaders packs its own stream of
   documents drawn from a mix (:class:`~collective_loader.text.packing.Packer`, rows of
   ``seq_len + 1`` tokens, ``ROWS`` rows per replica and step; one case again with ``MORE_ROWS``), then
   :func:`~collective_loader.text.balance.place` places the step's pieces over the replicas. A
   replica's cost is the sum over its rows of ``sum(L**2) + c * sum(L)`` over the rows' pieces.
   Per step the balance is max / mean cost over the replicas (1.0: no replica waits for another);
   the table gives its mean over the steps, as packed and as placed, with ``c = 0`` (attention
   alone) and ``c = 6 * 4096`` (a 4096-wide model), at 1, 2 and 4 rows per replica and step.
   Padding overhead = token slots / real tokens - 1 (the same with and without balancing: rows
   stay full). Beside it, a floor no placement can beat that cuts a piece only where, counting the
   longer pieces, no row has room for it, as ``place`` does (:func:`floor`), and the older, looser
   one of the longest piece alone.
   Then :func:`~collective_loader.text.balance.place`'s time per step against dp, 8 to 1,024
   leaders' pieces of the long-tail mix (2 rows of 32k per replica), as one leader computes it.
2. A real world of dp = 2 x cp = 2 on MDS datasets of the tiny and long-tail mixes: off (each
   leader delivers the rows it packed, ``PerDocument`` over cp) vs on (``Balance()``,
   ``BalancedDocuments``); the leaders' ``stats()`` give cost max/mean over the replicas (as packed
   and as placed) and over the cp ranks, and the padding the cp split adds.
   Per-cp-rank cost from the rows alone, at cp 2, 4 and 8: ``bench/cp_balance.py``.
3. End to end: a gloo world of dp = 2 leaders streaming a real MDS dataset of the long-tail mix
   through :class:`~collective_loader.CollectiveLoader`; the "model" sleeps in proportion to its
   batch's attention cost (``sum(L**2)`` from ``cu_seqlens``), then all-reduces a gradient-sized
   tensor (every replica waits for the slowest, as in training). Steps per second, balancing off vs
   on, alternating over rounds.

Targets (issue 29): mean max/mean over replicas <= 1.05 on every mix at dp 2, 4 and 8, and over
cp ranks at cp 2 with padding <= 10%; the balanced end-to-end run faster on the long-tail mix.
Issue 40: within 0.01 of the floor on every mix at dp 2, 4, 8 with 1, 2 and 4 rows per replica;
issue 49: within 0.015 of it, with ``place`` at most 15 ms per step at dp 8.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import math
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from harness import Run, keep, runs_of, table, worlds_in_rounds  # bench/harness.py: run as python bench/<name>.py

from collective_loader.testing import launch
from collective_loader.text.balance import Piece, place, place_in_blocks, replica_costs
from collective_loader.text.packing import Packer

TARGET = 1.05
NEAR = 0.015  # issue 49 (0.01 in issue 40): balanced within this of the floor
DPS = (2, 4, 8)
ROWS = (1, 2, 4)  # rows per replica and step
TIMED_DPS = (8, 32, 128, 512, 1024)  # place()'s time per step against dp
TIMED = ("long tail", 2)  # (mix, rows per replica) of the timed steps
EXHAUSTIVE_CASE = ("log-normal", 2, 1)  # (mix, dp, rows): placed against the best of all placements
EXHAUSTIVE = 20  # the most pieces a step may have to try all its placements
SEARCH_NODES = 5_000  # the most placements the searches of one step's floor visit (see floor)
SEARCH_GAP = 0.002  # no search where a placement is within this of the floor so far
RULE_NODES = 2_000  # the most nodes RuleSearch expands for one step's floor (see floor)
MORE_ROWS = ("long tail", 8, 8)  # (mix, dp, rows): one case again with more rows per replica and step
WORLD_ROWS = 2  # rows per replica and step in the dp = 2 x cp = 2 world
WIDE = 6 * 4096  # c for a 4096-wide model (see text/balance.py)
TITLE = "Balanced packing: cost per replica and per cp rank, off vs on"


def mixes() -> dict[str, tuple[str, int, object]]:
    """name -> (description, seq_len, draw(rng) -> one document's length)."""
    return {
        "tiny": ("uniform 1-30 tokens", 8192, lambda rng: int(rng.integers(1, 31))),
        "all short": ("uniform 64-1024 tokens", 8192, lambda rng: int(rng.integers(64, 1025))),
        "log-normal": (
            "log-normal, median 665 tokens, sigma 1.5, 16 to 8192",
            8192,
            lambda rng: int(np.clip(rng.lognormal(6.5, 1.5), 16, 8192)),
        ),
        "one long + many short": (
            "one of 4096 tokens in 16, else uniform 64-1024",
            8192,
            lambda rng: 4096 if rng.random() < 1 / 16 else int(rng.integers(64, 1025)),
        ),
        "single document": ("every document fills a row", 8192, lambda rng: 8193),
        "long tail": (
            "log-normal, median 1000 tokens, sigma 1.2, at most 32768 (rows of 32k)",
            32768,
            lambda rng: int(np.clip(rng.lognormal(np.log(1000), 1.2), 1, 32768)),
        ),
    }


def packed_steps(draw, seq_len: int, dp: int, steps: int, seed: int, rows_per_step: int) -> list[list[list[list[int]]]]:
    """``steps`` steps of every leader's rows (piece lengths) as its own packer cuts them."""
    out: list[list[list[list[int]]]] = [[] for _ in range(steps)]
    for leader in range(dp):
        rng = np.random.default_rng([seed, leader])
        packer = Packer(seq_len)
        for k in range(steps):
            rows = []
            while len(rows) < rows_per_step:
                row = packer.next_row()
                if row is None:
                    packer.add(None, np.zeros(draw(rng), np.int64))
                    continue
                rows.append(row.pieces)
            out[k].append(rows)
    return out


def ratio(costs: list[float]) -> float:
    return max(costs) / statistics.fmean(costs)


def floor_longest(rows: list[list[list[int]]], capacity: int) -> float:
    """The floor of issue 29: the replica of the longest piece ``P`` fills all its rows of
    ``capacity`` tokens, at best, with the shortest other pieces (:class:`FirstCut`).
    ``rows[j][r]``: the piece lengths of leader ``j``'s row ``r``, every row full."""
    longest = sorted((n for leader in rows for row in leader for n in row), reverse=True)
    first_cut = FirstCut(longest, len(rows) * len(rows[0]), capacity)
    mean = sum(n * n for n in longest) / len(rows)
    room = len(rows[0]) * capacity - longest[0]
    return max(1.0, (longest[0] ** 2 + float(first_cut.least(1, room, len(rows[0])))) / mean)


def cuttable(longest: list[int], rows: int, capacity: int) -> list[int]:
    """The pieces (indices into ``longest``, descending) that can be the first one cut by a
    placement onto ``rows`` rows (every row of the step) of ``capacity`` tokens that cuts a piece
    only where, counting the pieces before it (longest first), no row has room for it --
    ``place`` keeps to that (:func:`within_floor` checks it). For piece ``i`` to be cut first,
    every row must hold more than ``capacity - L_i`` tokens of the ``i`` whole pieces before it: so
    ``i >= rows``, those ``i`` pieces can fill every row that far (those at least that long one row
    each, the others their tokens' worth), and the room they leave, the tokens of piece ``i`` and
    all after it, is at most ``rows`` times ``L_i - 1``. The pieces where all three hold.

    >>> cuttable([5, 4, 3, 2, 2], 2, 8)  # the last: the 14 tokens before it can fill both rows past 6
    [4]
    """
    before = [0, *itertools.accumulate(longest)]  # tokens of the i longest
    descending = [-m for m in longest]
    out = []
    for i, n in enumerate(longest):
        least = capacity - n + 1  # what every row must hold of the pieces before piece i
        alone = min(i, bisect.bisect_right(descending, -least))  # those at least that long
        filled = alone + (before[i] - before[alone]) // least
        if i >= rows and before[-1] - before[i] <= rows * (n - 1) and filled >= rows:
            out.append(i)
    return out


class FirstCut:
    """``least(k, tokens, rows)``: a floor under the ``sum(L**2)`` that ``tokens`` tokens of
    ``rows`` rows (of one replica or several) cost when drawn from the pieces ranked ``k`` and on
    (``longest``: the step's pieces, descending, onto ``all_rows`` rows of ``capacity``), in any
    placement under :func:`cuttable`'s rule that keeps the ``k`` longest whole. Let piece ``i`` be
    the first it cuts (one of :func:`cuttable` from ``k`` on; ``len(longest)``: none). Every row
    then holds more than ``capacity - L_i`` tokens of the whole pieces ranked before ``i``, so at
    least ``tokens - rows * (L_i - 1)`` of the tokens are whole pieces ranked ``k .. i - 1``,
    costing at least those of the shortest of them along the chord (each token of a piece of
    length ``L`` at ``L``; ``sum(L**2)`` exactly where the tokens end a piece); the others count
    as free. The least over ``i``; ``inf`` where no ``i`` leaves enough pieces. ``kept_whole``: how
    many of the longest pieces every such placement keeps whole (those before the first cuttable).

    >>> first_cut = FirstCut([5, 4, 3, 2, 2], all_rows=2, capacity=8)
    >>> first_cut.kept_whole
    4
    >>> first_cut.least(1, [3, 0], [1, 1])  # 3 tokens: cut at the last, 2 whole (a 2); no cut, a 2 + 1 of a 2
    array([4., 0.])
    """

    def __init__(self, longest: list[int], all_rows: int, capacity: int) -> None:
        self.n = len(longest)
        self.lengths = np.array([*longest, 0], np.float64)
        self.tokens = np.concatenate([[0.0], np.cumsum(longest, dtype=np.float64)])  # of the i longest
        self.squares = np.concatenate([[0.0], np.cumsum(np.square(np.array(longest, np.float64)))])
        self.first = np.array([*cuttable(longest, all_rows, capacity), self.n], np.int64)
        self.kept_whole = int(self.first[0])

    def least(self, k: int, tokens: np.ndarray | float, rows: np.ndarray | float) -> np.ndarray:
        """The floor for each of ``tokens`` on as many ``rows`` (arrays of one shape, or numbers)."""
        tokens, rows = np.asarray(tokens, np.float64)[..., None], np.asarray(rows, np.float64)[..., None]
        first = self.first[self.first >= k]
        free = np.where(first < self.n, self.lengths[first] - 1, 0.0)  # per row, from the first cut on
        whole = np.maximum(0.0, tokens - rows * free)
        top = self.tokens[first]
        # the shortest whole pieces ranked before the cut: x + 1 .. first - 1 wholly, then part of x
        x = np.searchsorted(self.tokens, top - whole, side="right") - 1
        after = np.minimum(x + 1, self.n)
        cost = self.squares[first] - self.squares[after] + (whole - (top - self.tokens[after])) * self.lengths[x]
        cost = np.where(whole == 0, 0.0, np.where(x >= k, cost, np.inf))
        return cost.min(axis=-1)


def floor_counted(rows: list[list[list[int]]], capacity: int) -> float:
    """A floor from counting alone (:func:`floor` adds searches), over the ``k`` longest pieces
    (``k`` up to ``2 * dp`` and at most :attr:`FirstCut.kept_whole`), each replica filling the rest of
    its rows at best with the shortest other pieces (:class:`FirstCut`): some replica holds
    ``m + 1`` of the ``m * dp + 1`` longest, at best the shortest of them (``m`` = 0: the longest
    alone, the floor of issue 29); and the ``q`` replicas that hold the ``k`` longest cost, on
    average, at least their squares plus ``q`` replicas' worth of tokens of the shortest others
    (the least over the ``q`` their tokens allow). ``rows[j][r]``: the piece lengths of leader
    ``j``'s row ``r``, every row full."""
    dp, per, tokens = len(rows), len(rows[0]), len(rows[0]) * capacity
    longest = sorted((n for leader in rows for row in leader for n in row), reverse=True)
    first_cut = FirstCut(longest, dp * per, capacity)
    whole = first_cut.kept_whole
    mean = sum(x * x for x in longest) / dp
    best, top_tokens, top_squares = mean, 0, 0
    for k in range(1, min(2 * dp, whole) + 1):
        top_tokens, top_squares = top_tokens + longest[k - 1], top_squares + longest[k - 1] ** 2
        if (k - 1) % dp == 0:  # m + 1 of the m * dp + 1 longest on one replica
            held = longest[k - 1 - (k - 1) // dp : k]
            if sum(held) <= tokens:
                best = max(best, sum(x * x for x in held) + float(first_cut.least(k, tokens - sum(held), per)))
        q = np.arange(max(1, -(-top_tokens // tokens)), min(k, dp) + 1)
        if len(q):
            best = max(best, float(((top_squares + first_cut.least(k, q * tokens - top_tokens, q * per)) / q).min()))
    return max(1.0, best / mean)


def averaged(first_cut: FirstCut, k: int, squares: list[int], used: list[int], tokens: int, rows: int) -> float:
    """Over the ``q`` replicas of the most ``squares`` (each ``rows`` rows, ``tokens`` tokens, of
    which ``used`` are placed), for every ``q``: their squares plus the floor of their rooms' tokens
    in the pieces ranked ``k`` and on (:class:`FirstCut`), on average. The most of those."""
    order = np.argsort(-np.array(squares, np.float64), kind="stable")
    total = np.cumsum(np.array(squares, np.float64)[order])
    room = np.cumsum(tokens - np.array(used, np.float64)[order])
    q = np.arange(1, len(squares) + 1)
    return float(((total + first_cut.least(k, room, q * rows)) / q).max())


class Search:
    """The least, over every way to put the ``k`` longest pieces whole onto ``replicas`` replicas of
    ``rows`` rows of ``capacity`` tokens, of a bound on the costliest replica: each replica at least
    its own squares plus its remaining room in the shortest other pieces (:class:`FirstCut`), and
    any ``q`` replicas of the most squares at least, on average, their squares plus their rooms in
    the shortest others (as in :func:`floor_counted`). Branch and bound, longest first, onto each
    replica that differs from those before (equal replicas are one choice); a partial placement's
    bound counts the unplaced pieces among the fillers, so it never exceeds a completion's.
    ``None`` when it would visit more than ``nodes`` placements. ``k``: at most :attr:`FirstCut.kept_whole`."""

    def __init__(
        self, longest: list[int], replicas: int, rows: int, capacity: int, k: int, nodes: int, first_cut: FirstCut
    ) -> None:
        self.longest, self.replicas, self.rows, self.k, self.nodes = longest, replicas, rows, k, nodes
        self.tokens = rows * capacity
        self.first_cut = first_cut
        self.squares = [0] * replicas
        self.used = [0] * replicas
        self.best = float("inf")

    def __call__(self) -> float | None:
        try:
            self._place(0)
        except StopIteration:
            return None
        return self.best

    def _bound(self, j: int) -> float:
        """Each replica's bound, its room in the pieces ranked ``j`` and on."""
        rooms = self.tokens - np.array(self.used, np.float64)
        return float((np.array(self.squares, np.float64) + self.first_cut.least(j, rooms, self.rows)).max())

    def _leaf(self) -> float:
        return max(
            self._bound(self.k), averaged(self.first_cut, self.k, self.squares, self.used, self.tokens, self.rows)
        )

    def _place(self, j: int) -> None:
        self.nodes -= 1
        if self.nodes < 0:
            raise StopIteration
        if j == self.k:
            self.best = min(self.best, self._leaf())
            return
        n, seen, choices = self.longest[j], set(), []
        for d in range(self.replicas):
            if self.used[d] + n <= self.tokens and (self.squares[d], self.used[d]) not in seen:
                seen.add((self.squares[d], self.used[d]))
                room = self.tokens - self.used[d] - n
                choices.append((self.squares[d] + n * n + float(self.first_cut.least(j + 1, room, self.rows)), d))
        for _, d in sorted(choices):
            self.squares[d], self.used[d] = self.squares[d] + n * n, self.used[d] + n
            if self._bound(j + 1) < self.best:
                self._place(j + 1)
            self.squares[d], self.used[d] = self.squares[d] - n * n, self.used[d] - n


class RuleSearch:
    """The least bound on the costliest replica over placements of the pieces one by one, longest
    first, as the rule has them: a piece goes whole into any row that holds it (each choice that
    differs from those before: equal (replica, rows) states are one), and is cut only where no row
    does, which ends the branch (the rest counted free beyond :class:`FirstCut`'s bound). Best
    first: the node of the least bound next (its bound as in :class:`Search`, the pieces from
    the next on unplaced); the floor is the least bound left open, so it holds at any budget:
    ``nodes`` expansions, or until that bound reaches ``stop`` (a placement's max cost). Unlike
    :class:`Search`, this counts that a piece some row holds cannot be kept back for another."""

    def __init__(self, longest: list[int], replicas: int, rows: int, capacity: int, first_cut: FirstCut) -> None:
        self.longest, self.replicas, self.rows, self.capacity = longest, replicas, rows, capacity
        self.first_cut = first_cut

    def bound(self, squares: tuple[int, ...], rooms: tuple[tuple[int, ...], ...], j: int) -> float:
        used = [self.rows * self.capacity - sum(r) for r in rooms]
        room = np.array([sum(r) for r in rooms], np.float64)
        own = float((np.array(squares, np.float64) + self.first_cut.least(j, room, self.rows)).max())
        return max(own, averaged(self.first_cut, j, list(squares), used, self.rows * self.capacity, self.rows))

    def __call__(self, nodes: int, stop: float = math.inf) -> float:
        start = ((0,) * self.replicas, ((self.capacity,) * self.rows,) * self.replicas)
        order = itertools.count()  # ties by depth, then first pushed: deterministic
        heap = [(self.bound(*start, 0), 0, next(order), start)]
        seen = set()
        while True:
            bound, depth, _, (squares, rooms) = heapq.heappop(heap)
            j = -depth
            n = self.longest[j] if j < len(self.longest) else 0
            if bound >= stop or j == len(self.longest) or nodes == 0 or all(r < n for rr in rooms for r in rr):
                return bound  # the least bound open; a leaf (all placed, or a cut) is its own bound
            nodes -= 1
            for d, own in enumerate(rooms):
                for i, r in enumerate(own):
                    if r >= n:
                        child_rooms = (*rooms[:d], tuple(sorted((*own[:i], r - n, *own[i + 1 :]))), *rooms[d + 1 :])
                        child_squares = (*squares[:d], squares[d] + n * n, *squares[d + 1 :])
                        state = (j + 1, tuple(sorted(zip(child_squares, child_rooms))))
                        if state not in seen:
                            seen.add(state)
                            child = max(bound, self.bound(child_squares, child_rooms, j + 1))
                            heapq.heappush(heap, (child, -(j + 1), next(order), (child_squares, child_rooms)))


def floor(rows: list[list[list[int]]], capacity: int, reached: float | None = None) -> float:
    """The least max / mean attention cost over the replicas of any placement of one step's pieces
    under :func:`cuttable`'s rule, from below: the larger of :func:`floor_counted`,
    :class:`Search` over the ``k`` longest (``k`` from ``2 * dp`` up in steps of ``dp`` while the
    searches end within ``SEARCH_NODES`` placements in all) and, with one row per replica,
    :class:`RuleSearch` (``RULE_NODES`` expansions). Deterministic budgets: the same floor on every
    run. The searches only raise the floor towards what a placement reached: they are skipped where
    ``reached`` (a placement's max / mean, if given) is within ``SEARCH_GAP`` of the floor so far.
    The mean is the step's without cuts, the most any placement's can be.
    ``rows[j][r]``: the piece lengths of leader ``j``'s row ``r``, every row full."""
    dp, per = len(rows), len(rows[0])
    longest = sorted((n for leader in rows for row in leader for n in row), reverse=True)
    mean = sum(x * x for x in longest) / dp
    best = floor_counted(rows, capacity)
    if reached is not None and reached - best <= SEARCH_GAP:
        return best
    first_cut, budget = FirstCut(longest, dp * per, capacity), SEARCH_NODES
    whole = first_cut.kept_whole
    for k in range(min(2 * dp, whole), whole + 1, dp):
        search = Search(longest, dp, per, capacity, k, budget, first_cut)
        found = search()
        if found is None:
            break
        best, budget = max(best, found / mean), search.nodes  # what this search left of the budget
    # with more rows per replica its open bounds stayed level within any budget tried (up to 2,000)
    if per == 1 and (reached is None or reached - best > SEARCH_GAP):
        stop = math.inf if reached is None else reached * mean
        best = max(best, RuleSearch(longest, dp, per, capacity, first_cut)(RULE_NODES, stop) / mean)
    return best


def optimum_two(rows: list[list[list[int]]], capacity: int) -> float | None:
    """The least max / mean attention cost of any placement of one step's pieces on 2 replicas of
    one row each, by trying them all: every piece whole but at most one, cut across the two rows,
    and that one only if, longest first, neither row had room for it at its turn (what ``place``
    allows itself). ``None`` past ``EXHAUSTIVE`` pieces. ``rows``: 2 leaders' one full row each."""
    longest = sorted((n for leader in rows for row in leader for n in row), reverse=True)
    if len(longest) > EXHAUSTIVE:
        return None
    squares, best = sum(n * n for n in longest), None
    for cut in range(-1, len(longest)):
        others = [i for i in range(len(longest)) if i != cut]
        tokens, sq, before = (
            subset_sums([longest[i] for i in others]),
            subset_sums([longest[i] ** 2 for i in others]),
            subset_sums([longest[i] if i < cut else 0 for i in others]),  # placed before the cut one
        )
        if cut < 0:
            valid, first, second = tokens == capacity, sq, squares - sq
        else:
            n, k = longest[cut], capacity - tokens  # k of its tokens in replica 0's row
            valid = (k > 0) & (k < n) & (capacity - before < n) & (capacity - (before[-1] - before) < n)
            first, second = sq + k * k, squares - n * n - sq + (n - k) ** 2
        if valid.any():
            ratio = (np.maximum(first, second) / ((first + second) / 2))[valid].min()
            best = ratio if best is None else min(best, ratio)
    return None if best is None else float(best)


def subset_sums(values: list[int]) -> np.ndarray:
    """The sum of every subset of ``values``, indexed by its bit mask."""
    sums = np.zeros(1 << len(values), np.int64)
    for b, v in enumerate(values):
        sums[1 << b : 2 << b] = sums[: 1 << b] + v
    return sums


def within_floor(rows: list[list[list[int]]], out: list[list[list[Piece]]], capacity: int) -> bool:
    """Whether a placement ``out`` of the step's ``rows`` is one :func:`floor` covers: every piece it
    holds cut came, longest first, when every row already held more than ``capacity`` minus its
    length of the pieces before it (``place`` cuts a piece only where no row holds it whole)."""
    pieces = sorted(
        (
            Piece(j, r, start, n)
            for j, leader in enumerate(rows)
            for r, row in enumerate(leader)
            for start, n in zip(itertools.accumulate([0, *row]), row)
            if n
        ),
        key=lambda p: (-p.length, p),
    )
    rank = {(p.leader, p.row, p.start): i for i, p in enumerate(pieces)}
    starts = {key: sorted(s for (j, r, s) in rank if (j, r) == key) for key in {(p.leader, p.row) for p in pieces}}

    def rank_of(part: Piece) -> int:  # the rank of the piece a part lies in
        own = starts[part.leader, part.row]
        return rank[part.leader, part.row, own[bisect.bisect_right(own, part.start) - 1]]

    placed = {p for replica in out for row in replica for p in row}
    held = [sorted((rank_of(p), p.length) for p in row) for replica in out for row in replica]
    for i, piece in enumerate(pieces):
        if piece not in placed and any(capacity - sum(n for q, n in row if q < i) >= piece.length for row in held):
            return False
    return True


def exhaustive(steps: int) -> dict:
    """Placed, floor and :func:`optimum_two` over the steps of ``EXHAUSTIVE_CASE`` it can try."""
    name, dp, rows_per_step = EXHAUSTIVE_CASE
    _, seq_len, draw = mixes()[name]
    placed, floors, counted, optima = [], [], [], []
    for rows in packed_steps(draw, seq_len, dp, steps, dp, rows_per_step):
        best = optimum_two(rows, seq_len + 1)
        if best is not None:
            out = place(rows, rows_per_step, seq_len + 1, 0.0)
            placed.append(ratio(replica_costs([[[p.length for p in r] for r in rep] for rep in out], 0.0)))
            floors.append(floor(rows, seq_len + 1))  # searched on every step: no placement to stop at
            counted.append(floor_counted(rows, seq_len + 1))
            optima.append(best)
    return {
        "mix": name,
        "dp": dp,
        "rows": rows_per_step,
        "steps": len(placed),
        "of": steps,
        "placed": statistics.fmean(placed),
        "floor": statistics.fmean(floors),
        "floor_counted": statistics.fmean(counted),
        "optimum": statistics.fmean(optima),
        "steps_floor_above_optimum": sum(f > o for f, o in zip(floors, optima)),  # the floor would be wrong
    }


def arithmetic(steps: int) -> list[dict]:
    cases = [(name, dp, rows) for name in mixes() for rows in ROWS for dp in DPS] + [MORE_ROWS]
    return [case(name, dp, rows, steps) for name, dp, rows in cases]


def case(name: str, dp: int, rows_per_step: int, steps: int) -> dict:
    _, seq_len, draw = mixes()[name]
    record = {"mix": name, "dp": dp, "rows": rows_per_step, "steps": steps}
    per_step = packed_steps(draw, seq_len, dp, steps, dp, rows_per_step)
    record["attention_floor_longest"] = statistics.fmean(floor_longest(rows, seq_len + 1) for rows in per_step)
    record["attention_floor_counted"] = statistics.fmean(floor_counted(rows, seq_len + 1) for rows in per_step)
    for label, c in (("attention", 0.0), ("wide", float(WIDE))):
        packed, placed, floors, below, outside = [], [], [], 0, 0
        for rows in per_step:
            out = place(rows, rows_per_step, seq_len + 1, c)
            packed.append(ratio(replica_costs(rows, c)))
            placed.append(ratio(replica_costs([[[p.length for p in r] for r in rep] for rep in out], c)))
            if c == 0.0:
                floors.append(floor(rows, seq_len + 1, placed[-1]))
                below += placed[-1] < floors[-1]  # the floor would be wrong
                outside += not within_floor(rows, out, seq_len + 1)  # the floor would not apply to place
        record[f"{label}_packed"] = statistics.fmean(packed)
        record[f"{label}_placed"] = statistics.fmean(placed)
        record[f"{label}_placed_worst"] = max(placed)
        if c == 0.0:
            record["attention_floor"] = statistics.fmean(floors)
            record["steps_below_floor"], record["steps_outside_floor"] = below, outside
    by_row = []  # Balance(rows=1), as TorchTitan's --dataloader.balance places them
    for rows in per_step:
        out = place_in_blocks(rows, rows_per_step, seq_len + 1, 0.0, 1)
        by_row.append(ratio(replica_costs([[[p.length for p in r] for r in rep] for rep in out], 0.0)))
    record["attention_by_row"] = statistics.fmean(by_row)
    slots = steps * dp * rows_per_step * (seq_len + 1)
    real = sum(n for rows in per_step for leader in rows for row in leader for n in row)
    record["padding"] = slots / real - 1
    return record


def timed(steps: int) -> list[dict]:
    """``place``'s seconds per step at each dp of ``TIMED_DPS``: ``steps`` steps of the ``TIMED``
    mix's rows, every leader's pieces placed at once, as each leader does per step."""
    name, rows_per_step = TIMED
    _, seq_len, draw = mixes()[name]
    records = []
    for dp in TIMED_DPS:
        per_step = packed_steps(draw, seq_len, dp, steps, dp, rows_per_step)
        start = time.process_time()
        for rows in per_step:
            place(rows, rows_per_step, seq_len + 1, 0.0)
        seconds = (time.process_time() - start) / steps
        pieces = statistics.fmean(sum(len(row) for leader in rows for row in leader) for rows in per_step)
        records.append({"dp": dp, "rows": rows_per_step, "steps": steps, "pieces": pieces, "seconds": seconds})
    return records


# --- a real world of dp = 2 x cp = 2 --------------------------------------------------------------

WORLD_MIXES = {"tiny": 2048, "long tail": 64}  # mix -> documents per sample-batch (a batch's worth or more)


def world_rank_main(args: tuple[str, int, int, str, str]) -> int:
    """On every rank of a dp = 2 x cp = 2 world: one epoch, off (``PerDocument``, rows as packed)
    or on (``Balance()``, ``BalancedDocuments``); the leaders keep their ``stats()``."""
    from torch.distributed.device_mesh import init_device_mesh

    from collective_loader import BalancedDocuments, CollectiveLoader, PerDocument
    from collective_loader.streaming import StreamingSource
    from collective_loader.text import Balance, Packing, TokenColumn

    path, seq_len, documents, variant, out = args
    on = variant == "on"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    source = StreamingSource(
        mesh,
        local=path,
        batch_size=WORLD_ROWS,
        shuffle=True,
        shuffle_seed=5,
        layout=TokenColumn(dtype="uint16"),
        packing=Packing(seq_len, "drop", ("cu_seqlens",), Balance() if on else None),
        documents_per_batch=documents,
    )
    split = (BalancedDocuments if on else PerDocument)(cu_seqlens="cu_seqlens", pad_values={"labels": -100})
    keys = {"input_ids": 1, "labels": 1}
    loader = CollectiveLoader(
        source, mesh, inputs=("input_ids",), labels=("labels",), every_stage=("cu_seqlens",), seq_dims=keys, split=split
    )
    steps = sum(1 for _ in loader)
    loader.close()
    keep(out, {"variant": variant, "leader": loader.place.is_leader, "steps": steps, "stats": loader.stats()})
    return 0


def world(tokens: int) -> list[dict]:
    """Per mix, off and on: the leaders' figures (mean over the two leaders)."""
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for mix, documents in WORLD_MIXES.items():
            path, out = os.path.join(tmp, mix), os.path.join(tmp, f"{mix}.records")
            mix_dataset(path, mix, tokens)
            seq_len = mixes()[mix][1]
            for variant in ("off", "on"):
                code = launch.run(world_rank_main, (path, seq_len, documents, variant, out), 4, timeout=900)
                if code:
                    raise SystemExit(f"{mix} {variant}: the dp = 2 x cp = 2 world failed with exit code {code}")
            for ranks in runs_of(out):
                leaders = [r["stats"] for r in ranks if r["leader"]]
                record = {"mix": mix, "variant": ranks[0]["variant"], "steps": ranks[0]["steps"]}
                for key in ("cost_max_over_mean_packed", "cost_max_over_mean", "cp_cost_max_over_mean", "cp_padding"):
                    if key in leaders[0]:
                        record[key] = statistics.fmean(s[key] for s in leaders)
                records.append(record)
    return records


# --- end to end -----------------------------------------------------------------------------------

SECONDS_PER_COST = 1e-10  # the "model": a 32k-token document alone sleeps 107 ms


def mix_dataset(path: str, mix: str, tokens: int) -> None:
    """An MDS dataset of at least ``tokens`` tokens in documents of ``mix`` (one per sample)."""
    from collective_loader.testing.data import write_token_documents

    rng = np.random.default_rng(11)
    draw = mixes()[mix][2]
    docs, total = [], 0
    while total < tokens:
        n = draw(rng)  # type: ignore[operator]
        docs.append(rng.integers(1, 60000, size=n).astype(np.int64))
        total += n
    write_token_documents(path, docs, "bytes", "uint16", shard_bytes=1 << 22)


def rank_main(args: tuple[str, str, str]) -> int:
    """On every rank of a dp = 2 world: one epoch, balancing off or on; keeps seconds per step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from collective_loader import CollectiveLoader
    from collective_loader.streaming import StreamingSource
    from collective_loader.text import Balance, Packing, TokenColumn

    path, variant, out = args
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    packing = Packing(32768, "drop", ("cu_seqlens",), Balance() if variant == "on" else None)
    source = StreamingSource(
        mesh,
        local=path,
        batch_size=2,
        shuffle=True,
        shuffle_seed=5,
        layout=TokenColumn(dtype="uint16"),
        packing=packing,
        documents_per_batch=64,
    )
    loader = CollectiveLoader(source, mesh, inputs=("input_ids",), labels=("labels",), every_stage=("cu_seqlens",))
    grad = torch.zeros(1 << 18)
    seconds, costs = [], []
    start = time.perf_counter()
    for batch in loader:
        lengths = batch["cu_seqlens"].diff(dim=1).double()
        cost = float((lengths**2).sum())
        time.sleep(cost * SECONDS_PER_COST)  # forward and backward, in proportion to attention
        dist.all_reduce(grad)  # every replica waits for the slowest
        costs.append(cost)
        now = time.perf_counter()
        seconds.append(now - start)
        start = now
    loader.close()
    keep(out, {"variant": variant, "seconds": seconds[1:], "costs": costs})
    return 0


def end_to_end(rounds: int, tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path, out = os.path.join(tmp, "long_tail"), os.path.join(tmp, "records")
        mix_dataset(path, "long tail", tokens)
        code = worlds_in_rounds(
            ("off", "on"), rounds, lambda v, r: launch.run(rank_main, (path, v, out), 2, timeout=900)
        )
        if code:
            raise SystemExit(code)
        runs = runs_of(out)
    result: dict = {"off": {"steps_per_second": []}, "on": {"steps_per_second": []}}
    for ranks in runs:
        mine, variant = ranks[0], ranks[0]["variant"]
        result[variant]["steps_per_second"].append(len(mine["seconds"]) / sum(mine["seconds"]))
        result[variant]["steps"] = len(mine["seconds"]) + 1
        # the model's time alone: each step waits for the costlier replica
        slowest = [max(costs) for costs in zip(*(r["costs"] for r in ranks))][1:]
        result[variant]["model_seconds"] = sum(slowest) * SECONDS_PER_COST
        result[variant]["seconds"] = sum(mine["seconds"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20 steps per case, smaller worlds, one round end to end")
    args = parser.parse_args()
    run = Run("balance.py")
    steps = 20 if args.quick else 100
    records = arithmetic(steps)
    times = timed(2 if args.quick else 5)
    tried = exhaustive(steps)
    in_world = world(300_000 if args.quick else 1_500_000)
    e2e = end_to_end(1 if args.quick else 3, 1_500_000 if args.quick else 6_000_000)
    results = {
        "meta": run.meta(steps=steps, rows=ROWS),
        "arithmetic": records,
        "place_time": times,
        "exhaustive": tried,
        "world_dp2_cp2": in_world,
        "end_to_end": e2e,
    }
    run.write("balance", TITLE, results, report(results))


def report(results: dict) -> list[str]:
    """The markdown body of ``results`` (as ``main`` writes them to bench/results/balance.json)."""
    records, times, tried = results["arithmetic"], results["place_time"], results["exhaustive"]
    in_world, e2e, steps = results["world_dp2_cp2"], results["end_to_end"], results["meta"]["steps"]
    rows = []
    for r in records:
        met = "met" if r["attention_placed"] <= TARGET else "**not met**"
        near = "met" if r["attention_placed"] - r["attention_floor"] <= NEAR else "**not met**"
        rows.append(
            (
                r["mix"],
                r["dp"],
                r["rows"],
                f"{r['attention_packed']:.3f}",
                f"{r['attention_placed']:.3f}",
                f"{r['attention_placed_worst']:.3f}",
                f"{r['attention_floor']:.3f}",
                f"{r['attention_placed'] - r['attention_floor']:+.4f}",
                f"{r['attention_floor_counted']:.3f}",
                f"{r['attention_floor_longest']:.3f}",
                f"{r['attention_by_row']:.3f}",
                f"{r['wide_packed']:.3f}",
                f"{r['wide_placed']:.3f}",
                f"{r['padding']:.2%}",
                met,
                near,
            )
        )
    world_rows = []
    for mix in WORLD_MIXES:
        off, on = (next(r for r in in_world if r["mix"] == mix and r["variant"] == v) for v in ("off", "on"))
        world_rows.append(
            (
                mix,
                on["steps"],
                f"{on['cost_max_over_mean_packed']:.3f}",
                f"{on['cost_max_over_mean']:.3f}",
                f"{off['cp_cost_max_over_mean']:.3f}",
                f"{off['cp_padding']:.2%}",
                f"{on['cp_cost_max_over_mean']:.3f}",
                f"{on['cp_padding']:.2%}",
            )
        )
    off, on = (statistics.median(e2e[k]["steps_per_second"]) for k in ("off", "on"))
    body = [
        f"Arithmetic: each of dp leaders packs its own documents of the mix (*rows* per replica and step: "
        f"{', '.join(map(str, ROWS))}, and {MORE_ROWS[2]} once more for {MORE_ROWS[0]} at dp {MORE_ROWS[1]}; {steps} "
        "steps, seed = dp); the step's pieces are placed by `text.balance.place`. Balance = max / mean "
        "replica cost per step, mean over the steps (worst step beside it); cost = sum(L^2) + c sum(L) per row; "
        f"c = 0 (attention) and c = {WIDE} (6 x 4096); *floor*: under the least max / mean of any placement that, "
        "as `place` does, cuts a piece only where, counting the pieces before it (longest first), no row has room "
        "for it. If piece i is the first it cuts (`cuttable`), every row holds more than capacity - L_i tokens of "
        "whole pieces at least L_i long: each replica's rows hold at most rows x (L_i - 1) tokens counted free, the "
        "others whole pieces ranked before i at their tokens' cost along the shortest first; the least over i "
        "(`FirstCut`). The floor is the largest of the *counted* one (some replica holds m + 1 of the m dp + 1 "
        "longest; the replicas that hold the k longest, k <= 2 dp, cost on average at least their squares plus the "
        "rest of their rows), a branch-and-bound search over every placement of the k longest (k from 2 dp up by "
        f"dp, at most {SEARCH_NODES} placements a step in all) and, with one row per replica, a best-first search "
        "over placements made one piece at a time as the rule forces them (a piece some row holds goes whole into "
        f"one of those rows; {RULE_NODES} expansions a step; the least bound left open); no search where the floor "
        f"so far is within {SEARCH_GAP} of the balanced step; the mean: the step's without cuts (no placement's is "
        "more); `floor` in bench/balance.py; mean over the "
        "steps; *above floor*: balanced - floor; *longest alone*: issue 29's floor (the replica of the longest "
        "piece filled with the shortest); *row by row*: `Balance(rows=1)`, each row slot placed on its own, as "
        "TorchTitan's `--dataloader.balance` does. Padding = slots / real tokens - 1, the same either way. Checks "
        "over every case, each must be 0: steps balanced below their floor "
        f"{sum(r['steps_below_floor'] for r in records)}; steps where `place` cut a piece a row had room for at its turn "
        f"{sum(r['steps_outside_floor'] for r in records)}. "
        f"Targets: balanced <= {TARGET} with c = 0 (issue 29); balanced within {NEAR} of the floor (issue 49; 0.01 in "
        "issue 40).",
        "",
        *table(
            "mix | dp | rows | packed (c=0) | balanced (c=0) | worst step | floor (c=0) | above floor | counted "
            "| longest alone "
            f"| row by row (c=0) | packed (c=6d) | balanced (c=6d) | padding | <= {TARGET} | within {NEAR}",
            rows,
        ),
        "Mixes: " + "; ".join(f"*{name}*: {desc}" for name, (desc, _, _) in mixes().items()) + ".",
        "",
        f"How loose the floor is where every placement can be tried ({tried['mix']}, dp {tried['dp']}, "
        f"{tried['rows']} row per replica, the {tried['steps']} of {tried['of']} steps of at most {EXHAUSTIVE} pieces; "
        "`optimum_two` in bench/balance.py: every piece whole but at most one, cut across the two rows, and that one "
        "only if, longest first, neither row had room for it at its turn, as `place` allows itself): balanced "
        f"{tried['placed']:.4f}, the best of all placements {tried['optimum']:.4f}, floor {tried['floor']:.4f} "
        f"(counted alone {tried['floor_counted']:.4f}); steps whose floor is above their best placement: "
        f"{tried['steps_floor_above_optimum']} (must be 0).",
        "",
        f"`place`'s time per step against dp, as one leader computes it for every leader's pieces (CPU seconds "
        f"of this process, mean of {times[0]['steps']} steps): the {TIMED[0]} mix, {TIMED[1]} rows of "
        f"{mixes()[TIMED[0]][1]} tokens per replica.",
        "",
        *table(
            "dp | pieces per step | ms per step",
            [(t["dp"], f"{t['pieces']:.0f}", f"{t['seconds'] * 1e3:.1f}") for t in times],
        ),
        f"A real world of dp = 2 x cp = 2 (4 gloo ranks), one epoch of an MDS dataset of each mix ({WORLD_ROWS} rows "
        "per replica and step, rows of the mix's length, the epoch's partial end dropped); off: rows as each leader "
        "packed them, `PerDocument` over cp; on: `Balance()`, `BalancedDocuments()`. Figures from the leaders' "
        "`stats()`, mean of the two: over the replicas, cost max/mean as packed (= off) and as placed (on); over "
        "the cp ranks, cost max/mean per micro-batch (one step's rows) and the padding the split adds.",
        "",
        *table(
            "mix | steps | replicas: off | replicas: on | cp ranks: off | cp padding: off | cp ranks: on "
            "| cp padding: on",
            world_rows,
        ),
        f"End to end (long tail, rows of 32768, 2 rows per replica, dp = 2, {e2e['off']['steps']} steps per epoch): "
        f"each step sleeps {SECONDS_PER_COST:g} s per unit of sum(L^2) of its batch, then all-reduces 1 MiB. "
        f"Steps per second per round, off: {', '.join(f'{x:.2f}' for x in e2e['off']['steps_per_second'])}; "
        f"on: {', '.join(f'{x:.2f}' for x in e2e['on']['steps_per_second'])}. Median {off:.2f} vs {on:.2f}: "
        f"balanced {on / off - 1:+.1%}. Of the last round's {e2e['off']['seconds']:.2f} s (off) and "
        f"{e2e['on']['seconds']:.2f} s (on), the model's sleep of the costlier replica was "
        f"{e2e['off']['model_seconds']:.2f} s and {e2e['on']['model_seconds']:.2f} s; the rest is loading, delivery and "
        "the all-reduce.",
    ]
    return body


if __name__ == "__main__":
    sys.exit(main())
