"""Jobs over two nodes, each a torchrun agent in namespaces of its own (``nodes.py``).

Cases: leaders on both nodes, all leaders on one node (pp outermost), leaders spread unevenly
(refused on every rank, never a hang), and a whole node SIGKILLed mid-epoch (the other node's
ranks raise the loader's error and end, nothing is left in either node's /dev/shm, and the job
started again from its last checkpoint continues exactly). Each checks every rank's samples with
the invariants: the demo's verdict, or :func:`collective_loader.testing.invariants.check` here.

Run as a script (under ``nodes.py``'s entry), this file is the killed job's training loop.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import math
import os
import select
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nodes
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from collective_loader import CollectiveLoader
from collective_loader.cli.args import parse_mesh
from collective_loader.plan.mesh import MeshLayout
from collective_loader.plan.routing import Routing
from collective_loader.plan.split import RowSplit
from collective_loader.streaming import StreamingSource
from collective_loader.testing import invariants
from collective_loader.testing.data import INPUTS, LABELS, SEQ_DIMS, expected, write_dataset

SAMPLES, SEQ, BATCH = 128, 16, 4  # dp=2: 16 steps per epoch
TRAIN_MESH = ("dp", "pp", "tp"), (2, 2, 2)  # one replica, and its leader, per node
WORLD = 8
LOADER_TIMEOUT = 20.0  # seconds; the loader's, in the killed job
CKPT_EVERY = 4  # steps
JOB_TIMEOUT = 300.0  # seconds for one job, torchrun's start included (2 x 4 ranks on 2 loaded cores)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An MDS dataset both nodes read: outside their private /dev/shm and temp dirs, as on a
    shared filesystem."""
    out = str(tmp_path_factory.mktemp("mds") / "tokens")
    write_dataset(out, SAMPLES, SEQ)
    return out


def leader_nodes(mesh: str, where: dict[int, dict[str, int]], placement: str = "spread") -> list[int]:
    """The node each replica's leader ran on, by dp_rank."""
    dims, shape = parse_mesh(mesh)
    layout = MeshLayout.build(dims, shape, range(math.prod(shape)), placement=placement)
    return [where[r]["two_nodes_node"] for r in layout.leaders()]


def run_demo(
    cluster: nodes.Cluster, data: str, mesh: str, placement: str = "spread", **start: float
) -> tuple[nodes.Result, nodes.Job]:
    job = cluster.start(
        [
            "-m",
            "collective_loader",
            "demo",
            "--data",
            data,
            "--mesh",
            mesh,
            "--seq-len",
            str(SEQ),
            "--batch-size",
            str(BATCH),
            "--placement",
            placement,
        ],
        **start,
    )
    return job.wait(JOB_TIMEOUT), job


def assert_demo_passed(result: nodes.Result, world: int) -> None:
    assert result.codes == (0, 0) and len(result.ranks) == world, result.describe()
    assert all(r.exit and r.exit["code"] == 0 for r in result.ranks.values()), result.describe()
    report = result.ranks[0].log
    assert "all checks passed" in report and report.count("[ok]") == 5, result.describe()


def assert_nodes_clean(cluster: nodes.Cluster) -> None:
    left = {node.index: node.blocks() + node.locks() for node in cluster.nodes}
    assert left == {0: [], 1: []}, f"streaming's files left on the nodes: {left}"


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_TIMEOUT)
@pytest.mark.parametrize(
    "mesh,placement,leader_nodes_wanted",
    [("dp=2,pp=2,tp=2", "spread", 2), ("pp=2,dp=2,tp=2", "first_stage", 1), ("pp=2,dp=2,tp=2", "spread", 2)],
    ids=["both_nodes", "one_node", "both_nodes_spread"],
)
def test_leader_placements_over_nodes(
    tmp_path: Path, data: str, mesh: str, placement: str, leader_nodes_wanted: int
) -> None:
    """The two leaders on both nodes (data dims outermost, or pp outermost with the default
    placement, which spreads them over the stages), or both on one node (pp outermost, every
    leader on the first stage)."""
    with nodes.Cluster(tmp_path, nproc=4) as cluster:
        result, job = run_demo(cluster, data, mesh, placement)
        print(f"{mesh} ({placement}) over 2 x 4 ranks: {result.seconds:.1f}s")
        assert_demo_passed(result, 8)
        placed = leader_nodes(mesh, job.where(), placement)
        assert len(placed) == 2 and len(set(placed)) == leader_nodes_wanted, result.describe()
        assert_nodes_clean(cluster)


