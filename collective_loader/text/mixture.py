"""Data mixtures on a schedule: which source each packed row of a step comes from.

A :class:`MixtureSchedule` gives each source a weight as a function of training *progress*, counted in
real tokens trained over every replica (``unit="tokens"``) or in global steps (``"steps"``). It is
a tuple of :class:`Phase`\\ s: from its ``start`` a phase holds its weights (piecewise constant),
reached from the previous phase's over ``ramp`` units (linear; 0: a step change). A source absent
from a phase, or at weight 0, is inactive in it: it has not started yet, or it stopped.

A :class:`RowAllocator` turns the weights into rows: ``allocate(progress, rows)`` names the source
of each of a step's ``rows`` rows. Every packed row holds ``seq_len`` real tokens but an epoch's
very last, padded one, which :meth:`RowAllocator.credit` counts by its real tokens (*Short rows*
below), so a source's share of rows is its share of real tokens. It is a pure function of the
schedule, the progress, the rows and the allocator's state, with no rank in it: every leader
computes the same allocation without communicating, and every replica gets it (see *Data
parallelism* below).

**The rule.** Each source ``s`` keeps a row count ``allocated[s]`` and a target ``target[s]``, the
sum of its weight over every row slot so far; ``deficit = target - allocated``. For each row slot
every active source's target grows by its weight (normalized over the active sources, so the
targets grow by 1 per row in all), then the row goes to a source whose deficit is at least
``delta = 1 / (2n - 2)`` (``n`` active sources), the one whose deficit would pass ``1 - delta``
soonest at its weight (the smallest ``(1 - delta - deficit) / weight``; ties: the first name).
This is Tijdeman's rule for the chairman assignment problem (R. Tijdeman, *The chairman
assignment problem*, Discrete Mathematics 32, 1980): an earliest-deadline-first order over
windows shrunk by ``delta``. The plain "largest deficit first" (smooth weighted round-robin) is
simpler but can owe a source more than one row: weights ``12, 12, 3, 1, 1`` (of 29) leave a
deficit of ``30/29`` after row 17 (``tests/unit/test_mixture.py`` checks both).

**The bound.** At constant weights over ``n >= 2`` sources from a fresh start (every deficit 0),
after every row ``delta - 1 <= deficit <= 1 - delta`` for every source (up to ``1e-9`` of
rounding): within one row of its target, and within half a row for two sources. The lower side
is the rule's own: the deficits sum to 0, so after adding the weights the largest is at least
``1 / n >= delta`` and some source is eligible, and a source gets a row only at a deficit of
``delta`` or more. The upper side is Tijdeman's theorem. So over any window of
consecutive rows (``W`` steps of ``r`` rows, any ``W``), each source's row count is within
``2 - 2 * delta = 2 - 1 / (n - 1)`` rows of ``weight * W * r``: one row for two sources, under two
for any number. The share error of a window is at most that over ``W * r``: within 1% needs
``W * r >= 200`` rows per replica (100 for two sources). When the weights change (a phase, a ramp,
a source excluded) the deficits carry on; no bound of one row is proven then. While the same
sources stay active the lower side still holds and the deficits still sum to 0 (so each is under
``n - 1``); measured, over thousands of random schedules: within ``1 - delta`` under ramps alone,
at most 1.42 rows with the weights changing every step, 1.47 with sources starting, stopping and
excluded as well.

**Short rows.** A row that holds ``f`` (of a row) fewer real tokens than ``seq_len`` (a
source's last, padded row of an epoch on some leader) is credited: its source's count grows by
``1 - f`` instead of 1 and every target by ``weight * (1 - f)``, so the counters count real tokens
and later rows make up the difference. :meth:`ReplicaAllocator.allocate` takes the short rows
among each replica's next rows (``short``) and credits them in the column that takes them,
allocating that column again with the credit so that the same column, not the next step, makes
up what it can. No bound
is proven with short rows. Measured (``tests/unit/test_mixture.py``, and real runs in
``tests/distributed/test_mixture_source.py``: a source at 1/4 whose every part ends in a padded
row every few steps, at dp 4 and 8): within 1 row in every window of 8 steps over all replicas,
as without short rows (2.81 rows when they counted as full). When every part ends at the same
step in a nearly empty row, every row of that source left is such a row and only its next epoch
can make up the difference: 1.62 rows (5.62 as full rows; 8 parts ending in 2 real tokens of 32).

**Resume.** :meth:`RowAllocator.state_dict` holds, per source, its rows and its deficit (the
target is ``allocated + deficit``; the deficit stays small, so saving it keeps the target to
the bit), whether it was excluded, the progress of the last step and the schedule it ran under.
:meth:`RowAllocator.load_state_dict` goes on from those counters under the schedule the allocator
was made with, which may be an edit of the saved one (``allow_edit=True``; otherwise an edit is
refused, naming what changed). The targets carry on: an edit of the future never makes a source
catch up for the past, and a source dropped by an edit keeps its counters, so re-adding it later
continues them. It returns the changes, one line each, for the caller to log.

**Data parallelism.** The allocator counts the rows of *one* replica; every replica takes the
same sources for its rows. Neither the schedule nor the state names a degree of data
parallelism: progress is global (tokens over all replicas, or global steps), so a run resumed at
another DP degree (with ``rows`` per replica changed to keep the global batch) continues the same
counters. At constant weights the sequence of sources row after row does not depend on how it is
cut into steps: ``allocate(p, 8)`` twice gives ``allocate(p, 4)`` four times. When the weights
change, a step's rows take the weights at the step's start progress, so a ramp is sampled at
each step's start.

>>> schedule = MixtureSchedule((Phase(0, {"web": 0.75, "code": 0.25}), Phase(1000, {"web": 0.5, "math": 0.5}, ramp=100)))
>>> schedule.sources, schedule.weights_at(1050)
(('code', 'math', 'web'), {'code': 0.125, 'math': 0.25, 'web': 0.625})
>>> rows = RowAllocator(schedule)
>>> rows.allocate(progress=0, rows=8)
['web', 'code', 'web', 'web', 'web', 'code', 'web', 'web']
>>> rows.allocate(progress=1100, rows=4)
['math', 'web', 'math', 'web']
>>> state = rows.state_dict()
>>> edited = MixtureSchedule((Phase(0, {"web": 0.75, "code": 0.25}), Phase(1000, {"web": 0.25, "math": 0.75})))
>>> for line in RowAllocator(edited).load_state_dict(state, allow_edit=True):
...     print(line)
phase 1: start 1000, ramp 100, weights {math: 0.5, web: 0.5} -> start 1000, ramp 0, weights {math: 0.75, web: 0.25}
weights at progress 1100 tokens: math 0.5 -> 0.75, web 0.5 -> 0.25

The command line's form, JSON or TOML (:func:`read_mixture`, with the sources; :func:`mixture_schedule_from_mapping`)::

    unit = "tokens"           # or "steps"
    [[phase]]
    start = 0
    weights = { web = 0.7, code = 0.3 }
    [[phase]]
    start = 9e6
    ramp = 1e6
    weights = { web = 0.3, code = 0.2, math = 0.5 }

or, for constant weights, ``weights = { web = 0.7, code = 0.3 }`` alone. Pure: no
``torch.distributed``; the only I/O is :func:`read_mixture` reading its file.
"""

