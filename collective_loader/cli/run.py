"""One rank of the demo: build the mesh, stream one epoch of a StreamingDataset through
:class:`StreamingSource` + ``CollectiveLoader`` (on LLM data, rows the leaders pack, numbered),
then the naive run, the gathering of every rank's record, and rank 0's report, each phase ending
in an agreement so that a rank failing in one ends the demo on every rank at once."""

from __future__ import annotations

import functools
import gc
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from collective_loader.cli.args import RUNS, SHUFFLE_SEED, DemoArgs
from collective_loader.cli.naive import naive_ids
from collective_loader.cli.report import report
from collective_loader.delivery.agreement import agree_outcome, run_phase
from collective_loader.delivery.transport import new_group
from collective_loader.loader import CollectiveLoader
from collective_loader.plan.mesh import MeshLayout
from collective_loader.plan.routing import Routing
from collective_loader.plan.wire import Kind
from collective_loader.streaming import StreamingSource
from collective_loader.streaming.streams import PackedStream
from collective_loader.testing import invariants
from collective_loader.testing.data import INPUTS, LABELS, SEQ_DIMS, write_dataset
from collective_loader.testing.s3_endpoint import APP_ID_VARIABLE
from collective_loader.text import Packing


def rank_main(a: DemoArgs) -> int:
    """The demo on this rank (``launch.run`` calls it on every one); its exit code, rank 0's verdict."""
    if not a.data:  # under torchrun
        return on_node_data(a, "demo", lambda out: write_dataset(out, a.samples, a.seq_len), rank_main)
    show_library_log()
    mesh = init_device_mesh("cpu", a.shape, mesh_dim_names=a.dims)
    me = dist.get_rank()
    # the demo's own exchanges after the epoch; each phase ends in an agreement over this group,
    # so a rank that fails there ends the demo on every rank at once (see after_epoch)
    group = new_group(range(dist.get_world_size()), "gloo", a.timeout, "collective_loader:demo")
    assert group is not None
    # the endpoint counts requests by this name; streaming's S3 client, made lazily per dataset
    # (and in each DataLoader worker), reads it when it is created
    os.environ[APP_ID_VARIABLE] = f"{RUNS['collective_loader']}{me}"
    start = time.perf_counter()
    source = StreamingSource(
        mesh,
        **a.stream_from("collective_loader"),
        batch_size=a.batch_size,
        shuffle=True,
        shuffle_seed=SHUFFLE_SEED,
        num_workers=a.num_workers,
        clean_stale=True,
        placement=a.placement,
        layout=a.layout,
        packing=None if a.layout is None else Packing(a.seq_len, a.at_end),
    )
    loader = CollectiveLoader(
        source if a.layout is None else functools.partial(NumberedRows.of, source),
        mesh,
        inputs=INPUTS,
        labels=LABELS,
        seq_dims=SEQ_DIMS,
        split=a.split,
        delivery=a.delivery,
        placement=a.placement,
    )
    steps = []
    for batch in loader:
        steps.append(batch)
        if me == 0 and len(steps) % 8 == 0:
            print(f"  step {len(steps)}: {time.perf_counter() - start:.1f}s", flush=True)
    seconds = time.perf_counter() - start
    try:
        ours = run_phase(group, functools.partial(finish, loader, steps, seconds), failed("closing the loader"))
        layout, routing, dp_size = loader.mesh_layout, loader.routing, loader.dp_size
        del loader, source  # frees the leaders' dataset: on local data the naive run reuses its directory
        gc.collect()
        return after_epoch(a, group, layout, routing, dp_size, ours)
    except DemoError as e:
        if e.__cause__ is not None:  # this rank failed: its own traceback, then the verdict every rank prints
            traceback.print_exception(e.__cause__)
        print(f"rank {me}: {e}", file=sys.stderr)
        return 1


def on_node_data(a: DemoArgs, name: str, write: Callable[[str], None], main: Callable[[DemoArgs], int]) -> int:
    """Under torchrun: ``write`` the demo's data once per node (local rank 0, in a temp dir named
    after the run), run ``main`` with it on every rank, then remove it."""
    out = os.path.join(
        tempfile.gettempdir(), f"collective_loader_{name}_{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
    )
    first_on_node = int(os.environ.get("LOCAL_RANK", 0)) == 0
    if first_on_node:
        shutil.rmtree(out, ignore_errors=True)
        write(out)
    dist.barrier()
    try:
        return main(replace(a, data=out))
    finally:
        dist.barrier()
        if first_on_node:
            shutil.rmtree(out, ignore_errors=True)


class DemoError(RuntimeError):
    """A rank failed after the epoch (closing, naive run, gathering, report); raised on every rank."""


def failed(phase: str) -> Callable[[int, str], Exception]:
    """What every rank raises when ``rank`` failed in ``phase`` with ``text``."""
    return lambda rank, text: DemoError(f"rank {rank} failed in {phase}: {text}")


