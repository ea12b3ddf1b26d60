"""mosaicml-streaming's ``StreamingDataset`` on the data-parallel leaders only.

Streaming assumes every rank builds and iterates the dataset and that ranks which should see the
same samples are adjacent. Under pipeline parallelism neither holds. :class:`StreamingSource`
builds the dataset and its ``DataLoader`` on the leaders alone, showing streaming a world of
exactly the leaders (rank = dp_rank, world = dp_size, local world = leaders on this node: see
:mod:`collective_loader.streaming.leaders`), and :class:`~collective_loader.CollectiveLoader`
delivers its batches to everyone else::

    source = StreamingSource(mesh, local="/data/mds", batch_size=8, shuffle=True, num_workers=2)
    loader = CollectiveLoader(source, mesh, inputs=("input_ids", "position_ids"), labels=("labels",))

Batch sizes: ``batch_size`` is the **per-replica** batch of one step (what one leader's
``DataLoader`` yields, all micro-batches of a pipeline step together). The global batch is
``batch_size * dp_size``; a pipeline schedule splits each replica's batch into micro-batches.
Elastic resume keeps the global batch: at twice the replicas, halve ``batch_size``.
"""

from __future__ import annotations

import datetime
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader

from collective_loader.delivery.transport import new_group
from collective_loader.delivery.workers import stop_workers
from collective_loader.plan.mesh import DEFAULT_PLACEMENT, MeshLayout, Placement
from collective_loader.streaming.cleanup import release, remove_stale
from collective_loader.streaming.leaders import leader_env, leaders_world
from collective_loader.text.collate import lm_collate

Sample = Mapping[str, Any]
CLOSE_WAIT = 60.0  # seconds a leader waits for the others before releasing shared files