from __future__ import annotations

import bisect
import copy
import difflib
import json
import math
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

Unit = Literal["tokens", "steps"]
UNITS = ("tokens", "steps")
WhenExhausted = Literal["end", "repeat", "stop"]
WHEN_EXHAUSTED = ("end", "repeat", "stop")
STATE_VERSION = 1
_SLACK = 1e-9  # rounding allowed at the eligibility threshold (deficits stay within (-1, 1))


class _Weights(Mapping[str, float]):
    """A phase's weights: read-only, hashable, in name order."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, float]) -> None:
        self._items = dict(sorted(items.items()))

    def __getitem__(self, name: str) -> float:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _phase_problem(start: Any, weights: Any, ramp: Any) -> str | None:
    """What is wrong with a phase's fields, field first, or ``None``."""
    if not _number(start) or start < 0:
        return f"start must be a finite number >= 0, got {start!r}"
    if not _number(ramp) or ramp < 0:
        return f"ramp must be a finite number >= 0, got {ramp!r}"
    if not isinstance(weights, Mapping) or not weights:
        return f"weights must be a non-empty mapping of source name to weight, got {weights!r}"
    for name, weight in weights.items():
        if not isinstance(name, str) or not name:
            return f"weights: a source name must be a non-empty str, got {name!r}"
        if not _number(weight) or weight < 0:
            return f"weights: {name!r} is {weight!r}; a weight must be a finite number >= 0"
    if not any(w > 0 for w in weights.values()):
        return f"weights: at least one must be positive, got {dict(weights)!r}"
    return None


