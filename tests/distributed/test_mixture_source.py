"""Data mixtures on a schedule (issue 38), over real StreamingDatasets on MDS shards written here.

Two sources of numbered token documents whose lengths differ tenfold: ``short`` (10-60 tokens)
and ``long`` (200-800); ``extra`` joins in an edited schedule; ``tiny`` (12 short documents) runs
out within a few steps, ``rep`` (24 of 28 tokens) every few steps at dp 4 and 8. Every token says
which source and document it came from, so the checks count tokens, not samples. One world of 4
ranks, meshes dp x copies (a dim given its role by ``roles=``) with dp = 1, 2, 4 at the same global
batch (8 rows of 32 tokens per step):

* the shares of real tokens follow each schedule (constant, two phases, a ramp) over every window
  of 8 steps, within the allocator's bound, at dp 1, 2 and 4; ``source_id`` names each row's source;
* a resume at the same DP degree continues bit-identically (also after a source began a new
  epoch); under an edited schedule (other weights, a source added) every source continues from
  its own cursor and no token is trained twice; at another DP degree (2 -> 1, 2 -> 4) no token is
  trained twice and every document begun is finished;
* each policy for a source that runs out: a new shuffled epoch, stop and share its weight, end
  the epoch (on every rank at the same step); a source that runs out and repeats (or stops) at dp 4
  and 8 (a world of 8 ranks): its leaders' last, padded rows count their real tokens, and every
  window of 8 steps stays within the bound;
* per-document context-parallel splits of mixed rows reassemble to rows of one source each.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import islice

import numpy as np
import pytest
import ranks
import torch
import torch.distributed as dist
from text_rows import row_tokens

from collective_loader import CollectiveLoader, PerDocument
from collective_loader.streaming import MixtureSource
from collective_loader.testing.data import write_token_documents
from collective_loader.text import MixtureSchedule, Packing, TokenColumn

Phase = MixtureSchedule.Phase

SEQ_LEN, GLOBAL_ROWS, GLOBAL_DOCS, RANKS = 32, 8, 16, 4
# token ranges per source (uint16): which source a token came from is its range
BASE = {"short": 0, "rep": 19200, "long": 20000, "extra": 45000, "tiny": 64600}
STRIDE = {"short": 64, "rep": 33, "long": 1024, "extra": 64, "tiny": 64}
LENGTHS = {
    "short": np.random.default_rng(1).integers(10, 61, size=300).tolist(),
    "long": np.random.default_rng(2).integers(200, 801, size=24).tolist(),
    "extra": np.random.default_rng(3).integers(10, 61, size=300).tolist(),
    "tiny": np.random.default_rng(4).integers(10, 61, size=12).tolist(),
    # 3 per leader at dp 8, 6 at dp 4 (84 and 168 tokens): every part ends in a row of 17 or 2 real tokens
    "rep": [28] * 24,
}
# the replicas' peers get copies: a dim its name does not tell, so roles= must reach every source
ROLES = {"copies": "replicate"}
KEYS = dict(inputs=("input_ids", "position_ids", "sequence_id"), labels=("labels", "source_id"), roles=ROLES)
STEP_TOKENS = GLOBAL_ROWS * SEQ_LEN  # progress per step, in tokens over every replica
UINT16 = TokenColumn(dtype="uint16")


def source_of(token: int) -> str:
    return max((b, n) for n, b in BASE.items() if token >= b)[1]


def document_of(token: int) -> tuple[str, int]:
    name = source_of(token)
    return name, (token - BASE[name]) // STRIDE[name]


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
def world(worlds):
    return worlds.get(RANKS)


def mixture(
    data: dict[str, str],
    names: tuple[str, ...],
    schedule: MixtureSchedule,
    dp: int,
    allow_edit: bool = False,
    layout: TokenColumn = UINT16,
    **policies: str,
):
    """A MixtureSource of ``names`` over dp replicas of the world's ranks (copies fill the rest),
    at the same global batch whatever dp: rows and documents per replica scale with 1 / dp."""
    mesh = ranks.make_mesh(("dp", "copies"), (dp, dist.get_world_size() // dp))
    sources = {
        name: {"local": data[name], "shuffle": True, "shuffle_seed": 7, "num_canonical_nodes": 4}
        | ({"when_exhausted": policies[name]} if name in policies else {})
        for name in names
    }
    boundaries = ("position_ids", "sequence_id")
    return mesh, MixtureSource(
        mesh,
        sources,
        schedule,
        batch_size=GLOBAL_ROWS // dp,
        packing=Packing(SEQ_LEN, "pad", boundaries),
        layout=layout,
        documents_per_batch=GLOBAL_DOCS // dp,
        allow_edit=allow_edit,
        roles=ROLES,
    )


def build(data, names, schedule, dp: int = 2, allow_edit: bool = False, **policies: str) -> CollectiveLoader:
    mesh, source = mixture(data, names, schedule, dp, allow_edit, **policies)
    return CollectiveLoader(source, mesh, **KEYS)


def rows_of(batch) -> list[tuple[int, list[int]]]:
    """(source_id, real tokens) of each row."""
    return [(int(s), t.tolist()) for s, t in zip(batch["source_id"], row_tokens(batch))]


TWO = ("long", "short")  # MixtureSource.names: sorted
HALF = MixtureSchedule.constant({"short": 0.5, "long": 0.5})
EDITED = MixtureSchedule.constant({"short": 0.2, "long": 0.3, "extra": 0.5})
A, B = {"short": 0.8, "long": 0.2}, {"short": 0.2, "long": 0.8}
SCHEDULES = {
    "constant": HALF,
    "phases": MixtureSchedule((Phase(0, A), Phase(12 * STEP_TOKENS, B))),
    "ramp": MixtureSchedule((Phase(0, A), Phase(16 * STEP_TOKENS, B, ramp=8 * STEP_TOKENS))),
}
STEPS = 24


def shares_run(data: dict[str, str]) -> dict:
    """Every schedule at dp 1, 2, 4: each leader's rows (None elsewhere) and its stats."""
    out = {}
    for dp in (1, 2, 4):
        for name, schedule in SCHEDULES.items():
            loader = build(data, TWO, schedule, dp)
            rows = [rows_of(b) for b in islice(loader, STEPS)]
            stats = loader.stats()
            leader = loader.is_leader
            loader.close()
            out[(name, dp)] = {"rows": rows, "stats": stats} if leader else None
    return out


