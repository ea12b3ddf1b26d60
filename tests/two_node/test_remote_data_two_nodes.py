"""A two-node job streaming from the S3 endpoint, each node with its own ``local`` cache (under its
own temp dir, ``nodes.py``): only the nodes that hold a leader fill their cache, no other rank
sends the endpoint a single request, and every rank's samples pass the invariants over the
epoch.

Run as a script (under ``nodes.py``'s entry), this file is the job's rank.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
from pathlib import Path

import nodes
import pytest
import torch
import torch.distributed as dist
from s3_bucket import S3_BUCKET, s3_shards
from torch.distributed.device_mesh import init_device_mesh

from collective_loader import CollectiveLoader
from collective_loader.cli.args import parse_mesh
from collective_loader.plan.mesh import MeshLayout
from collective_loader.plan.routing import Routing
from collective_loader.plan.split import RowSplit
from collective_loader.streaming import StreamingSource
from collective_loader.testing import invariants
from collective_loader.testing.data import INPUTS, LABELS, SEQ_DIMS, expected, write_dataset
from collective_loader.testing.s3_endpoint import APP_ID_VARIABLE

SAMPLES, SEQ, BATCH = 128, 16, 4
SHARD_BYTES = 1 << 11
CACHE = "s3-cache"  # under each node's temp dir
JOB_TIMEOUT = 300.0


def rank_main(argv: list[str]) -> None:
    """One epoch of ``--mesh`` from ``--remote``; saves this rank's place and batches to ``--out``."""
    p = argparse.ArgumentParser()
    p.add_argument("--remote", required=True)
    p.add_argument("--mesh", required=True)
    p.add_argument("--placement", required=True)
    p.add_argument("--out", required=True, type=Path)
    a = p.parse_args(argv)
    os.environ[APP_ID_VARIABLE] = f"rank{os.environ['RANK']}"
    dist.init_process_group("gloo")
    dims, shape = parse_mesh(a.mesh)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    source = StreamingSource(
        mesh,
        remote=a.remote,
        local=os.path.join(tempfile.gettempdir(), CACHE),
        batch_size=BATCH,
        shuffle=True,
        shuffle_seed=7,
        placement=a.placement,
    )
    loader = CollectiveLoader(
        source, mesh, inputs=INPUTS, labels=LABELS, seq_dims=SEQ_DIMS, timeout=120, placement=a.placement
    )
    batches = [b for b in loader]
    loader.close()
    torch.save({"place": loader.place, "batches": batches}, a.out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


def cached_shards(node: nodes.Node) -> list[str]:
    return sorted(p.name for p in (node.tmp / CACHE).rglob("*.mds"))


@pytest.mark.timeout(2 * JOB_TIMEOUT)
@pytest.mark.parametrize(
    "placement,leader_nodes",
    [("first_stage", 1), pytest.param("spread", 2, marks=pytest.mark.slow)],
    ids=["leaders_on_one_node", "leaders_on_both_nodes"],
)
def test_only_the_leaders_nodes_fetch(s3, tmp_path: Path, placement: str, leader_nodes: int) -> None:
    """pp outermost over two nodes of 4 (a stage per node): the leaders on the first stage's node,
    or spread over both."""
    mesh = "pp=2,dp=2,tp=2"
    remote = f"s3://{S3_BUCKET}/two-nodes-{leader_nodes}"
    write_dataset(remote, SAMPLES, SEQ, shard_bytes=SHARD_BYTES)
    shards = [key.rsplit("/", 1)[1] for key in s3_shards(s3, remote)]
    s3.clear()
    out = tmp_path / "out"
    out.mkdir()
    with nodes.Cluster(tmp_path / "nodes", nproc=4) as cluster:  # the job inherits the endpoint's env
        job = cluster.start([__file__, "--remote", remote, "--mesh", mesh, "--placement", placement, "--out", str(out)])
        result = job.wait(JOB_TIMEOUT)
        print(f"{mesh} over 2 x 4 ranks from S3: {result.seconds:.1f}s")
        assert result.codes == (0, 0) and len(result.ranks) == 8, result.describe()
        where = job.where()
        left = {n.index: n.blocks() + n.locks() for n in cluster.nodes}
        assert left == {0: [], 1: []}, f"streaming's files left on the nodes: {left}"

    records = {r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(8)}
    verdicts = invariants.check(
        [
            invariants.RankRecord(p.rank, p.dp_rank, p.stage, p.shard, rec["batches"])
            for p, rec in ((rec["place"], rec) for rec in records.values())
        ],
        Routing(INPUTS, LABELS, SEQ_DIMS, RowSplit("zigzag"), ()),
        lambda ids: expected(ids, SEQ),
        range(SAMPLES),
    )
    assert all(v.ok for v in verdicts), [f"{v.name}: {v.detail}" for v in verdicts if not v.ok]

    dims, shape = parse_mesh(mesh)
    leaders = MeshLayout.build(dims, shape, range(math.prod(shape)), placement=placement).leaders()
    node_of = {r: w["two_nodes_node"] for r, w in where.items()}
    assert len({node_of[r] for r in leaders}) == leader_nodes
    by_client = s3.requests_by_client()
    fetching = {int(c[4:]) for c in by_client if re.fullmatch(r"rank\d+", c)}
    assert fetching == set(leaders), by_client  # every leader fetched, nobody else sent one request
    cached = {node.index: cached_shards(node) for node in cluster.nodes}
    for node, names in cached.items():  # a node's leaders fetch the shards their replicas read
        assert bool(names) == any(node_of[r] == node for r in leaders), cached
    assert sorted(set(cached[0] + cached[1])) == shards, cached


if __name__ == "__main__":
    rank_main(sys.argv[1:])
