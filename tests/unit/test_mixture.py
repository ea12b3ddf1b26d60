"""Data mixtures on a schedule (issue 38), the pure core: :mod:`collective_loader.text.mixture`.

What is checked: the row allocator's bound at constant weights, after every row and over every
window of 8 steps or more (hypothesis over weights, rows per step and windows), and why the
plain "largest deficit first" rule is not used; the schedule's weights at phase boundaries and
inside a ramp; sources starting and stopping; a source excluded and the others renormalized;
resume equal to an uninterrupted run; resume after an edit of the schedule's future (no
catch-up, the change lines); no dependence on the degree of data parallelism; short rows (a
source's last, padded rows) counted by their real tokens, every 8-step window within the bound
across a source's new epochs at dp 4 and 8; the JSON and TOML forms and every refusal, naming the
field.
"""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collective_loader.streaming.mixture_file import read_mixture, schedule_from_mapping, when_exhausted_of
from collective_loader.text.mixture import Allocation, MixtureSchedule

Phase = MixtureSchedule.Phase

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EPS = 1e-9

# relative weights of 2..6 sources: tiny and equal ones included
weight_maps = st.dictionaries(
    st.sampled_from(["books", "code", "math", "papers", "web", "wiki"]),
    st.one_of(st.floats(0.001, 1.0), st.integers(1, 30), st.just(1e-6)),
    min_size=2,
    max_size=6,
)


def delta(n: int) -> float:
    """Tijdeman's margin for n sources: every deficit stays within [delta - 1, 1 - delta]."""
    return 1 / (2 * n - 2) if n > 1 else 0.0


class Rows:
    """An :class:`Allocation` driven step after step: the tests' stateful view of the pure one.
    Without ``dp``, one replica, and ``allocate`` gives its rows alone."""

    def __init__(self, schedule: MixtureSchedule, dp: int | None = None) -> None:
        self.now, self.single = Allocation.start(schedule, dp or 1), dp is None

    def allocate(self, progress, rows, short=None):
        every, self.now = self.now.allocate(progress, rows, short)
        return every[0] if self.single else every

    def exclude(self, name: str) -> None:
        self.now = self.now.exclude(name)

    def resume(self, state, schedule=None, **kwargs) -> list[str]:
        self.now, changes = Allocation.resume(state, schedule or self.now.schedule, self.now.dp_size, **kwargs)
        return changes

    def __getattr__(self, name: str):
        return getattr(self.now, name)


def deficits(allocator: Rows) -> dict[str, float]:
    return dict(allocator.owed)


# --- the bound at constant weights -------------------------------------------------------------


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(weights=weight_maps, rows=st.integers(1, 16), steps=st.integers(8, 40))
def test_every_row_and_every_window_of_8_steps_or_more_is_within_the_bound(weights, rows, steps):
    """After every row each source is within ``1 - delta`` rows of its target; so each window of
    ``W >= 8`` steps (any ``W``, in fact) holds within ``2 - 2 delta < 2`` rows of ``w * W * r``."""
    allocator = Rows(MixtureSchedule.constant(weights))
    w = allocator.weights_at(0)
    n, margin = len(w), delta(len(w))
    sequence = []
    for step in range(steps):
        sequence += allocator.allocate(step, rows)
        for name, d in deficits(allocator).items():  # the allocator's own accounting
            assert margin - 1 - EPS <= d <= 1 - margin + EPS, (name, d)
    # the same from the rows themselves, after every row: count vs k * w
    counts = dict.fromkeys(w, 0)
    prefix = [dict(counts)]
    for k, name in enumerate(sequence, 1):
        counts[name] += 1
        prefix.append(dict(counts))
        for s, weight in w.items():
            assert abs(counts[s] - k * weight) <= 1 - margin + EPS, (k, s, counts[s], k * weight)
    worst = 0.0
    for first in range(steps):
        for last in range(first + 8, steps + 1):
            a, b = prefix[first * rows], prefix[last * rows]
            for s, weight in w.items():
                worst = max(worst, abs(b[s] - a[s] - weight * (last - first) * rows))
    assert worst <= 2 - 2 * margin + EPS, (n, worst)
    assert sum(counts.values()) == steps * rows and set(sequence) <= set(w)