def test_shares_of_tokens_follow_each_schedule_in_every_window_at_dp_1_2_4(world, data):
    results = world.run(shares_run, data, timeout=300)
    for (name, dp), _ in results[0].items():
        schedule = SCHEDULES[name]
        leaders = [r[(name, dp)] for r in results if r[(name, dp)] is not None]
        assert len(leaders) == dp
        for leader in leaders:
            assert len(leader["rows"]) == STEPS
            for step_rows in leader["rows"]:
                for source_id, tokens in step_rows:
                    assert tokens and {source_of(t) for t in tokens} == {TWO[source_id]}, (name, dp, source_id)
            stats = leader["stats"]
            assert stats["mixture/long/documents"] > 0 and stats["mixture/short/documents"] > 0, stats
            assert abs(stats["mixture/long/share"] - stats["mixture/long/target"]) < 0.05, stats
        # each replica's rows follow the weights too: within 4 rows of its target (measured: 3.25)
        for leader in leaders:
            longs = np.cumsum([sum(s == 0 for s, _ in rows) for rows in leader["rows"]])
            want = np.cumsum(
                [GLOBAL_ROWS // dp * schedule.weights_at(step * STEP_TOKENS)["long"] for step in range(STEPS)]
            )
            assert np.abs(longs - want).max() <= 4, (name, dp, longs, want)
        # every window of 8 steps: the long source's real tokens over every replica against the
        # weights at the window's step starts (what the allocator samples), within its bound over
        # all replicas: one row for two sources at constant weights, 1.5 measured when weights change
        per_step = [Counter() for _ in range(STEPS)]
        for leader in leaders:
            for step, rows in enumerate(leader["rows"]):
                for s, tokens in rows:
                    per_step[step][TWO[s]] += len(tokens)
        bound = (1.0 if name == "constant" else 1.5) * (SEQ_LEN + 1)
        for start in range(STEPS - 8 + 1):
            window = sum(per_step[start : start + 8], Counter())
            total = sum(window.values())
            weight = np.mean(
                [schedule.weights_at(step * STEP_TOKENS).get("long", 0.0) for step in range(start, start + 8)]
            )
            assert abs(window["long"] - weight * total) <= bound, (name, dp, start, window, weight)


def resumed_run(data: dict[str, str], before: int, after: int, edit: bool, **policies: str) -> dict:
    """``before`` steps at dp=2, a checkpoint, then ``after`` steps resumed (under EDITED when
    ``edit``); and the uninterrupted run of ``before + after`` steps (and its stats, on a leader)."""
    names = ("long", "tiny") if policies else TWO
    schedule = MixtureSchedule.constant(dict.fromkeys(names, 0.5))
    loader = build(data, names, schedule, **policies)
    whole = [rows_of(b) for b in islice(loader, before + after)]
    stats = loader.stats() if loader.is_leader else None
    loader.close()
    loader = build(data, names, schedule, **policies)
    first = [rows_of(b) for b in islice(loader, before)]
    state = loader.state_dict()
    loader.close()
    loader = build(data, ("extra", *names) if edit else names, EDITED if edit else schedule, 2, edit, **policies)
    loader.load_state_dict(state)
    second = [rows_of(b) for b in islice(loader, after)]
    leader = loader.is_leader
    loader.close()
    return {"whole": whole, "first": first, "second": second, "rank": dist.get_rank(), "stats": stats, "leader": leader}


def test_a_resume_continues_bit_identically(world, data):
    for r in world.run(resumed_run, data, 6, 6, False, timeout=240):
        assert r["first"] + r["second"] == r["whole"], r["rank"]


def test_a_resume_after_a_source_began_a_new_epoch_continues_bit_identically(world, data):
    # tiny runs out at about step 6 (a row per replica and step); the checkpoint is after it
    for r in world.run(resumed_run, data, 9, 5, False, tiny="repeat", timeout=240):
        assert r["first"] + r["second"] == r["whole"], r["rank"]
        if r["stats"]:
            assert r["stats"]["mixture/tiny/epochs"] >= 2, r["stats"]


def test_a_resume_under_an_edited_schedule_continues_every_source_and_repeats_nothing(world, data):
    results = world.run(resumed_run, data, 6, 16, True, timeout=240)
    names = ("extra", "long", "short")  # the edited run's sources, sorted
    trained = Counter()
    for r in (r for r in results if r["leader"]):  # the tp peers got copies
        for rows in r["first"]:  # the first part ran with ("long", "short")
            for s, tokens in rows:
                trained.update(tokens)
                assert {source_of(t) for t in tokens} == {TWO[s]}
        for rows in r["second"]:
            for s, tokens in rows:
                trained.update(tokens)
                assert {source_of(t) for t in tokens} == {names[s]}
    assert max(trained.values()) == 1  # no token trained twice, across the resume
    # over both replicas, the second part's rows follow the new weights within the allocator's bound
    after = Counter(names[s] for r in results if r["leader"] for rows in r["second"] for s, _ in rows)
    total = sum(after.values())
    for name, weight in (("extra", 0.5), ("long", 0.3), ("short", 0.2)):
        assert abs(after[name] - weight * total) <= 2, (name, after)


def unasked_edit_run(data: dict[str, str]) -> dict:
    """A state saved under HALF loaded under EDITED without ``allow_edit``: what each rank raised."""
    loader = build(data, TWO, HALF)
    list(islice(loader, 3))
    state = loader.state_dict()
    loader.close()
    loader = build(data, ("extra", *TWO), EDITED)
    try:
        loader.load_state_dict(state)
        next(iter(loader))
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e)}
    finally:
        loader.close()
    return {"error": None}


