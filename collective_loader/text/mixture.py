"""Data mixtures on a schedule, the pure core: which source each packed row of a step comes from.

A :class:`MixtureSchedule` gives each source a weight over training *progress* (real tokens
trained over every replica, or global steps): :class:`Phase`\\ s, each holding its weights from
its ``start``, reached from the previous phase's over ``ramp`` units. An :class:`Allocation` holds
the counters; ``allocate(progress, rows)`` names the source of each row of a step on every replica
and returns them with the next allocation: counters in, counters out, no rank in it, so every
leader computes the same rows without communicating. The rule, its bound and proof, short rows and
edits of the schedule: ``docs/mixtures.md``.

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
import difflib
import json
import math
from collections import Counter
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
        if not isinstance(self.weights, Mapping) or not self.weights:
            raise ValueError(f"weights must be a non-empty mapping of source name to weight, got {self.weights!r}")
        for name, weight in self.weights.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"weights: a source name must be a non-empty str, got {name!r}")
            if not _number(weight) or weight < 0:
                raise ValueError(f"weights: {name!r} is {weight!r}; a weight must be a finite number >= 0")
        if not any(w > 0 for w in self.weights.values()):
            raise ValueError(f"weights: at least one must be positive, got {dict(self.weights)!r}")
        object.__setattr__(self, "start", float(self.start))
        object.__setattr__(self, "ramp", float(self.ramp))
        object.__setattr__(self, "weights", MappingProxyType({k: float(v) for k, v in sorted(self.weights.items())}))

    def describe(self) -> str:
        weights = ", ".join(f"{k}: {v:g}" for k, v in self.weights.items())
        return f"start {self.start:g}, ramp {self.ramp:g}, weights {{{weights}}}"


@dataclass(frozen=True)
class MixtureSchedule:
    """Each source's weight over progress, counted in ``unit``: ``"tokens"`` (real tokens trained
    over every replica) or ``"steps"`` (global steps); ``phases`` start at 0 and then increase.

    >>> MixtureSchedule.constant({"web": 3, "code": 1}).weights_at(123)
    {'code': 0.25, 'web': 0.75}
    """

    phases: tuple[Phase, ...]
    unit: Unit = "tokens"

    def __post_init__(self) -> None:
        phases = tuple(self.phases) if isinstance(self.phases, list) else self.phases
        if not isinstance(phases, tuple) or not phases or not all(isinstance(p, Phase) for p in phases):
            raise ValueError(f"phases must be a non-empty tuple of Phase, got {self.phases!r}")
        object.__setattr__(self, "phases", phases)
        if self.unit not in ("tokens", "steps"):
            raise ValueError(f"unit must be 'tokens' or 'steps', got {self.unit!r}")
        if phases[0].start != 0 or phases[0].ramp != 0:
            raise ValueError(f"phase 0: start must be 0, and ramp 0 (nothing to ramp from), got {phases[0].describe()}")
        for i, (before, phase) in enumerate(zip(phases, phases[1:]), 1):
            if phase.start <= before.start:
                raise ValueError(
                    f"phase {i}: start {phase.start:g} must be after phase {i - 1}'s start {before.start:g}"
                )
            if before.ramp > phase.start - before.start:
                raise ValueError(
                    f"phase {i - 1}: ramp {before.ramp:g} is longer than the phase (phase {i} starts at {phase.start:g})"
                )

    @classmethod
    def constant(cls, weights: Mapping[str, float], unit: Unit = "tokens") -> MixtureSchedule:
        """One phase: these weights throughout."""
        return cls((Phase(0, weights),), unit)

    @classmethod
    def from_mapping(cls, data: Any, where: str = "mixture schedule") -> MixtureSchedule:
        """A schedule from its config form (parsed JSON or TOML; :meth:`to_mapping` writes it)::

            {"unit": "tokens", "phase": [{"start": 0, "weights": {"web": 0.7, "code": 0.3}},
                                         {"start": 9e6, "ramp": 1e6, "weights": {"web": 0.3, "math": 0.7}}]}

        or ``{"weights": {...}}`` for constant weights. Unknown keys are refused, naming them;
        ``where`` begins every error (a file's path).
        """
        try:
            _known(data, ("phase", "unit", "weights"))
            if ("phase" in data) == ("weights" in data):
                raise ValueError(
                    "give either phase (a list of phases) or weights (constant weights), not both or neither"
                )
            phases = [{"start": 0, "weights": data["weights"]}] if "weights" in data else data["phase"]
            if not isinstance(phases, (list, tuple)) or not phases:
                raise ValueError(f"phase must be a non-empty list of phases, got {phases!r}")
            return cls(tuple(_phase(i, raw) for i, raw in enumerate(phases)), data.get("unit", "tokens"))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

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
        """The config form, plain values (:meth:`from_mapping` reads it back to an equal schedule)."""
        return {
            "unit": self.unit,
            "phase": [{"start": p.start, "ramp": p.ramp, "weights": dict(p.weights)} for p in self.phases],
        }


def _known(data: Any, known: tuple[str, ...]) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"must be a table (mapping) with {', '.join(known)}, got {type(data).__qualname__}")
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, 1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown key {key!r}{hint}; known: {', '.join(known)}")


def _phase(i: int, raw: Any) -> Phase:
    try:
        _known(raw, ("ramp", "start", "weights"))
        if "start" not in raw or "weights" not in raw:
            raise ValueError("missing start or weights")
        return Phase(raw["start"], raw["weights"], raw.get("ramp", 0.0))
    except ValueError as e:
        raise ValueError(f"phase {i}: {e}") from None


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
        step, short = _Step(self, self.weights_at(progress)), short or {}
        every: list[list[str]] = [[] for _ in range(self.dp_size)]
        counts: list[Counter[str]] = [Counter() for _ in range(self.dp_size)]

        def taken(names: list[str]) -> set[tuple[int, str, int]]:
            return {(r, name, counts[r][name]) for r, name in enumerate(names)} & short.keys()

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
                counts[r][name] += 1
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
            raise ValueError(
                f"mixture state: expected Allocation.state_dict() of version {STATE_VERSION} ({', '.join(keys)})"
            )
        saved, last, excluded = (
            MixtureSchedule.from_mapping(json.loads(state["schedule"]), "mixture state: schedule"),
            _progress(state["progress"]),
            frozenset(state["excluded"]),
        )
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


class _Step:
    """One step's working counters: a column is computed without changing them, then taken."""

    def __init__(self, allocation: Allocation, weights: dict[str, float]) -> None:
        if not weights:
            raise RuntimeError(f"mixture: every active source was excluded (ran out): {sorted(allocation.excluded)}")
        self.rows, self.owed, self.replicas = dict(allocation.rows), dict(allocation.owed), allocation.replicas.copy()
        self.weights, self.names = list(weights.items()), list(weights)
        self.columns = [list(allocation.rows).index(name) for name in self.names]
        self.vector = np.array(list(weights.values()))
        self.delta = 1 / (2 * len(weights) - 2) if len(weights) > 1 else 0.0

    def column(self) -> tuple[list[str], dict[str, float], np.ndarray]:
        """Row ``j`` of every replica: its sources over all replicas by Tijdeman's rule, each
        placed on a replica greatest per-replica deficit first (ties: replica, then source); with
        the counters after it, over all replicas and per replica."""
        dp, owed, picks = len(self.replicas), dict(self.owed), Counter[str]()
        for _ in range(dp):
            for name, weight in self.weights:
                owed[name] += weight
            chosen, soonest = None, math.inf
            for name, weight in self.weights:  # earliest deadline among the eligible; ties: first name
                if owed[name] >= self.delta - _SLACK and (1 - self.delta - owed[name]) / weight < soonest:
                    chosen, soonest = name, (1 - self.delta - owed[name]) / weight
            if chosen is None:  # none eligible: only after a change of weights left deficits behind
                chosen = max(self.names, key=owed.__getitem__)
            owed[chosen] -= 1.0
            picks[chosen] += 1
        deficit = self.replicas[:, self.columns] + self.vector  # (replica, active source)
        placed, left = [""] * dp, dp
        for flat in np.argsort(-deficit, axis=None, kind="stable").tolist():  # ties in (replica, source) order
            r, k = divmod(flat, len(self.names))
            if not placed[r] and picks[self.names[k]] > 0:
                placed[r], left = self.names[k], left - 1
                picks[self.names[k]] -= 1
                deficit[r, k] -= 1.0
                if not left:
                    break
        return placed, owed, deficit

    def take(self, column: tuple[list[str], dict[str, float], np.ndarray]) -> None:
        names, self.owed, self.replicas[:, self.columns] = column
        for name in names:
            self.rows[name] += 1

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
    old: MixtureSchedule, new: MixtureSchedule, progress: float, rows: Mapping[str, float], excluded: frozenset[str]
) -> list[str]:
    """What an edit of the schedule changes, one line each, for the log."""
    if old == new:
        return []
    lines = (
        [f"unit: {old.unit} -> {new.unit} (the saved progress {progress:g} is now read in {new.unit})"]
        if old.unit != new.unit
        else []
    )
    for i in range(max(len(old.phases), len(new.phases))):
        a, b = (s.phases[i].describe() if i < len(s.phases) else "none" for s in (old, new))
        lines += [f"phase {i}: {a} -> {b}"] if a != b else []
    for name in sorted(set(new.sources) - set(old.sources)):
        lines.append(
            f"source added: {name}"
            + (f" (continues from its saved counters: {rows[name]} rows)" if rows.get(name) else "")
        )
    for name in sorted(set(old.sources) - set(new.sources)):
        lines.append(f"source dropped: {name} (its counters stay in the state: {rows.get(name, 0)} rows)")
    before, after = (_normalized(s.weights_at(progress), excluded) for s in (old, new))
    pairs = {k: (f"{before.get(k, 0):.4g}", f"{after.get(k, 0):.4g}") for k in sorted(before.keys() | after.keys())}
    moved = [f"{k} {a} -> {b}" for k, (a, b) in pairs.items() if a != b]
    return [*lines, f"weights at progress {progress:g} {new.unit}: {', '.join(moved) or 'unchanged'}"]
