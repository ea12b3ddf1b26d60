"""``QuorumData`` inside one replica group (a gloo world of 4 ranks, dp_shard=2 x tp=2), driven by
a scripted stand-in for torchft's ``Manager`` (no torchft, no lighthouse): the quorum changes
every step, some steps do not commit, the group sometimes sits a step out or heals. Over the
committed steps every sample is trained once, tp peers get the same samples, labels belong to
their inputs, and the leader reads only the current step's share. The same over real MDS shards
(a ``StreamingDataset`` the leaders alone build, :class:`LeaderStreamingDataset`): its samples,
and packed rows of its documents, where the group also heals from states that jump the cursor
ahead with an anchor at the order's start: every token of every document once, in the order's
sequence. The real thing, with torchft and SIGKILL, is
``tests/integrations/test_torchft_elastic.py``."""

from __future__ import annotations

import math
import random
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from ranks import make_mesh

from collective_loader import LeaderError
from collective_loader.integrations.torchft import QuorumData
from collective_loader.plan.quorum import GlobalOrder, participant_range
from collective_loader.streaming import LeaderStreamingDataset
from collective_loader.testing.data import numbered_documents, tokens, write_dataset, write_token_documents
from collective_loader.text import Packing, TokenColumn

G, N = 10, 37  # global batch, dataset length (steps wrap around passes)


class Samples:
    """Sample i: x = [i, 2i], y = 3i, its id; counts the indices read."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.read: list[int] = []
        self.fail_at = fail_at

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        if i == self.fail_at:
            raise KeyError(f"sample {i} is unreadable")
        self.read.append(i)
        return {"x": torch.tensor([i, 2.0 * i]), "y": torch.tensor(3.0 * i), "sample_id": i}


class ScriptedManager:
    """What QuorumData asks of torchft's Manager, from a seeded script the same on every rank:
    each step's (participant, participants, commit), healing steps included."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.step_no = 0
        self.fns: dict = {}
        self.quorum: tuple[int | None, int] = (None, 0)

    def register_state_dict_fn(self, key, load, save) -> None:
        assert key not in self.fns
        self.fns[key] = (load, save)

    def start_quorum(self) -> None:
        n = self.rng.randint(1, 4)
        self.quorum = (None, n) if self.rng.random() < 0.15 else (self.rng.randrange(n), n)

    def participating_rank(self):
        return self.quorum[0]

    def num_participants(self) -> int:
        return self.quorum[1]

    def is_participating(self) -> bool:
        return self.quorum[0] is not None

    def current_step(self) -> int:
        return self.step_no

    def should_commit(self) -> bool:
        ok = self.rng.random() < 0.75
        self.step_no += ok
        return ok


def run_steps(seed: int, steps: int, micro_batch: int) -> dict:
    mesh = make_mesh(("dp_shard", "tp"), (2, 2))
    manager = ScriptedManager(seed)
    samples = Samples()
    data = QuorumData(
        lambda: samples,
        mesh,
        manager,
        global_batch=G,
        micro_batch=micro_batch,
        inputs=("x", "sample_id"),
        labels=("y",),
        seed=7,
        timeout=60,
    )
    order = GlobalOrder(N, seed=7)
    log, started = [], time.perf_counter()
    for _ in range(steps):
        manager.start_quorum()
        cursor = data.cursor
        ids, micro = [], 0
        read_before = len(samples.read)
        for batch in data.step():
            micro += 1
            assert torch.equal(batch["y"], 1.5 * batch["x"][:, 1]) and torch.equal(
                batch["x"][:, 0].long(), batch["sample_id"]
            )
            ids += batch["sample_id"].tolist()
        share = data.share
        if data.loader.is_leader:  # read exactly this step's share, nothing ahead
            read, expected = samples.read[read_before:], order.indices(*share.replica)
            assert read == expected or (read == [0] and expected == [])  # an empty share's keys: sample 0's
        committed = manager.should_commit()
        data.end_step(committed)
        log.append(
            {
                "cursor": cursor,
                "quorum": manager.quorum,
                "ids": ids,
                "micro": micro,
                "committed": committed,
                "share": share,
            }
        )
    per_step = (time.perf_counter() - started) / steps
    data.close()
    return {"log": log, "per_step": per_step, "dp_rank": data.loader.dp_rank, "cursor": data.cursor}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("micro_batch", [2, 1])  # 1: a replica's share of 1 of 2 micro-batches has an empty one
