"""Packed rows balanced over the data-parallel replicas (``Packing(balance=Balance(...))``), end to end.

Real MDS shards written by the test (LLM Foundry's token bytes), a real StreamingDataset on the
leaders, delivery through CollectiveLoader. Documents are numbered (token ``k`` of document ``i``
is ``i * STRIDE + k``), so counting delivered tokens finds any lost or trained twice. Checked:
balancing changes where a step's tokens train, not which (the per-step multiset equals the
unbalanced run's, dp=2 and pp=2 x dp=2), every stage of a replica gets the same rows, the global
valid-label count is right on every rank, the replicas' cost evens out, a mid-epoch resume gives
the uninterrupted rows, a resume on one replica trains every token once, and a leader whose data
fails ends every leader with its error.
"""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
import ranks
import torch
import torch.distributed as dist
from text_rows import all_tokens, row_tokens

from collective_loader import CollectiveLoader, LeaderError, mesh_place
from collective_loader.delivery.leader_group import LeaderGroup
from collective_loader.streaming import StreamingSource
from collective_loader.streaming.balanced_rows import BalancedRows
from collective_loader.testing.data import numbered_documents, write_token_documents
from collective_loader.text import Packing, TokenColumn
from collective_loader.text.balance import Balance
from collective_loader.text.packing import Row

STRIDE = 128
DOCS = 160
SEQ_LEN = 32
VALID = "num_valid_tokens"
TIMEOUT = 240


def lengths() -> list[int]:
    """A long tail: most documents of 1-20 tokens, some of 60-127 (longer than a row)."""
    rng = np.random.default_rng(5)
    return [int(rng.integers(60, 128)) if rng.random() < 0.3 else int(rng.integers(1, 21)) for _ in range(DOCS)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("balance") / "tokens")
    write_token_documents(out, numbered_documents(lengths(), STRIDE), "bytes", "uint16", shard_bytes=1 << 12)
    return out


def every_token() -> Counter:
    return Counter(int(t) for d in numbered_documents(lengths(), STRIDE) for t in d)


def build(
    data: str, dims: tuple, shape: tuple, balance: bool, rows: int = 2, replicas: int | None = None
) -> CollectiveLoader:
    mesh = ranks.make_mesh(dims, shape)
    valid = VALID if balance and replicas is None else None  # a global count needs every leader: not in blocks
    packing = Packing(
        SEQ_LEN,
        "pad",
        ("sequence_id",),
        Balance(linear_cost=2.0, valid_tokens=valid, replicas=replicas) if balance else None,
    )
    source = StreamingSource(
        mesh,
        local=data,
        batch_size=rows,
        shuffle=True,
        shuffle_seed=3,
        num_canonical_nodes=2,
        layout=TokenColumn(dtype="uint16"),
        packing=packing,
        documents_per_batch=8 // mesh_place(mesh, dist.get_rank()).dp_size,
        timeout=TIMEOUT,
    )
    return CollectiveLoader(
        source,
        mesh,
        inputs=("input_ids", "sequence_id"),
        labels=("labels",),
        every_stage=(valid,) if valid else (),
        timeout=TIMEOUT,
    )


def epoch(data: str, dims: tuple, shape: tuple, balance: bool, replicas: int | None = None) -> dict:
    """One epoch on every rank: what it received, and (leaders) the balance figures."""
    loader = build(data, dims, shape, balance, replicas=replicas)
    batches = [{k: v.clone() for k, v in b.items()} for b in loader]
    stats = loader.stats() if loader.is_leader else None  # the leader's traffic and its packing figures
    place = loader.place
    loader.close()
    return {
        "dp": place.dp_rank,
        "first": place.is_first_stage,
        "last": place.is_last_stage,
        "batches": batches,
        "stats": stats,
    }


def steps_by_replica(records: list[dict]) -> list[dict[int, dict]]:
    """Each step's whole batch per replica: the first stage's inputs with the last stage's labels."""
    first = {r["dp"]: r["batches"] for r in records if r["first"]}
    last = {r["dp"]: r["batches"] for r in records if r["last"]}
    steps = len(next(iter(first.values())))
    return [{d: {**first[d][k], "labels": last[d][k]["labels"]} for d in first} for k in range(steps)]


@pytest.mark.parametrize("size,dims,shape", [(2, ("dp",), (2,)), (4, ("pp", "dp"), (2, 2))], ids=["dp2", "pp2xdp2"])
def test_balancing_moves_tokens_between_replicas_but_trains_the_same_ones(worlds, data, size, dims, shape):
    world = worlds.get(size)
    off = steps_by_replica(world.run(epoch, data, dims, shape, False, timeout=TIMEOUT))
    on_records = world.run(epoch, data, dims, shape, True, timeout=TIMEOUT)
    on = steps_by_replica(on_records)
    assert len(on) == len(off) > 4
    moved = 0
    for k, (a, b) in enumerate(zip(off, on)):
        per_replica_off = {d: Counter(all_tokens([a[d]])) for d in a}
        per_replica_on = {d: Counter(all_tokens([b[d]])) for d in b}
        assert sum(per_replica_off.values(), Counter()) == sum(per_replica_on.values(), Counter()), f"step {k}"
        moved += sum(per_replica_off[d] != per_replica_on[d] for d in a)
        for batch in b.values():  # the stages of a replica got the same rows: labels are the inputs shifted
            shifted, labels = batch["input_ids"][:, 1:], batch["labels"][:, :-1]
            real = labels != -100
            assert torch.equal(shifted[real], labels[real]), f"step {k}"
            assert batch["input_ids"].shape == (2, SEQ_LEN)
        valid = sum(int((batch["labels"] != -100).sum()) for batch in b.values())
        assert all(int(r["batches"][k][VALID]) == valid for r in on_records), f"step {k}: valid-label count"
    assert moved > 0, "balancing placed no token elsewhere"
    got = Counter(t for step in on for batch in step.values() for row in row_tokens(batch) for t in row.tolist())
    assert max(got.values()) == 1 and set(got) <= set(every_token())
    stats = [r["stats"] for r in on_records if r["stats"] is not None]
    assert len(stats) == 2 and all(s["balanced_steps"] >= len(on) for s in stats)
    assert all(s["cost_max_over_mean"] < s["cost_max_over_mean_packed"] for s in stats), stats


