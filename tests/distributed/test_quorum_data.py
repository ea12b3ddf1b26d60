"""``QuorumData`` inside one replica group (a gloo world of 4 ranks, dp_shard=2 x tp=2), driven by
a scripted stand-in for torchft's ``Manager`` (no torchft, no lighthouse): the quorum changes
every step, some steps do not commit, the group sometimes sits a step out or heals. Over the
committed steps every sample is trained once, tp peers get the same samples, labels belong to
their inputs, and the leader reads only the current step's share. The real thing, with torchft
and SIGKILL, is ``tests/integrations/test_torchft_elastic.py``."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch
import torch.distributed as dist
from ranks import make_mesh

from collective_loader import LeaderError
from collective_loader.integrations.torchft import QuorumData
from collective_loader.plan.quorum import GlobalOrder, participant_range

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
    manager._use_async_quorum = manager._init_sync = True  # torchft's asynchronous quorum with init_sync
    try:
        QuorumData(list(range(5)), mesh, manager, global_batch=2, micro_batch=1, inputs=("x",), labels=())
    except ValueError as e:
        errors.append(str(e))
    manager._init_sync = False
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
        assert len(errors) == 4 and "init_sync=False" in errors[0]
        assert "without a step" in errors[1] and "again before end_step" in errors[2] and "expected 1" in errors[3]