def test_scripted_quorums_train_every_sample_once(worlds, micro_batch):
    results = worlds.get(4).run(run_steps, 11, 30, micro_batch)
    by_dp = {}
    for r in results:
        by_dp.setdefault(r["dp_rank"], []).append(r)
    assert [r["log"] for r in by_dp[0][1:]] == [by_dp[0][0]["log"]]  # tp peers: the same
    order = GlobalOrder(N, seed=7)
    trained, cursor, empty_steps = [], 0, 0
    for step in range(30):
        a, b = (by_dp[d][0]["log"][step] for d in (0, 1))
        assert a["cursor"] == cursor and a["micro"] == b["micro"]  # both replicas end the step together
        participant, n = a["quorum"]
        if participant is None:
            assert a["ids"] == b["ids"] == []
        else:
            lo, hi = participant_range(cursor, G, participant, n)
            assert a["ids"] + b["ids"] == order.indices(lo, hi)
            assert a["micro"] == math.ceil(math.ceil((hi - lo) / 2) / micro_batch)
            empty_steps += micro_batch == 1 and (hi - lo) % 2 == 1
        if a["committed"]:
            trained.append((participant, n))
            cursor += G
    assert results[0]["cursor"] == cursor and len(trained) >= 10
    assert micro_batch == 2 or empty_steps > 0
    print(f"QuorumData step with a scripted quorum: {1e3 * max(r['per_step'] for r in results):.1f} ms per step")


def failing_source() -> str:
    mesh = make_mesh(("dp_shard", "tp"), (2, 2))
    manager = ScriptedManager(0)
    data = QuorumData(
        lambda: Samples(fail_at=GlobalOrder(N, seed=0).indices(0, 1)[0]),
        mesh,
        manager,
        global_batch=4,
        micro_batch=1,
        inputs=("x", "sample_id"),
        labels=("y",),
    )
    manager.quorum = (0, 1)
    try:
        for _ in data.step():
            pass
    except LeaderError as e:
        return str(e)
    finally:
        data.close()
    return "no error"


@pytest.mark.timeout(240)
def test_a_dataset_error_reaches_every_rank(worlds):
    texts = worlds.get(4).run(failing_source)
    assert all("unreadable" in t for t in texts), texts


def out_of_order() -> list[str]:
    mesh = make_mesh(("dp_shard", "tp"), (2, 2))
    manager = ScriptedManager(0)
    errors = []
    data = QuorumData(list(range(5)), mesh, manager, global_batch=2, micro_batch=1, inputs=("x",), labels=())
    try:
        data.end_step(True)
    except RuntimeError as e:
        errors.append(str(e))
    manager.quorum = (None, 1)
    list(data.step())
    try:
        data.step()
    except RuntimeError as e:
        errors.append(str(e))
    try:
        data.end_step(True)  # the manager did not commit
    except RuntimeError as e:
        errors.append(str(e))
    data.close()
    dist.barrier()
    return errors


@pytest.mark.timeout(240)
def test_steps_out_of_order_are_refused(worlds):
    for errors in worlds.get(4).run(out_of_order):
        assert len(errors) == 3
        assert "without a step" in errors[0] and "again before end_step" in errors[1] and "expected 1" in errors[2]


class PartlyHealing(ScriptedManager):
    """torchft's asynchronous quorum with ``init_sync=True`` at step 0, as the group's ranks see it:
    every rank has the group's participant, the ranks in ``healing`` are not participating (they
    heal, their gradients are zeroed). Counts ``is_participating()`` calls."""

    def __init__(self, healing: bool) -> None:
        super().__init__(0)
        self.healing, self.asked = healing, 0

    def is_participating(self) -> bool:
        self.asked += 1
        return self.quorum[0] is not None and not self.healing


def partly_healing() -> dict:
    mesh = make_mesh(("dp_shard", "tp"), (2, 2))
    manager = PartlyHealing(healing=dist.get_rank() in (1, 3))  # rank 0, the leader of replica 0, does not heal
    samples = [{"x": torch.tensor(float(i))} for i in range(8)]
    data = QuorumData(samples, mesh, manager, global_batch=2, micro_batch=1, inputs=("x",), labels=())
    manager.quorum = (0, 2)
    try:
        data.step()
        refused = "no error"
    except RuntimeError as e:
        refused = str(e)
    manager.healing = False  # healed: the same quorum again
    micro = len(list(data.step()))
    manager.step_no += 1
    data.end_step(True)
    asked = manager.asked
    manager.start_quorum()
    list(data.step())
    data.end_step(manager.should_commit())
    data.close()
    return {"refused": refused, "micro": micro, "asked": (asked, manager.asked)}