def largest_deficit_first(weights: list[Fraction], rows: int) -> Fraction:
    """The smooth weighted round-robin rule, exactly: the most any source was owed after a row."""
    d = [Fraction(0)] * len(weights)
    worst = Fraction(0)
    for _ in range(rows):
        d = [x + w for x, w in zip(d, weights)]
        j = max(range(len(d)), key=lambda i: (d[i], -i))
        d[j] -= 1
        worst = max(worst, *d)
    return worst


def test_largest_deficit_first_can_owe_more_than_a_row_and_ours_does_not():
    """Why the allocator uses Tijdeman's rule and not the plain largest deficit first."""
    raw = {"a": 12, "b": 12, "c": 3, "d": 1, "e": 1}
    assert largest_deficit_first([Fraction(v, 29) for v in raw.values()], 29) == Fraction(30, 29)
    allocator = Rows(MixtureSchedule.constant(raw))
    worst = 0.0
    for step in range(29 * 4):
        allocator.allocate(step, 1)
        worst = max(worst, *deficits(allocator).values())
    assert worst <= 1 - delta(5) + EPS  # 0.875


def test_two_sources_stay_within_half_a_row():
    allocator = Rows(MixtureSchedule.constant({"web": 0.6, "code": 0.4}))
    assert allocator.allocate(0, 5) == ["web", "code", "web", "code", "web"]
    for step in range(1, 200):
        allocator.allocate(step, 3)
        assert max(abs(d) for d in deficits(allocator).values()) <= 0.5 + EPS


# --- the schedule -------------------------------------------------------------------------------

THREE = MixtureSchedule(
    (
        Phase(0, {"web": 0.7, "code": 0.3}),
        Phase(9e6, {"web": 0.3, "code": 0.2, "math": 0.5}, ramp=1e6),
        Phase(2e7, {"web": 1, "math": 0}),
    )
)


def close(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-12 for k in a)


def test_weights_at_phase_boundaries_and_inside_a_ramp():
    assert THREE.sources == ("code", "math", "web") and THREE.unit == "tokens"
    first = {"code": 0.3, "web": 0.7}
    assert close(THREE.weights_at(0), first) and close(THREE.weights_at(9e6 - 1), first)
    assert close(THREE.weights_at(9e6), first)  # a ramp starts from the previous weights
    assert close(THREE.weights_at(9.5e6), {"code": 0.25, "math": 0.25, "web": 0.5})
    assert close(THREE.weights_at(9.25e6), {"code": 0.275, "math": 0.125, "web": 0.6})
    assert close(THREE.weights_at(1e7), {"code": 0.2, "math": 0.5, "web": 0.3})
    assert close(THREE.weights_at(2e7 - 1), {"code": 0.2, "math": 0.5, "web": 0.3})
    assert THREE.weights_at(2e7) == {"web": 1.0} == THREE.weights_at(1e12)  # a step change; math at 0 stops
    for p in (0, 9.1e6, 9.9e6, 3e7):
        assert abs(sum(THREE.weights_at(p).values()) - 1) < 1e-12
    with pytest.raises(ValueError, match="progress must be a finite number >= 0"):
        THREE.weights_at(-1)


def test_weights_are_relative_and_a_constant_schedule_is_one_phase():
    assert MixtureSchedule.constant({"a": 3, "b": 1, "c": 0}).weights_at(5) == {"a": 0.75, "b": 0.25}
    assert MixtureSchedule.constant({"a": 1}, unit="steps") == MixtureSchedule((Phase(0, {"a": 1}),), "steps")
    phase = Phase(0, {"b": 1, "a": 2})
    assert list(phase.weights) == ["a", "b"] and phase == Phase(0.0, {"a": 2.0, "b": 1.0})
    with pytest.raises(TypeError):
        phase.weights["a"] = 5  # type: ignore[index]
    assert MixtureSchedule([Phase(0, {"a": 1})]).phases == (Phase(0, {"a": 1}),)  # a list is taken as a tuple


def test_sources_start_and_stop_at_phases():
    schedule = MixtureSchedule(
        (Phase(0, {"a": 1, "b": 1}), Phase(10, {"a": 1, "b": 1, "c": 2}), Phase(20, {"a": 1, "c": 0})), unit="steps"
    )
    allocator = Rows(schedule)
    steps = [allocator.allocate(step, 8) for step in range(30)]
    assert all("c" not in rows for rows in steps[:10])  # not started
    assert all(rows == ["a"] * 8 for rows in steps[20:])  # b dropped, c at 0: stopped
    middle = [name for rows in steps[10:20] for name in rows]
    for name, share in {"a": 0.25, "b": 0.25, "c": 0.5}.items():
        assert abs(middle.count(name) - share * 80) < 2, (name, middle.count(name))


