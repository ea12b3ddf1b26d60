"""StreamingDataset end to end: real MDS shards, real StreamingDataset, real DataLoader workers.

Coverage over meshes with pp > 1, the seed's naive ``replication`` set-up next to ours, exact
resume (prefetch on, workers), elastic resume dp 2 -> 1 and 2 -> 4, several epochs, leaders
sharing a node, a failed construction that restores the environment, and clean-up, also after a
killed run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import ranks
import torch
import torch.distributed as dist

from collective_loader import CollectiveLoader, LeaderError
from collective_loader.cli.args import DemoArgs
from collective_loader.cli.naive import naive_ids
from collective_loader.cli.report import label_mismatch
from collective_loader.cli.run import failed
from collective_loader.delivery.transport import new_group
from collective_loader.plan.mesh import MeshLayout
from collective_loader.plan.routing import Routing
from collective_loader.plan.split import RowSplit
from collective_loader.streaming import StreamingSource
from collective_loader.streaming.source import STALE_AFTER
from collective_loader.testing import invariants
from collective_loader.testing.data import INPUTS, LABELS, SEQ_DIMS, expected, write_dataset

SAMPLES, SEQ = 96, 16


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mds") / "tokens")
    write_dataset(out, SAMPLES, SEQ)
    return out


def leftovers() -> list[str]:
    """Streaming's shared memory segments and lock files on this machine."""
    shm = [f for f in os.listdir("/dev/shm") if re.match(r"^\d{6}_", f)]
    locks = [f for f in os.listdir(tempfile.gettempdir()) if re.match(r"^\d{6}_.*filelock$", f)]
    return sorted(shm + locks)


def _build(data, dims, shape, batch_size, **kw):
    mesh = ranks.make_mesh(dims, shape)
    workers = kw.pop("num_workers", 0)
    source = StreamingSource(
        mesh,
        local=data,
        batch_size=batch_size,
        shuffle=True,
        shuffle_seed=7,
        num_canonical_nodes=2,
        num_workers=workers,
        # forked workers of these big test processes were ~10x slower (docs/streaming.md, 'DataLoader workers')
        dataloader_kwargs={"multiprocessing_context": "forkserver"} if workers else None,
    )
    return CollectiveLoader(source, mesh, inputs=INPUTS, labels=LABELS, seq_dims=SEQ_DIMS, **kw)


def _free(loader) -> None:
    loader.close()  # frees the leader's dataset, whose shared memory goes with it


def epochs(data, dims, shape, *, batch_size=4, n_epochs=1, **kw):
    loader = _build(data, dims, shape, batch_size, **kw)
    place = loader.place
    out = [[b for b in loader] for _ in range(n_epochs)]
    _free(loader)
    dist.barrier()
    return {"place": place, "epochs": out, "leftovers": leftovers()}


def naive(data, dims, shape, batch_size=4):
    layout = MeshLayout.build(dims, shape, range(dist.get_world_size()))
    group = new_group(range(dist.get_world_size()), "gloo", 60.0, "test:naive")
    assert group is not None
    args = DemoArgs(dims, shape, data, SAMPLES, batch_size, SEQ, "zigzag", "broadcast", 0)
    return naive_ids(args, layout, group, failed("the naive run"))


def resume(data, dims, shape, stop_after, num_workers):
    full = epochs(data, dims, shape, num_workers=num_workers)["epochs"][0]
    first = _build(data, dims, shape, 4, num_workers=num_workers)
    it = iter(first)
    head = [next(it) for _ in range(stop_after)]
    state = first.state_dict()
    _free(first)
    second = _build(data, dims, shape, 4, num_workers=num_workers)
    second.load_state_dict(state)
    tail = [b for b in second]
    _free(second)
    ids = lambda bs: [b["sample_id"].tolist() if b else None for b in bs]  # noqa: E731
    return ids(full), ids(head), ids(tail)