def test_an_edited_schedule_is_refused_on_every_rank_unless_allowed(world, data):
    for r in world.run(unasked_edit_run, data, timeout=240):
        assert r["error"] is not None, r
        assert "allow_edit=True" in r["message"] and "extra" in r["message"], r


def dp_change_run(data: dict[str, str], before: int, after: int, dp_after: int) -> dict:
    """``before`` steps at dp=2, a checkpoint, ``after`` steps resumed at ``dp_after`` (what the
    leaders trained; None elsewhere)."""
    loader = build(data, TWO, HALF, dp=2)
    first = [rows_of(b) for b in islice(loader, before)]
    first_leader = loader.is_leader
    state = loader.state_dict()
    loader.close()
    loader = build(data, TWO, HALF, dp=dp_after)
    loader.load_state_dict(state)
    second = [rows_of(b) for b in islice(loader, after)]
    leader = loader.is_leader
    loader.close()
    return {"first": first if first_leader else None, "second": second if leader else None}


@pytest.mark.parametrize("dp_after", [1, 4])
def test_a_resume_at_another_dp_degree_trains_no_token_twice_and_finishes_every_document_begun(world, data, dp_after):
    results = world.run(dp_change_run, data, 6, {1: 60, 4: 40}[dp_after], dp_after, timeout=240)
    trained = Counter(t for r in results if r["first"] for rows in r["first"] for _, tokens in rows for t in tokens)
    begun = {document_of(t) for t in trained}
    trained.update(t for r in results if r["second"] for rows in r["second"] for _, tokens in rows for t in tokens)
    assert max(trained.values()) == 1  # across the resume, at another DP degree
    for name, doc in begun:  # every document begun before the checkpoint is trained to its end after it
        tokens = BASE[name] + doc * STRIDE[name] + np.arange(LENGTHS[name][doc])
        missing = [int(t) for t in tokens if trained[int(t)] == 0]
        assert not missing, (name, doc, len(missing))