@pytest.mark.timeout(2 * JOB_TIMEOUT)
def test_uneven_leaders_fail_on_every_rank(tmp_path: Path, data: str) -> None:
    """Leaders 0, 2, 4 of ``dp=3,tp=2`` sit two on one node and one on the other, which
    streaming cannot express: every rank must say so and the job end, not hang. torchrun stops
    a node's ranks as soon as one has failed; a 5 s look interval lets each report first."""
    with nodes.Cluster(tmp_path, nproc=3) as cluster:
        result, job = run_demo(cluster, data, "dp=3,tp=2", monitor_interval=5.0)
        print(f"dp=3,tp=2 over 2 x 3 ranks: ended in {result.seconds:.1f}s")
        assert not result.timed_out and 0 not in result.codes, result.describe()
        assert sorted(leader_nodes("dp=3,tp=2", job.where())) in ([0, 0, 1], [0, 1, 1]), result.describe()
        assert len(result.ranks) == 6, result.describe()
        for r in result.ranks.values():
            assert r.exit and "spread unevenly" in (r.exit["error"] or ""), result.describe()
        assert_nodes_clean(cluster)


@pytest.mark.timeout(2 * JOB_TIMEOUT)
def test_a_rank_failing_in_the_demo_report_ends_both_nodes(tmp_path: Path, data: str) -> None:
    """Rank 0 raises in the demo's report, after the epoch: the ranks on both nodes hear it
    from the report's agreement and exit non-zero, so both agents do too (before, the node
    whose ranks had succeeded waited in torchrun's exit barrier until killed). pp=4,dp=2 puts
    replica 1's leader on a middle stage, as the report's original KeyError needed."""
    with nodes.Cluster(tmp_path, nproc=4) as cluster:
        job = cluster.start(
            [
                str(nodes.SUPPORT / "failing_demo.py"),
                "report",
                "0",
                "--data",
                data,
                "--mesh",
                "pp=4,dp=2",
                "--seq-len",
                str(SEQ),
                "--batch-size",
                str(BATCH),
                "--timeout",
                "60",
            ],
            monitor_interval=5.0,
        )
        result = job.wait(JOB_TIMEOUT)
        print(f"pp=4,dp=2 over 2 x 4 ranks, rank 0's report failing: ended in {result.seconds:.1f}s")
        assert not result.timed_out and 0 not in result.codes, result.describe()
        assert len(result.ranks) == WORLD and {r.node for r in result.ranks.values()} == {0, 1}, result.describe()
        for r in result.ranks.values():  # each exited by itself (torchrun stopped none), with rank 0's error
            assert r.exit and r.exit["code"] != 0, result.describe()
            assert "rank 0 failed in the report: KeyError: 'injected by failing_demo.py'" in r.log, result.describe()
        assert_nodes_clean(cluster)


# --- a node killed mid-epoch ------------------------------------------------------------------


def train(argv: list[str]) -> None:
    """One rank of the training job: one epoch of ``TRAIN_MESH``, a checkpoint every
    ``CKPT_EVERY`` steps (each rank its loader state and the batches it got so far, as a trainer
    saves its model), progress after each step, and every batch of the epoch at the end. With
    ``--hold-at``: after that step, it says so (``held``) and waits until the test lets its node
    go (``hold<node>``), as in a long step of compute."""
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--resume", type=int, default=0, help="the checkpoint's step; 0: from the start")
    p.add_argument("--hold-at", type=int, default=0, help="the step after which to wait for the test; 0: none")
    a = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", TRAIN_MESH[1], mesh_dim_names=TRAIN_MESH[0])
    source = StreamingSource(
        mesh, local=a.data, batch_size=BATCH, shuffle=True, shuffle_seed=17, num_canonical_nodes=2, clean_stale=True
    )
    loader = CollectiveLoader(source, mesh, inputs=INPUTS, labels=LABELS, seq_dims=SEQ_DIMS, timeout=LOADER_TIMEOUT)
    steps: list[dict[str, torch.Tensor]] = []
    if a.resume:
        saved = torch.load(a.out / f"step{a.resume}" / f"rank{rank}.pt", weights_only=True)
        loader.load_state_dict(saved["loader"])
        steps = saved["steps"]
    for batch in loader:
        steps.append(batch)
        if len(steps) % CKPT_EVERY == 0:
            save(a.out / f"step{len(steps)}" / f"rank{rank}.pt", {"loader": loader.state_dict(), "steps": steps})
        save(a.out / "progress" / f"rank{rank}.pt", len(steps))
        if len(steps) == a.hold_at:
            with open(a.out / HELD, "wb") as held:  # the test reads it (a FIFO)
                held.write(bytes([rank]))
            with open(a.out / f"{HOLD}{os.environ['TWO_NODES_NODE']}", "rb") as hold:
                fcntl.flock(hold, fcntl.LOCK_SH)  # the test holds it exclusively until it lets us go
    loader.close()
    save(a.out / "epoch" / f"rank{rank}.pt", steps)
    dist.destroy_process_group()


