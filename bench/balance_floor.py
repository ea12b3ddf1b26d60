"""The floor ``bench/balance.py`` judges ``place`` against: from below, the least max / mean attention
cost over the replicas of any placement of one step's pieces that cuts a piece only where,
counting the longer pieces, no row has room for it, as ``place`` does (:func:`floor`, from
:func:`cuttable`, :class:`FirstCut`, :func:`floor_counted` and the searches :class:`Search` and
:class:`RuleSearch`); the checks that it holds (:func:`within_floor`: a placement keeps to that
rule; :func:`optimum_two`: the best of all placements where every one can be tried); and issue
29's looser floor of the longest piece alone (:func:`floor_longest`).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math

import numpy as np

from collective_loader.text.balance import Piece

EXHAUSTIVE = 20  # the most pieces a step may have to try all its placements
SEARCH_NODES = 5_000  # the most placements the searches of one step's floor visit (see floor)
SEARCH_GAP = 0.002  # no search where a placement is within this of the floor so far
RULE_NODES = 2_000  # the most nodes RuleSearch expands for one step's floor (see floor)


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
