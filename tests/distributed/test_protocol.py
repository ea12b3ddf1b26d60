"""The delivery protocol one step at a time, with no transfer thread and no loader; and the
thread on its own.

Every rank of a gloo world builds its :class:`Settings` by hand (the groups, routing and place a
``CollectiveLoader`` would build) and calls ``LeaderStep.step`` / ``MemberStep.step`` in lockstep,
then ``post`` / ``complete`` as the training thread would: what each step hands over is checked
for both transports. :class:`Prefetcher` is checked without any process group.
"""

from __future__ import annotations

import threading

import pytest
import ranks
import torch
import torch.distributed as dist

from collective_loader.delivery.agreement import control_group
from collective_loader.delivery.config import LoaderConfig
from collective_loader.delivery.figures import ShardWorkTally
from collective_loader.delivery.prefetch import Prefetcher
from collective_loader.delivery.protocol import (
    LeaderStep,
    MemberStep,
    complete,
    failed,
    post,
)
from collective_loader.delivery.settings import Settings
from collective_loader.delivery.transport import build_groups
from collective_loader.delivery.watchdog import StallWatch
from collective_loader.errors import BatchError, DeliveryError, LeaderError, WireError
from collective_loader.plan.mesh import MeshLayout
from collective_loader.plan.routing import Routing
from collective_loader.plan.split import RowSplit
from collective_loader.plan.wire import Kind

STEPS = 3


def settings_by_hand(transport: str, delivery: str) -> Settings:
    """This rank's settings on a pp=2 x cp=2 mesh, built as CollectiveLoader builds them."""
    layout = MeshLayout.from_mesh(ranks.make_mesh(("pp", "cp"), (2, 2)))
    place = layout.place(dist.get_rank())
    keys = ranks.KEYS
    routing = Routing(keys["inputs"], keys["labels"], keys["seq_dims"], RowSplit("zigzag"), layout.shard_dims())
    cpu = torch.device("cpu")
    config = LoaderConfig(transport=transport, delivery=delivery, prefetch=2, timeout=30.0, max_batch_bytes=1 << 20)
    groups = build_groups(
        control_group(30.0),
        layout,
        place,
        device=cpu,
        transport=transport,
        timeout=30.0,
        scatter=delivery == "scatter",
        buffers_per_channel=4,
        middle_data=False,
    )
    return Settings(config, layout, place, routing, cpu, 2, groups)


def by_hand(transport: str, delivery: str) -> dict:
    """Run STEPS data steps and the end by calling the protocol directly; return what each gave."""
    settings = settings_by_hand(transport, delivery)
    place, routing = settings.place, settings.routing
    batches = [ranks.sample_batch([2 * i, 2 * i + 1], 8) for i in range(STEPS)]
    if place.is_leader:
        it = iter(batches)
        watch = StallWatch(60.0, lambda step: None, "test-watch")
        protocol = LeaderStep(settings, None, lambda step: next(it), lambda: None, watch, ShardWorkTally(), epoch_id=1)
    else:
        protocol = MemberStep(settings, None)
    out = []
    for step in range(STEPS + 1):
        item = protocol.step(step)  # the gloo part: header (and with the host transport, the bytes)
        pending = bool(item.sends or item.receive)
        item = complete(settings, post(settings, item))  # the training thread's part
        out.append(
            {
                "kind": int(item.kind),
                "step": item.step,
                "pending": pending,
                "batch": {k: v.clone() for k, v in item.batch.items()},
            }
        )
    if place.is_leader:
        watch.close()
    want = [routing.piece(routing.select(b, place.stage), place.shard) for b in batches]
    return {"rank": dist.get_rank(), "leader": place.is_leader, "items": out, "want": want}


@pytest.mark.parametrize("delivery", ["broadcast", "scatter"])
@pytest.mark.parametrize("transport", ["host", "device"])
def test_steps_by_hand(worlds, transport, delivery):
    for r in worlds.get(4).run(by_hand, transport, delivery, timeout=90):
        items = r["items"]
        assert [i["kind"] for i in items] == [int(Kind.DATA)] * STEPS + [int(Kind.END)]
        assert [i["step"] for i in items] == list(range(STEPS + 1))
        # the device transport leaves the tensor bytes to the training thread; the host one does not
        assert [i["pending"] for i in items[:STEPS]] == [transport == "device"] * STEPS, (r["rank"], items)
        for step, (item, want) in enumerate(zip(items, r["want"])):
            assert item["batch"].keys() == want.keys(), (r["rank"], step)
            for key, value in want.items():
                assert torch.equal(item["batch"][key], value), (r["rank"], step, key)


# --- the transfer thread, without collectives -----------------------------------------------


def _recording(calls: list[int], last: int):
    def step(n: int) -> int:
        calls.append(n)
        return n

    return step, (lambda item: item >= last)


def test_lead_is_bounded_by_what_was_taken():
    """``close()`` lets the thread run the steps already granted and nothing beyond, so what it
    ran by then is exactly what the lead allows (no sleep: the join is the synchronisation)."""
    calls: list[int] = []
    step, is_last = _recording(calls, last=100)
    p = Prefetcher(step, lead=3, is_last=is_last, on_error=repr, name="t")
    p.close(wait=5)
    assert not p.alive()
    assert calls == [0, 1, 2]  # the lead: three steps before anything is taken, no more
    calls.clear()
    p = Prefetcher(step, lead=3, is_last=is_last, on_error=repr, name="t")
    assert [p.take(), p.take()] == [0, 1]
    p.close(wait=5)
    assert not p.alive()
    assert calls == [0, 1, 2, 3, 4]  # two taken: two steps more, nothing beyond


def test_the_last_item_and_an_error_end_the_thread():
    p = Prefetcher(lambda n: n, lead=10, is_last=lambda n: n == 2, on_error=repr, name="t")
    assert [p.take() for _ in range(3)] == [0, 1, 2]
    p.close(wait=5)
    assert not p.alive() and p._queue.empty()

    def failing(n: int) -> str:
        if n == 1:
            raise KeyError("boom")
        return "ok"

    p = Prefetcher(failing, lead=10, is_last=lambda item: False, on_error=lambda e: f"error {e!r}", name="t")
    assert [p.take(), p.take()] == ["ok", "error KeyError('boom')"]
    p.close(wait=5)
    assert not p.alive()


def test_interrupt_replaces_a_stuck_step():
    release = threading.Event()

    def stuck(n: int) -> str:
        release.wait(10)
        return "late"

    p = Prefetcher(stuck, lead=2, is_last=lambda item: False, on_error=repr, name="t")
    p.interrupt("stalled")
    assert p.take() == "stalled"
    release.set()
    p.close(wait=5)
    assert not p.alive()
    assert p._queue.empty()  # what the stuck step returned after the interrupt was dropped


@pytest.mark.parametrize(
    "error,kind",
    [
        (DeliveryError("lost rank 3"), Kind.DELIVERY_ERROR),
        (WireError("bad magic"), Kind.DELIVERY_ERROR),
        (BatchError("key 'x'"), Kind.BATCH_ERROR),
        (LeaderError("boom"), Kind.SOURCE_ERROR),
        (KeyError("k"), Kind.SOURCE_ERROR),
    ],
)
def test_an_exception_on_the_transfer_thread_keeps_its_class_and_message(error, kind):
    """What the training loop raises is the exception the thread saw, not a relabelled one."""
    p = Prefetcher(
        lambda n: (_ for _ in ()).throw(error), lead=2, is_last=lambda item: False, on_error=failed, name="t"
    )
    item = p.take()
    p.close(wait=5)
    assert item.error is error and item.kind == kind
