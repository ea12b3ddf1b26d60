"""One collective per step while batch sizes repeat, two when a batch grows, one more per large
tensor sent from the leader's source without a copy; batches the loop keeps are never
overwritten by reused buffers; reused buffers stop the allocations.

Runs an 8-rank gloo world, mesh pp=2, cp=2, tp=2 (shard and replicate peers, two stages).
"""

from __future__ import annotations

import pytest
import ranks
import torch
import torch.distributed as dist

from collective_loader import CollectiveLoader
from collective_loader.delivery.modes import APART_MIN_BYTES
from collective_loader.plan import wire

MESH = (("pp", "cp", "tp"), (2, 2, 2))
# sequence lengths per step: repeats, growth, shrinking, growth again (zigzag over cp=2 needs % 4)
LENGTHS = [16, 16, 16, 64, 64, 8, 8, 8, 32, 32, 16, 48, 48, 48]


def _growths(lengths):
    return sum(1 for prev, cur in zip([0] + lengths, lengths) if cur > prev)


def _expected(loader, step, length):
    stage = "both" if loader.place.pp_size == 1 else loader.place.stage
    selected = loader.routing.select(ranks.sample_batch([step], length), stage)
    return loader.routing.piece(selected, loader.place.shard)


def varying_sizes(delivery: str, keep: bool, lengths: list[int]):
    """Run one epoch; return (collectives, allocations, wrong steps) for this rank."""
    mesh = ranks.make_mesh(*MESH)

    def source():
        return (ranks.sample_batch([i], n) for i, n in enumerate(lengths))

    loader = CollectiveLoader(source, mesh, **ranks.KEYS, delivery=delivery, timeout=60)
    kept, wrong = [], []
    for step, batch in enumerate(loader):
        if keep:
            kept.append(batch)  # no copy: these are views into the received buffers
        elif any(not torch.equal(batch[k], v) for k, v in _expected(loader, step, lengths[step]).items()):
            wrong.append(step)
    for step, batch in enumerate(kept):
        want = _expected(loader, step, lengths[step])
        if batch.keys() != want.keys() or any(not torch.equal(batch[k], v) for k, v in want.items()):
            wrong.append(step)
    allocations = sum(ch.pool.allocations for ch in loader.settings.groups.channels.values())
    stats = loader.stats()
    loader.close()
    return {
        "rank": dist.get_rank(),
        "leader": loader.is_leader,
        "collectives": stats["collectives"],
        "allocations": allocations,
        "wrong": wrong,
    }


@pytest.mark.parametrize("delivery", ["broadcast", "scatter"])
def test_a_step_is_one_collective_unless_the_batch_grows(worlds, delivery):
    records = worlds.get(8).run(varying_sizes, delivery, False, LENGTHS, timeout=120)
    assert all(not r["wrong"] for r in records), [(r["rank"], r["wrong"]) for r in records]
    # every message of the epoch (each step's data, then the end) plus one more per growth
    per_channel = len(LENGTHS) + 1 + _growths(LENGTHS)
    for r in records:
        channels = 2 if r["leader"] else 1  # the leader sends to the first and the last stage
        assert r["collectives"] == channels * per_channel, r


@pytest.mark.parametrize("delivery", ["broadcast", "scatter"])
def test_kept_batches_are_not_overwritten(worlds, delivery):
    records = worlds.get(8).run(varying_sizes, delivery, True, LENGTHS * 2, timeout=120)
    assert all(not r["wrong"] for r in records), [(r["rank"], r["wrong"]) for r in records]


def test_reused_buffers_stop_the_allocations(worlds):
    steps = 60
    dropped = worlds.get(8).run(varying_sizes, "broadcast", False, [16] * steps, timeout=120)
    kept = worlds.get(8).run(varying_sizes, "broadcast", True, [16] * steps, timeout=120)
    for d, k in zip(dropped, kept):
        assert not d["wrong"] and not k["wrong"]
        # a loop that drops its batches: a handful of buffers per channel, whatever the steps
        assert d["allocations"] <= (2 if d["leader"] else 1) * 8, d
        # a loop that keeps them: a fresh buffer for (about) every step
        assert k["allocations"] >= steps, k


