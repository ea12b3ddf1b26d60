"""Where a packing leader is in its documents, and what it hands over so that a resume is exact.

A leader reads its documents in sample-batches (one DataLoader batch each). Batch ``t`` of every
leader belongs to the same *step* ``t`` of the dataset's global order (mosaicml-streaming deals
each step's samples out to the ranks, whatever their number), so a document occurrence is named
by ``(step, sample)``: its step and its sample index in the dataset. The packer's position is a
:class:`Cursor`: the first document with tokens in no row yet, and how many of its tokens are.

Leaders take different numbers of documents per row, so their cursors differ. A resume restarts
the dataset at the lowest cursor step over the leaders, ``D``, and each leader passes over what
was trained since: the *hand-over* is one table of **entries** ``(n, 4)`` int64, columns
:data:`COLUMNS`: for each document occurrence at a step ``>= D`` whose tokens were trained (or
passed over), the leader (dp rank) whose stream held it, its step, its sample index, and its
offset: :data:`FULL` when every token is in a row, else the number of tokens that are.
(:func:`hand_over` builds a leader's part from its :class:`Log`, :func:`combine` the whole table.)

On resume, a leader skips, in its own stream, the entries :class:`Skips` gives it: with the same
leaders' world, its own entries (and the shared ones, leader ``-1``), which restores its rows
exactly; with another DP degree, all of them, which no stream holds twice, so no document's
token is trained twice or lost. Entries left unmatched after a resume stay in the next hand-over
as shared ones, until every leader is past their step.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

FULL = -1  # an entry's offset when every token of the document is in rows
SHARED = -1  # an entry's leader when no leader's stream claimed it yet
COLUMNS = ("leader", "step", "sample", "offset")


def empty() -> np.ndarray:
    """An entries table with no rows, ``(0, 4)`` int64."""
    return np.zeros((0, len(COLUMNS)), dtype=np.int64)


@dataclass(frozen=True, order=True)
class Cursor:
    """The first document with tokens in no row yet: the ``index``-th of sample-batch ``step``,
    ``offset`` of its tokens in rows. ``index`` may be the batch's size: the whole batch is done."""

    step: int
    index: int
    offset: int


@dataclass(frozen=True)
class Skip:
    """What a resumed leader does with one document: start it at ``offset`` (:data:`FULL`: pass
    over it); ``entry`` is the hand-over row that said so."""

    offset: int
    entry: tuple[int, int, int, int]


class Skips:
    """The documents a resumed leader passes over (whole, or their first tokens), by ``(step, sample)``.

    >>> skips = Skips(np.array([[0, 3, 17, FULL], [1, 3, 9, 40]]), leader=0, all_leaders=False)
    >>> skips.take(3, 17).offset, skips.take(3, 17), skips.take(3, 9)
    (-1, None, None)
    >>> Skips(np.array([[0, 3, 17, FULL], [1, 3, 9, 40]]), leader=0, all_leaders=True).take(3, 9).offset
    40
    """

    def __init__(self, entries: np.ndarray, leader: int, all_leaders: bool) -> None:
        rows = [_entry(row) for row in np.asarray(entries, dtype=np.int64).reshape(-1, 4)]
        if not all_leaders:
            rows = [r for r in rows if r[0] in (leader, SHARED)]
        # an occurrence that repeats within a step: whole skips first, then the partial one
        by_doc: dict[tuple[int, int], list[tuple[int, int, int, int]]] = defaultdict(list)
        for row in sorted(rows, key=lambda r: (r[3] != FULL, r[3])):
            by_doc[(row[1], row[2])].append(row)
        self._by_doc = {k: deque(v) for k, v in by_doc.items()}

    def take(self, step: int, sample: int) -> Skip | None:
        """The skip for this occurrence of ``sample`` at ``step``, or ``None`` (train it all)."""
        queue = self._by_doc.get((step, sample))
        if not queue:
            return None
        entry = queue.popleft()
        return Skip(entry[3], entry)