def policy_run(data: dict[str, str], policy: str, steps: int) -> dict:
    """``short`` at 3/4 and ``tiny`` at 1/4 (a row per replica and step), dp=2: ``tiny`` runs out
    at about step 6."""
    schedule = MixtureSchedule.constant({"short": 0.75, "tiny": 0.25})
    loader = build(data, ("short", "tiny"), schedule, tiny=policy)
    rows = [rows_of(b) for b in islice(loader, steps)]
    stats = loader.stats()
    leader = loader.is_leader
    loader.close()
    return {"rows": rows, "stats": stats if leader else None}


def closed_groups_run(data: dict[str, str]) -> dict:
    """Two steps of a mixture whose leaders agree each step, then close: the groups its streams
    used (the sources' shared one, the agreement's) are given back to torch, and the source
    refuses a second loader."""
    mesh, source = mixture(
        data, ("short", "tiny"), MixtureSchedule.constant({"short": 0.5, "tiny": 0.5}), 2, tiny="repeat"
    )
    loader = CollectiveLoader(source, mesh, **KEYS)
    list(islice(loader, 2))
    used = []
    if loader.is_leader:
        stream = loader.source
        used = [stream.agreement.group, *(s.stream.data.leaders.group for s in stream.sources.values())]
    known_before = [bool(dist.get_process_group_ranks(g)) for g in used]
    loader.close()
    forgotten = []
    for group in used:
        try:
            dist.get_process_group_ranks(group)
            forgotten.append(False)
        except KeyError:  # torch no longer knows it: destroyed
            forgotten.append(True)
    try:
        CollectiveLoader(source, mesh, **KEYS)
        again = None
    except Exception as e:
        again = f"{type(e).__name__}: {e}"
    return {"leader": loader.is_leader, "before": known_before, "forgotten": forgotten, "again": again}


def test_close_gives_back_the_groups_the_mixtures_streams_used_and_the_source_serves_one_loader(world, data):
    runs = world.run(closed_groups_run, data, timeout=120)
    leaders = [r for r in runs if r["leader"]]
    assert len(leaders) == 2
    for r in leaders:
        assert r["before"] == [True, True, True] and r["forgotten"] == [True, True, True], r
    for r in runs:
        assert r["again"] is not None and "build a new source for a new loader" in r["again"], r