def elastic_save(data, dims, shape, batch_size, stop_after):
    loader = _build(data, dims, shape, batch_size)
    it = iter(loader)
    taken = [next(it)["sample_id"].tolist() for _ in range(stop_after)] if loader.is_leader else []
    if not loader.is_leader:
        for _ in range(stop_after):
            next(it)
    state = loader.state_dict()
    _free(loader)
    return state, taken


def elastic_resume(data, dims, shape, batch_size, state):
    loader = _build(data, dims, shape, batch_size)
    loader.load_state_dict(state)
    rest = [b["sample_id"].tolist() for b in loader]
    leader = loader.is_leader
    _free(loader)
    return rest if leader else None


def failed_build():
    mesh = ranks.make_mesh(("pp", "dp", "tp"), (2, 2, 2))
    before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    barrier = dist.barrier
    # download_timeout passes through to StreamingDataset: the second leader waits that long for
    # the index the first one cannot produce
    source = StreamingSource(mesh, local="/nonexistent/mds", batch_size=4, download_timeout=3)
    try:
        CollectiveLoader(source, mesh, inputs=INPUTS, labels=LABELS)
    except LeaderError as e:
        message = str(e)
    else:
        message = None
    after = {k: os.environ.get(k) for k in before}
    return message, before == after, dist.barrier is barrier


def _verify(records_by_rank, epoch):
    """Check (a)-(e) for one epoch; return the leaders' sample ids in delivery order."""
    records = [
        invariants.RankRecord(
            r["place"].rank, r["place"].dp_rank, r["place"].stage, r["place"].shard, r["epochs"][epoch]
        )
        for r in records_by_rank
    ]
    routing = Routing(INPUTS, LABELS, SEQ_DIMS, RowSplit("zigzag"), ())
    if records_by_rank[0]["place"].shard:
        routing = Routing(INPUTS, LABELS, SEQ_DIMS, RowSplit("zigzag"), (("cp", 2),))
    verdicts = invariants.check(records, routing, lambda ids: expected(ids, SEQ), range(SAMPLES))
    assert all(v.ok for v in verdicts), [f"{v.name}: {v.detail}" for v in verdicts if not v.ok]
    return [
        i for r in records_by_rank if r["place"].is_leader for b in r["epochs"][epoch] for i in b["sample_id"].tolist()
    ]


@pytest.fixture
def world(worlds):
    return worlds.get(8)


@pytest.mark.parametrize(
    "dims,shape,num_workers",
    [
        (("pp", "dp", "tp"), (2, 2, 2), 0),
        (("tp", "pp", "dp"), (2, 2, 2), 2),  # odd order, DataLoader workers
        (("pp", "dp", "cp"), (2, 2, 2), 0),  # context parallel shards
        (("dp", "pp", "tp"), (2, 2, 2), 0),
    ],
)
def test_coverage_one_epoch(world, data, dims, shape, num_workers):
    results = world.run(epochs, data, dims, shape, num_workers=num_workers, timeout=180)
    _verify(results, 0)
    assert all(r["leftovers"] == [] for r in results), results[0]["leftovers"]


def test_seed_reproduction_naive_replication_mismatches_ours_does_not(world, data):
    dims, shape = ("pp", "dp", "tp"), (2, 2, 2)
    ours = world.run(epochs, data, dims, shape, timeout=180)
    theirs = world.run(naive, data, dims, shape, timeout=180)
    layout = MeshLayout.build(dims, shape, range(8))
    stage_of = {r: layout.place(r).stage for r in range(8)}
    dp_of = {r: layout.place(r).dp_rank for r in range(8)}
    our_ids = {r: [b["sample_id"].tolist() for b in res["epochs"][0]] for r, res in enumerate(ours)}
    bad, total = label_mismatch(stage_of, dp_of, our_ids)
    assert total > 0 and bad == 0
    bad, total = label_mismatch(stage_of, dp_of, dict(enumerate(theirs)))
    assert total > 0 and bad == total, (bad, total)  # every step of the naive set-up is wrong


