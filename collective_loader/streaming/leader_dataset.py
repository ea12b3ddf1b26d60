"""A mosaicml-streaming ``StreamingDataset`` that the replicas' leaders build alone and read by
sample index: the dataset of a reader with an order of its own
(:class:`~collective_loader.integrations.torchft.QuorumData`), where :class:`StreamingSource`
iterates streaming's order instead. The leaders' world is :class:`StreamingSource`'s
(:mod:`~collective_loader.streaming.leaders_world`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from collective_loader.delivery.leader_group import LeaderGroup
from collective_loader.plan.mesh import DEFAULT_PLACEMENT, MeshLayout, Placement, StageStyle
from collective_loader.streaming.leaders_world import leader_env, leaders_world
from collective_loader.streaming.streams import release_together

# StreamingDataset's arguments that choose its own order: QuorumData reads by index, in its own
_ORDER_ARGUMENTS = (
    "shuffle",
    "shuffle_seed",
    "shuffle_algo",
    "shuffle_block_size",
    "num_canonical_nodes",
    "partition_algo",
    "epoch_size",
    "replication",
    "sampling_method",
    "sampling_granularity",
    "batching_method",
)


class LeaderStreamingDataset:
    """A mosaicml-streaming ``StreamingDataset`` that the group's replicas' leaders build alone,
    read by index: :class:`~collective_loader.integrations.torchft.QuorumData`'s dataset for MDS shards.

    Construct it on **every** rank of the group, with the mesh and placement options given to
    ``QuorumData`` (it creates the leaders' process group, which every rank joins); ``QuorumData``
    calls it on the leaders, which build the dataset in streaming's world of the leaders only,
    as :class:`~collective_loader.streaming.StreamingSource` does
    (:func:`~collective_loader.streaming.leaders_world.leaders_world`: the leaders' ``RANK`` /
    ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE``, streaming's barriers over their group, a shared-memory
    prefix no other job or group on the node takes). The result reads sample ``i`` of the
    dataset's ``num_samples`` (``len()`` is that, not streaming's per-rank length), downloading
    its shard when it has a ``remote``; closing it releases streaming's shared memory once every
    leader of the group is done.

    Example (every rank of a replica group)::

        docs = LeaderStreamingDataset(mesh, local="/data/mds")
        data = QuorumData(docs, mesh, manager, global_batch=64, micro_batch=4,
                          packing=Packing(seq_len=2048), layout=TokenColumn(dtype="uint16"),
                          inputs=("input_ids", "position_ids"), labels=("labels",))

    Args:
        mesh, roles, placement, stage_style: as given to ``QuorumData``.
        timeout: seconds the leaders wait for each other while building.
        **dataset_kwargs: passed to ``StreamingDataset`` (``local``, ``remote``, ``streams``,
            ``cache_limit``, ...); the arguments of streaming's own sample order (``shuffle``,
            ``num_canonical_nodes``, ``epoch_size``, ...) are refused: ``QuorumData``'s
            ``shuffle=`` and ``seed=`` make the order.
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        *,
        roles: Mapping[str, str] | None = None,
        placement: Placement = DEFAULT_PLACEMENT,
        stage_style: StageStyle = "loop",
        timeout: float = 600.0,
        **dataset_kwargs: Any,
    ) -> None:
        refused = [k for k in _ORDER_ARGUMENTS if k in dataset_kwargs]
        if refused:
            raise ValueError(
                f"{refused}: QuorumData reads the dataset by index in its own global order (its shuffle= and seed=); "
                "leave out streaming's order arguments"
            )
        layout = MeshLayout.from_mesh(mesh, roles, placement, stage_style)
        self.place = layout.place(dist.get_rank())
        leaders = layout.leaders()
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        # on every rank, before any group: a placement streaming cannot express is refused everywhere
        self._env = leader_env(leaders, self.place.dp_rank, local_world_size)
        self._leaders = LeaderGroup.build(leaders, timeout, "quorum_streaming_leaders")
        self._dataset_kwargs = {"batch_size": 1, **dataset_kwargs}  # streaming's batch: unused by index reads

    def __call__(self) -> StreamingByIndex:
        """Build the dataset (leaders only; ``QuorumData`` calls this)."""
        if not self.place.is_leader:
            raise RuntimeError(
                f"rank {self.place.rank} is not a leader of this mesh; give LeaderStreamingDataset the mesh, roles, "
                "placement and stage_style given to QuorumData"
            )
        from collective_loader.streaming.dataset import DownloadFailureRaisingDataset

        leaders = self._leaders.hold()  # released when the dataset closes
        with leaders_world(self._env, leaders.group):
            dataset = DownloadFailureRaisingDataset(**self._dataset_kwargs)
        return StreamingByIndex(dataset, leaders)


class StreamingByIndex:
    """A leader's ``StreamingDataset`` read by sample index (see :class:`LeaderStreamingDataset`)."""

    def __init__(self, dataset: Any, leaders: LeaderGroup) -> None:
        self.dataset: Any = dataset
        self.leaders = leaders  # held for it (released at close)

    def __len__(self) -> int:
        return int(self.dataset.num_samples)  # streaming's len() is one rank's share of an epoch

    def __getitem__(self, index: int) -> Any:
        return self.dataset.get_item(int(index))

    def close(self) -> None:
        """Release streaming's shared memory and lock files, once every leader of the group is
        here (they share the node's blocks); at most ``CLOSE_WAIT`` seconds."""
        if self.dataset is None:
            return
        dataset, self.dataset = self.dataset, None
        try:
            release_together(dataset, self.leaders)
        finally:
            self.leaders.release()
