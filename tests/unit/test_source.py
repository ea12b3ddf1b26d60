"""The Source protocol's one adapter (:mod:`collective_loader.delivery.source_protocol`), without processes:
what a plain iterable's state, resume, stop and close become, and what is refused."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from collective_loader import Source
from collective_loader.delivery.source_protocol import IterableSource, as_source, build_source
from collective_loader.streaming.streams import BalancedStream, PackedStream, SampleStream


def test_a_plain_iterable_resumes_by_skipping_with_a_warning():
    source = as_source([{"x": i} for i in range(5)])
    assert isinstance(source, IterableSource) and not source.elastic
    assert source.state_dict() is None and source.checkpoint_state(None) is None
    source.resume(None, 3)
    with pytest.warns(UserWarning, match="resuming by skipping 3 batches"):
        assert [b["x"] for b in source] == [3, 4]
    assert [b["x"] for b in source] == [0, 1, 2, 3, 4]  # the skip was for one epoch only


def test_a_stateful_dataloader_resumes_from_its_own_state():
    def loader():
        return StatefulDataLoader([{"x": torch.tensor(i)} for i in range(6)], batch_size=2)

    first = as_source(loader())
    it = iter(first)
    next(it)
    state = first.state_dict()
    second = as_source(loader())
    second.resume(state, steps=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="the source has no state_dict")  # no skipping: its own state
        assert [b["x"].tolist() for b in second] == [[2, 3], [4, 5]]


def test_stop_ends_a_generator_and_close_calls_the_iterable_s_close():
    events = []

    class Numbers:
        def __iter__(self):
            try:
                yield from ({"x": i} for i in range(10))
            finally:
                events.append("generator closed")

        def close(self):
            events.append("closed")

    source = as_source(Numbers())
    it = iter(source)
    next(it)
    source.stop()
    assert events == ["generator closed"]
    source.close()
    assert events == ["generator closed", "closed"]


def test_stop_ends_dataloader_workers_at_once():
    source = as_source(DataLoader(list(range(8)), batch_size=2, num_workers=1))
    it = iter(source)
    next(it)
    workers = list(it._workers)  # type: ignore[attr-defined]
    source.stop()
    for w in workers:
        w.join(timeout=5)
    assert not any(w.is_alive() for w in workers)


def test_build_source_calls_a_callable_and_refuses_what_is_not_iterable():
    assert [b["x"] for b in build_source(lambda: [{"x": 1}])] == [1]
    with pytest.raises(TypeError, match="source must be an iterable or a callable, got int"):
        build_source(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"source\(\) returned a int, which is not iterable"):
        build_source(lambda: 3)  # type: ignore[arg-type, return-value]


def test_a_source_is_kept_as_it_is_and_the_streams_are_sources():
    class Own:
        elastic = True

        def __iter__(self):
            return iter([])

        def state_dict(self):
            return None

        def resume(self, state, steps):
            pass

        def checkpoint_state(self, snapshot):
            return snapshot

        def stop(self):
            pass

        def stats(self):
            return {}

        def close(self):
            pass

    own = Own()
    assert as_source(own) is own
    # what StreamingSource builds on a leader implements the protocol (checked on the classes'
    # members: building one needs a leaders' world)
    members = ("elastic", "state_dict", "resume", "checkpoint_state", "stop", "stats", "close", "__iter__")
    for kind in (SampleStream, PackedStream, BalancedStream):
        assert all(hasattr(kind, m) for m in members), kind
    assert not isinstance([], Source)


class _Partial:
    """A source that forgot ``resume``, ``checkpoint_state`` and ``stats``."""

    elastic = True

    def __iter__(self):
        yield {"x": 1}

    def state_dict(self):
        return {"at": 1}

    def stop(self):
        pass

    def close(self):
        pass


def test_a_partial_source_is_refused_by_name():
    with pytest.raises(TypeError, match=r"_Partial has .*elastic.* but not resume, checkpoint_state, stats"):
        build_source(_Partial)
