"""Data mixtures on a schedule (issue 38), over real StreamingDatasets on MDS shards written here.

Two sources of numbered token documents whose lengths differ tenfold: ``short`` (10-60 tokens)
and ``long`` (200-800); a third, ``extra``, joins in an edited schedule. Every token says which
source and document it came from, so the checks count tokens, not samples:

* the shares of real tokens follow the schedule over every window of 8 steps, where streaming's
  own ``Stream(proportion=0.5)`` twice gives the long source ~93% of the tokens;
* ``source_id`` names each row's source;
* a resume at the same DP degree continues bit-identically; a resume under an edited schedule
  (other weights, a source added) continues every source from its own cursor, trains no token
  twice, and follows the new weights.
"""

from __future__ import annotations

from collections import Counter
from itertools import islice

import numpy as np
import pytest
import ranks
import torch.distributed as dist
from text_rows import row_tokens
from world import World

from collective_loader import CollectiveLoader
from collective_loader.streaming import MixtureSource
from collective_loader.testing.data import write_token_documents
from collective_loader.text import MixtureSchedule, Packing, TokenColumn

SEQ_LEN, ROWS, DOCS_PER_BATCH = 32, 2, 4
# token ranges per source (uint16): which source a token came from is its range
BASE = {"short": 0, "long": 20000, "extra": 45000}
STRIDE = {"short": 64, "long": 1024, "extra": 64}
LENGTHS = {
    "short": np.random.default_rng(1).integers(10, 61, size=300).tolist(),
    "long": np.random.default_rng(2).integers(200, 801, size=24).tolist(),
    "extra": np.random.default_rng(3).integers(10, 61, size=300).tolist(),
}
KEYS = dict(inputs=("input_ids", "position_ids", "sequence_id"), labels=("labels", "source_id"))