def test_a_repeated_source_begins_a_new_shuffled_epoch_on_every_leader_at_the_same_step(world, data):
    results = world.run(policy_run, data, "repeat", 20, timeout=240)
    leaders = [r for r in results if r["stats"]]
    assert all(len(r["rows"]) == 20 for r in results)  # no end, no hang at the restart
    # each replica's tiny documents, in the order it trained them; each epoch once each
    order = [
        [document_of(t) for rows in r["rows"] for s, tokens in rows if s == 1 for t in tokens[:1]] for r in leaders
    ]
    epochs = {int(r["stats"]["mixture/tiny/epochs"]) for r in leaders}
    assert len(epochs) == 1 and min(epochs) >= 3, epochs  # 20 rows of tiny per replica, ~6 per epoch
    trained = Counter(t for r in leaders for rows in r["rows"] for s, tokens in rows if s == 1 for t in tokens)
    per_epoch = sum(LENGTHS["tiny"])
    assert sum(trained.values()) > 2 * per_epoch  # it came back
    assert max(trained.values()) <= max(epochs)  # at most once per epoch
    assert order[0] != order[1]  # the replicas read different parts
    # the rows keep following the weights: three rows of short and one of tiny per step, on average
    for r in leaders:
        assert sum(s for rows in r["rows"] for s, _ in rows) == 20


def test_a_stopped_source_shares_its_weight_and_the_run_goes_on(world, data):
    results = world.run(policy_run, data, "stop", 20, timeout=240)
    leaders = [r for r in results if r["stats"]]
    assert all(len(r["rows"]) == 20 for r in results)
    last_tiny = [max(i for i, rows in enumerate(r["rows"]) if any(s == 1 for s, _ in rows)) for r in leaders]
    assert len(set(last_tiny)) == 1 and 3 <= last_tiny[0] < 12, last_tiny  # stopped at the same step everywhere
    for r in leaders:
        after = r["rows"][last_tiny[0] + 1 :]
        assert after and all(s == 0 for rows in after for s, _ in rows)
        assert r["stats"]["mixture/tiny/weight"] == 0.0 and r["stats"]["mixture/short/weight"] == 1.0
    trained = Counter(t for r in leaders for rows in r["rows"] for _, tokens in rows for t in tokens)
    assert max(trained.values()) == 1


def test_a_source_that_ends_the_epoch_ends_it_on_every_rank_at_the_same_step(world, data):
    results = world.run(policy_run, data, "end", 20, timeout=240)
    lengths = {len(r["rows"]) for r in results}
    assert len(lengths) == 1 and 3 <= min(lengths) < 12, lengths


READS = {"done": 0, "fail_after": 0}  # this process's sample-batches read, and after how many they fail (0: never)


@dataclass(frozen=True)
class UnreadableAfter(TokenColumn):
    """TokenColumn's reads, until this process has read ``READS["fail_after"]`` sample-batches: then
    every read raises, as an unreadable shard would (a layout is the public place to fail a read)."""

    def documents(self, samples):
        READS["done"] += 1
        if 0 < READS["fail_after"] < READS["done"]:
            raise OSError("shard 3 is unreadable")
        return super().documents(samples)


def failing_leader_run(data: dict[str, str]) -> dict:
    """Replica 1's leader fails reading its rows after 4 sample-batches (at about step 5) while
    the leaders agree every step ("repeat"): what each rank raised, and after how many steps."""
    schedule = MixtureSchedule.constant({"short": 0.75, "tiny": 0.25})
    mesh, source = mixture(data, ("short", "tiny"), schedule, 2, layout=UnreadableAfter(dtype="uint16"), tiny="repeat")
    loader = CollectiveLoader(source, mesh, **KEYS)
    READS.update(done=0, fail_after=4 if loader.is_leader and loader.place.dp_rank == 1 else 0)
    steps = 0
    try:
        for _ in islice(loader, 20):
            steps += 1
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "steps": steps}
    finally:
        loader.close()
    return {"error": None, "steps": steps}


def test_a_leader_failing_while_the_leaders_agree_ends_every_rank(world, data):
    # every rank learns of it in that step's agreement, not after the group's timeout: the run ends early
    results = world.run(failing_leader_run, data, timeout=240)
    for r in results:
        assert r["error"] is not None and "shard 3 is unreadable" in r["message"], r
        assert r["steps"] < 20, r


