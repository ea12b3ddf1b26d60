"""Which samples a replica trains on in one step of a job whose replica groups come and go
(torchft's quorum): pure arithmetic on one committed cursor, no process group.

The job's whole data state is one integer, the **cursor**: how many samples of a fixed global
order the committed steps have trained. The global order is a seeded permutation of
``range(length)`` per pass over the dataset (or the identity, unshuffled); position ``p`` is
sample ``order(p // length)[p % length]``, so the order never ends and never depends on how many
groups there are. A step trains positions ``[cursor, cursor + global_batch)``:

* participant ``r`` of ``n`` (torchft's ``participating_rank()`` / ``num_participants()``) takes
  a contiguous piece of that window, the sizes as even as possible (the first
  ``global_batch % n`` participants one sample more): :func:`participant_range`;
* inside a participant (a replica group), its ``dp`` replicas split its piece again the same way:
  :func:`replica_range`;
* every replica of the group delivers its piece as the same number of micro-batches,
  ``ceil(ceil(piece / dp) / micro_batch)`` (:func:`micro_batch_count`), each at most
  ``micro_batch`` samples, sizes as even as possible; a replica whose piece is smaller than
  that count gets empty micro-batches at the end: :func:`micro_batch_ranges`.

So the global batch is the same at every step whatever the quorum: fewer participants means
more micro-batches each. The cursor moves by ``global_batch`` only when the step commits.

A position may also be a **packed row**: row ``r`` is tokens ``[r * (seq_len + 1), (r + 1) *
(seq_len + 1))`` of the documents of the global order concatenated, so the same arithmetic
splits rows; :class:`DocumentStarts` finds which documents hold a row's tokens.

>>> participant_range(cursor=8, global_batch=10, participant=1, participants=3)
(12, 15)
>>> replica_range(12, 15, dp_rank=0, dp_size=2), replica_range(12, 15, dp_rank=1, dp_size=2)
((12, 14), (14, 15))
>>> micro_batch_count(piece=3, dp_size=2, micro_batch=1)
2
>>> micro_batch_ranges(14, 15, 2)
[(14, 15), (15, 15)]
>>> order = GlobalOrder(length=5, seed=0, shuffle=False)
>>> order.indices(3, 8)  # positions 3..7: the end of pass 0, the start of pass 1
[3, 4, 0, 1, 2]
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


def even_sizes(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` sizes as even as possible, the larger ones first.

    >>> even_sizes(10, 3)
    [4, 3, 3]
    """
    if parts < 1 or total < 0:
        raise ValueError(f"cannot split {total} into {parts} parts")
    base, extra = divmod(total, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def _piece(start: int, stop: int, index: int, parts: int) -> tuple[int, int]:
    if not 0 <= index < parts:
        raise ValueError(f"index {index} is not in range({parts})")
    sizes = even_sizes(stop - start, parts)
    lo = start + sum(sizes[:index])
    return lo, lo + sizes[index]


def participant_range(cursor: int, global_batch: int, participant: int, participants: int) -> tuple[int, int]:
    """The positions ``[lo, hi)`` of the global order that participant ``participant`` of
    ``participants`` trains in the step whose window starts at ``cursor``."""
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    if cursor < 0:
        raise ValueError(f"cursor must be >= 0, got {cursor}")
    return _piece(cursor, cursor + global_batch, participant, participants)


def replica_range(lo: int, hi: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """The part of a participant's positions ``[lo, hi)`` that its replica ``dp_rank`` of
    ``dp_size`` trains."""
    return _piece(lo, hi, dp_rank, dp_size)


def micro_batch_count(piece: int, dp_size: int, micro_batch: int) -> int:
    """How many micro-batches every replica of a participant delivers for a piece of ``piece``
    samples split over ``dp_size`` replicas, each micro-batch at most ``micro_batch`` samples
    (the same on every replica, so that they all end the step together); 0 for an empty piece.

    >>> micro_batch_count(7, 2, 2), micro_batch_count(0, 2, 2)
    (2, 0)
    """
    if micro_batch < 1 or dp_size < 1:
        raise ValueError(f"micro_batch and dp_size must be >= 1, got {micro_batch} and {dp_size}")
    largest = -(-piece // dp_size)
    return -(-largest // micro_batch)


def micro_batch_ranges(lo: int, hi: int, count: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``count`` consecutive ranges, sizes as even as possible (larger
    first; empty ones at the end when there are fewer positions than ranges)."""
    if count == 0:
        if hi != lo:
            raise ValueError(f"{hi - lo} positions in no micro-batch")
        return []
    out, start = [], lo
    for size in even_sizes(hi - lo, count):
        out.append((start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class StepShare:
    """What one replica trains in one step: the participant's and the replica's positions and
    the replica's micro-batches (position ranges, possibly empty). ``participant`` is ``None``
    for a replica group that does not take part in the step (torchft's healing group in
    asynchronous mode): it trains nothing."""

    cursor: int
    global_batch: int
    participant: int | None
    participants: int
    group: tuple[int, int]
    replica: tuple[int, int]
    micro_batches: tuple[tuple[int, int], ...]


def step_share(
    cursor: int,
    global_batch: int,
    participant: int | None,
    participants: int,
    dp_rank: int,
    dp_size: int,
    micro_batch: int,
) -> StepShare:
    """Everything a replica needs for one step, from the cursor and the step's quorum.

    >>> s = step_share(cursor=0, global_batch=5, participant=0, participants=2, dp_rank=1, dp_size=2, micro_batch=1)
    >>> s.group, s.replica, s.micro_batches
    ((0, 3), (2, 3), ((2, 3), (3, 3)))
    >>> step_share(0, 5, None, 1, 0, 2, 1).micro_batches
    ()
    """
    if participant is None or participants == 0:
        return StepShare(cursor, global_batch, None, participants, (cursor, cursor), (cursor, cursor), ())
    group = participant_range(cursor, global_batch, participant, participants)
    replica = replica_range(*group, dp_rank, dp_size)
    count = micro_batch_count(group[1] - group[0], dp_size, micro_batch)
    return StepShare(
        cursor,
        global_batch,
        participant,
        participants,
        group,
        replica,
        tuple(micro_batch_ranges(*replica, count)),
    )


class GlobalOrder:
    """Positions of the never-ending global order -> dataset indices: pass ``e`` over a dataset of
    ``length`` samples is ``numpy.random.default_rng([seed, e]).permutation(length)``, or the
    identity without ``shuffle``. The same on every process, for any number of groups.

    >>> order = GlobalOrder(10, seed=1)
    >>> order.indices(0, 10) != list(range(10)), sorted(order.indices(10, 20)) == list(range(10))
    (True, True)
    """

    def __init__(self, length: int, seed: int = 0, shuffle: bool = True) -> None:
        if length < 1:
            raise ValueError(f"the dataset is empty (length {length})")
        self.length, self.seed, self.shuffle = length, seed, shuffle
        self._cached: tuple[int, np.ndarray] | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of pass ``epoch``."""
        if not self.shuffle:
            return np.arange(self.length)
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.length))
        return self._cached[1]

    def indices(self, lo: int, hi: int) -> list[int]:
        """The dataset indices at positions ``[lo, hi)``."""
        out: list[int] = []
        position = lo
        while position < hi:
            epoch, offset = divmod(position, self.length)
            take = min(hi - position, self.length - offset)
            out += self.permutation(epoch)[offset : offset + take].tolist()
            position += take
        return out


class DocumentStarts:
    """Where the documents of the global order start in its **token stream** (the documents'
    tokens concatenated in order), learnt from an **anchor** on: the document at position
    ``position`` starts at stream token ``token``.

    Packed rows under a changing quorum (``QuorumData(..., packing=...)``) are the rows of
    ``seq_len + 1`` tokens of that stream: row ``r`` is tokens ``[r * (seq_len + 1), (r + 1) *
    (seq_len + 1))``, so the cursor counts rows, and moves by ``global_batch`` rows per committed
    step whatever the documents' lengths. A leader needs to know which document holds a token:
    :meth:`locate` reads lengths forward from the anchor (``length(position)``, only for
    positions it does not know yet) and :meth:`forget_before` moves the anchor up once the
    committed cursor has passed. The anchor is the only part of the row state that is not
    arithmetic: a leader's is at most one window behind the cursor, and any anchor at or
    before the cursor finds the same documents (an earlier one reads more lengths).

    >>> lengths = [3, 0, 5, 2]  # documents 0..3 of the order: tokens 0-2, none, 3-7, 8-9
    >>> starts = DocumentStarts()
    >>> starts.locate(4, lengths.__getitem__), starts.locate(8, lengths.__getitem__)
    ((2, 1), (3, 0))
    >>> starts.forget_before(8), starts.locate(9, lengths.__getitem__)
    ((3, 8), (3, 1))
    """

    def __init__(self, position: int = 0, token: int = 0) -> None:
        self.reset(position, token)

    def reset(self, position: int, token: int) -> None:
        """Start again from the anchor ``(position, token)``, forgetting every length learnt."""
        if position < 0 or token < 0 or (position == 0 and token != 0):
            raise ValueError(f"no document of the order can start at ({position}, {token})")
        self.position, self.token = position, token
        self._ends: list[int] = []  # stream token after each known document, from the anchor on

    @property
    def known(self) -> int:
        """The first position whose length is not known yet."""
        return self.position + len(self._ends)

    def learn(self, position: int, length: int) -> None:
        """Record that the document at ``position`` holds ``length`` tokens: kept when it is the
        next unknown one (a reader tells every document it reads; the others are known already
        or cannot be placed yet)."""
        if position == self.known:
            self._ends.append((self._ends[-1] if self._ends else self.token) + length)

    def locate(self, token: int, length: Callable[[int], int]) -> tuple[int, int]:
        """``(position, offset)`` of the document holding stream token ``token``, and how many of
        its tokens come before it; reads the lengths it needs with ``length(position)``.
        Empty documents hold no token: the one returned is never empty."""
        if token < self.token:
            raise ValueError(f"token {token} is before the anchor ({self.position}, {self.token})")
        while not self._ends or self._ends[-1] <= token:
            self.learn(self.known, length(self.known))
        k = bisect.bisect_right(self._ends, token)
        start = self._ends[k - 1] if k else self.token
        return self.position + k, token - start

    def forget_before(self, token: int) -> tuple[int, int]:
        """Move the anchor to the last known document start at or before ``token`` (the committed
        cursor's first token), dropping what comes before it; returns the new anchor."""
        if token < self.token:
            raise ValueError(f"token {token} is before the anchor ({self.position}, {self.token})")
        k = bisect.bisect_right(self._ends, token)
        if k:
            self.position, self.token = self.position + k, self._ends[k - 1]
            del self._ends[:k]
        return self.position, self.token