class StreamingSource:
    """Builds a ``StreamingDataset`` and its ``DataLoader`` on the leaders; pass it to
    ``CollectiveLoader`` as the source.

    Construct it on **every** rank (it creates a process group of the leaders, which every rank
    must join); the dataset itself is built only when ``CollectiveLoader`` calls it, on leaders.

    Args:
        mesh: the same ``DeviceMesh`` given to ``CollectiveLoader``.
        batch_size: per-replica batch size of one step (given to streaming and the DataLoader).
        collate: samples -> batch; :func:`lm_collate` by default.
        num_workers: DataLoader worker processes per leader.
        roles: dim roles, as for ``CollectiveLoader``.
        placement: where the leaders sit, as for ``CollectiveLoader`` (``"spread"`` by default;
            give both the same).
        clean_stale: first remove the shared memory and lock files killed runs left on this
            node (:func:`remove_stale`); blocks that a live process maps are kept.
        timeout: seconds the leaders wait for each other while building.
        dataloader_kwargs: more DataLoader arguments (``pin_memory``, ``prefetch_factor``, …).
        **dataset_kwargs: passed to ``StreamingDataset`` unchanged (``local``, ``remote``,
            ``streams``, ``shuffle``, ``shuffle_algo``, ``shuffle_seed``,
            ``num_canonical_nodes``, ``epoch_size``, …).
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        *,
        batch_size: int,
        collate: Callable[[Sequence[Sample]], Mapping[str, Any]] = lm_collate,
        num_workers: int = 0,
        roles: Mapping[str, str] | None = None,
        placement: Placement = DEFAULT_PLACEMENT,
        clean_stale: bool = False,
        timeout: float = 600.0,
        dataloader_kwargs: Mapping[str, Any] | None = None,
        **dataset_kwargs: Any,
    ) -> None:
        if "batch_size" in (dataloader_kwargs or {}) or "replication" in dataset_kwargs:
            raise ValueError("give batch_size once, to StreamingSource; replication is what this class replaces")
        layout = MeshLayout.from_mesh(mesh, roles, placement)
        self.place = layout.place(dist.get_rank())
        leaders = layout.leaders()
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        # pure arithmetic from the layout and the node size, done on every rank: a placement
        # streaming cannot express is refused everywhere, not on the leaders alone (the others
        # would wait for them in a group creation until killed)
        self._env = leader_env(leaders, self.place.dp_rank, local_world_size)
        self._group = (
            new_group(sorted(leaders), "gloo", timeout, "collective_loader:streaming_leaders") if len(leaders) > 1 else None
        )
        self.batch_size = batch_size
        self._collate = collate
        self._num_workers = num_workers
        self._clean_stale = clean_stale
        self._dataloader_kwargs = dict(dataloader_kwargs or {})
        self._dataset_kwargs = dataset_kwargs

    def __call__(self) -> LeaderStream:
        """Build the dataset and DataLoader (leaders only; ``CollectiveLoader`` calls this)."""
        if not self.place.is_leader:
            raise RuntimeError(f"rank {self.place.rank} is not a leader; only leaders build the dataset")
        from collective_loader.streaming.dataset import DownloadFailureRaisingDataset

        with leaders_world(self._env, self._group):
            if self._clean_stale:
                if self.place.dp_rank % int(self._env["LOCAL_WORLD_SIZE"]) == 0:  # the node's first leader
                    remove_stale()
                dist.barrier()  # the leaders' barrier: nobody looks for blocks while they are removed
            dataset = DownloadFailureRaisingDataset(batch_size=self.batch_size, **self._dataset_kwargs)
        loader = DataLoader(
            dataset, batch_size=self.batch_size, num_workers=self._num_workers, collate_fn=self._collate,
            **self._dataloader_kwargs,
        )
        return LeaderStream(dataset, loader, self.batch_size * self.place.dp_size, self._group)


class LeaderStream:
    """A leader's dataset and DataLoader, with a state that counts the batches taken from it.

    Its state is streaming's own (``StreamingDataset.state_dict``) for the *global* number of
    samples consumed, ``batches taken x global batch``, plus the global batch size, which a
    resume must keep (``supports_elastic_resume``: the DP degree may change with it). Streaming
    is asked once per epoch; the per-batch snapshots are arithmetic on that answer (each call
    of streaming's ``state_dict`` after a resume maps one more shared-memory block until exit).
    """

    supports_elastic_resume = True

    def __init__(self, dataset: Any, loader: DataLoader, global_batch: int, leaders: dist.ProcessGroup | None) -> None:
        self.dataset: Any = dataset
        self.loader: DataLoader | None = loader
        self.global_batch = global_batch
        self._leaders = leaders
        self._taken = 0
        self._epoch_state: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        assert self.loader is not None, "LeaderStream used after close()"
        self._taken, self._epoch_state = 0, None
        batches = iter(self.loader)
        try:
            for batch in batches:
                if self._epoch_state is None:  # the epoch has started: streaming knows its offset now
                    self._epoch_state = self.dataset.state_dict(num_samples=0, from_beginning=False)
                self._taken += 1
                yield batch
        except GeneratorExit:  # left early (CollectiveLoader.close): workers exit now, not at gc
            stop_workers(batches, self.loader)
            raise

    def state_dict(self) -> dict[str, Any]:
        if self._epoch_state is None:
            self._epoch_state = self.dataset.state_dict(num_samples=0, from_beginning=False)
        state = dict(self._epoch_state)
        state["sample_in_epoch"] += self._taken * self.global_batch
        return {**state, "global_batch": self.global_batch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("global_batch") != self.global_batch:
            raise ValueError(
                f"the state was saved with a global batch of {state.get('global_batch')} samples; this run's is "
                f"{self.global_batch} (batch_size x dp_size): streaming resumes exactly only with the same global batch"
            )
        self.dataset.load_state_dict({k: v for k, v in state.items() if k != "global_batch"})

    def close(self) -> None:
        """Release the dataset's shared memory and lock files now rather than at interpreter exit.

        Every leader calls it (``CollectiveLoader.close`` does); it first waits, at most
        ``CLOSE_WAIT`` seconds, for the other leaders, which share the node's blocks and locks.
        """
        if self.dataset is None:
            return
        stop_workers(getattr(self.loader, "_iterator", None), self.loader)  # persistent_workers
        dataset, self.dataset, self.loader = self.dataset, None, None
        if self._leaders is not None:
            try:
                dist.monitored_barrier(group=self._leaders, timeout=datetime.timedelta(seconds=CLOSE_WAIT))
            except RuntimeError as e:
                warnings.warn(f"not every leader closed its dataset; leaving streaming's files in place: {e}", stacklevel=2)
                return
        release(dataset)