def save(path: Path, obj: object) -> None:
    """torch.save whole or not at all: a node may be killed in the middle of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path.with_suffix(".part"))
    path.with_suffix(".part").replace(path)


def start_training(cluster: nodes.Cluster, data: str, out: Path, *args: str, **start: float) -> nodes.Job:
    return cluster.start([__file__, "--data", data, "--out", str(out), *args], **start)


def epoch(out: Path) -> list[list[dict[str, torch.Tensor]]]:
    """Every rank's batches of the epoch, by global rank."""
    return [torch.load(out / "epoch" / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def steps_done(out: Path) -> int:
    """The step every rank has finished."""
    files = [out / "progress" / f"rank{r}.pt" for r in range(WORLD)]
    return min(torch.load(f, weights_only=True) if f.exists() else 0 for f in files)


def last_checkpoint(out: Path) -> int:
    """The latest step whose checkpoint every rank wrote."""
    return max(
        (int(d.name[4:]) for d in out.glob("step*") if all((d / f"rank{r}.pt").exists() for r in range(WORLD))),
        default=0,
    )


def check_epoch(batches: list[list[dict[str, torch.Tensor]]]) -> None:
    """Invariants (a)-(e) over one epoch of ``TRAIN_MESH`` on every rank."""
    layout = MeshLayout.build(*TRAIN_MESH, range(len(batches)))
    records = []
    for rank, steps in enumerate(batches):
        place = layout.place(rank)
        records.append(invariants.RankRecord(rank, place.dp_rank, place.stage, place.shard, steps))
    routing = Routing(INPUTS, LABELS, SEQ_DIMS, RowSplit("zigzag"), ())
    verdicts = invariants.check(records, routing, lambda ids: expected(ids, SEQ), range(SAMPLES))
    assert all(v.ok for v in verdicts), [f"{v.name}: {v.detail}" for v in verdicts if not v.ok]


def ids(steps: list[dict[str, torch.Tensor]]) -> list[list[int]]:
    return [b["sample_id"].tolist() for b in steps]  # every stage gets sample_id


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data: str) -> list[list[dict[str, torch.Tensor]]]:
    """Every rank's batches of an uninterrupted epoch of the training job: what a resumed one
    must repeat."""
    out = tmp_path_factory.mktemp("reference")
    with nodes.Cluster(out / "nodes", nproc=4) as cluster:
        result = start_training(cluster, data, out).wait(JOB_TIMEOUT)
    print(f"uninterrupted training epoch over 2 x 4 ranks: {result.seconds:.1f}s")
    assert result.codes == (0, 0), result.describe()
    batches = epoch(out)
    check_epoch(batches)
    return batches


HELD, HOLD = "held", "hold"  # a FIFO each held rank writes its rank to; its node's lock it then waits for


class Hold:
    """Ranks that reach ``--hold-at`` wait on their node's lock until :meth:`release`; ``reader``
    is the read end of ``HELD``."""

    def __init__(self, out: Path, stack: contextlib.ExitStack) -> None:
        os.mkfifo(out / HELD)
        self.reader = os.open(out / HELD, os.O_RDONLY | os.O_NONBLOCK)
        stack.callback(os.close, self.reader)
        keep_open = os.open(out / HELD, os.O_WRONLY)  # no end of file between the ranks' writes
        stack.callback(os.close, keep_open)
        self.locks = [stack.enter_context(open(out / f"{HOLD}{node}", "wb")) for node in range(2)]
        for lock in self.locks:
            fcntl.flock(lock, fcntl.LOCK_EX)

    def release(self, node: int) -> None:
        fcntl.flock(self.locks[node], fcntl.LOCK_UN)


@contextlib.contextmanager
def holding(out: Path) -> Iterator[Hold]:
    """While in it, ranks that reach ``--hold-at`` wait (those of a node not released, to the end)."""
    with contextlib.ExitStack() as stack:
        yield Hold(out, stack)


def wait_until_held(job: nodes.Job, reader: int) -> None:
    """Until every rank has reached the hold, or an agent has ended (the job failed first)."""
    agents = [os.pidfd_open(agent.pid) for agent in job.agents]  # readable once it has exited
    held: set[int] = set()
    deadline = time.monotonic() + JOB_TIMEOUT  # a bound for a hang, not a measure
    try:
        while len(held) < WORLD:
            ready, _, _ = select.select([reader, *agents], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"ranks {sorted(set(range(WORLD)) - held)} did not get to the hold"
            assert reader in ready, f"the job ended before every rank got to the hold: {sorted(held)}"
            held |= set(os.read(reader, WORLD))
    finally:
        for fd in agents:
            os.close(fd)


def kill_mid_epoch(cluster: nodes.Cluster, data: str, out: Path, victim: int) -> tuple[nodes.Result, float]:
    """Kill node ``victim`` while every rank is held two steps past the first checkpoint (as in a
    step of compute), then let the other node's ranks go on (the killed node's stay held until
    the kernel has ended them); return how the job ended and the seconds from the kill to its end."""
    with holding(out) as hold:
        job = start_training(cluster, data, out, "--hold-at", str(CKPT_EVERY + 2), monitor_interval=5.0)
        wait_until_held(job, hold.reader)
        killed_at = time.time()
        job.kill_node(victim)
        hold.release(1 - victim)
        ended = job.wait(JOB_TIMEOUT)
    took = time.time() - killed_at
    left = {node.index: node.blocks() + node.locks() for node in cluster.nodes}
    print(f"killed node {victim} after step {steps_done(out)}; the job ended {took:.1f}s later; left: {left}")
    print(ended.describe())
    assert steps_done(out) == CKPT_EVERY + 2, "the killed node's ranks got past the hold"
    waited_out = f"Timed out waiting {LOADER_TIMEOUT * 1000:.0f}ms"  # gloo's words for the loader's timeout
    for r in ended.ranks.values():
        if r.node != victim and r.exit is not None:  # None: stopped by torchrun
            error = r.exit["error"] or ""
            assert error.startswith("DeliveryError"), ended.describe()
            assert "Timed out" not in error or waited_out in error, ended.describe()  # the loader's timeout at most
    return ended, took


@pytest.mark.slow
@pytest.mark.timeout(4 * JOB_TIMEOUT)
@pytest.mark.parametrize("victim", [0, 1], ids=["store-node", "other-node"])
def test_node_killed_mid_epoch_then_resumed(
    tmp_path: Path, data: str, reference: list[list[dict[str, torch.Tensor]]], victim: int
) -> None:
    """Node 0 holds the rendezvous store: killing it takes torchrun's agent on the other node
    down too. Killing node 1 leaves node 0's ranks to our loader's errors. Either way the
    survivors end (each that torchrun does not stop first raising ``DeliveryError``, having
    waited for no collective longer than the loader's timeout; torchrun's 5 s look interval lets
    each report its error first) and leave no block in their /dev/shm; the killed
    node's blocks stay, as on a host that went down, until the job started again there from
    the last checkpoint (``clean_stale``) removes them; and that job continues the epoch
    exactly."""
    with nodes.Cluster(tmp_path / "nodes", nproc=4) as cluster:
        ended, took = kill_mid_epoch(cluster, data, tmp_path, victim)
        survivor = cluster.nodes[1 - victim]
        assert not ended.timed_out and ended.codes[survivor.index] != 0, ended.describe()
        assert survivor.blocks() == [], ended.describe()

        step = last_checkpoint(tmp_path)
        resumed = start_training(cluster, data, tmp_path, "--resume", str(step)).wait(JOB_TIMEOUT)
        print(f"resumed from step {step}: {resumed.seconds:.1f}s")
        assert resumed.codes == (0, 0), resumed.describe()
        assert_nodes_clean(cluster)
    again = epoch(tmp_path)
    for rank in range(WORLD):
        assert ids(again[rank]) == ids(reference[rank]), f"rank {rank} resumed from step {step} differently"
    check_epoch(again)


if __name__ == "__main__":
    train(sys.argv[1:])
