"""Data mixtures on a schedule, the pure core: which source each packed row of a step comes from.

A :class:`MixtureSchedule` is each source's weight over progress (tokens or steps), as
:class:`MixtureSchedule.Phase`\\ s. An :class:`Allocation` holds the counters: ``allocate(progress, rows)`` names
the sources of a step's rows on every replica and returns the next allocation (counters in,
counters out, no rank in it: every leader computes the same rows alone). The rule, its bound and
proof, short rows and edits: ``docs/mixtures.md``.

>>> Phase = MixtureSchedule.Phase
>>> schedule = MixtureSchedule((Phase(0, {"web": 0.75, "code": 0.25}), Phase(1000, {"web": 0.5, "math": 0.5}, ramp=100)))
>>> schedule.sources, schedule.weights_at(1050)
(('code', 'math', 'web'), {'code': 0.125, 'math': 0.25, 'web': 0.625})
>>> rows, allocation = Allocation.start(schedule).allocate(progress=0, rows=8)
>>> rows, allocation.allocate(progress=1100, rows=4)[0]
([['web', 'code', 'web', 'web', 'web', 'code', 'web', 'web']], [['math', 'web', 'math', 'web']])
>>> edited = MixtureSchedule((Phase(0, {"web": 0.75, "code": 0.25}), Phase(1000, {"web": 0.25, "math": 0.75})))
>>> print(*Allocation.resume(allocation.state_dict(), edited, allow_edit=True, progress=1100)[1], sep="\\n")
phase 1: start 1000, ramp 100, weights {math: 0.5, web: 0.5} -> start 1000, ramp 0, weights {math: 0.75, web: 0.25}
weights at progress 1100 tokens: math 0.5 -> 0.75, web 0.5 -> 0.25
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import numpy as np

Unit = Literal["tokens", "steps"]
STATE_VERSION = 2
_SLACK = 1e-9  # rounding allowed at the eligibility threshold (deficits stay within (-1, 1))


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _progress(progress: Any) -> float:
    if not _number(progress) or progress < 0:
        raise ValueError(f"progress must be a finite number >= 0, got {progress!r}")
    return float(progress)


def _normalized(weights: Mapping[str, float], without: frozenset[str] = frozenset()) -> dict[str, float]:
    active = {k: v for k, v in sorted(weights.items()) if v > 0 and k not in without}
    total = sum(active.values())
    return {k: v / total for k, v in active.items()}


@dataclass(frozen=True)
class MixtureSchedule:
    """Each source's weight over progress, counted in ``unit``: ``"tokens"`` (real tokens trained
    over every replica) or ``"steps"`` (global steps); ``phases`` start at 0 and then increase.

    >>> MixtureSchedule.constant({"web": 3, "code": 1}).weights_at(123)
    {'code': 0.25, 'web': 0.75}
    """

    @dataclass(frozen=True)
    class Phase:
        """From ``start`` (in the schedule's unit) on, these ``weights`` (relative; a source absent or
        at 0 is inactive), reached from the previous phase's linearly over ``ramp`` units (0: at once)."""

        start: float
        weights: Mapping[str, float]
        ramp: float = 0.0

        def __post_init__(self) -> None:
            for field, value in (("start", self.start), ("ramp", self.ramp)):
                if not _number(value) or value < 0:
                    raise ValueError(f"{field} must be a finite number >= 0, got {value!r}")
            weights = self.weights if isinstance(self.weights, Mapping) else {}
            bad = [
                f"{k!r}: {v!r}" for k, v in weights.items() if not (isinstance(k, str) and k and _number(v) and v >= 0)
            ]
            if bad or not any(v > 0 for v in weights.values()):
                raise ValueError(
                    "weights must map source names to finite numbers >= 0, at least one positive; "
                    f"got {', '.join(bad) if bad else repr(self.weights)}"
                )
            object.__setattr__(self, "start", float(self.start))
            object.__setattr__(self, "ramp", float(self.ramp))
            object.__setattr__(self, "weights", MappingProxyType({k: float(v) for k, v in sorted(weights.items())}))

        def describe(self) -> str:
            weights = ", ".join(f"{k}: {v:g}" for k, v in self.weights.items())
            return f"start {self.start:g}, ramp {self.ramp:g}, weights {{{weights}}}"

    phases: tuple[Phase, ...]
    unit: Unit = "tokens"

    def __post_init__(self) -> None:
        phases = tuple(self.phases) if isinstance(self.phases, list) else self.phases
        if not isinstance(phases, tuple) or not phases or not all(isinstance(p, MixtureSchedule.Phase) for p in phases):
            raise ValueError(f"phases must be a non-empty tuple of Phase, got {self.phases!r}")
        object.__setattr__(self, "phases", phases)
        if self.unit not in ("tokens", "steps"):
            raise ValueError(f"unit must be 'tokens' or 'steps', got {self.unit!r}")
        if phases[0].start != 0 or phases[0].ramp != 0:
            raise ValueError(f"phase 0: start must be 0, and ramp 0 (nothing to ramp from), got {phases[0].describe()}")
        for i, (before, phase) in enumerate(zip(phases, phases[1:]), 1):
            if phase.start <= before.start:
                raise ValueError(f"phase {i}: start {phase.start:g} must be after phase {i - 1}'s, {before.start:g}")
            if before.ramp > phase.start - before.start:
                raise ValueError(
                    f"phase {i - 1}: ramp {before.ramp:g} outlasts the phase (phase {i} starts at {phase.start:g})"
                )

    @classmethod
    def constant(cls, weights: Mapping[str, float], unit: Unit = "tokens") -> MixtureSchedule:
        """One phase: these weights throughout."""
        return cls((cls.Phase(0, weights),), unit)

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
            return _normalized(phase.weights)
        f = (progress - phase.start) / phase.ramp
        before, after = _normalized(self.phases[i - 1].weights), _normalized(phase.weights)
        return _normalized(
            {k: (1 - f) * before.get(k, 0.0) + f * after.get(k, 0.0) for k in before.keys() | after.keys()}
        )

    def to_mapping(self) -> dict[str, Any]:
        """The config form, plain values (``streaming.mixture_file.schedule_from_mapping`` reads it)."""
        return {
            "unit": self.unit,
            "phase": [{"start": p.start, "ramp": p.ramp, "weights": dict(p.weights)} for p in self.phases],
        }


