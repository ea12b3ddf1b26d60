"""Functions run on every rank of a test world, and the synthetic data they load.

Samples carry their own id so the test process can check every invariant from what the ranks
received: ``input_ids[s] = id * 1000 + s``, ``labels = input_ids + 1``, ``position_ids[s] = s``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from collective_loader import CollectiveLoader, mesh_place
from collective_loader.plan.mesh import MeshLayout

KEYS = dict(
    inputs=("input_ids", "position_ids", "sample_id"),
    labels=("labels", "sample_id"),
    seq_dims={"input_ids": 1, "position_ids": 1, "labels": 1},
)


def sample_batch(ids: list[int], seq_len: int, packed: bool = False) -> dict[str, torch.Tensor]:
    """One batch of ``ids``; ``packed`` adds ``cu_seqlens``, offsets of made-up documents that
    depend on the ids (so a rank holding another step's offsets is caught)."""
    ids_t = torch.tensor(ids, dtype=torch.int64)
    pos = torch.arange(seq_len, dtype=torch.int64)
    input_ids = ids_t[:, None] * 1000 + pos[None, :]
    batch = {
        "input_ids": input_ids,
        "position_ids": pos.expand(len(ids), seq_len).clone(),
        "labels": input_ids + 1,
        "sample_id": ids_t,
    }
    if packed:
        batch["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(ids_t % 7 + 1, 0)]).int()
    return batch


def id_batches(
    dp_rank: int, dp_size: int, n_samples: int, batch_size: int, seq_len: int, packed: bool = False
) -> Iterator[dict]:
    """Replica ``dp_rank``'s share of ``n_samples`` (strided, disjoint), in batches; drops the remainder."""
    mine = list(range(dp_rank, n_samples, dp_size))
    for start in range(0, len(mine) - batch_size + 1, batch_size):
        yield sample_batch(mine[start : start + batch_size], seq_len, packed)


def make_mesh(dims: tuple[str, ...], shape: tuple[int, ...]):
    return init_device_mesh("cpu", shape, mesh_dim_names=dims)


def deliver(
    dims: tuple[str, ...],
    shape: tuple[int, ...],
    *,
    n_samples: int = 24,
    batch_size: int = 2,
    seq_len: int = 16,
    epochs: int = 1,
    **options: Any,
) -> dict[str, Any]:
    """Run whole epochs and return what this rank received, with its place in the mesh."""
    mesh = make_mesh(dims, shape)
    place = mesh_place(mesh, dist.get_rank(), options.get("roles"))
    dp_rank, dp_size = place.dp_rank, place.dp_size
    touched = []

    def source():
        touched.append(dist.get_rank())
        packed = bool(options.get("every_stage"))
        return _Reiterable(lambda: id_batches(dp_rank, dp_size, n_samples, batch_size, seq_len, packed))

    loader = CollectiveLoader(source, mesh, **{**KEYS, **options})
    epochs_out = [[{k: v.clone() for k, v in batch.items()} for batch in loader] for _ in range(epochs)]
    loader.close()
    place = loader.place
    return {
        "rank": dist.get_rank(),
        "dp_rank": loader.dp_rank,
        "dp_size": loader.dp_size,
        "is_leader": loader.is_leader,
        "stage": place.stage,
        "shard": place.shard,
        "coords": place.coords,
        "touched_source": touched,
        "epochs": epochs_out,
        "group_count": loader.group_count,
    }


class _Reiterable:
    """An iterable that restarts on every ``iter()``, like a DataLoader."""

    def __init__(self, make):
        self._make = make

    def __iter__(self):
        return self._make()


def dp_rank_of(rank: int, dims: tuple[str, ...], shape: tuple[int, ...]) -> int:
    """The dp_rank of ``rank`` on a mesh of ranks ``0..n-1`` in row-major order."""
    n = 1
    for s in shape:
        n *= s
    return MeshLayout.build(dims, shape, range(n)).place(rank).dp_rank
