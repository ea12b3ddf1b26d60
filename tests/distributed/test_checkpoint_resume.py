"""state_dict / load_state_dict: exact resume counts consumed (not prefetched) batches."""

from __future__ import annotations

import warnings

import pytest
import ranks
import torch.distributed as dist

from collective_loader import BatchError, CollectiveLoader, mesh_place

MESH = (("pp", "dp", "tp"), (2, 2, 2))
LEADERS = (0, 6)  # the default placement: replica 0's on the first stage, replica 1's on the last


class CountingSource:
    """A deterministic source with its own state: the index of the next batch."""

    def __init__(self, dp: int):
        self.dp, self.next = dp, 0

    def __iter__(self):
        while self.next < 10:
            batch = ranks.sample_batch([self.dp + 2 * (2 * self.next + j) for j in range(2)], 16)
            self.next += 1
            yield batch

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


def _build(kind: str):
    mesh = ranks.make_mesh(*MESH)
    dp = mesh_place(mesh, dist.get_rank()).dp_rank
    if kind == "stateful":
        source = lambda: CountingSource(dp)  # noqa: E731
    else:
        source = lambda: list(ranks.id_batches(dp, 2, 40, 2, 16))  # noqa: E731
    return CollectiveLoader(source, mesh, **ranks.KEYS)


def _ids(batch):
    return batch["sample_id"].tolist() if batch else None


def resume_run(kind: str, stop_after: int):
    """Uninterrupted ids, and ids of a run stopped after ``stop_after`` steps and resumed in a new loader."""
    full = [_ids(b) for b in _build(kind)]
    first = _build(kind)
    it = iter(first)
    head = [_ids(next(it)) for _ in range(stop_after)]
    state = first.state_dict()
    first.close()
    second = _build(kind)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second.load_state_dict(state)
        tail = [_ids(b) for b in second]
    skipped = any("skipping" in str(w.message) for w in caught)
    return full, head, tail, state["steps"], skipped


def dp_mismatch():
    loader = _build("list")
    state = loader.state_dict()
    state["dp_size"] = 4
    try:
        loader.load_state_dict(state)
    except ValueError as e:
        return str(e)
    return None


class BytesStateSource:
    """Batches whose ``state_dict`` holds bytes, which the wire format does not carry."""

    def __iter__(self):
        yield from ranks.id_batches(mesh_place(self.mesh, dist.get_rank()).dp_rank, 2, 20, 2, 8)

    def state_dict(self) -> dict:
        return {"blob": b"\x00\x01"}


def unsendable_state():
    """Every rank asks for the state after one step; the leader cannot encode its source's."""
    mesh = ranks.make_mesh(("pp", "dp", "tp"), (2, 2, 2))
    source = BytesStateSource()
    source.mesh = mesh
    loader = CollectiveLoader(source, mesh, **ranks.KEYS, timeout=30)
    it = iter(loader)
    next(it)
    try:
        loader.state_dict()
    except BatchError as e:
        return str(e)
    finally:
        loader.close()
    return None


def test_a_state_the_leader_cannot_send_fails_on_every_rank_of_its_replica(world):
    """Before, the leader raised and the rest of its replica waited for its message until the timeout."""
    for message in world.run(unsendable_state, timeout=60):
        assert message is not None and "cannot send its loader state to its replica" in message, message
        assert "'source.blob'" in message or "blob" in message, message


@pytest.fixture
def world(worlds):
    return worlds.get(8)


@pytest.mark.parametrize("kind", ["stateful", "list"])
def test_exact_resume(world, kind):
    for rank, (full, head, tail, steps, skipped) in enumerate(world.run(resume_run, kind, 3, timeout=90)):
        assert steps == 3, (rank, steps)
        assert head == full[:3] and tail == full[3:], (rank, head, tail, full)
        assert len(full) == 10
        # a list has no state: the leader warns and skips the consumed batches
        assert skipped == (kind == "list" and rank in LEADERS), (rank, skipped)


def test_dp_change_refused_for_a_source_that_cannot_repartition(world):
    for message in world.run(dp_mismatch, timeout=60):
        assert message is not None and "saved with 4 data-parallel replicas" in message


class EpochSource:
    """Five batches an epoch, their ids telling the epoch; like streaming, a state taken after an
    epoch's last batch resumes into that epoch with nothing left in it."""

    def __init__(self, dp: int):
        self.dp, self.epoch, self.next, self._resumed = dp, -1, 0, False

    def __iter__(self):
        if not self._resumed:
            self.epoch, self.next = self.epoch + 1, 0
        self._resumed = False
        while self.next < 5:
            self.next += 1
            yield ranks.sample_batch([1000 * self.epoch + 10 * self.next + self.dp], 16)

    def state_dict(self):
        return {"epoch": self.epoch, "next": self.next}

    def load_state_dict(self, state):
        self.epoch, self.next, self._resumed = state["epoch"], state["next"], True


def checkpoint_after_last_batch():
    mesh = ranks.make_mesh(*MESH)
    dp = mesh_place(mesh, dist.get_rank()).dp_rank
    first = CollectiveLoader(lambda: EpochSource(dp), mesh, **ranks.KEYS)
    it = iter(first)
    for _ in range(5):
        next(it)  # the epoch's last batch; the loop has not seen its end yet
    state = first.state_dict()
    first.close()
    second = CollectiveLoader(lambda: EpochSource(dp), mesh, **ranks.KEYS)
    second.load_state_dict(state)
    ids = [_ids(b) for b in second]
    epoch = second.epoch
    second.close()
    return {"dp": dp, "ids": ids, "epoch": epoch}


def test_a_checkpoint_after_the_last_batch_resumes_into_the_next_epoch(worlds):
    for r in worlds.get(8).run(checkpoint_after_last_batch, timeout=120):
        assert r["ids"] == [[1000 + 10 * n + r["dp"]] for n in range(1, 6)], r
        assert r["epoch"] == 2, r  # epochs started: the saved one, then the next