@FAST
@given(
    phases=st.lists(
        st.tuples(st.integers(1, 12), st.integers(0, 12), st.lists(st.floats(0.01, 1), min_size=4, max_size=4)),
        min_size=1,
        max_size=4,
    ),
    rows=st.integers(1, 8),
)
def test_changing_weights_keep_the_lower_bound_and_the_books_balanced(phases, rows):
    """Under ramps and step changes (every source active throughout) no bound of one row is
    proven; what is: each deficit stays >= delta - 1, they sum to 0, hence each < n - 1.
    (Measured, 3000 schedules changing every step: at most 1.42; ramps alone stay within
    1 - delta.)"""
    names, start, built = ["a", "b", "c", "d"], 0, [Phase(0, {"a": 1, "b": 1, "c": 1, "d": 1})]
    for length, ramp, weights in phases:
        start += 12
        built.append(Phase(start, dict(zip(names, weights)), ramp=min(ramp, length)))
    allocator = Rows(MixtureSchedule(tuple(built), unit="steps"))
    for step in range(start + 13):
        for _ in range(rows):
            allocator.allocate(step, 1)
            d = deficits(allocator)
            assert min(d.values()) >= delta(4) - 1 - EPS and abs(sum(d.values())) < 1e-9
            assert max(d.values()) < 3


# --- exclusion ----------------------------------------------------------------------------------


def test_an_excluded_source_stops_and_the_others_share_its_weight():
    allocator = Rows(MixtureSchedule.constant({"a": 0.5, "b": 0.3, "c": 0.2}))
    for step in range(5):
        allocator.allocate(step, 10)
    allocator.exclude("c")
    allocator.exclude("c")  # idempotent
    assert allocator.excluded == {"c"} and allocator.weights_at(5) == pytest.approx({"a": 0.625, "b": 0.375})
    before = allocator.rows
    after = [name for step in range(5, 25) for name in allocator.allocate(step, 10)]
    assert "c" not in after and allocator.rows["c"] == before["c"]
    assert abs(after.count("a") - 0.625 * 200) < 2 and abs(after.count("b") - 0.375 * 200) < 2
    assert allocator.state_dict()["excluded"] == ["c"]
    allocator.exclude("a")
    allocator.exclude("b")
    assert allocator.weights_at(30) == {}
    with pytest.raises(RuntimeError, match=r"every active source was excluded \(ran out\): \['a', 'b', 'c'\]"):
        allocator.allocate(30, 1)


def test_allocate_refuses_progress_going_back():
    allocator = Rows(MixtureSchedule.constant({"a": 1}))
    assert allocator.allocate(5, 0) == [] and allocator.progress == 5
    with pytest.raises(ValueError, match="progress went back from 5 to 4"):
        allocator.allocate(4, 1)


# --- resume -------------------------------------------------------------------------------------


def run(allocator: Rows, steps: range, rows: int, per_step: float = 1.0) -> list[list[str]]:
    return [allocator.allocate(step * per_step, rows) for step in steps]


@FAST
@given(split=st.integers(0, 40), rows=st.integers(1, 12))
def test_resume_equals_an_uninterrupted_run(split, rows):
    """Allocate N steps = allocate k, save (through JSON: the state is plain values), load into a
    new allocator, allocate N - k: the same rows and the same final state, to the bit."""
    schedule = MixtureSchedule(
        (Phase(0, {"a": 0.7, "b": 0.2, "c": 0.1}), Phase(13, {"a": 0.2, "b": 0.3, "d": 0.5}, ramp=9)), unit="steps"
    )
    whole = Rows(schedule)
    expected = run(whole, range(40), rows)
    first = Rows(schedule)
    got = run(first, range(split), rows)
    state = json.loads(json.dumps(first.state_dict()))
    second = Rows(schedule)
    assert second.resume(state) == []
    got += run(second, range(split, 40), rows)
    assert got == expected and second.state_dict() == whole.state_dict()


def test_the_state_is_plain_values_and_names_no_dp():
    allocator = Rows(THREE)
    allocator.allocate(0, 3)
    allocator.exclude("code")
    state = allocator.state_dict()
    assert set(state) == {"version", "schedule", "progress", "excluded", "rows", "owed", "replicas"}
    assert schedule_from_mapping(json.loads(state["schedule"])) == THREE
    assert state["excluded"] == ["code"] and state["rows"] == {"code": 1, "math": 0, "web": 2}
    assert state["owed"] == pytest.approx({"code": -0.1, "math": 0.0, "web": 0.1})
    assert state["replicas"] == {"code": [pytest.approx(-0.1)], "math": [0.0], "web": [pytest.approx(0.1)]}