@dataclass(frozen=True)
class Phase:
    """A part of a :class:`MixtureSchedule`: from ``start`` on, these weights.

    Args:
        start: where the phase begins, in the schedule's unit (tokens or steps of progress).
        weights: each source's weight (relative: normalized over the positive ones). A source
            absent, or at 0, is inactive during the phase.
        ramp: the weights move linearly from the previous phase's (each normalized) to these over
            ``ramp`` units from ``start``; 0: they change at ``start``. At most the phase's length.
    """

    start: float
    weights: Mapping[str, float]
    ramp: float = 0.0

    def __post_init__(self) -> None:
        problem = _phase_problem(self.start, self.weights, self.ramp)
        if problem:
            raise ValueError(f"Phase: {problem}")
        object.__setattr__(self, "start", float(self.start))
        object.__setattr__(self, "ramp", float(self.ramp))
        object.__setattr__(self, "weights", _Weights({k: float(v) for k, v in self.weights.items()}))

    def normalized(self) -> dict[str, float]:
        """The active sources' weights, summing to 1, in name order."""
        return _normalized(self.weights)

    def describe(self) -> str:
        weights = ", ".join(f"{k}: {v:g}" for k, v in self.weights.items())
        return f"start {self.start:g}, ramp {self.ramp:g}, weights {{{weights}}}"


def _normalized(weights: Mapping[str, float]) -> dict[str, float]:
    active = {k: v for k, v in sorted(weights.items()) if v > 0}
    total = sum(active.values())
    return {k: v / total for k, v in active.items()} if total > 0 else {}


@dataclass(frozen=True)
class MixtureSchedule:
    """Each source's weight over training progress: :class:`Phase`\\ s, the first at 0.

    Args:
        phases: the phases, starting at 0 and at strictly increasing starts.
        unit: what progress counts: ``"tokens"``, real (non-padding) tokens trained over every
            replica, or ``"steps"``, global steps.

    >>> MixtureSchedule.constant({"web": 3, "code": 1}).weights_at(123)
    {'code': 0.25, 'web': 0.75}
    """

    phases: tuple[Phase, ...]
    unit: Unit = "tokens"

    def __post_init__(self) -> None:
        phases = tuple(self.phases) if isinstance(self.phases, (list, tuple)) else self.phases
        if not isinstance(phases, tuple) or not phases:
            raise ValueError(f"MixtureSchedule: phases must be a non-empty tuple of Phase, got {self.phases!r}")
        for i, phase in enumerate(phases):
            if not isinstance(phase, Phase):
                raise TypeError(f"MixtureSchedule: phase {i} must be a Phase, got {type(phase).__qualname__}")
        object.__setattr__(self, "phases", phases)
        if self.unit not in UNITS:
            raise ValueError(f"MixtureSchedule: unit must be 'tokens' or 'steps', got {self.unit!r}")
        if phases[0].start != 0:
            raise ValueError(f"MixtureSchedule: phase 0: start must be 0, got {phases[0].start:g}")
        if phases[0].ramp != 0:
            raise ValueError(
                f"MixtureSchedule: phase 0: ramp must be 0 (there is no earlier phase to ramp from), got {phases[0].ramp:g}"
            )
        for i in range(1, len(phases)):
            before, phase = phases[i - 1], phases[i]
            if phase.start <= before.start:
                raise ValueError(
                    f"MixtureSchedule: phase {i}: start {phase.start:g} must be after phase {i - 1}'s start {before.start:g}"
                )
            if before.ramp > phase.start - before.start:
                raise ValueError(
                    f"MixtureSchedule: phase {i - 1}: ramp {before.ramp:g} is longer than the phase "
                    f"({phase.start - before.start:g}: phase {i} starts at {phase.start:g})"
                )

    @classmethod
    def constant(cls, weights: Mapping[str, float], unit: Unit = "tokens") -> MixtureSchedule:
        """One phase: these weights throughout."""
        return cls((Phase(0, weights),), unit)

    @property
    def sources(self) -> tuple[str, ...]:
        """Every source named in any phase (at weight 0 included), sorted."""
        return tuple(sorted({name for phase in self.phases for name in phase.weights}))

    def weights_at(self, progress: float) -> dict[str, float]:
        """The active sources' weights at ``progress``, summing to 1, in name order."""
        progress = _progress(progress)
        i = bisect.bisect_right([p.start for p in self.phases], progress) - 1
        phase = self.phases[i]
        if phase.ramp == 0 or progress >= phase.start + phase.ramp:
            return phase.normalized()
        f = (progress - phase.start) / phase.ramp
        before, after = self.phases[i - 1].normalized(), phase.normalized()
        mixed = {k: (1 - f) * before.get(k, 0.0) + f * after.get(k, 0.0) for k in before.keys() | after.keys()}
        return _normalized(mixed)

    def to_mapping(self) -> dict[str, Any]:
        """The config form (:func:`mixture_schedule_from_mapping` reads it back to an equal schedule)."""
        phases = [{"start": p.start, "ramp": p.ramp, "weights": dict(p.weights)} for p in self.phases]
        return {"unit": self.unit, "phase": phases}

    def fingerprint(self) -> str:
        """One line, equal for equal schedules: the config form as canonical JSON."""
        return json.dumps(self.to_mapping(), sort_keys=True, separators=(",", ":"))