@dataclass(frozen=True, eq=False)
class Allocation:
    """Where a mixture's rows stand, never changed in place (see the module).

    Per source (sources of earlier schedules too, so an edit that adds one back continues it):
    ``rows`` it got over all replicas (a short row counts its real tokens), ``owed`` its target
    (its weight summed over every row slot) minus its rows, and ``replicas`` that per replica,
    ``(dp_size, sources)`` in ``rows``' order; the sources ``excluded``; the last step's ``progress``.

    >>> every, allocation = Allocation.start(MixtureSchedule.constant({"a": 0.5, "b": 0.25, "c": 0.25}), 2).allocate(0, 2)
    >>> every, allocation.rows, allocation.exclude("a").weights_at(4)
    ([['a', 'c'], ['b', 'a']], {'a': 2, 'b': 1, 'c': 1}, {'b': 0.5, 'c': 0.5})
    """

    schedule: MixtureSchedule
    dp_size: int
    rows: Mapping[str, float]
    owed: Mapping[str, float]
    replicas: np.ndarray
    excluded: frozenset[str] = frozenset()
    progress: float = 0.0

    @classmethod
    def start(cls, schedule: MixtureSchedule, dp_size: int = 1) -> Allocation:
        """Nothing allocated yet, over ``dp_size`` replicas."""
        names = schedule.sources
        return cls(
            schedule, dp_size, dict.fromkeys(names, 0), dict.fromkeys(names, 0.0), np.zeros((dp_size, len(names)))
        )

    @property
    def targets(self) -> dict[str, float]:
        """Each source's target over all replicas."""
        return {k: self.rows[k] + owed for k, owed in self.owed.items()}

    def weights_at(self, progress: float) -> dict[str, float]:
        """The schedule's weights at ``progress`` over the sources not excluded, summing to 1."""
        return _normalized(self.schedule.weights_at(progress), self.excluded)

    def exclude(self, name: str) -> Allocation:
        """Without ``name`` (it ran out, under "stop"): the others share its weight; its counters stay."""
        return dataclasses.replace(self, excluded=self.excluded | {name})

    def allocate(
        self, progress: float, rows: int, short: Mapping[tuple[int, str, int], float] | None = None
    ) -> tuple[list[list[str]], Allocation]:
        """Per replica, the sources of its ``rows`` rows of a step at the weights of ``progress``
        (the step's start, never before the last step's), and the allocation after them.
        ``short[(replica, source, k)]``: the ``k``-th row of ``source`` that ``replica`` takes from
        this step on holds that much (of a row) fewer real tokens than a full one; the column (row
        ``j`` of every replica) that takes it is allocated again with it credited."""
        progress = _progress(progress)
        if progress < self.progress:
            raise ValueError(f"progress went back from {self.progress:g} to {progress:g}")
        step, short = _Counters(self, self.weights_at(progress)), short or {}
        every: list[list[str]] = [[] for _ in range(self.dp_size)]

        def taken(names: list[str]) -> set[tuple[int, str, int]]:
            return {(r, name, every[r].count(name)) for r, name in enumerate(names)} & short.keys() if short else set()

        for _ in range(rows):
            column = step.column()
            ahead = taken(column[0])
            for key in sorted(ahead):
                step.credit(key, short[key])
            column = step.column() if ahead else column
            step.take(column)
            for key in sorted(taken(column[0]) ^ ahead):  # credited but not taken, or the reverse
                step.credit(key, -short[key] if key in ahead else short[key])
            for r, name in enumerate(column[0]):
                every[r].append(name)
        return every, dataclasses.replace(
            self, rows=step.rows, owed=step.owed, replicas=step.replicas, progress=progress
        )

    def state_dict(self) -> dict[str, Any]:
        """Plain values to resume from, at this DP degree or another."""
        return {
            "version": STATE_VERSION,
            "schedule": json.dumps(self.schedule.to_mapping(), sort_keys=True),  # a batch holds no list of tables
            "progress": self.progress,
            "excluded": sorted(self.excluded),
            "rows": dict(self.rows),
            "owed": dict(self.owed),
            "replicas": {name: self.replicas[:, i].tolist() for i, name in enumerate(self.rows)},
        }

    @classmethod
    def resume(
        cls,
        state: Any,
        schedule: MixtureSchedule,
        dp_size: int = 1,
        *,
        allow_edit: bool = False,
        progress: float | None = None,
    ) -> tuple[Allocation, list[str]]:
        """Go on from ``state`` under ``schedule``, and what changed from the schedule it was saved
        under, one line each, the weights compared at ``progress`` (where the run resumes; default:
        the saved one). A change is refused unless ``allow_edit``. Every counter carries on (an edit
        never makes a source catch up for the past), but at another ``dp_size`` the replicas' start afresh."""
        keys = ("version", "schedule", "progress", "excluded", "rows", "owed", "replicas")
        if not isinstance(state, Mapping) or not set(keys) <= state.keys() or state["version"] != STATE_VERSION:
            raise ValueError(f"mixture state: expected an Allocation.state_dict() of version {STATE_VERSION}")
        form = json.loads(state["schedule"])  # to_mapping's, checked when it was made
        saved = MixtureSchedule(tuple(MixtureSchedule.Phase(**phase) for phase in form["phase"]), form["unit"])
        last, excluded = _progress(state["progress"]), frozenset(state["excluded"])
        at = last if progress is None else _progress(progress)
        if at < last:
            raise ValueError(f"mixture state: progress {at:g} is before the saved progress {last:g}")
        changes = _changes(saved, schedule, at, state["rows"], excluded)
        if changes and not allow_edit:
            raise ValueError(
                "mixture: the schedule differs from the one the state was saved under; resume with "
                "allow_edit=True to accept the edit:\n  " + "\n  ".join(changes)
            )
        names = sorted(set(state["rows"]) | set(schedule.sources))
        rows, owed = ({k: table.get(k, 0) for k in names} for table in (state["rows"], state["owed"]))
        replicas = np.zeros((dp_size, len(names)))
        for name, column in state["replicas"].items():
            if len(column) == dp_size:  # at another DP degree the replicas start afresh
                replicas[:, names.index(name)] = column
        return cls(schedule, dp_size, rows, owed, replicas, excluded, last), changes