def test_blocks_of_two_replicas_balance_each_its_own_tokens_and_stop_together(worlds, data):
    """dp = 4, ``Balance(replicas=2)``: replicas 0-1 and 2-3 each place their own leaders' rows."""
    world = worlds.get(4)
    off = steps_by_replica(world.run(epoch, data, ("dp",), (4,), False, timeout=TIMEOUT))
    on_records = world.run(epoch, data, ("dp",), (4,), True, 2, timeout=TIMEOUT)
    on = steps_by_replica(on_records)
    assert len({len(r["batches"]) for r in on_records}) == 1, "every rank stops at the same step"
    assert len(on) == len(off) > 2
    moved = 0
    for k, (a, b) in enumerate(zip(off, on)):
        for block in ((0, 1), (2, 3)):
            packed = [Counter(all_tokens([a[d]])) for d in block]
            placed = [Counter(all_tokens([b[d]])) for d in block]
            assert sum(packed, Counter()) == sum(placed, Counter()), f"step {k}, replicas {block}"
            moved += packed != placed
            if all(len(row) == SEQ_LEN + 1 for d in block for row in row_tokens(a[d])):
                assert all(len(row) == SEQ_LEN + 1 for d in block for row in row_tokens(b[d])), (
                    f"step {k}: a row not full"
                )
    assert moved > 0, "no block placed a token elsewhere"
    stats = [r["stats"] for r in on_records]
    assert all(s["cost_max_over_mean"] <= s["cost_max_over_mean_packed"] for s in stats), stats


def resumed(data: str, stop: int) -> tuple:
    full_loader = build(data, ("dp",), (2,), True)
    full = [{k: v.clone() for k, v in b.items()} for b in full_loader]
    full_loader.close()
    first = build(data, ("dp",), (2,), True)
    it = iter(first)
    head = [{k: v.clone() for k, v in next(it).items()} for _ in range(stop)]
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    first.close()
    second = build(data, ("dp",), (2,), True)
    second.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    tail = [{k: v.clone() for k, v in b.items()} for b in second]
    second.close()
    return full, head, tail


def test_a_resume_gives_the_uninterrupted_balanced_rows(worlds, data):
    for rank, (full, head, tail) in enumerate(worlds.get(2).run(resumed, data, 5, timeout=TIMEOUT)):
        rows = head + tail
        assert len(full) > 6 and len(rows) == len(full), rank
        assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(full, rows)), rank


def save_after(data: str, stop: int) -> tuple:
    loader = build(data, ("dp",), (2,), True)
    it = iter(loader)
    head = [next(it) for _ in range(stop)]
    state = loader.state_dict()
    loader.close()
    return state, all_tokens(head)


def resume_on_one_replica(data: str, state: dict) -> list[int]:
    loader = build(data, ("tp",), (2,), True, rows=4)  # one replica: balancing has one leader
    loader.load_state_dict(state)
    tokens = all_tokens(list(loader))
    loader.close()
    return tokens


def test_a_resume_on_one_replica_trains_every_token_once(worlds, data):
    world = worlds.get(2)
    saved = world.run(save_after, data, 4, timeout=TIMEOUT)
    state = saved[0][0]
    before = [t for _, tokens in saved for t in tokens]
    after = world.run(resume_on_one_replica, data, state, timeout=TIMEOUT)[0]
    got = Counter(before + after)
    assert [t for t, n in got.items() if n > 1] == [], "a token was trained twice"
    assert got == every_token(), f"lost {sum((every_token() - got).values())} tokens"


def failing_leader() -> str:
    """Two leaders balance; replica 1's data raises at its second step."""
    group = LeaderGroup.build([0, 1], 30.0, "test_balance")
    me = dist.get_rank()
    rows = BalancedRows(Packing(4, balance=Balance()), 1, me, group)

    def steps():
        yield [Row(np.arange(5) + 10 * me, [5])]
        if me == 1:
            raise OSError("shard 7 is unreadable")
        yield [Row(np.arange(5), [5])]

    out = rows.batches(steps())
    next(out)
    try:
        next(out)
    except (LeaderError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_leader_whose_data_fails_ends_every_leader_with_its_error(worlds):
    messages = worlds.get(2).run(failing_leader, timeout=60)
    assert messages[1] == "OSError: shard 7 is unreadable"
    assert messages[0] == (
        "LeaderError: the leader of replica 1 failed while the leaders balanced a step: OSError: shard 7 is unreadable"
    )