def test_two_epochs_new_permutation(world, data):
    results = world.run(epochs, data, ("pp", "dp", "tp"), (2, 2, 2), n_epochs=2, timeout=180)
    first, second = _verify(results, 0), _verify(results, 1)
    assert sorted(first) == sorted(second) == list(range(SAMPLES)) and first != second


# with workers: 80-110 s here, so slow; test_torchdata resumes exactly with workers in the default run
@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_exact_resume(world, data, num_workers):
    results = world.run(resume, data, ("pp", "dp", "tp"), (2, 2, 2), 5, num_workers, timeout=240)
    for rank, (full, head, tail) in enumerate(results):
        assert len(full) == SAMPLES // 8 and head == full[:5] and tail == full[5:], rank


def test_failed_construction_restores_environment(world):
    for message, env_restored, barrier_restored in world.run(failed_build, timeout=120):
        assert message is not None and "leader rank 0 could not build its source" in message
        assert env_restored and barrier_restored


@pytest.mark.parametrize("new_dp", [1, 4])
def test_elastic_resume(worlds, data, new_dp):
    world = worlds.get(4)
    saved = world.run(elastic_save, data, ("dp", "tp"), (2, 2), 4, 3, timeout=180)
    state = saved[0][0]
    taken = [i for s, ids in saved for step in ids for i in step]
    new_shape = {1: (1, 4), 4: (4, 1)}[new_dp]
    rest = world.run(elastic_resume, data, ("dp", "tp"), new_shape, 8 // new_dp, state, timeout=180)
    after = [i for r in rest if r is not None for step in r for i in step]
    assert len(taken) == 3 * 8
    assert len(set(taken) | set(after)) == len(taken) + len(after), "a sample was delivered twice"
    assert sorted(taken + after) == list(range(SAMPLES)), "a sample was lost"


KILLED = textwrap.dedent(
    """
    import os, signal, sys
    from streaming import StreamingDataset
    ds = StreamingDataset(local=sys.argv[1], batch_size=4)
    next(iter(ds))
    os.killpg(0, signal.SIGKILL)  # the whole run, Python's resource tracker included, as a scheduler does
    """
)


def killed_then_restart(data, clean_stale):
    mesh = ranks.make_mesh(("pp", "dp", "tp"), (2, 2, 2))
    source = StreamingSource(mesh, local=data, batch_size=4, clean_stale=clean_stale)
    loader = CollectiveLoader(source, mesh, inputs=INPUTS, labels=LABELS)
    steps = sum(1 for _ in loader)
    _free(loader)
    return steps


def test_after_a_killed_run_the_next_run_starts_and_clean_stale_removes_the_leftovers(world, data):
    proc = subprocess.run(
        [sys.executable, "-c", KILLED, data], capture_output=True, timeout=120, start_new_session=True
    )
    assert proc.returncode == -signal.SIGKILL
    stale = leftovers()
    assert stale, "the killed run should have left streaming's shared memory behind"
    # streaming takes the next free prefix: the next run starts, and the killed run's blocks stay
    assert world.run(killed_then_restart, data, False, timeout=180) == [SAMPLES // 8] * 8
    assert leftovers() == stale
    assert world.run(killed_then_restart, data, True, timeout=180) == [SAMPLES // 8] * 8
    assert leftovers() == []


def checkpoint_then_die(data, path, checkpoint_at, die_at):
    """Save the loader state after ``checkpoint_at`` steps, then the whole job dies (SIGKILL) at
    ``die_at``; the ids each rank got before dying go to a file, line by line."""
    rank = dist.get_rank()
    try:
        loader = _build(data, ("pp", "dp", "tp"), (2, 2, 2), 4)
        with open(os.path.join(path, f"ids_{rank}.jsonl"), "w") as f:
            for step, batch in enumerate(loader, 1):
                f.write(json.dumps(batch["sample_id"].tolist()) + "\n")
                f.flush()
                if step == checkpoint_at:
                    torch.save(loader.state_dict(), os.path.join(path, f"state_{rank}.pt"))
                if step == die_at:
                    break
    finally:
        os.kill(os.getpid(), signal.SIGKILL)  # every rank, whatever happened: a job killed by its scheduler


def resume_after_kill(data, path):
    mesh = ranks.make_mesh(("pp", "dp", "tp"), (2, 2, 2))
    source = StreamingSource(
        mesh, local=data, batch_size=4, shuffle=True, shuffle_seed=7, num_canonical_nodes=2, clean_stale=True
    )  # the killed job's shared memory is still there
    loader = CollectiveLoader(source, mesh, inputs=INPUTS, labels=LABELS, seq_dims=SEQ_DIMS)
    loader.load_state_dict(torch.load(os.path.join(path, f"state_{dist.get_rank()}.pt"), weights_only=False))
    tail = [b["sample_id"].tolist() for b in loader]
    _free(loader)
    return tail


def test_resume_after_the_whole_job_was_killed(worlds, data, tmp_path):
    world = worlds.get(8)
    full = [
        [b["sample_id"].tolist() for b in r["epochs"][0]]
        for r in world.run(epochs, data, ("pp", "dp", "tp"), (2, 2, 2), timeout=180)
    ]
    world.run(checkpoint_then_die, data, str(tmp_path), 3, 6, dying=frozenset(range(8)), timeout=180)
    # clean_stale keeps a block changed in the last STALE_AFTER seconds (it may be another job's,
    # created a moment ago): a restart comes later than that, as the scheduler's would
    changed = [os.stat(os.path.join("/dev/shm", n)).st_ctime for n in leftovers() if not n.endswith("filelock")]
    assert changed, "the killed job should have left streaming's shared memory behind"
    time.sleep(max(0.0, max(changed) + STALE_AFTER + 0.1 - time.time()))
    tails = world.run(resume_after_kill, data, str(tmp_path), timeout=240)  # a fresh world
    for rank in range(8):
        with open(tmp_path / f"ids_{rank}.jsonl") as f:
            before = [json.loads(line) for line in f]
        assert before[:3] == full[rank][:3], rank  # what was delivered up to the checkpoint
        assert tails[rank] == full[rank][3:], rank  # from step 4 on: the uninterrupted run
        seen = {i for step in full[rank][:3] for i in step}
        assert not seen & {i for step in tails[rank] for i in step}, rank  # nothing delivered twice
    assert leftovers() == []


def left_early(data):
    """Leave an epoch after 2 steps; on leaders, report whether streaming's download threads
    for it had exited before its shared memory was freed."""
    loader = _build(data, ("pp", "dp", "tp"), (2, 2, 2), 4)
    it = iter(loader)
    next(it), next(it)
    iterator = loader.source.dataset._iterator if loader.is_leader else None
    _free(loader)
    from streaming.base.dataset import _IterState

    return None if iterator is None else _IterState(iterator._state).name


def test_an_epoch_left_early_stops_streamings_threads_before_release(world, data):
    states = [s for s in world.run(left_early, data, timeout=120) if s is not None]
    assert states == ["EXITED", "EXITED"]
    assert leftovers() == []


def uneven_leaders(data):
    """dp=3, tp=2 on two nodes of 3 ranks: two leaders on the first node, one on the second."""
    os.environ["LOCAL_WORLD_SIZE"] = "3"
    try:
        StreamingSource(ranks.make_mesh(("dp", "tp"), (3, 2)), local=data, batch_size=2)
    except ValueError as e:
        return str(e)
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = str(dist.get_world_size())
    return None


def test_leaders_spread_unevenly_over_nodes_are_refused_on_every_rank(worlds, data):
    # refused on the leaders alone, the other ranks went on into group creation and hung
    messages = worlds.get(6).run(uneven_leaders, data, timeout=60)
    assert all(m is not None and "unevenly" in m for m in messages), messages