def cp_run(data: dict[str, str]) -> dict:
    """dp=2 x cp=2, documents split per document over the cp ranks: what each rank got."""
    mesh = ranks.make_mesh(("dp", "cp"), (2, 2))
    schedule = MixtureSchedule.constant({"short": 0.5, "long": 0.5})
    sources = {name: {"local": data[name], "shuffle": False, "num_canonical_nodes": 4} for name in TWO}
    source = MixtureSource(
        mesh,
        sources,
        schedule,
        batch_size=2,
        packing=Packing(SEQ_LEN, "pad", ("position_ids", "cu_seqlens")),
        layout=TokenColumn(dtype="uint16"),
        documents_per_batch=4,
    )
    loader = CollectiveLoader(
        source,
        mesh,
        inputs=("input_ids", "position_ids"),
        labels=("labels", "source_id"),
        every_stage=("cu_seqlens",),
        seq_dims={"input_ids": 1, "position_ids": 1, "labels": 1},
        split=PerDocument(cu_seqlens="cu_seqlens", positions="position_ids"),
    )
    steps = [dict(b) for b in islice(loader, 6)]
    place = loader.place
    loader.close()
    return {"dp_rank": place.dp_rank, "shard": place.shard, "steps": steps}


def test_per_document_context_parallel_splits_of_mixed_rows_reassemble(world, data):
    records = world.run(cp_run, data, timeout=240)
    split = PerDocument(cu_seqlens="cu_seqlens", positions="position_ids")
    for dp_rank in (0, 1):
        mine = sorted((r for r in records if r["dp_rank"] == dp_rank), key=lambda r: r["shard"])
        assert len(mine) == 2 and len(mine[0]["steps"]) == 6
        for step in range(6):
            pieces = [r["steps"][step] for r in mine]
            assert torch.equal(pieces[0]["source_id"], pieces[1]["source_id"])
            assert torch.equal(pieces[0]["cu_seqlens"], pieces[1]["cu_seqlens"])
            batch = pieces[0]
            rows = len(batch["source_id"])
            inputs = split.unshard([p["input_ids"] for p in pieces], [2], 1, batch).reshape(rows, SEQ_LEN)
            labels = split.unshard([p["labels"] for p in pieces], [2], 1, batch).reshape(rows, SEQ_LEN)
            for row in range(rows):
                real = labels[row] != -100
                assert torch.equal(
                    labels[row][:-1][real[:-1]], inputs[row][1:][real[:-1]]
                )  # labels are the next tokens
                tokens = inputs[row][inputs[row] != 0].tolist() + labels[row][real].tolist()
                assert {source_of(t) for t in tokens} == {TWO[int(batch["source_id"][row])]}, (dp_rank, step, row)


# --- short rows: a source's last, padded rows count their real tokens ------------------------------


def real_tokens(batch) -> list[tuple[int, int]]:
    """(source_id, real tokens: the labels that are tokens) of each row."""
    return [(int(s), int((labels != -100).sum())) for s, labels in zip(batch["source_id"], batch["labels"])]


REP = ("rep", "short")  # MixtureSource.names: sorted
SHORT_ROWS = MixtureSchedule.constant({"short": 0.75, "rep": 0.25})
SHORT_ROWS_STEPS = 32


def short_rows_run(data: dict[str, str], dp: int, policy: str) -> dict | None:
    """``SHORT_ROWS_STEPS`` steps of ``short`` and ``rep`` (``policy``: it runs out every few
    steps) at ``dp``: each row's (source_id, real tokens) on a leader, with its stats."""
    loader = build(data, REP, SHORT_ROWS, dp, rep=policy)
    rows = [real_tokens(b) for b in islice(loader, SHORT_ROWS_STEPS)]
    out = {"rows": rows, "stats": loader.stats()} if loader.is_leader else None
    loader.close()
    return out


def window_errors(leaders: list[dict], weights: list[dict[str, float]], width: int = 8) -> list[tuple[float, float]]:
    """Per window of ``width`` steps, over every replica: the largest over the sources of
    ``|real tokens of the source - sum over the window's steps of its weight x the step's real
    tokens|`` (``weights``: each step's), in rows of ``SEQ_LEN`` tokens, and that over the
    window's real tokens (its share error)."""
    steps = len(weights)
    real = np.zeros((steps, len(REP)))  # (step, source_id)
    for leader in leaders:
        for step, rows in enumerate(leader["rows"]):
            for s, tokens in rows:
                real[step, s] += tokens
    target = np.array([[w.get(name, 0.0) for name in REP] for w in weights]) * real.sum(1, keepdims=True)
    out = []
    for start in range(steps - width + 1):
        window = slice(start, start + width)
        error = np.abs(real[window].sum(0) - target[window].sum(0)).max()
        out.append((float(error) / SEQ_LEN, float(error / real[window].sum())))
    return out


