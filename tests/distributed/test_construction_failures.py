"""A construction phase that fails on one rank ends construction on every rank, with its error.

Each phase is failed on one rank of a 4-rank world (mesh dp=2, tp=2: leaders 0 and 2): the
loader's argument check, a leader's source, and a leader's ``StreamingDataset`` constructor
(while the other leader waits in streaming's barrier). Before, the other ranks waited in the
next collective (a group creation, a barrier) until a timeout or forever.
"""

from __future__ import annotations

import pytest
import ranks
import torch.distributed as dist

from collective_loader import (
    CollectiveLoader,
    ConstructionError,
    LeaderError,
    LoaderConfig,
    mesh_place,
)
from collective_loader.streaming import StreamingSource
from collective_loader.testing.data import INPUTS, LABELS, write_dataset

MESH = (("dp", "tp"), (2, 2))
FAILING = 2  # the rank (the second replica's leader) whose phase fails
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mds") / "tokens")
    write_dataset(out, 32, 8)
    return out


class _PartialSource:
    """Meant as a Source, but with ``resume`` and none of the rest of what only a Source has."""

    def __iter__(self):
        return iter([])

    def resume(self, state, steps):
        pass

    def close(self):
        pass


class _ElsewhereSource:
    """A source callable that placed the leaders itself (``PlacesLeaders``), on ranks the loader
    does not use: built on every rank, refused on every rank before any leader calls it."""

    leaders = (0, 1)

    def __call__(self):
        raise AssertionError("a source placed elsewhere must not be built")


def build(phase: str, data: str) -> dict:
    mesh = ranks.make_mesh(*MESH)
    me = dist.get_rank()
    dp = mesh_place(mesh, me).dp_rank
    try:
        if phase == "arguments":
            CollectiveLoader(
                lambda: [], mesh, inputs=INPUTS, labels=LABELS, prefetch=0 if me == FAILING else None, timeout=TIMEOUT
            )
        elif phase == "option":  # a misspelt option on one rank
            options = {"prefech": 2} if me == FAILING else {}
            CollectiveLoader(lambda: [], mesh, inputs=INPUTS, labels=LABELS, timeout=TIMEOUT, **options)
        elif phase == "config":  # a config and keywords at once, on one rank
            config = LoaderConfig(inputs=INPUTS, labels=LABELS, timeout=TIMEOUT)
            options = {"prefetch": 2} if me == FAILING else {}
            CollectiveLoader(lambda: [], mesh, config, **options)
        elif phase == "partial":  # one leader's source has part of the Source protocol only
            source = _PartialSource if me == FAILING else (lambda: [])
            CollectiveLoader(source, mesh, inputs=INPUTS, labels=LABELS, timeout=TIMEOUT)
        elif phase == "places_leaders":  # every rank: a source whose leaders are not the loader's
            CollectiveLoader(_ElsewhereSource(), mesh, inputs=INPUTS, labels=LABELS, timeout=TIMEOUT)
        elif phase == "source":

            def source():
                if me == FAILING:
                    raise OSError("no such bucket")
                return []

            CollectiveLoader(source, mesh, inputs=INPUTS, labels=LABELS, timeout=TIMEOUT)
        else:  # a leader's StreamingDataset fails while the other leader is inside its constructor
            # streaming waits download_timeout for a shard index that is not there, then raises
            broken = {"local": data + "-missing", "download_timeout": 2} if me == FAILING else {"local": data}
            source = StreamingSource(mesh, batch_size=2, timeout=TIMEOUT, **broken)
            CollectiveLoader(source, mesh, inputs=INPUTS, labels=LABELS, timeout=TIMEOUT)
    except Exception as e:
        return {"rank": me, "dp": dp, "error": type(e).__name__, "message": str(e)}
    return {"rank": me, "dp": dp, "error": None}


@pytest.mark.parametrize(
    "phase,error,needle",
    [
        (
            "arguments",
            ConstructionError,
            f"rank {FAILING} could not build CollectiveLoader: ValueError: prefetch must be >= 1",
        ),
        ("option", ConstructionError, f"rank {FAILING} could not build CollectiveLoader: TypeError: "),
        ("config", ConstructionError, "give a LoaderConfig or its fields as keywords, not both"),
        ("source", LeaderError, f"leader rank {FAILING} could not build its source: OSError: no such bucket"),
        (
            "places_leaders",
            ConstructionError,
            "ValueError: the source places the replicas' leaders on ranks [0, 1], the loader on [0, 2]",
        ),
        (
            "partial",
            LeaderError,
            "_PartialSource has __iter__, resume, close of the Source protocol but not state_dict",
        ),
        ("dataset", LeaderError, f"leader rank {FAILING} failed while the leaders built their datasets"),
    ],
)
def test_a_phase_failing_on_one_rank_fails_on_every_rank(worlds, data, phase, error, needle):
    records = worlds.get(4).run(build, phase, data, timeout=TIMEOUT + 30)
    messages = {r["message"] for r in records if r["error"]}
    for r in records:
        assert r["error"] == error.__name__, r
        # the failing rank's own error, on every rank: the others did not wait for the timeout (that
        # would be a DeliveryError naming it)
        assert needle in r["message"], r
    assert len(messages) == 1, messages  # the same error everywhere


def build_from_config() -> dict:
    mesh = ranks.make_mesh(*MESH)
    place = mesh_place(mesh, dist.get_rank())
    config = LoaderConfig(inputs=INPUTS, labels=LABELS, timeout=TIMEOUT, prefetch=3)
    batches = [ranks.sample_batch([2 * i + place.dp_rank], 8) for i in range(3)]
    with CollectiveLoader(batches, mesh, config) as loader:
        ids = [batch["sample_id"].tolist() for batch in loader]
        return {"same": loader.config == config, "prefetch": loader.settings.prefetch, "ids": ids, "dp": place.dp_rank}


def test_a_loader_config_builds_the_loader_it_describes(worlds):
    """``CollectiveLoader(source, mesh, LoaderConfig(...))`` is the keyword form's twin: every rank
    delivers its replica's batches and reports the config it was given."""
    for r in worlds.get(4).run(build_from_config, timeout=TIMEOUT + 30):
        assert r["same"] and r["prefetch"] == 3, r
        assert r["ids"] == [[2 * i + r["dp"]] for i in range(3)], r