def test_an_edit_is_refused_unless_allowed_naming_what_changed():
    old = MixtureSchedule.constant({"web": 0.5, "code": 0.5}, unit="steps")
    allocator = Rows(old)
    run(allocator, range(20), 8)
    state = allocator.state_dict()
    new = MixtureSchedule(
        (Phase(0, {"web": 0.5, "code": 0.5}), Phase(20, {"web": 0.6, "code": 0.1, "math": 0.3})), "steps"
    )
    with pytest.raises(ValueError, match="allow_edit=True") as refused:
        Rows(new).resume(state)
    assert "source added: math" in str(refused.value)
    resumed = Rows(new)
    lines = resumed.resume(state, allow_edit=True, progress=20)
    assert lines == [
        "phase 1: none -> start 20, ramp 0, weights {code: 0.1, math: 0.3, web: 0.6}",
        "source added: math",
        "weights at progress 20 steps: code 0.5 -> 0.1, math 0 -> 0.3, web 0.5 -> 0.6",
    ]
    assert resumed.schedule == new and resumed.progress == 19 and resumed.rows == {"code": 80, "math": 0, "web": 80}
    after = [name for rows in run(resumed, range(20, 45), 8) for name in rows]
    for name, share in {"web": 0.6, "code": 0.1, "math": 0.3}.items():
        assert abs(after.count(name) - share * len(after)) < 2, (name, after.count(name))
    # the schedule given to load_state_dict replaces the allocator's own
    other = Rows(old)
    assert other.resume(state, new, allow_edit=True, progress=20) == lines and other.schedule == new
    # without the progress it resumes at, the weights are compared at the last step's
    assert other.resume(state, new, allow_edit=True)[-1] == "weights at progress 19 steps: unchanged"
    with pytest.raises(ValueError, match="progress 18 is before the saved progress 19"):
        other.resume(state, new, allow_edit=True, progress=18)


def test_an_edit_never_makes_a_source_catch_up_for_the_past():
    """Half code for 20 steps, then the whole schedule edited to 10% code: from then on code gets
    10% of the rows, at once. Recomputing its target from the edited schedule would owe it
    -64 rows: no code at all for 80 steps."""
    allocator = Rows(MixtureSchedule.constant({"web": 0.5, "code": 0.5}, unit="steps"))
    run(allocator, range(20), 8)
    state = allocator.state_dict()
    resumed = Rows(MixtureSchedule.constant({"web": 0.9, "code": 0.1}, unit="steps"))
    assert resumed.resume(state, allow_edit=True, progress=20) == [
        "phase 0: start 0, ramp 0, weights {code: 0.5, web: 0.5} -> start 0, ramp 0, weights {code: 0.1, web: 0.9}",
        "weights at progress 20 steps: code 0.5 -> 0.1, web 0.5 -> 0.9",
    ]
    for first in range(20, 60, 8):  # every window of 8 steps
        window = [name for rows in run(resumed, range(first, first + 8), 8) for name in rows]
        assert abs(window.count("code") - 0.1 * 64) < 2 and abs(window.count("web") - 0.9 * 64) < 2


def test_a_dropped_source_keeps_its_counters_and_continues_them_when_added_again():
    three = MixtureSchedule.constant({"web": 0.5, "code": 0.3, "books": 0.2})
    allocator = Rows(three)
    run(allocator, range(10), 10)
    books = allocator.rows["books"], allocator.targets["books"]
    two = Rows(MixtureSchedule.constant({"web": 0.6, "code": 0.4}))
    assert two.resume(allocator.state_dict(), allow_edit=True) == [
        "phase 0: start 0, ramp 0, weights {books: 0.2, code: 0.3, web: 0.5} -> start 0, ramp 0, weights {code: 0.4, web: 0.6}",
        "source dropped: books (its counters stay in the state: 20 rows)",
        "weights at progress 9 tokens: books 0.2 -> 0, code 0.3 -> 0.4, web 0.5 -> 0.6",
    ]
    assert all("books" not in rows for rows in run(two, range(10, 20), 10))
    state = two.state_dict()
    assert state["rows"]["books"] == books[0]
    again = Rows(three)
    lines = again.resume(state, allow_edit=True)
    assert "source added: books (continues from its saved counters: 20 rows)" in lines
    assert (again.rows["books"], again.targets["books"]) == books