@pytest.mark.timeout(600)  # two runs of up to 240 s
@pytest.mark.parametrize("policy", ["repeat", "stop"])
def test_a_source_s_last_padded_rows_count_their_real_tokens_at_dp_4_and_8(worlds, data, policy):
    """``rep`` (a quarter of the rows) runs out every few steps, each leader's part ending in a
    padded row: counted by its real tokens, every window of 8 steps over all replicas (across its
    new epochs, or across its stop) stays within the allocator's bound, 1 row for two sources at
    constant weights (1.5 documented over any mixture); measured 1.00 and 0.11 rows at dp 4 and 8
    ("repeat"), 0.81 and 0.11 ("stop"). Counted as full rows (before issue 48) the worst was 2.81
    rows (4.67%) at dp 4 and 8, under both policies."""
    world = worlds.get(8)  # the last tests of the module: the 4-rank world is closed
    worst = {}
    for dp in (4, 8):
        results = world.run(short_rows_run, data, dp, policy, timeout=240)
        leaders = [r for r in results if r is not None]
        assert len(leaders) == dp and all(len(r["rows"]) == SHORT_ROWS_STEPS for r in leaders)
        padded = [real for r in leaders for rows in r["rows"] for s, real in rows if s == 0 and real < SEQ_LEN]
        assert len(padded) >= dp // 2, padded  # rep's leaders delivered padded rows at its epochs' ends
        # each step's weights: rep's quarter, or short alone once rep stopped (before, every step has 2 rows of it)
        last = max(i for r in leaders for i, rows in enumerate(r["rows"]) if any(s == 0 for s, _ in rows))
        assert (last == SHORT_ROWS_STEPS - 1) == (policy == "repeat"), last  # "stop": inside a window
        weights = [SHORT_ROWS.weights_at(0) if step <= last else {"short": 1.0} for step in range(SHORT_ROWS_STEPS)]
        worst[dp] = max(window_errors(leaders, weights))  # (rows, share)
        targets = {r["stats"]["mixture/rep/target"] for r in leaders}
        assert len(targets) == 1, targets  # every leader counts the same real tokens
    assert all(rows <= 1.5 for rows, _ in worst.values()), worst


def short_rows_resumed_run(data: dict[str, str], before: int, after: int) -> dict:
    """``rep`` repeating at dp 4: ``before + after`` steps, and ``before`` steps, a checkpoint,
    ``after`` steps resumed: each rank's rows."""
    loader = build(data, REP, SHORT_ROWS, 4, rep="repeat")
    whole = [rows_of(b) for b in islice(loader, before + after)]
    loader.close()
    loader = build(data, REP, SHORT_ROWS, 4, rep="repeat")
    first = [rows_of(b) for b in islice(loader, before)]
    state = loader.state_dict()
    loader.close()
    loader = build(data, REP, SHORT_ROWS, 4, rep="repeat")
    loader.load_state_dict(state)
    second = [rows_of(b) for b in islice(loader, after)]
    loader.close()
    return {"whole": whole, "first": first, "second": second}


def test_a_resume_across_credited_short_rows_continues_bit_identically(worlds, data):
    # rep's parts end in short rows at steps 10 and 20 here: the state after step 10 carries their credit.
    # rep begins its next epoch at step 11, on the transfer thread, often while the state of step 10 is
    # being made (tests/unit/test_packed_stream.py forces that order)
    results = worlds.get(8).run(short_rows_resumed_run, data, 11, 12, timeout=240)
    for r in results:
        assert r["first"] + r["second"] == r["whole"]

    def padded(part: str) -> int:  # rows of rep with fewer than SEQ_LEN + 1 tokens, over all ranks
        return sum(len(tokens) <= SEQ_LEN for r in results for rows in r[part] for s, tokens in rows if s == 0)

    assert padded("first") and padded("second")  # credited short rows on both sides of the checkpoint