@pytest.mark.timeout(240)
def test_a_rank_healing_with_a_share_stops_the_step_on_every_rank(worlds):
    results = worlds.get(4).run(partly_healing)
    # the same error on every rank, the healing ones and the others (they share one loader)
    assert len({r["refused"] for r in results}) == 1, results
    refused = results[0]["refused"]
    assert "its rank 1 " in refused and "is_participating() is False" in refused and "init_sync=False" in refused
    # then the step goes on when nobody heals (participant 0 of 2: 1 sample, one micro-batch per
    # replica); after the first commit nobody asks any more (no collective)
    assert all(r["micro"] == 1 and r["asked"] == (2, 2) for r in results), results


# --- real MDS shards: a StreamingDataset built on the leaders alone ---------------------------------

SEQ, STRIDE, DOCS = 6, 1 << 10, 300  # samples of SEQ + 1 tokens; token k of document i is i * STRIDE + k


def doc_lengths() -> list[int]:
    return np.random.default_rng(4).integers(0, 25, size=DOCS).tolist()  # some empty


@pytest.fixture(scope="module")
def mds(tmp_path_factory):
    root = tmp_path_factory.mktemp("quorum_mds")
    write_dataset(str(root / "samples"), N, SEQ, shard_bytes=1 << 9)  # several shards
    write_token_documents(str(root / "docs"), numbered_documents(doc_lengths(), STRIDE), "bytes", "uint32", 1 << 10)
    return root


def streaming_steps(path: str, steps: int) -> dict:
    mesh = make_mesh(("dp_shard", "tp"), (2, 2))
    manager = ScriptedManager(5)
    docs = LeaderStreamingDataset(mesh, local=path)
    data = QuorumData(docs, mesh, manager, global_batch=G, micro_batch=2, inputs=("tokens", "id"), labels=(), seed=7)
    log, world = [], None
    if data.loader.is_leader:  # streaming saw the leaders' world: 2 ranks, one per replica
        world = (data.loader.source.dataset.dataset._unique_rank_world.num_ranks, len(data.loader.source.dataset))
    for _ in range(steps):
        manager.start_quorum()
        cursor, ids, rows_ok = data.cursor, [], True
        for batch in data.step():
            ids += batch["id"].tolist()
            rows_ok &= all(
                np.array_equal(t.numpy(), tokens(i, SEQ)) for t, i in zip(batch["tokens"], batch["id"].tolist())
            )
        committed = manager.should_commit()
        data.end_step(committed)
        log.append({"cursor": cursor, "quorum": manager.quorum, "ids": ids, "committed": committed, "ok": rows_ok})
    data.close()
    return {"log": log, "dp_rank": data.loader.dp_rank, "world": world}


@pytest.mark.timeout(240)
def test_a_streaming_dataset_read_by_index_trains_every_sample_once(worlds, mds):
    results = worlds.get(4).run(streaming_steps, str(mds / "samples"), 20)
    assert [r["world"] for r in results if r["world"]] == [(2, N), (2, N)]
    by_dp = {d: [r for r in results if r["dp_rank"] == d] for d in (0, 1)}
    assert all(r["log"] == by_dp[d][0]["log"] for d in (0, 1) for r in by_dp[d])  # tp peers: the same
    order, cursor = GlobalOrder(N, seed=7), 0
    for a, b in zip(by_dp[0][0]["log"], by_dp[1][0]["log"]):
        assert a["cursor"] == cursor and a["ok"] and b["ok"]  # each sample's tokens are its own
        participant, n = a["quorum"]
        expected = [] if participant is None else order.indices(*participant_range(cursor, G, participant, n))
        assert a["ids"] + b["ids"] == expected  # this participant's piece of the window, in the order
        cursor += G * a["committed"]
    assert cursor >= 5 * G


class HealingManager(ScriptedManager):
    """Also heals now and then, as torchft would a group that missed steps: the state it loads is
    this group's own with the cursor ``jump`` windows ahead (0 or 1: the others committed one
    without it) and the anchor at the order's start (the least a peer's can tell)."""

    def __init__(self, seed: int, key: str = "collective_loader") -> None:
        super().__init__(seed)
        self.key, self.jumps = key, []

    def start_quorum(self) -> None:
        super().start_quorum()
        jump = self.rng.choice([0, 1]) if self.rng.random() < 0.2 else None
        self.jumps.append(jump)
        if jump is not None:
            load, save = self.fns[self.key]
            state = save()
            load({**state, "cursor": state["cursor"] + jump * state["global_batch"], "anchor": [0, 0]})
            self.step_no += jump