def test_a_bad_state_is_refused_naming_what_is_wrong():
    good = Rows(THREE).state_dict()
    cases = [
        ({k: v for k, v in good.items() if k != "progress"}, "expected an Allocation.state_dict\\(\\) of version 2"),
        ({**good, "version": 1}, "of version 2"),
        ({**good, "progress": -1.0}, "progress must be a finite number >= 0"),
        ([], "expected an Allocation.state_dict"),
    ]
    for state, needle in cases:
        with pytest.raises(ValueError, match=needle):
            Rows(THREE).resume(state)  # type: ignore[arg-type]


# --- data parallelism ---------------------------------------------------------------------------


def test_the_allocation_does_not_depend_on_the_dp_degree():
    """Nothing in the allocator names a rank or a DP degree: every leader computes the same rows,
    and at constant weights the row sequence does not depend on how it is cut into steps, so a
    run resumed at another DP degree (rows per replica changed to keep the global batch)
    continues the very sequence an uninterrupted run makes."""
    schedule = MixtureSchedule.constant({"web": 0.55, "code": 0.3, "math": 0.15})
    leaders = [Rows(schedule) for _ in range(4)]
    assert len({tuple(a.allocate(0, 16)) for a in leaders}) == 1
    flat = [name for rows in run(Rows(schedule), range(24), 8) for name in rows]
    assert flat == [name for rows in run(Rows(schedule), range(48), 4) for name in rows]
    # dp 2 -> 4 (8 -> 4 rows per replica) at step 10, through a saved state
    dp2 = Rows(schedule)
    cut = [name for rows in run(dp2, range(10), 8) for name in rows]
    dp4 = Rows(schedule)
    assert dp4.resume(dp2.state_dict()) == []
    cut += [name for rows in run(dp4, range(20, 48), 4) for name in rows]
    assert cut == flat


# --- every replica's rows at once ---------------------------------------------------------------


# derandomized: the per-replica bound is measured, not proven, so the examples are fixed
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(weights=weight_maps, dp=st.integers(1, 12), rows=st.integers(1, 6), steps=st.integers(4, 30))
def test_over_all_replicas_each_source_stays_within_a_row_and_each_replica_within_four(weights, dp, rows, steps):
    """At constant weights the allocation over all replicas keeps the Rows's bound (its
    columns of dp rows are its rows), and every replica's own count stays within 4 rows of its
    target (no bound is proven: the worst measured was 3.25; 5 equal weights at dp 5 reach 3.2)."""
    allocator = Rows(MixtureSchedule.constant(weights), dp)
    share = allocator.weights_at(0)
    n = len(share)
    per_replica = [dict.fromkeys(share, 0) for _ in range(dp)]
    for step in range(steps):
        for replica, names in enumerate(allocator.allocate(step, rows)):
            assert len(names) == rows
            for name in names:
                per_replica[replica][name] += 1
        done = (step + 1) * rows
        for name, weight in share.items():
            total = sum(counts[name] for counts in per_replica)
            assert abs(total - weight * done * dp) <= 1 - delta(n) + EPS, (name, step)
            for counts in per_replica:
                assert abs(counts[name] - weight * done) <= 4, (name, step, counts)


def test_a_replicas_rows_do_not_depend_on_how_its_steps_are_cut():
    schedule = MixtureSchedule.constant({"web": 0.55, "code": 0.3, "math": 0.15})
    whole, cut = Rows(schedule, 4), Rows(schedule, 4)
    by_step = [whole.allocate(0, 8) for _ in range(5)]
    by_row = [cut.allocate(0, 1) for _ in range(40)]
    for replica in range(4):
        assert [n for step in by_step for n in step[replica]] == [n for row in by_row for n in row[replica]]


def test_the_replicas_state_resumes_exactly_and_at_another_dp_degree_goes_on_over_all():
    schedule = MixtureSchedule.constant({"web": 0.5, "code": 0.3, "math": 0.2})
    whole = Rows(schedule, 4)
    want = [whole.allocate(0, 4) for _ in range(12)]
    first = Rows(schedule, 4)
    got = [first.allocate(0, 4) for _ in range(5)]
    again = Rows(schedule, 4)
    assert again.resume(first.state_dict()) == []
    got += [again.allocate(0, 4) for _ in range(7)]
    assert got == want
    # at dp 2 (8 rows per replica, the same global batch) the columns over all replicas go on
    two = Rows(schedule, 2)
    two.resume(first.state_dict())
    for _ in range(7):
        two.allocate(0, 8)
    assert two.rows == whole.rows


