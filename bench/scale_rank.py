"""One rank of a fake world, in a process of its own: ``python bench/scale.py --one MESH RANK`` runs
:func:`one_rank` and prints its JSON; what it measures and what a fake world skips:
``bench/scale.py``'s docstring."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

from harness import peak_rss_bytes, reset_peak_rss, rss_bytes  # bench/harness.py: run as python bench/<name>.py

from collective_loader.plan.mesh import MeshLayout

DIMS = ("pp", "dp", "tp")
ROWS, SEQ = 4, 4096  # a step's batch per replica: input_ids, position_ids, labels (int64)


class Recorder:
    """Wraps ``dist.new_group`` (gloo made fake) and the collectives the loader issues, counting them."""

    OPS = ("all_reduce", "broadcast", "scatter", "all_gather_object", "all_to_all_single", "monitored_barrier")

    def __init__(self, on_control: Callable[[Any], None]) -> None:
        import torch.distributed as dist

        self.dist, self.on_control = dist, on_control
        self.calls = 0
        self.seconds = 0.0
        self.member: list[tuple[str, int]] = []  # (desc, size) of the groups this rank is in
        self.collectives: list[tuple[str, int, int]] = []  # (op, group size, bytes)
        new_group = dist.new_group

        def counted_new_group(ranks: Any = None, timeout: Any = None, backend: Any = None, *a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            group = new_group(ranks, timeout, "fake" if backend == "gloo" else backend, *a, **k)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            if isinstance(group, dist.ProcessGroup):
                desc = k.get("group_desc") or ""
                self.member.append((desc, group.size()))
                if desc == "collective_loader:control":
                    on_control(group)
            return group

        dist.new_group = counted_new_group
        for op in self.OPS:
            setattr(dist, op, self._counted(op, getattr(dist, op)))

    def _counted(self, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        def counted(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            size = self.dist.get_world_size(group) if group is not None else self.dist.get_world_size()
            first = args[0] if args else None
            nbytes = first.numel() * first.element_size() if isinstance(first, torch.Tensor) else 0
            if op == "all_gather_object":  # the object's pickle: what the gather moves per rank
                import pickle

                nbytes = len(pickle.dumps(args[1]))
            self.collectives.append((op, size, nbytes))
            return fn(*args, **kwargs)

        return counted


def one_rank(shape: tuple[int, ...], rank: int) -> dict[str, Any]:
    """Build the loader as ``rank`` of a fake world of ``prod(shape)`` ranks; what it took."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed import fake_pg  # noqa: F401  (registers the "fake" backend)

    from collective_loader import CollectiveLoader, LoaderConfig
    from collective_loader.delivery.agreement import digest
    from collective_loader.delivery.bulletin import Bulletin
    from collective_loader.delivery.modes import mode_for
    from collective_loader.plan import wire

    world = 1
    for s in shape:
        world *= s
    config = LoaderConfig(inputs=("input_ids", "position_ids"), labels=("labels",))
    dist.init_process_group("fake", rank=rank, world_size=world, store=dist.HashStore())
    layout = MeshLayout.build(DIMS, shape, range(world))
    place = layout.place(rank)

    def post_leaders_digest(control: Any) -> None:  # the leader would: see the module docstring
        text = config.fingerprint(layout)
        Bulletin.open(control.group_name, place.dp_rank, 1.0).post_config(digest(text).numpy().tobytes().hex())

    recorder = Recorder(post_leaders_digest)
    start = time.perf_counter()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=DIMS)
    mesh_seconds, mesh_groups = time.perf_counter() - start, recorder.calls
    recorder.calls, recorder.seconds, recorder.member = 0, 0.0, []
    batch = {k: torch.zeros(ROWS, SEQ, dtype=torch.int64) for k in ("input_ids", "position_ids", "labels")}
    gc.collect()
    reset_peak_rss()
    base = rss_bytes()
    start = time.perf_counter()
    loader = CollectiveLoader([batch], mesh, config)
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes() - base
    settings = loader.settings
    channels = []
    for name, channel in settings.groups.channels.items():
        packed = mode_for(settings, channel, None).pack(0, batch)
        nbytes = wire.HEADER_BYTES + packed.header.payload_nbytes
        channels.append({"name": name, "members": len(channel.ranks), "message": nbytes, "apart": len(packed.apart)})
    return {
        "world": world,
        "shape": list(shape),
        "rank": rank,
        "stage": place.stage,
        "leader": place.is_leader,
        "in_delivery": loader.in_delivery,
        "seconds": seconds,
        "peak_above_base": peak,
        "base_rss": base,
        "new_group_calls": recorder.calls,
        "new_group_seconds": recorder.seconds,
        "group_count": loader.group_count,
        "member_of": recorder.member,
        "collectives": recorder.collectives,
        "channels": channels,
        "dp": layout.dp_size,
        "mesh_seconds": mesh_seconds,
        "mesh_new_group_calls": mesh_groups,
    }
