"""Unit and property tests for :mod:`collective_loader.plan.quorum`: a step's window split over
the quorum's participants, their replicas and micro-batches; the global order; the committed
cursor over a random history of quorums and failed commits (no processes)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collective_loader.plan.quorum import (
    GlobalOrder,
    even_sizes,
    micro_batch_count,
    micro_batch_ranges,
    participant_range,
    step_share,
)

PROPS = settings(max_examples=150, deadline=None)


def positions(ranges) -> list[int]:
    return [p for lo, hi in ranges for p in range(lo, hi)]


@PROPS
@given(
    cursor=st.integers(0, 10_000),
    global_batch=st.integers(1, 64),
    participants=st.integers(1, 9),
    dp_size=st.integers(1, 4),
    micro_batch=st.integers(1, 9),
)
def test_a_step_covers_its_window_once(cursor, global_batch, participants, dp_size, micro_batch):
    """Over every participant, replica and micro-batch: the window [cursor, cursor + G) once, in
    order; micro-batches at most ``micro_batch``; every replica of a participant the same number
    of micro-batches, no more than its largest replica needs."""
    seen = []
    for participant in range(participants):
        shares = [
            step_share(cursor, global_batch, participant, participants, r, dp_size, micro_batch) for r in range(dp_size)
        ]
        counts = {len(s.micro_batches) for s in shares}
        assert len(counts) == 1
        largest = max(s.replica[1] - s.replica[0] for s in shares)
        assert counts == {-(-largest // micro_batch)}
        for s in shares:
            assert all(hi - lo <= micro_batch for lo, hi in s.micro_batches)
            assert positions(s.micro_batches) == list(range(*s.replica))
            seen += positions(s.micro_batches)
    assert seen == list(range(cursor, cursor + global_batch))


@PROPS
@given(global_batch=st.integers(1, 100), participants=st.integers(1, 12))
def test_participants_sizes_differ_by_at_most_one(global_batch, participants):
    sizes = [hi - lo for lo, hi in (participant_range(0, global_batch, r, participants) for r in range(participants))]
    assert sum(sizes) == global_batch and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the first G % n take one more
    assert sizes == even_sizes(global_batch, participants)


def test_a_group_outside_the_step_trains_nothing():
    share = step_share(40, 8, None, 2, 0, 2, 4)
    assert share.micro_batches == () and share.participant is None


def test_refusals():
    with pytest.raises(ValueError):
        participant_range(0, 0, 0, 1)
    with pytest.raises(ValueError):
        participant_range(0, 4, 2, 2)
    with pytest.raises(ValueError):
        micro_batch_count(4, 1, 0)
    with pytest.raises(ValueError):
        micro_batch_ranges(0, 3, 0)
    with pytest.raises(ValueError):
        GlobalOrder(0)


@PROPS
@given(length=st.integers(1, 50), seed=st.integers(0, 5), shuffle=st.booleans(), passes=st.integers(1, 3))
def test_the_global_order_is_one_permutation_per_pass(length, seed, shuffle, passes):
    order = GlobalOrder(length, seed, shuffle)
    everything = order.indices(0, passes * length)
    for e in range(passes):
        assert sorted(everything[e * length : (e + 1) * length]) == list(range(length))
    # any cut into windows reads the same order, on any process (a fresh object)
    cuts = sorted(random.Random(seed).sample(range(passes * length + 1), k=min(4, passes * length + 1)))
    bounds = [0, *cuts, passes * length]
    pieces = [GlobalOrder(length, seed, shuffle).indices(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    assert [i for p in pieces for i in p] == everything
    if not shuffle:
        assert everything[:length] == list(range(length))


def test_passes_are_shuffled_differently():
    order = GlobalOrder(100, seed=3)
    assert order.indices(0, 100) != order.indices(100, 200)
    assert order.indices(0, 100) == GlobalOrder(100, seed=3).indices(0, 100)
    assert order.indices(0, 100) != GlobalOrder(100, seed=4).indices(0, 100)


@PROPS
@given(
    seed=st.integers(0, 10_000),
    global_batch=st.integers(1, 24),
    dp_size=st.integers(1, 3),
    micro_batch=st.integers(1, 5),
    attempts=st.integers(1, 40),
)
def test_committed_steps_train_every_sample_once(seed, global_batch, dp_size, micro_batch, attempts):
    """A random history: each attempt has a quorum of 1-4 participants (some healing, outside
    the step) and commits or not; the cursor moves only on a commit. Over the committed
    attempts, every position below the final cursor is trained exactly once, G per step."""
    rng = random.Random(seed)
    cursor, trained = 0, []
    for _ in range(attempts):
        participants = rng.randint(1, 4)
        served = []
        for participant in [*range(participants), None]:  # None: a healing group
            for r in range(dp_size):
                share = step_share(cursor, global_batch, participant, participants, r, dp_size, micro_batch)
                served += positions(share.micro_batches)
        assert len(served) == global_batch
        if rng.random() < 0.7:  # should_commit() returned True
            trained += served
            cursor += global_batch
    assert sorted(trained) == list(range(cursor))