# --- short rows -----------------------------------------------------------------------------------


def test_a_short_row_counts_its_real_tokens_and_the_state_carries_it():
    rows = Rows(MixtureSchedule.constant({"web": 0.75, "code": 0.25}))
    assert rows.allocate(0, 1) == ["web"]
    # code's next row holds half a row of real tokens: it counts 0.5, every target grows by 0.5 row's weight
    assert rows.allocate(1, 1, {(0, "code", 0): 0.5}) == ["code"]
    assert rows.rows == {"code": 0.5, "web": 1}
    assert rows.targets == pytest.approx({"code": 0.375, "web": 1.125})  # the weights of 1.5 rows
    assert rows.allocate(2, 4) == ["web", "web", "code", "web"]  # and the next rows make up for it
    again = Rows(rows.schedule)
    again.resume(json.loads(json.dumps(rows.state_dict())))
    assert again.state_dict() == rows.state_dict() and again.allocate(6, 8) == rows.allocate(6, 8)


def repeating(dp: int, rows: int, epoch: list[list[float]], steps: int = 60, credit: bool = True) -> np.ndarray:
    """``rep`` at 1/4 beside ``big``, over ``dp`` replicas, as ``MixtureStream`` runs it: replica
    ``r``'s part of every epoch of ``rep`` holds rows of ``epoch[r]`` real rows each (1: full,
    the last padded); a step that would take a row a replica lacks begins a new epoch of ``rep``
    (the rows left dropped); the allocator is told the short rows among every replica's next
    ``rows`` rows, and allocates again when they are not the ones it was told of. Per step, the
    real rows of ``rep`` and of the step over all replicas."""
    allocator = Allocation.start(MixtureSchedule.constant({"big": 0.75, "rep": 0.25}, unit="steps"), dp)
    parts = [list(part) for part in epoch]
    known: dict[tuple[int, str, int], float] = {}
    out = []
    for step in range(steps):
        while True:
            every, trial = allocator.allocate(step, rows, known)
            need = [names.count("rep") for names in every]
            heard = {(r, "rep", i): 1 - f for r, part in enumerate(parts) for i, f in enumerate(part[:rows]) if f < 1}
            if credit and heard != known:
                known = heard
                continue
            if any(n > len(part) for n, part in zip(need, parts)):
                parts = [list(part) for part in epoch]  # a new epoch of rep on every replica
                continue
            break
        allocator = trial
        rep = sum(sum(part[:n]) for part, n in zip(parts, need))
        out.append((rep, dp * rows - sum(n - sum(part[:n]) for part, n in zip(parts, need))))
        parts = [part[n:] for part, n in zip(parts, need)]
        known = {(r, name, i - need[r]): f for (r, name, i), f in known.items() if i >= need[r]}
    return np.array(out)


def worst_window(real: np.ndarray, width: int = 8) -> float:
    """The largest ``|real rows of rep - 1/4 x real rows|`` over the windows of ``width`` steps."""
    sums = np.array([real[i : i + width].sum(0) for i in range(len(real) - width + 1)])
    return float(np.abs(sums[:, 0] - 0.25 * sums[:, 1]).max())


@pytest.mark.parametrize("dp, rows", [(4, 2), (8, 1), (8, 2)])
def test_short_rows_counted_by_their_real_tokens_keep_every_window_within_the_bound(dp, rows):
    """Every replica's part of ``rep`` ends in a padded row, together (the distributed test's
    data: 28-token documents, rows of 32) or apart (random parts): counted by their real tokens,
    every window of 8 steps over all replicas stays within 1.5 rows (the documented bound; 1.00
    the worst here); counted as full rows it did not (2.81 rows at dp 4, 5.62 at dp 8)."""
    rng = np.random.default_rng(dp * 10 + rows)
    cases = [[[1, 1, 17 / 32] if dp == 8 else [1] * 5 + [2 / 32]] * dp]
    cases += [[[1] * int(rng.integers(2, 6)) + [rng.integers(1, 32) / 32] for _ in range(dp)] for _ in range(8)]
    credited = max(worst_window(repeating(dp, rows, epoch)) for epoch in cases)
    full = max(worst_window(repeating(dp, rows, epoch, credit=False)) for epoch in cases)
    assert credited <= 1.5 < full, (credited, full)