def _progress(progress: Any) -> float:
    if not _number(progress) or progress < 0:
        raise ValueError(f"progress must be a finite number >= 0, got {progress!r}")
    return float(progress)


class RowAllocator:
    """Which source each of a step's rows comes from, the same on every leader (see the module).

    >>> rows = RowAllocator(MixtureSchedule.constant({"a": 0.5, "b": 0.25, "c": 0.25}))
    >>> rows.allocate(0, 4), rows.allocate(4, 4), rows.allocated
    (['a', 'b', 'c', 'a'], ['a', 'b', 'c', 'a'], {'a': 4, 'b': 2, 'c': 2})
    >>> rows.exclude("a")
    >>> rows.allocate(8, 4), rows.weights_at(8)
    (['b', 'c', 'b', 'c'], {'b': 0.5, 'c': 0.5})
    """

    def __init__(self, schedule: MixtureSchedule) -> None:
        if not isinstance(schedule, MixtureSchedule):
            raise TypeError(f"RowAllocator(schedule=...) must be a MixtureSchedule, got {type(schedule).__qualname__}")
        self._schedule = schedule
        self._allocated: dict[str, float] = dict.fromkeys(schedule.sources, 0)
        self._deficit: dict[str, float] = dict.fromkeys(schedule.sources, 0.0)
        self._excluded: set[str] = set()
        self._progress = 0.0

    @property
    def schedule(self) -> MixtureSchedule:
        return self._schedule

    @property
    def progress(self) -> float:
        """The progress of the last step allocated (0 before the first)."""
        return self._progress

    @property
    def allocated(self) -> dict[str, float]:
        """Rows each source got so far, sources of earlier schedules included; a short row
        counts its real tokens (:meth:`credit`)."""
        return dict(sorted(self._allocated.items()))

    @property
    def targets(self) -> dict[str, float]:
        """Each source's target so far: the sum of its weight over every row slot, each slot
        counted by its real tokens."""
        return {k: self._allocated[k] + d for k, d in sorted(self._deficit.items())}

    @property
    def excluded(self) -> frozenset[str]:
        """The sources :meth:`exclude`\\ d: inactive from then on."""
        return frozenset(self._excluded)

    def exclude(self, name: str) -> None:
        """Take a source out (it ran out, under the policy "stop and renormalize the others"): the
        other active sources share its weight from the next step on; its counters stay."""
        if name not in self._allocated:
            raise ValueError(f"RowAllocator.exclude: unknown source {name!r}; sources: {sorted(self._allocated)}")
        self._excluded.add(name)

    def credit(self, name: str, rows: float, progress: float) -> None:
        """A row of ``name`` allocated at ``progress`` held ``rows`` (of a row) fewer real tokens
        than a full one: it counts ``1 - rows``, and every target grows by its weight times that."""
        for other, weight in self.weights_at(progress).items():
            self._deficit[other] -= weight * rows
        self._deficit[name] += rows
        self._allocated[name] -= rows

    def weights_at(self, progress: float) -> dict[str, float]:
        """The schedule's weights at ``progress`` over the sources not excluded, summing to 1
        (empty when every active source is excluded)."""
        weights = self._schedule.weights_at(progress)
        return _normalized({k: v for k, v in weights.items() if k not in self._excluded})

    def allocate(self, progress: float, rows: int) -> list[str]:
        """The source of each of one step's ``rows`` rows, at the weights of ``progress`` (the
        step's start, in the schedule's unit; never less than the last step's)."""
        progress = _progress(progress)
        if progress < self._progress:
            raise ValueError(f"RowAllocator.allocate: progress went back from {self._progress:g} to {progress:g}")
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ValueError(f"RowAllocator.allocate: rows must be an int >= 0, got {rows!r}")
        weights = list(self.weights_at(progress).items())
        if not weights:
            active = sorted(self._schedule.weights_at(progress))
            raise RuntimeError(
                f"mixture: no source left at progress {progress:g} {self._schedule.unit}: "
                f"every active source ({', '.join(active)}) was excluded (ran out)"
            )
        delta = 1 / (2 * len(weights) - 2) if len(weights) > 1 else 0.0
        deficit, out = self._deficit, []
        for _ in range(rows):
            for name, weight in weights:
                deficit[name] += weight
            chosen, soonest = None, math.inf
            for name, weight in weights:  # earliest deadline among the eligible; ties: first name
                if deficit[name] >= delta - _SLACK:
                    due = (1 - delta - deficit[name]) / weight
                    if due < soonest:
                        chosen, soonest = name, due
            if chosen is None:  # none eligible: only after a change of weights left deficits behind
                chosen = max(weights, key=lambda item: deficit[item[0]])[0]
            deficit[chosen] -= 1.0
            self._allocated[chosen] += 1
            out.append(chosen)
        self._progress = progress
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain values (ints, floats, bools, str) to resume from, at any DP degree."""
        return {
            "version": STATE_VERSION,
            "schedule": self._schedule.fingerprint(),
            "progress": self._progress,
            "sources": {
                name: {
                    "allocated": self._allocated[name],
                    "deficit": self._deficit[name],
                    "excluded": name in self._excluded,
                }
                for name in sorted(self._allocated)
            },
        }

    def load_state_dict(
        self,
        state: Mapping[str, Any],
        schedule: MixtureSchedule | None = None,
        *,
        allow_edit: bool = False,
        progress: float | None = None,
    ) -> list[str]:
        """Continue from ``state`` under ``schedule`` (default: the allocator's own).

        Each source's counters carry on (a source new to the schedule starts at 0; one it dropped
        keeps its counters in the state), so do the exclusions and the progress. Returns what
        changed from the schedule the state was saved under, one line each (empty: nothing),
        the weights compared at ``progress``, where the run resumes (default: the saved
        progress, the last step's start); a change is refused unless ``allow_edit``.
        """
        new = self._schedule if schedule is None else schedule
        if not isinstance(new, MixtureSchedule):
            raise TypeError(
                f"RowAllocator.load_state_dict(schedule=...) must be a MixtureSchedule, got {type(new).__qualname__}"
            )
        saved, last, allocated, deficit, excluded = _read_state(state)
        at = last if progress is None else _progress(progress)
        if at < last:
            raise ValueError(f"RowAllocator.load_state_dict: progress {at:g} is before the saved progress {last:g}")
        changes = _changes(saved, new, at, allocated, excluded)
        if changes and not allow_edit:
            raise ValueError(
                "mixture: the schedule differs from the one the state was saved under; resume with "
                "allow_edit=True to accept the edit:\n  " + "\n  ".join(changes)
            )
        for name in new.sources:
            allocated.setdefault(name, 0)
            deficit.setdefault(name, 0.0)
        self._schedule, self._progress = new, last
        self._allocated, self._deficit, self._excluded = allocated, deficit, excluded
        return changes


class ReplicaAllocator:
    """Which source each row of *every* replica comes from, a step of ``rows`` rows per replica at a time.

    Row ``j`` of every replica (a *column* of ``dp_size`` rows) is allocated at once: a
    :class:`RowAllocator` names the column's sources, so over all replicas each source stays within
    a row of its target (the error of a window over all replicas is that of one replica's window
    divided by dp); then each of the column's rows goes to a replica: the pairs (replica, source)
    are taken greatest per-replica deficit first (ties: replica, then source, in order), so each
    replica's own rows stay near its target too (no bound is proven; the worst measured was 3.25
    rows, over 300 random mixtures of 2 to 6 sources at dp 2 to 32, 1,000 columns each; the
    greedy's leftover rows go to whichever replica is last free, as with 5 equal weights at dp 5.
    Allocating each replica alone keeps it within one row but leaves the error over all replicas
    dp times as large). A replica's rows
    depend on its row index alone, not on how its rows are cut into steps (a micro-batch of one row
    per step gets the rows of a step of eight), and every leader computes every replica's rows, the
    same, without communicating.

    >>> rows = ReplicaAllocator(MixtureSchedule.constant({"a": 0.5, "b": 0.25, "c": 0.25}), dp_size=2)
    >>> rows.allocate(0, 2)
    [['a', 'c'], ['b', 'a']]
    >>> [sorted(sum(rows.allocate(512, 2), [])) for _ in range(2)]
    [['a', 'a', 'b', 'c'], ['a', 'a', 'b', 'c']]

    State (:meth:`state_dict`): the :class:`RowAllocator`'s, over all replicas, and each replica's
    deficit per source. Resumed at another DP degree the replicas' deficits start at 0 again; the
    allocation over all replicas goes on.
    """

    def __init__(self, schedule: MixtureSchedule, dp_size: int) -> None:
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"ReplicaAllocator(dp_size=...) must be an int >= 1, got {dp_size!r}")
        self.rows = RowAllocator(schedule)
        self.dp_size = dp_size
        self._deficit: dict[str, np.ndarray] = {name: np.zeros(dp_size) for name in schedule.sources}

    def allocate(
        self, progress: float, rows: int, short: Mapping[tuple[int, str, int], float] | None = None
    ) -> list[list[str]]:
        """Per replica, the source of each of its ``rows`` rows of one step, at the weights of
        ``progress`` (the step's start). ``short[(replica, source, k)]``: the ``k``-th row of
        ``source`` that ``replica`` takes from this step on holds that much (of a row) fewer real
        tokens than a full one; the column that takes it credits it (:meth:`RowAllocator.credit`,
        and the replica's own deficits), and is allocated again with the credit (found on a copy),
        so that the same column makes up what it can."""
        out: list[list[str]] = [[] for _ in range(self.dp_size)]
        short = short or {}

        def taken(column: list[str]) -> set[tuple[int, str, int]]:
            return {(r, name, out[r].count(name)) for r, name in enumerate(column)} & short.keys()

        for _ in range(rows):
            ahead = sorted(taken(copy.deepcopy(self)._column(progress))) if short else []
            for key in ahead:
                self._credit(key, short[key], progress)
            column = self._column(progress)
            for key in sorted(taken(column).symmetric_difference(ahead)):  # credited but not taken, or the reverse
                self._credit(key, -short[key] if key in ahead else short[key], progress)
            for replica, name in enumerate(column):
                out[replica].append(name)
        return out

    def _credit(self, key: tuple[int, str, int], rows: float, progress: float) -> None:
        replica, name, _ = key
        self.rows.credit(name, rows, progress)
        for other, weight in self.rows.weights_at(progress).items():
            self._deficit[other][replica] -= weight * rows
        self._deficit[name][replica] += rows

    def _column(self, progress: float) -> list[str]:
        left = Counter(self.rows.allocate(progress, self.dp_size))
        weights = self.rows.weights_at(progress)
        names = sorted(weights)
        for name in names:
            self._deficit.setdefault(name, np.zeros(self.dp_size))
        deficit = np.stack([self._deficit[name] + weights[name] for name in names], axis=1)  # (replica, source)
        replica, source = np.indices(deficit.shape)
        order = np.lexsort((source.ravel(), replica.ravel(), -deficit.ravel()))
        chosen: list[str | None] = [None] * self.dp_size
        placed = 0
        for pair in order.tolist():
            r, k = divmod(pair, len(names))
            if chosen[r] is None and left[names[k]] > 0:
                chosen[r] = names[k]
                left[names[k]] -= 1
                deficit[r, k] -= 1.0
                placed += 1
                if placed == self.dp_size:
                    break
        for k, name in enumerate(names):
            self._deficit[name] = deficit[:, k]
        return [name for name in chosen if name is not None]

    def state_dict(self) -> dict[str, Any]:
        """Plain values: the allocation over all replicas and each replica's deficits."""
        return {
            "rows": self.rows.state_dict(),
            "dp_size": self.dp_size,
            "replicas": {name: d.tolist() for name, d in sorted(self._deficit.items())},
        }

    def load_state_dict(
        self, state: Mapping[str, Any], *, allow_edit: bool = False, progress: float | None = None
    ) -> list[str]:
        """Go on from ``state`` under this allocator's schedule (:meth:`RowAllocator.load_state_dict`:
        an edit of the schedule is refused unless ``allow_edit``); returns the changes, one line each."""
        if not isinstance(state, Mapping) or not {"rows", "dp_size", "replicas"} <= set(state):
            raise ValueError(
                "mixture state: expected the keys rows, dp_size and replicas (ReplicaAllocator.state_dict)"
            )
        changes = self.rows.load_state_dict(state["rows"], self.rows.schedule, allow_edit=allow_edit, progress=progress)
        self._deficit = {name: np.zeros(self.dp_size) for name in self.rows.allocated}
        if state["dp_size"] == self.dp_size:  # at another DP degree the replicas start afresh
            for name, deficit in state["replicas"].items():
                self._deficit[name] = np.asarray(deficit, dtype=np.float64)
        return changes


def _read_state(state: Any) -> tuple[MixtureSchedule, float, dict[str, float], dict[str, float], set[str]]:
    def bad(what: str) -> ValueError:
        return ValueError(f"mixture state: {what}")

    if not isinstance(state, Mapping):
        raise bad(f"must be a mapping (RowAllocator.state_dict()), got {type(state).__qualname__}")
    missing = {"version", "schedule", "progress", "sources"} - state.keys()
    if missing:
        raise bad(f"missing keys {sorted(missing)}")
    if state["version"] != STATE_VERSION:
        raise bad(f"version {state['version']!r}, this library reads version {STATE_VERSION}")
    try:
        saved = mixture_schedule_from_mapping(json.loads(state["schedule"]))
    except (TypeError, ValueError) as e:
        raise bad(f"schedule: {e}") from None
    try:
        progress = _progress(state["progress"])
    except ValueError as e:
        raise bad(str(e)) from None
    sources = state["sources"]
    if not isinstance(sources, Mapping):
        raise bad(f"sources must be a mapping, got {type(sources).__qualname__}")
    allocated, deficit, excluded = {}, {}, set()
    for name, entry in sources.items():
        if not isinstance(entry, Mapping) or set(entry) != {"allocated", "deficit", "excluded"}:
            raise bad(f"sources[{name!r}] must hold allocated, deficit and excluded, got {entry!r}")
        rows, owed = entry["allocated"], entry["deficit"]
        if not _number(rows) or rows < 0:
            raise bad(f"sources[{name!r}].allocated must be a number >= 0, got {rows!r}")
        if not _number(owed):
            raise bad(f"sources[{name!r}].deficit must be a finite number, got {owed!r}")
        allocated[str(name)], deficit[str(name)] = rows, float(owed)
        if entry["excluded"]:
            excluded.add(str(name))
    unknown = set(saved.sources) - set(allocated)
    if unknown:
        raise bad(f"sources {sorted(unknown)} of its schedule have no counters")
    return saved, progress, allocated, deficit, excluded


def _changes(
    old: MixtureSchedule, new: MixtureSchedule, progress: float, allocated: Mapping[str, float], excluded: set[str]
) -> list[str]:
    """What an edit of the schedule changes, one line each, for the log."""
    if old.fingerprint() == new.fingerprint():
        return []
    lines = []
    if old.unit != new.unit:
        lines.append(f"unit: {old.unit} -> {new.unit} (the saved progress {progress:g} is now read in {new.unit})")
    for i in range(max(len(old.phases), len(new.phases))):
        a = old.phases[i].describe() if i < len(old.phases) else "none"
        b = new.phases[i].describe() if i < len(new.phases) else "none"
        if a != b:
            lines.append(f"phase {i}: {a} -> {b}")
    for name in sorted(set(new.sources) - set(old.sources)):
        rows = allocated.get(name)
        lines.append(f"source added: {name}" + (f" (continues from its saved counters: {rows} rows)" if rows else ""))
    for name in sorted(set(old.sources) - set(new.sources)):
        lines.append(f"source dropped: {name} (its counters stay in the state: {allocated.get(name, 0)} rows)")

    def now(schedule: MixtureSchedule) -> dict[str, float]:
        return _normalized({k: v for k, v in schedule.weights_at(progress).items() if k not in excluded})

    before, after = now(old), now(new)
    moved = [
        f"{k} {before.get(k, 0.0):.4g} -> {after.get(k, 0.0):.4g}"
        for k in sorted(before.keys() | after.keys())
        if f"{before.get(k, 0.0):.4g}" != f"{after.get(k, 0.0):.4g}"
    ]
    where = f"weights at progress {progress:g} {new.unit}"
    lines.append(f"{where}: {', '.join(moved)}" if moved else f"{where}: unchanged")
    return lines


_TOP = ("phase", "unit", "weights")
_PHASE = ("ramp", "start", "weights")


def _unknown(keys: Any, known: tuple[str, ...], where: str) -> None:
    unknown = [k for k in keys if k not in known]
    if unknown:
        hints = [
            f"{k!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(str(k), known, 1)) else repr(k)
            for k in unknown
        ]
        raise ValueError(
            f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; known: {', '.join(known)}"
        )


def mixture_schedule_from_mapping(data: Mapping[str, Any], where: str = "mixture schedule") -> MixtureSchedule:
    """A :class:`MixtureSchedule` from its config form (parsed JSON or TOML)::

        {"unit": "tokens", "phase": [{"start": 0, "weights": {"web": 0.7, "code": 0.3}},
                                     {"start": 9e6, "ramp": 1e6, "weights": {"web": 0.3, "math": 0.7}}]}

    or ``{"weights": {...}}`` for constant weights (``unit`` optional: ``"tokens"``). Unknown
    keys are refused, naming them; ``where`` prefixes every error (a file's path).

    >>> mixture_schedule_from_mapping({"weights": {"web": 1}}) == MixtureSchedule.constant({"web": 1})
    True
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: must be a table (mapping) with {', '.join(_TOP)}, got {type(data).__qualname__}")
    _unknown(data, _TOP, where)
    unit = data.get("unit", "tokens")
    if unit not in UNITS:
        raise ValueError(f"{where}: unit must be 'tokens' or 'steps', got {unit!r}")
    if ("phase" in data) == ("weights" in data):
        raise ValueError(
            f"{where}: give either phase (a list of phases) or weights (constant weights), not both or neither"
        )
    if "weights" in data:
        raw_phases: Any = [{"start": 0, "weights": data["weights"]}]
    else:
        raw_phases = data["phase"]
        if not isinstance(raw_phases, (list, tuple)) or not raw_phases:
            raise ValueError(f"{where}: phase must be a non-empty list of phases, got {raw_phases!r}")
    phases = []
    for i, raw in enumerate(raw_phases):
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: phase {i} must be a table (mapping), got {raw!r}")
        _unknown(raw, _PHASE, f"{where}: phase {i}")
        missing = [k for k in ("start", "weights") if k not in raw]
        if missing:
            raise ValueError(f"{where}: phase {i}: missing {' and '.join(missing)}")
        problem = _phase_problem(raw["start"], raw["weights"], raw.get("ramp", 0.0))
        if problem:
            raise ValueError(f"{where}: phase {i}: {problem}")
        phases.append(Phase(raw["start"], raw["weights"], raw.get("ramp", 0.0)))
    try:
        return MixtureSchedule(tuple(phases), unit)
    except ValueError as e:
        raise ValueError(f"{where}: {str(e).removeprefix('MixtureSchedule: ')}") from None


def read_mixture(path: str | Path) -> tuple[dict[str, dict[str, Any]], MixtureSchedule]:
    """A mixture from a ``.json`` or ``.toml`` file: its sources and its schedule. Errors name the file.

    A ``sources`` table holds one table per source, that source's ``StreamingDataset`` arguments
    (``local``, ``remote``, ``shuffle``, ...) and, optionally, what happens when it runs out
    (``when_exhausted``: :func:`when_exhausted_of`); beside it, the schedule's keys
    (:func:`mixture_schedule_from_mapping`)::

        unit = "tokens"
        weights = { web = 0.7, code = 0.3 }

        [sources.web]
        local = "/data/web"
        [sources.code]
        remote = "s3://bucket/code"
        local = "/cache/code"
        when_exhausted = "repeat"

    Every source the schedule weighs needs a table.
    """
    path = Path(path)
    where = str(path)
    formats: dict[str, Literal["json", "toml"]] = {".json": "json", ".toml": "toml"}
    format = formats.get(path.suffix.lower())
    if format is None:
        raise ValueError(f"{where}: a mixture must be a .json or .toml file")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{where}: cannot read the mixture: {e.strerror or e}") from None
    data = dict(_parse(text, format, where))
    sources = data.pop("sources", None)
    if not isinstance(sources, Mapping) or not sources:
        raise ValueError(f"{where}: needs a sources table: one table per source, its StreamingDataset arguments")
    bad = sorted(str(name) for name, table in sources.items() if not isinstance(table, Mapping))
    if bad:
        raise ValueError(f"{where}: sources {bad} must be tables of StreamingDataset arguments (local = ..., ...)")
    schedule = mixture_schedule_from_mapping(data, where)
    when_exhausted_of(sources, where)
    missing = sorted(set(schedule.sources) - set(sources))
    if missing:
        raise ValueError(f"{where}: the schedule weighs {missing}, which the sources table does not describe")
    return {str(name): dict(table) for name, table in sources.items()}, schedule


def when_exhausted_of(sources: Mapping[str, Mapping[str, Any]], where: str = "mixture") -> dict[str, WhenExhausted]:
    """Each source's policy for when it runs out, from the ``when_exhausted`` key of its table
    (``"end"`` when absent): ``"end"`` the epoch, for every source; ``"repeat"`` it, in a new
    shuffled epoch; ``"stop"`` it and share its weight among the others.

    >>> when_exhausted_of({"web": {"local": "/d/web"}, "code": {"local": "/d/code", "when_exhausted": "repeat"}})
    {'web': 'end', 'code': 'repeat'}
    """
    out: dict[str, WhenExhausted] = {}
    for name, table in sources.items():
        policy = table.get("when_exhausted", "end")
        if policy not in WHEN_EXHAUSTED:
            raise ValueError(
                f"{where}: sources.{name}.when_exhausted must be one of {', '.join(WHEN_EXHAUSTED)}; got {policy!r}"
            )
        out[str(name)] = policy
    return out


def _parse(text: str, format: Literal["json", "toml"], where: str) -> Mapping[str, Any]:
    if format == "json":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{where}: not valid JSON: {e}") from None
    else:
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            try:
                import tomli as tomllib
            except ImportError:
                raise ValueError(f"{where}: reading TOML needs Python 3.11 or the tomli package") from None
        try:
            data = tomllib.loads(text)
        except ValueError as e:
            raise ValueError(f"{where}: not valid TOML: {e}") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: must be a table (mapping), got {type(data).__qualname__}")
    return data