def source_of(token: int) -> str:
    return max((b, n) for n, b in BASE.items() if token >= b)[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mixture")
    out = {}
    for name, lengths in LENGTHS.items():
        docs = [BASE[name] + i * STRIDE[name] + np.arange(n, dtype=np.int64) for i, n in enumerate(lengths)]
        out[name] = str(root / name)
        write_token_documents(out[name], docs, "bytes", "uint16", shard_bytes=1 << 12)
    return out


@pytest.fixture(scope="module")
def world():
    w = World(2)
    yield w
    w.close()


def build(data: dict[str, str], schedule: MixtureSchedule, dp: int = 2) -> CollectiveLoader:
    """dp replicas over the 2 ranks (at dp=1 the second rank is a tp peer of the leader), with the
    same global batch: rows and documents per replica scale with 2 / dp."""
    mesh = ranks.make_mesh(("dp", "tp"), (dp, 2 // dp))
    sources = {
        name: {"local": path, "shuffle": True, "shuffle_seed": 7, "num_canonical_nodes": 2}
        for name, path in data.items()
    }
    source = MixtureSource(
        mesh,
        sources,
        schedule,
        batch_size=ROWS * 2 // dp,
        packing=Packing(SEQ_LEN, "pad", ("position_ids", "sequence_id")),
        layout=TokenColumn(dtype="uint16"),
        documents_per_batch=DOCS_PER_BATCH * 2 // dp,
    )
    return CollectiveLoader(source, mesh, **KEYS)


def rows_of(batch) -> list[tuple[int, list[int]]]:
    """(source_id, real tokens) of each row."""
    return [(int(s), t.tolist()) for s, t in zip(batch["source_id"], row_tokens(batch))]


HALF = MixtureSchedule.constant({"short": 0.5, "long": 0.5})
EDITED = MixtureSchedule.constant({"short": 0.2, "long": 0.3, "extra": 0.5})


def mixed_run(data: dict[str, str], steps: int) -> dict:
    loader = build({k: v for k, v in data.items() if k != "extra"}, HALF)
    out = [rows_of(b) for b in islice(loader, steps)]
    stats = loader.stats()
    loader.close()
    return {"rows": out, "stats": {k: v for k, v in stats.items() if k.startswith("mixture/")}}


def test_shares_of_tokens_follow_the_weights_in_every_window(world, data):
    steps = 40
    results = world.run(mixed_run, data, steps, timeout=180)
    names = ("long", "short")  # MixtureSource.names: sorted
    for dp_rank, r in enumerate(results):
        assert len(r["rows"]) == steps
        for step_rows in r["rows"]:
            for source_id, tokens in step_rows:
                assert tokens and {source_of(t) for t in tokens} == {names[source_id]}, (dp_rank, source_id)
        assert abs(r["stats"]["mixture/long/share"] - 0.5) < 0.02, r["stats"]
    # both replicas took the same sources for their rows, step by step
    assert [[s for s, _ in rows] for rows in results[0]["rows"]] == [
        [s for s, _ in rows] for rows in results[1]["rows"]
    ]
    # every window of 8 steps: each source's real tokens over both replicas within 2 rows of half
    per_step = [
        Counter({names[s]: len(t) for s, t in rows0 + rows1})
        for rows0, rows1 in zip(results[0]["rows"], results[1]["rows"])
    ]
    for start in range(steps - 8 + 1):
        window = sum(per_step[start : start + 8], Counter())
        total = sum(window.values())
        assert abs(window["long"] - total / 2) <= 2 * 2 * (SEQ_LEN + 1), (start, window)


def resumed_run(data: dict[str, str], before: int, after: int, edit: bool) -> dict:
    """``before`` steps, a checkpoint, then ``after`` steps resumed (under EDITED when ``edit``);
    and the uninterrupted run of ``before + after`` steps."""
    two = {k: v for k, v in data.items() if k != "extra"}
    loader = build(two, HALF)
    whole = [rows_of(b) for b in islice(loader, before + after)]
    loader.close()
    loader = build(two, HALF)
    first = [rows_of(b) for b in islice(loader, before)]
    state = loader.state_dict()
    loader.close()
    loader = build(data if edit else two, EDITED if edit else HALF)
    loader.load_state_dict(state)
    second = [rows_of(b) for b in islice(loader, after)]
    loader.close()
    return {"whole": whole, "first": first, "second": second, "rank": dist.get_rank()}


def test_a_resume_continues_bit_identically(world, data):
    for r in world.run(resumed_run, data, 6, 6, False, timeout=240):
        assert r["first"] + r["second"] == r["whole"], r["rank"]


def test_a_resume_under_an_edited_schedule_continues_every_source_and_repeats_nothing(world, data):
    results = world.run(resumed_run, data, 6, 16, True, timeout=240)
    names = ("extra", "long", "short")  # the edited run's sources, sorted
    trained = Counter()
    for r in results:
        for rows in r["first"]:  # the first part ran with ("long", "short")
            for s, tokens in rows:
                trained.update(tokens)
                assert {source_of(t) for t in tokens} == {("long", "short")[s]}
        for rows in r["second"]:
            for s, tokens in rows:
                trained.update(tokens)
                assert {source_of(t) for t in tokens} == {names[s]}
    assert max(trained.values()) == 1  # no token trained twice, across the resume
    after = Counter(names[s] for r in results for rows in r["second"] for s, _ in rows)
    total = sum(after.values())
    for name, weight in (("extra", 0.5), ("long", 0.3), ("short", 0.2)):
        assert abs(after[name] - weight * total) <= 2 * 2, (name, after)


def dp_change_run(data: dict[str, str], before: int, after: int) -> dict:
    """``before`` steps at dp=2, a checkpoint, ``after`` steps resumed at dp=1 (what the leaders
    trained; None on the other rank of the dp=1 run)."""
    two = {k: v for k, v in data.items() if k != "extra"}
    loader = build(two, HALF, dp=2)
    first = [rows_of(b) for b in islice(loader, before)]
    state = loader.state_dict()
    loader.close()
    loader = build(two, HALF, dp=1)
    loader.load_state_dict(state)
    second = [rows_of(b) for b in islice(loader, after)]
    leader = loader.is_leader
    loader.close()
    return {"first": first, "second": second if leader else None}


def test_a_resume_at_another_dp_degree_trains_no_token_twice_and_finishes_every_document_begun(world, data):
    results = world.run(dp_change_run, data, 6, 30, timeout=240)
    trained = Counter(t for r in results for rows in r["first"] for _, tokens in rows for t in tokens)
    begun = {(source_of(t), (t - BASE[source_of(t)]) // STRIDE[source_of(t)]) for t in trained}
    trained.update(t for r in results if r["second"] for rows in r["second"] for _, tokens in rows for t in tokens)
    assert max(trained.values()) == 1  # across the resume, at another DP degree
    for name, doc in begun:  # every document begun before the checkpoint is trained to its end after it
        tokens = BASE[name] + doc * STRIDE[name] + np.arange(LENGTHS[name][doc])
        missing = [int(t) for t in tokens if trained[int(t)] == 0]
        assert not missing, (name, doc, len(missing))