def test_parts_that_end_together_in_nearly_empty_rows_are_made_up_only_in_the_next_epoch():
    """A limit: when every replica's part ends in a row of 2 real tokens of 32 at the same step,
    every row of ``rep`` left is such a row, so only its next epoch can make up the difference:
    1.62 rows (5.62 counted as full rows), the worst window ending before the new epoch's rows."""
    epoch = [[1, 1, 2 / 32]] * 8
    assert worst_window(repeating(8, 1, epoch)) < 1.7 < 5 < worst_window(repeating(8, 1, epoch, credit=False))


def test_short_rows_beyond_a_step_s_reach_change_nothing():
    """A step takes at most ``rows`` rows of a source from a replica (its first pass too), so the
    short rows among each replica's next ``rows`` rows are all the allocation reads (what
    ``MixtureStream`` tells it): rows further on, queued or not, change nothing."""
    schedule = MixtureSchedule.constant({"web": 0.5, "code": 0.3, "math": 0.2})
    a, b = Rows(schedule, 4), Rows(schedule, 4)
    short = {(1, "code", 0): 0.75, (2, "web", 1): 0.5, (0, "web", 0): 0.25}
    assert a.allocate(0, 4, short) == b.allocate(0, 4, {**short, (0, "math", 4): 0.5, (3, "code", 7): 0.25})
    c = Rows(schedule, 4)
    c.allocate(0, 4)
    assert a.state_dict() == b.state_dict() and a.rows != c.rows  # the short rows were credited


def test_when_exhausted_is_read_per_source_and_a_bad_one_is_refused_naming_it():
    assert when_exhausted_of({"a": {}, "b": {"when_exhausted": "stop"}}) == {"a": "end", "b": "stop"}
    with pytest.raises(ValueError, match=r"sources\.b\.when_exhausted must be one of end, repeat, stop; got 'again'"):
        when_exhausted_of({"a": {}, "b": {"when_exhausted": "again"}})


# --- the config forms ---------------------------------------------------------------------------

TOML = """
unit = "tokens"
[[phase]]
start = 0
weights = { web = 0.7, code = 0.3 }
[[phase]]
start = 9e6
ramp = 1e6
weights = { web = 0.3, code = 0.2, math = 0.5 }
[[phase]]
start = 20_000_000
weights = { web = 1, math = 0 }
"""


SOURCES = {"web": {"local": "/data/web"}, "code": {"local": "/data/code", "shuffle": True}, "math": {"local": "/m"}}
SOURCES_TOML = """
[sources.web]
local = "/data/web"
[sources.code]
local = "/data/code"
shuffle = true
[sources.math]
local = "/m"
"""


def test_toml_and_json_files_read_to_the_sources_and_the_schedule(tmp_path):
    (tmp_path / "mix.toml").write_text(TOML + SOURCES_TOML)
    assert read_mixture(tmp_path / "mix.toml") == (SOURCES, THREE)
    (tmp_path / "mix.json").write_text(json.dumps({**THREE.to_mapping(), "sources": SOURCES}))
    assert read_mixture(str(tmp_path / "mix.json")) == (SOURCES, THREE)
    constant = {"unit": "steps", "weights": {"web": 2, "code": 1}, "sources": SOURCES}
    (tmp_path / "constant.json").write_text(json.dumps(constant))
    assert read_mixture(tmp_path / "constant.json")[1] == MixtureSchedule.constant({"web": 2, "code": 1}, unit="steps")


@given(weights=weight_maps, unit=st.sampled_from(["tokens", "steps"]))
@settings(max_examples=30, deadline=None)
def test_the_config_form_round_trips(weights, unit):
    schedule = MixtureSchedule((Phase(0, weights), Phase(5, {"x": 1}, ramp=2.5)), unit)
    assert schedule_from_mapping(json.loads(json.dumps(schedule.to_mapping()))) == schedule