def odd_batch(step: int) -> dict:
    """A batch of everything a batch may hold, different at every step."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) + step
    return {
        **ranks.sample_batch([step], 16),
        "extra": {
            "mask": base > 10,
            "bf16": base.to(torch.bfloat16),
            "f8": base.to(torch.float8_e4m3fn),
            "c64": torch.complex(base, -base),
            "scalar": torch.tensor(step * 1.5, dtype=torch.float64),
            "empty": torch.empty(0, 3, dtype=torch.int16),
            "strided": base.t(),  # non-contiguous
            "grad": base.clone().requires_grad_(True),
            "varying": base.to(torch.int32 if step % 2 else torch.float64)[: 1 + step % 3],  # dtype, shape change
            "meta": {"name": f"step-{step}", "n": step, "x": 0.25, "flags": [True, None, "a", [1, 2]]},
        },
    }


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and got.dtype == want.dtype
            and got.shape == want.shape
            and torch.equal(_bytes(got), _bytes(want))
            and not got.requires_grad
        )
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    return got == want


def odd_values(steps: int):
    mesh = ranks.make_mesh(*MESH)
    keys = {**ranks.KEYS, "inputs": ranks.KEYS["inputs"] + ("extra",)}
    loader = CollectiveLoader(lambda: (odd_batch(i) for i in range(steps)), mesh, **keys, timeout=60)
    wrong = []
    for step, batch in enumerate(loader):
        stage = loader.place.stage
        want = loader.routing.piece(loader.routing.select(odd_batch(step), stage), loader.place.shard)
        if not _same(batch, want):
            wrong.append(step)
    loader.close()
    return wrong


def test_every_kind_of_value_arrives_bit_exact(worlds):
    assert worlds.get(8).run(odd_values, 6, timeout=120) == [[]] * 8


# sequence lengths of 16-sample batches: int64 tensors of 16 x 8192 are 1 MiB (APART_MIN_BYTES),
# so they travel apart; at 4096 they are copied into the message, at 16384 they are 2 MiB
BIG_LENGTHS = [8192, 8192, 16384, 4096, 8192, 16384, 16384, 4096, 8192]
BIG_SAMPLES = 16


def big_batch(step: int, length: int) -> dict:
    return ranks.sample_batch(list(range(step * BIG_SAMPLES, (step + 1) * BIG_SAMPLES)), length)


def _expected_collectives(loader, stage: str) -> int:
    """What one channel's messages cost: each step's message (one more when it is larger than
    the one before), one broadcast per tensor that travels apart, then the end."""
    frame, count = wire.HEADER_BYTES, 0
    for step, length in enumerate(BIG_LENGTHS):
        plan = wire.encode(loader.routing.select(big_batch(step, length), stage), APART_MIN_BYTES)
        inline = wire.HEADER_BYTES + plan.nbytes - plan.apart_nbytes
        count += 1 + (inline > frame) + len(plan.apart)
        frame = inline
    return count + 1


def large_tensors(keep: bool):
    mesh = ranks.make_mesh(*MESH)
    yielded = []

    def source():
        for step, length in enumerate(BIG_LENGTHS):
            yielded.append(big_batch(step, length))
            yield yielded[-1]

    # no seq_dims: every rank gets whole tensors, so the leader's are the source's (a sequence
    # piece is a contiguous copy)
    loader = CollectiveLoader(source, mesh, **{**ranks.KEYS, "seq_dims": {}}, timeout=60)
    stage = loader.place.stage
    kept, wrong, uncopied = [], [], 0
    for step, batch in enumerate(loader):
        want = loader.routing.piece(
            loader.routing.select(big_batch(step, BIG_LENGTHS[step]), stage), loader.place.shard
        )
        if batch.keys() != want.keys() or any(not torch.equal(batch[k], v) for k, v in want.items()):
            wrong.append(step)
        if loader.is_leader:  # its batch holds the source's own large tensors (pieces of them)
            source_ptr = yielded[step]["input_ids"].untyped_storage().data_ptr()
            uncopied += batch["input_ids"].untyped_storage().data_ptr() == source_ptr
        if keep:
            kept.append((step, batch))
    wrong += [
        step
        for step, batch in kept
        if any(
            not torch.equal(batch[k], v)
            for k, v in loader.routing.piece(
                loader.routing.select(big_batch(step, BIG_LENGTHS[step]), stage), loader.place.shard
            ).items()
        )
    ]
    stats = loader.stats()
    stages = ["first", "last"] if loader.is_leader else [stage]
    expected = sum(_expected_collectives(loader, s) for s in stages)
    loader.close()
    return {
        "rank": dist.get_rank(),
        "leader": loader.is_leader,
        "wrong": wrong,
        "uncopied": uncopied,
        "collectives": stats["collectives"],
        "expected": expected,
    }


@pytest.mark.parametrize("keep", [False, True], ids=["dropped", "kept"])
def test_large_tensors_travel_apart_uncopied_and_arrive_whole(worlds, keep):
    records = worlds.get(8).run(large_tensors, keep, timeout=180)
    assert all(not r["wrong"] for r in records), [(r["rank"], r["wrong"]) for r in records]
    for r in records:
        assert r["collectives"] == r["expected"], r
        if r["leader"]:  # every step but the two whose tensors are 512 KiB
            assert r["uncopied"] == sum(length * BIG_SAMPLES * 8 >= APART_MIN_BYTES for length in BIG_LENGTHS), r
