"""The naive set-up of streaming#827 on the demo's mesh and data: every rank builds its own
StreamingDataset with ``replication = tp * cp``; the report sets its steps beside ours."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch.distributed as dist
from torch.utils.data import DataLoader

from collective_loader.cli.args import SHUFFLE_SEED, DemoArgs
from collective_loader.plan.mesh import MeshLayout
from collective_loader.streaming.cleanup import release
from collective_loader.streaming.leaders_world import leaders_world
from collective_loader.text.collate import lm_collate


def replication(layout: MeshLayout) -> int:
    """Streaming's ``replication`` for ``layout``: the ranks of a replica that need the same
    samples (its replicate and shard dims)."""
    return math.prod(s for s, r in zip(layout.shape, layout.roles) if r in ("replicate", "shard"))


def naive_ids(
    a: DemoArgs, layout: MeshLayout, group: dist.ProcessGroup, failed: Callable[[int, str], Exception]
) -> list[list[int]]:
    """The sample ids of each step this rank gets when it builds its own StreamingDataset.

    Streaming's barriers (and ours) run as agreements over ``group``: a rank that fails here
    makes the others raise ``failed(rank, text)`` at their next barrier."""
    from streaming import StreamingDataset

    dataset = None
    try:
        with leaders_world({}, group, failed):
            dataset = StreamingDataset(
                **a.stream_from("naive"),
                batch_size=a.batch_size,
                shuffle=True,
                shuffle_seed=SHUFFLE_SEED,
                replication=replication(layout),
            )
            loader = DataLoader(dataset, batch_size=a.batch_size, collate_fn=lm_collate)
            ids = [b["sample_id"].tolist() for b in loader]
            dist.barrier()  # every rank of the node is done with the blocks before they go
    finally:
        # also when a rank failed: the scope ends in an agreement that every rank joins once done
        # with the blocks, so none is read any more; the demo goes on without the naive run
        if dataset is not None:
            release(dataset)
    return ids