def packed_steps(path: str, steps: int, seq_len: int, micro_batch: int, given_lengths: bool) -> dict:
    mesh = make_mesh(("dp_shard", "tp"), (2, 2))
    manager = HealingManager(9)
    data = QuorumData(
        LeaderStreamingDataset(mesh, local=path),
        mesh,
        manager,
        global_batch=G,
        micro_batch=micro_batch,
        packing=Packing(seq_len),
        layout=TokenColumn(dtype="uint32"),
        document_lengths=doc_lengths() if given_lengths else None,
        inputs=("input_ids", "position_ids"),
        labels=("labels",),
        seed=3,
    )
    log, started = [], time.perf_counter()
    for _ in range(steps):
        manager.start_quorum()
        cursor, rows = data.cursor, []
        for batch in data.step():
            assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])  # labels of their inputs
            rows += [
                {"tokens": ids + [labels[-1]], "positions": pos}
                for ids, labels, pos in zip(
                    batch["input_ids"].tolist(), batch["labels"].tolist(), batch["position_ids"].tolist()
                )
            ]
        committed = manager.should_commit()
        data.end_step(committed)
        log.append({"cursor": cursor, "quorum": manager.quorum, "rows": rows, "committed": committed})
    per_step = (time.perf_counter() - started) / steps
    stats = data.loader.stats() if data.loader.is_leader else {}
    data.close()
    return {"log": log, "dp_rank": data.loader.dp_rank, "jumps": manager.jumps, "stats": stats, "per_step": per_step}


def token_stream(order: GlobalOrder, positions: int) -> tuple[list[int], list[int]]:
    """The first ``positions`` documents of the order concatenated: each token, and the position
    of its document in the order (a document recurs in every pass)."""
    docs = numbered_documents(doc_lengths(), STRIDE)
    pairs = [(int(t), p) for p, i in enumerate(order.indices(0, positions)) for t in docs[i]]
    return [t for t, _ in pairs], [p for _, p in pairs]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(  # rows shorter and longer than most documents; lengths read, or given
    "seq_len, micro_batch, given_lengths", [(7, 2, False), (23, 1, True)]
)
def test_packed_rows_of_a_streaming_dataset_train_every_token_once(worlds, mds, seq_len, micro_batch, given_lengths):
    steps = 24
    results = worlds.get(4).run(packed_steps, str(mds / "docs"), steps, seq_len, micro_batch, given_lengths)
    by_dp = {d: [r for r in results if r["dp_rank"] == d] for d in (0, 1)}
    assert all(r["log"] == by_dp[d][0]["log"] for d in (0, 1) for r in by_dp[d])  # tp peers: the same rows
    size = seq_len + 1
    stream, owner = token_stream(GlobalOrder(DOCS, seed=3), 3 * DOCS)  # more than the steps need
    jumps = by_dp[0][0]["jumps"]
    cursor, rows_trained = 0, 0
    for step, (a, b) in enumerate(zip(by_dp[0][0]["log"], by_dp[1][0]["log"])):
        cursor += G * bool(jumps[step])  # healed past a window the others committed
        assert a["cursor"] == cursor
        participant, n = a["quorum"]
        lo, hi = (cursor, cursor) if participant is None else participant_range(cursor, G, participant, n)
        rows = a["rows"] + b["rows"]
        # this participant's piece of the window: the stream's tokens lo * size .. hi * size, in order
        assert [t for r in rows for t in r["tokens"]] == stream[lo * size : hi * size]
        for k, r in enumerate(rows):  # positions restart at each document and at each row
            docs = owner[(lo + k) * size : (lo + k + 1) * size]
            assert r["positions"] == [
                0 if j == 0 or docs[j] != docs[j - 1] else r["positions"][j - 1] + 1 for j in range(seq_len)
            ]
        if a["committed"]:
            cursor += G
            rows_trained += hi - lo
    assert cursor >= 8 * G and rows_trained and any(jumps) and any(j == 0 for j in jumps if j is not None)
    read = [r["stats"] for r in results if r["stats"]]
    per_step = max(r["per_step"] for r in results)
    print(
        f"QuorumData packed rows (seq_len {seq_len}, lengths {'given' if given_lengths else 'read'}, {steps} attempts, "
        f"{cursor // G} windows, heals that reset the anchor to the start): leaders read "
        f"{[int(s['quorum_tokens_read']) for s in read]} tokens for {[int(s['quorum_rows']) * size for s in read]} "
        f"tokens of rows delivered; {1e3 * per_step:.1f} ms per step"
    )