def finish(loader: CollectiveLoader, steps: list[Any], seconds: float) -> tuple[Any, ...]:
    """Close the loader; this rank's record of the epoch, where it sits, and what it moved (and, on
    a packing leader, the batches it made and its packing figures)."""
    stats = loader.stats()
    made = loader.source if isinstance(loader.source, NumberedRows) else None
    loader.close()
    place = loader.place
    record = invariants.RankRecord(place.rank, place.dp_rank, place.stage, place.shard, steps)
    packed = (made.made, made.stats()) if made is not None else None
    return record, place.coords, place.is_leader, stats, seconds, packed


class NumberedRows:
    """A packing leader's stream (a :class:`~collective_loader.Source`) with each row numbered in
    a ``sample_id`` key (``dp_rank * 10**6 + row``), and every batch it made kept, so the checks
    can rebuild what each rank must hold. Otherwise the stream itself: its state, figures, close."""

    def __init__(self, stream: PackedStream, dp_rank: int) -> None:
        self.stream, self.dp_rank = stream, dp_rank
        self.elastic = stream.elastic
        self.made: dict[tuple[int, ...], dict[str, Any]] = {}

    @classmethod
    def of(cls, source: StreamingSource) -> NumberedRows:
        """The leader's stream of ``source``, numbered (``CollectiveLoader`` calls it on leaders)."""
        stream = source()
        assert isinstance(stream, PackedStream), "the demo numbers packed rows"
        return cls(stream, source.place.dp_rank)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        row = self.dp_rank * 10**6
        for batch in self.stream:
            batch = dict(batch)
            n = len(batch["input_ids"])
            batch["sample_id"] = torch.arange(row, row + n)
            row += n
            self.made[tuple(batch["sample_id"].tolist())] = batch
            yield batch

    def state_dict(self) -> Any:
        return self.stream.state_dict()

    def resume(self, state: Any, steps: int) -> None:
        self.stream.resume(state, steps)

    def checkpoint_state(self, snapshot: Any) -> Any:
        return self.stream.checkpoint_state(snapshot)

    def stop(self) -> None:
        self.stream.stop()

    def stats(self) -> dict[str, float]:
        return self.stream.stats()

    def close(self) -> None:
        self.stream.close()


def after_epoch(
    a: DemoArgs, group: dist.ProcessGroup, layout: MeshLayout, routing: Routing, dp_size: int, ours: tuple[Any, ...]
) -> int:
    """The naive run, the gathering of every rank's records and rank 0's report, each phase ending
    in an agreement over ``group``: when any rank fails in one, every rank raises
    :class:`DemoError` naming it, instead of leaving the others waiting for it (on one node and
    on several). Returns the report's exit code on every rank."""
    me = dist.get_rank()
    os.environ[APP_ID_VARIABLE] = f"{RUNS['naive']}{me}"
    naive, naive_failed = naive_run(a, layout, group) if a.layout is None else ([], None)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (ours, naive), group=group)  # the demo's bookkeeping, not the data path
    code = run_phase(
        group,
        lambda: (
            report(a, layout, routing, dp_size, [g[0] for g in gathered], [g[1] for g in gathered], naive_failed)
            if me == 0
            else 0
        ),
        failed("the report"),
    )
    verdict = torch.tensor([code])
    dist.broadcast(verdict, src=0, group=group)  # rank 0's verdict is every rank's exit code
    return int(verdict)


def naive_run(a: DemoArgs, layout: MeshLayout, group: dist.ProcessGroup) -> tuple[list[list[int]] | None, str | None]:
    """The naive run's sample ids on this rank and ``None``, or, when it failed on any rank,
    ``None`` and why (one line, the same on every rank). The naive run is the comparison, not
    what the demo checks: streaming's own limits (two runs started together on one machine took
    the same shared-memory prefix) must not fail the demo, whose verdict judges our loader."""
    why = ""
    try:
        ids = naive_ids(a, layout, group, failed("the naive run"))
    except Exception as e:  # on every rank: the others hear of it at their next barrier
        ids = None
        why = (
            str(e)
            if isinstance(e, DemoError)
            else f"rank {dist.get_rank()} failed in the naive run: {type(e).__name__}: {e}"
        )
    # the first failing rank's reason, on every rank (also a failure after the last barrier)
    kind, message, _ = agree_outcome(group, Kind.PHASE_ERROR if why else Kind.DATA, " ".join(why.split()))
    return (ids, None) if kind == Kind.DATA else (None, message)


def show_library_log() -> None:
    """Print the library's INFO lines (what each loader decided) on this rank's stdout."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter("  [rank %(rank)s] %(message)s", defaults={"rank": os.environ.get("RANK", "?")})
    )
    library = logging.getLogger("collective_loader")
    library.addHandler(handler)
    library.setLevel(logging.INFO)