class Log:
    """The documents a leader passed in one epoch: each sample-batch's sample indices, and the
    hand-over entries its :class:`Skips` matched. Appended by the thread that loads, read by the
    one that checkpoints (a lock keeps them apart)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: dict[int, np.ndarray] = {}
        self._matched: list[tuple[int, int, tuple[int, int, int, int]]] = []  # (step, index, entry)

    def add_batch(self, step: int, samples: np.ndarray) -> None:
        with self._lock:
            self._samples[step] = np.asarray(samples, dtype=np.int64)

    def matched(self, step: int, index: int, entry: tuple[int, int, int, int]) -> None:
        with self._lock:
            self._matched.append((step, index, entry))

    def prune(self, step: int) -> None:
        """Forget the batches before ``step`` (no later hand-over reaches below it)."""
        with self._lock:
            for t in [t for t in self._samples if t < step]:
                del self._samples[t]
            self._matched = [m for m in self._matched if m[0] >= step]

    def hand_over(self, leader: int, cursor: Cursor, first_step: int) -> tuple[np.ndarray, np.ndarray]:
        """``(passed, matched)``: the entries of the documents this leader passed at steps
        ``>= first_step`` before ``cursor`` (its partly trained one included), and the hand-over
        entries it matched there.

        >>> log = Log(); log.add_batch(4, np.array([11, 12])); log.add_batch(5, np.array([13, 14]))
        >>> log.hand_over(leader=1, cursor=Cursor(5, 1, 30), first_step=4)[0].tolist()
        [[1, 4, 11, -1], [1, 4, 12, -1], [1, 5, 13, -1], [1, 5, 14, 30]]
        """
        with self._lock:
            rows: list[tuple[int, int, int, int]] = []
            for step in sorted(t for t in self._samples if first_step <= t <= cursor.step):
                samples = self._samples[step]
                whole = samples if step < cursor.step else samples[: cursor.index]
                rows.extend((leader, step, int(s), FULL) for s in whole)
                if step == cursor.step and cursor.offset and cursor.index < len(samples):
                    rows.append((leader, step, int(samples[cursor.index]), cursor.offset))
            # the log may run ahead of the cursor (the loading thread reads on): a match counts if
            # the cursor is past it; at the cursor's own document, if its skip is behind the cursor
            matched = [
                e
                for t, i, e in self._matched
                if t >= first_step
                and (
                    (t, i) < (cursor.step, cursor.index)
                    or ((t, i) == (cursor.step, cursor.index) and 0 < e[3] <= cursor.offset)
                )
            ]
        return _table(rows), _table(matched)


def combine(parts: Sequence[tuple[np.ndarray, np.ndarray]], resumed: np.ndarray, first_step: int) -> np.ndarray:
    """The hand-over of every leader: their passed entries, then the entries the run resumed with
    (``resumed``) at steps ``>= first_step`` that no leader has matched yet, as shared ones.

    >>> resumed = np.array([[0, 7, 5, FULL], [1, 7, 6, FULL]])
    >>> part = (np.array([[0, 7, 5, FULL]]), np.array([[0, 7, 5, FULL]]))
    >>> combine([part], resumed, first_step=7).tolist()
    [[0, 7, 5, -1], [-1, 7, 6, -1]]
    """
    passed = [p for p, _ in parts if len(p)]
    unmatched = Counter(
        tuple(int(x) for x in row) for row in np.asarray(resumed).reshape(-1, 4) if row[1] >= first_step
    )
    unmatched.subtract(tuple(int(x) for x in row) for _, m in parts for row in m)
    left = [
        (SHARED, step, sample, offset) for (_, step, sample, offset), n in unmatched.items() for _ in range(max(n, 0))
    ]
    return np.concatenate([*passed, _table(left)]) if passed or left else empty()


def _entry(row: Iterable[int]) -> tuple[int, int, int, int]:
    leader, step, sample, offset = (int(x) for x in row)
    return leader, step, sample, offset


def _table(rows: Iterable[tuple[int, ...]]) -> np.ndarray:
    rows = list(rows)
    return np.array(rows, dtype=np.int64).reshape(-1, 4) if rows else empty()