@pytest.mark.parametrize(
    "data,needle",
    [
        ({"phases": []}, "unknown key 'phases' \\(did you mean 'phase'\\?\\); known: phase, unit, weights"),
        ({"phase": [{"start": 0, "weights": {"a": 1}, "ramp_length": 1}]}, "phase 0: unknown key 'ramp_length'"),
        ({"phase": [{"weights": {"a": 1}}]}, "phase 0: missing start"),
        (
            {"phase": [{"start": 0, "weights": {"a": 1}}, {"start": "9e6", "weights": {"a": 1}}]},
            "phase 1: start must be",
        ),
        (
            {"phase": [{"start": 0, "weights": {"a": -1, "b": 1}}]},
            "phase 0: weights must map source names to finite numbers >= 0, at least one positive; got 'a': -1",
        ),
        (
            {"phase": [{"start": 0, "weights": {"a": 0}}]},
            "phase 0: weights must map .*, at least one positive; got \\{'a': 0\\}",
        ),
        ({"phase": [{"start": 0, "weights": {"a": True}}]}, "phase 0: weights must map .* got 'a': True"),
        (
            {"phase": [{"start": 0, "weights": {"a": 1}}, {"start": 5, "weights": {"a": 1}, "ramp": -1}]},
            "phase 1: ramp must be",
        ),
        ({"phase": [{"start": 1, "weights": {"a": 1}}]}, "phase 0: start must be 0, and ramp 0"),
        (
            {"phase": [{"start": 0, "weights": {"a": 1}, "ramp": 1}]},
            "phase 0: start must be 0, and ramp 0 \\(nothing to ramp from\\), got start 0, ramp 1",
        ),
        (
            {"phase": [{"start": 0, "weights": {"a": 1}}, {"start": 0, "weights": {"b": 1}}]},
            "phase 1: start 0 must be after phase 0's, 0",
        ),
        (
            {
                "phase": [
                    {"start": 0, "weights": {"a": 1}},
                    {"start": 10, "weights": {"b": 1}, "ramp": 6},
                    {"start": 15, "weights": {"a": 1}},
                ]
            },
            "phase 1: ramp 6 outlasts the phase \\(phase 2 starts at 15\\)",
        ),
        ({"unit": "samples", "weights": {"a": 1}}, "unit must be 'tokens' or 'steps', got 'samples'"),
        ({"weights": {"a": 1}, "phase": []}, "either phase .* or weights"),
        ({"phase": []}, "phase must be a non-empty list"),
        ({"phase": [3]}, "phase 0: must be a table"),
        ([1, 2], "must be a table"),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(data, needle):
    with pytest.raises(ValueError, match=f"^mixture schedule: .*{needle}"):
        schedule_from_mapping(data)


def test_the_dataclasses_refuse_bad_fields():
    with pytest.raises(ValueError, match="^weights must map .* got 'web': -0.5"):
        Phase(0, {"web": -0.5})
    with pytest.raises(ValueError, match="^ramp must be"):
        Phase(0, {"web": 1}, ramp=float("nan"))
    with pytest.raises(ValueError, match="^weights must map source names .* got '': 1"):
        Phase(0, {"": 1})
    with pytest.raises(ValueError, match="^phases must be a non-empty tuple"):
        MixtureSchedule(())
    with pytest.raises(ValueError, match="^phases must be a non-empty tuple of Phase"):
        MixtureSchedule((Phase(0, {"a": 1}), {"start": 1}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^phase 2: start 3 must be after phase 1's, 4"):
        MixtureSchedule((Phase(0, {"a": 1}), Phase(4, {"a": 1}), Phase(3, {"a": 1})))


def test_bad_files_are_refused_naming_the_file(tmp_path):
    a = "\n[sources.a]\nlocal = '/a'\n"
    cases = {
        "bad.json": ('{"weights": {"a": 1}', "not valid JSON"),
        "bad.toml": ("weights = {a = }", "not valid TOML"),
        "unknown.toml": ("weight = { a = 1 }\n" + a, "unknown key 'weight' \\(did you mean 'weights'\\?\\)"),
        "mix.yaml": ("weights: {a: 1}", "must be a .json or .toml file"),
        "nosources.toml": ("weights = { a = 1 }\n", "needs a sources table"),
        "unsourced.toml": ("weights = { a = 1, b = 1 }\n" + a, "the schedule weighs \\['b'\\]"),
        "flat.json": ('{"weights": {"a": 1}, "sources": {"a": "/a"}}', "must be tables"),
    }
    for name, (text, needle) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=f"^{tmp_path / name}: .*{needle}"):
            read_mixture(tmp_path / name)
    with pytest.raises(ValueError, match="cannot read the mixture"):
        read_mixture(tmp_path / "missing.toml")