class _Counters:
    """One step's working counters: a column is computed without changing them, then taken."""

    def __init__(self, allocation: Allocation, weights: dict[str, float]) -> None:
        if not weights:
            raise RuntimeError(f"mixture: every active source was excluded (ran out): {sorted(allocation.excluded)}")
        self.rows, self.owed, self.replicas = dict(allocation.rows), dict(allocation.owed), allocation.replicas.copy()
        self.weights, self.names = list(weights.items()), list(weights)
        self.columns = [list(allocation.rows).index(name) for name in self.names]
        self.vector = np.array(list(weights.values()))
        self.delta = 1 / (2 * len(weights) - 2) if len(weights) > 1 else 0.0

    def column(self) -> tuple[list[str], dict[str, float], np.ndarray, list[int]]:
        """Row ``j`` of every replica: its sources over all replicas by Tijdeman's rule, each
        placed on a replica greatest per-replica deficit first (ties: replica, then source); with
        the counters after it, over all replicas and per replica, and the rows of each source."""
        weights, delta, dp, n = self.weights, self.delta, len(self.replicas), len(self.names)
        owed, picks = dict(self.owed), [0] * n
        for _ in range(dp):
            for name, weight in weights:
                owed[name] += weight
            chosen, soonest = -1, math.inf
            for k, (name, weight) in enumerate(weights):  # earliest deadline among the eligible; ties: first
                if owed[name] >= delta - _SLACK and (due := (1 - delta - owed[name]) / weight) < soonest:
                    chosen, soonest = k, due
            if chosen < 0:  # none eligible: only after a change of weights left deficits behind
                chosen = max(range(n), key=lambda k: owed[self.names[k]])
            owed[self.names[chosen]] -= 1.0
            picks[chosen] += 1
        deficit, left, placed = self.replicas[:, self.columns] + self.vector, list(picks), [-1] * dp
        for flat in np.argsort(-deficit, axis=None, kind="stable").tolist():  # ties in (replica, source) order
            r, k = divmod(flat, n)
            if placed[r] < 0 and left[k]:
                placed[r], left[k], dp = k, left[k] - 1, dp - 1
                if not dp:
                    break
        deficit[np.arange(len(placed)), placed] -= 1.0
        return [self.names[k] for k in placed], owed, deficit, picks

    def take(self, column: tuple[list[str], dict[str, float], np.ndarray, list[int]]) -> None:
        _, self.owed, self.replicas[:, self.columns], picks = column
        for name, rows in zip(self.names, picks):
            self.rows[name] += rows

    def credit(self, key: tuple[int, str, int], rows: float) -> None:
        """Replica ``key[0]``'s row of ``key[1]`` held ``rows`` (of a row) fewer real tokens: it
        counts ``1 - rows``, and every target grows by its weight times that."""
        replica, name, _ = key
        for (other, weight), column in zip(self.weights, self.columns):
            self.owed[other] -= weight * rows
            self.replicas[replica, column] -= weight * rows
        self.owed[name] += rows
        self.replicas[replica, self.columns[self.names.index(name)]] += rows
        self.rows[name] -= rows


