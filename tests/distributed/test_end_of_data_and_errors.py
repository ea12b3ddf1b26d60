"""End of data, errors and misconfiguration end cleanly on every rank; nothing waits forever.

Each function below runs on every rank and reports what it saw; the test process asserts it.
"""

from __future__ import annotations

import pytest
import ranks
import torch.distributed as dist

from collective_loader import (
    BatchError,
    CollectiveLoader,
    LeaderError,
    mesh_place,
)
from collective_loader.errors import ConfigMismatchError

MESH = (("pp", "dp", "cp"), (3, 2, 2))  # 12 ranks: middle stages, shard dim, two replicas
SECOND_LEADER = 10  # replica 1's leader: the last stage (the default placement), coords (2, 1, 0)


def _loader(source, **kw):
    mesh = ranks.make_mesh(*MESH)
    dp = mesh_place(mesh, dist.get_rank()).dp_rank
    return CollectiveLoader(lambda: source(dp), mesh, **{**ranks.KEYS, **kw}), dp


def _consume(loader):
    """Iterate to the end; return (steps received, exception type name, message) for this rank."""
    steps = 0
    try:
        for _ in loader:
            steps += 1
    except Exception as e:
        return steps, type(e).__name__, str(e)
    return steps, None, None


def uneven_lengths():
    loader, dp = _loader(lambda dp: ranks.id_batches(dp, 2, 4 * (3 + 2 * dp), 2, 16))
    return _consume(loader)


def source_raises(at_step: int, on_dp: int):
    def source(dp):
        for step, batch in enumerate(ranks.id_batches(dp, 2, 40, 2, 16)):
            if dp == on_dp and step == at_step:
                raise OSError("disk on fire")
            yield batch

    loader, _ = _loader(source)
    return _consume(loader)


def bad_batch(kind: str):
    def source(dp):
        for step, batch in enumerate(ranks.id_batches(dp, 2, 40, 2, 16 if kind != "length" else 10)):
            if kind == "missing" and step == 2:
                del batch["labels"]
            if kind == "extra" and step == 1:
                batch["surprise"] = 1
            if kind == "not_a_mapping" and step == 1:
                batch = list(batch.values())
            if kind == "object" and step == 2:
                batch["sample_id"] = object()
            if kind == "over_cap" and step == 3:
                batch["input_ids"] = batch["input_ids"].repeat(1, 8)  # 8x the bytes, still splittable
            yield batch

    # a step's first-stage payload is about 1 KiB; the grown batch is about 3 KiB
    loader, _ = _loader(source, max_batch_bytes=2048)
    return _consume(loader)


def source_build_fails():
    def build():
        if dist.get_rank() == SECOND_LEADER:
            raise FileNotFoundError("no shards at /nowhere")
        return []

    mesh = ranks.make_mesh(*MESH)
    try:
        CollectiveLoader(build, mesh, **ranks.KEYS)
    except LeaderError as e:
        return str(e)
    return None


def config_differs():
    mesh = ranks.make_mesh(*MESH)
    layout = "contiguous" if dist.get_rank() == 7 else "zigzag"
    try:
        CollectiveLoader(lambda: [], mesh, split=layout, **ranks.KEYS)
    except ConfigMismatchError as e:
        return str(e)
    return None


def restart_mid_epoch():
    """Break after 2 steps, start again: the new epoch starts from the first batch on every rank."""
    loader, dp = _loader(lambda dp: _Reiterable(dp))
    first = [b.get("sample_id", None) for _, b in zip(range(2), loader)]
    second = [b.get("sample_id", None) for b in loader]
    return [None if t is None else t.tolist() for t in first], [None if t is None else t.tolist() for t in second]


class _Reiterable:
    def __init__(self, dp):
        self.dp = dp

    def __iter__(self):
        return ranks.id_batches(self.dp, 2, 16, 2, 16)


def others_run_ahead(lagging: str, prefetch: int):
    """Every rank but the lagging ones takes ``prefetch`` steps before the lagging ones take any."""
    loader, _ = _loader(lambda dp: ranks.id_batches(dp, 2, 40, 2, 16), prefetch=prefetch)
    it = iter(loader)
    lags = loader.is_leader if lagging == "leader" else loader.is_last_stage
    taken = 0
    if not lags:
        for _ in range(prefetch):
            next(it)
            taken += 1
    dist.barrier()  # a rank that needed a lagging peer's loop to advance would hang here
    rest = sum(1 for _ in it)
    return taken + rest


@pytest.fixture
def world(worlds):
    return worlds.get(12)


def _stage_of(rank):
    return rank // 4  # pp is outermost in MESH


def test_uneven_lengths_stop_together(world):
    # replica 0 has 3 batches, replica 1 has 5: everyone stops after 3
    assert world.run(uneven_lengths, timeout=60) == [(3, None, None)] * 12


@pytest.mark.parametrize("at_step", [0, 3])
def test_source_exception_reaches_every_rank(world, at_step):
    results = world.run(source_raises, at_step, 1, timeout=60)
    for rank, (steps, kind, message) in enumerate(results):
        assert steps == at_step, (rank, steps)
        assert kind == "LeaderError", (rank, kind, message)
        assert f"leader rank {SECOND_LEADER} (dp_rank 1)" in message and "OSError: disk on fire" in message, message
        assert f"step {at_step}" in message


@pytest.mark.parametrize(
    "kind,at_step,needle",
    [
        ("missing", 2, "missing keys ['labels']"),
        ("extra", 1, "keys ['surprise'] that are in none of"),
        ("length", 0, "key 'input_ids' has length 10 along dim 1; the zigzag split over cp=2 needs a multiple of 4"),
        ("not_a_mapping", 1, "a batch must be a mapping of str to tensors, got list"),
        ("object", 2, "cannot deliver builtins.object at 'sample_id'"),
        ("over_cap", 3, "first-stage payload is"),
    ],
)
def test_bad_batch_is_a_value_error_everywhere(world, kind, at_step, needle):
    for rank, (steps, name, message) in enumerate(world.run(bad_batch, kind, timeout=60)):
        assert (steps, name) == (at_step, "BatchError"), (rank, steps, name, message)
        assert needle in message, message
    assert issubclass(BatchError, ValueError)


def test_source_build_failure_raises_everywhere(world):
    for message in world.run(source_build_fails, timeout=60):
        assert message is not None and f"leader rank {SECOND_LEADER} could not build its source" in message
        assert "FileNotFoundError: no shards at /nowhere" in message


def test_config_mismatch_raises_everywhere(world):
    for message in world.run(config_differs, timeout=60):
        assert message is not None and "rank 7 built" in message and "split=contiguous" in message


def test_new_iter_mid_epoch_restarts(world):
    for rank, (first, second) in enumerate(world.run(restart_mid_epoch, timeout=60)):
        if _stage_of(rank) == 1:
            assert first == [None, None] and second == [None] * 4
        else:
            dp = ranks.dp_rank_of(rank, *MESH)
            want = [[dp + 2 * (2 * s), dp + 2 * (2 * s + 1)] for s in range(4)]
            assert first == want[:2] and second == want, (rank, first, second)


@pytest.mark.parametrize("lagging", ["leader", "last"])
def test_bounded_lead_never_needs_the_lagging_loop(world, lagging):
    assert world.run(others_run_ahead, lagging, 3, timeout=60) == [10] * 12