def _changes(
    old: MixtureSchedule, new: MixtureSchedule, at: float, rows: Mapping, excluded: frozenset[str]
) -> list[str]:
    """What an edit of the schedule changes, one line each, for the log (weights compared ``at``)."""
    if old == new:
        return []
    unit = f"unit: {old.unit} -> {new.unit} (the saved progress {at:g} is now read in {new.unit})"
    lines = [unit] if old.unit != new.unit else []
    for i in range(max(len(old.phases), len(new.phases))):
        a, b = (s.phases[i].describe() if i < len(s.phases) else "none" for s in (old, new))
        lines += [f"phase {i}: {a} -> {b}"] if a != b else []
    for name in sorted(set(new.sources) - set(old.sources)):
        saved = f" (continues from its saved counters: {rows[name]} rows)" if rows.get(name) else ""
        lines.append(f"source added: {name}{saved}")
    for name in sorted(set(old.sources) - set(new.sources)):
        lines.append(f"source dropped: {name} (its counters stay in the state: {rows.get(name, 0)} rows)")
    before, after = (_normalized(s.weights_at(at), excluded) for s in (old, new))
    pairs = {k: (f"{before.get(k, 0):.4g}", f"{after.get(k, 0):.4g}") for k in sorted(before.keys() | after.keys())}
    moved = [f"{k} {a} -> {b}" for k, (a, b) in pairs.items() if a != b]
    return [*lines, f"weights at progress {at:g} {new.unit}: {', '.join(moved) or 'unchanged'}"]
