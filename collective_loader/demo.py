"""``python -m collective_loader demo``: one epoch of a StreamingDataset on a 4-D-capable mesh.

Writes a small tokenized MDS dataset (or reads ``--data DIR``), starts a local gloo world (or runs
under torchrun), and delivers one epoch through :class:`StreamingSource` + ``CollectiveLoader``.
Rank 0 then prints every rank's role and first batch, samples per replica, the collectives and
bytes moved, and the verdict of the invariant checks (:mod:`collective_loader.testing.invariants`).
Last, it runs the seed issue's naive set-up on the same mesh and data (every rank builds its own
StreamingDataset with ``replication = tp * cp``) and prints, side by side, the share of steps
whose last-stage labels do not belong to the first stage's inputs. Exit code 1 if a check fails,
2 (one line on stderr, before any rank starts) if ``--mesh`` cannot run.

``--data DIR`` may also hold LLM data as LLM Foundry writes it (a ``text`` column, given
``--tokenizer PATH``; a ``tokens`` column of bytes, given ``--token-dtype``; or of ndarray): the
leaders then tokenize and pack documents into rows of ``--seq-len + 1`` tokens
(:mod:`collective_loader.text`), the checks run on the rows each leader made (numbered in a
``sample_id`` key), and rank 0 prints the packing figures: documents, rows, tokens carried over
into a next row, and the share of padding. The naive run is left out there.

``--remote`` starts a local S3 endpoint in this process (:mod:`collective_loader.testing.s3_endpoint`),
writes the dataset to it, and both runs stream from it, each into a cache directory of its own;
after the world ends, this process prints the requests and bytes each rank fetched in each run,
and fails the demo if a rank that leads no replica fetched anything in ours.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader

from collective_loader.delivery.agreement import run_phase
from collective_loader.delivery.settings import Delivery
from collective_loader.delivery.transport import new_group
from collective_loader.loader import CollectiveLoader
from collective_loader.plan import sharding
from collective_loader.plan.mesh import (
    DEFAULT_PLACEMENT,
    DEFAULT_ROLES,
    PLACEMENTS,
    MeshLayout,
    Placement,
    group_count,
)
from collective_loader.plan.routing import Routing
from collective_loader.plan.sharding import Split
from collective_loader.streaming import (
    StreamingSource,
    leaders_world,
    lm_collate,
    release,
)
from collective_loader.testing import invariants, launch
from collective_loader.testing.data import INPUTS, LABELS, SEQ_DIMS, expected, shard_bytes_for, write_dataset
from collective_loader.testing.s3_endpoint import APP_ID_VARIABLE, S3Endpoint
from collective_loader.text import Packing, TextColumn, TokenColumn
from collective_loader.text.layouts import INTEGER_TYPES, Layout
from collective_loader.text.packing import AtEnd

SHUFFLE_SEED = 1234
BUCKET = "collective-loader-demo"
RUNS = {"collective_loader": "rank", "naive": "naive-rank"}  # --remote: run -> prefix of its ranks' client names
UPLOAD = "upload"  # --remote: this process's client name (the ranks name themselves before streaming)


@dataclass(frozen=True)
class DemoArgs:
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    data: str
    samples: int
    batch_size: int
    seq_len: int
    split: Split
    delivery: Delivery
    num_workers: int
    placement: Placement = DEFAULT_PLACEMENT  # where the leaders sit (CollectiveLoader's placement=)
    timeout: float = 600.0  # seconds: the local world's limit, and any rank's wait for another after the epoch
    remote: str = ""  # --remote: the dataset's s3:// URL; ``data`` then holds the runs' cache dirs
    layout: Layout | None = (
        None  # --data with LLM data: its tokens' layout (the leaders pack); None: the demo's own data
    )
    at_end: AtEnd = "pad"  # --at-end: the packing's last partial row and batch


# --- one rank ---------------------------------------------------------------------------------


def rank_main(a: DemoArgs) -> int:
    if not a.data:  # under torchrun: one copy of the dataset per node, written by local rank 0
        out = os.path.join(
            tempfile.gettempdir(), f"collective_loader_demo_{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
        )
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            shutil.rmtree(out, ignore_errors=True)
            write_dataset(out, a.samples, a.seq_len)
        dist.barrier()
        try:
            return rank_main(replace(a, data=out))
        finally:
            dist.barrier()
            if int(os.environ.get("LOCAL_RANK", 0)) == 0:
                shutil.rmtree(out, ignore_errors=True)
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
        **stream_from(a, "collective_loader"),
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


class DemoError(RuntimeError):
    """A rank failed after the epoch (closing, naive run, gathering, report); raised on every rank."""


def failed(phase: str) -> Callable[[int, str], Exception]:
    """What every rank raises when ``rank`` failed in ``phase`` with ``text``."""
    return lambda rank, text: DemoError(f"rank {rank} failed in {phase}: {text}")


def finish(loader: CollectiveLoader, steps: list[Any], seconds: float) -> tuple[Any, ...]:
    """Close the loader; this rank's record of the epoch, where it sits, and what it moved (and, on
    a packing leader, the batches it made and its packing figures)."""
    stats = loader.stats()
    made = loader._source if isinstance(loader._source, NumberedRows) else None
    loader.close()
    place = loader.place
    record = invariants.RankRecord(place.rank, place.dp_rank, place.stage, place.shard, steps)
    packed = (made.made, made.stream.packing_stats()) if made is not None else None
    return record, place.coords, place.is_leader, stats, seconds, packed


class NumberedRows:
    """A packing leader's stream with each row numbered in a ``sample_id`` key (``dp_rank * 10**6
    + row``), and every batch it made kept, so the checks can rebuild what each rank must hold."""

    def __init__(self, stream: Any, dp_rank: int) -> None:
        self.stream, self.dp_rank = stream, dp_rank
        self.made: dict[tuple[int, ...], dict[str, Any]] = {}

    @classmethod
    def of(cls, source: StreamingSource) -> NumberedRows:
        """The leader's stream of ``source``, numbered (``CollectiveLoader`` calls it on leaders)."""
        return cls(source(), source.place.dp_rank)

    def __iter__(self) -> Any:
        row = self.dp_rank * 10**6
        for batch in self.stream:
            n = len(batch["input_ids"])
            batch["sample_id"] = torch.arange(row, row + n)
            row += n
            self.made[tuple(batch["sample_id"].tolist())] = batch
            yield batch

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
    naive = naive_ids(a, layout, group, failed("the naive run")) if a.layout is None else []
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (ours, naive), group=group)  # the demo's bookkeeping, not the data path
    code = run_phase(
        group,
        lambda: (
            report(a, layout, routing, dp_size, [g[0] for g in gathered], [g[1] for g in gathered]) if me == 0 else 0
        ),
        failed("the report"),
    )
    verdict = torch.tensor([code])
    dist.broadcast(verdict, src=0, group=group)  # rank 0's verdict is every rank's exit code
    return int(verdict)


def show_library_log() -> None:
    """Print the library's INFO lines (what each loader decided) on this rank's stdout."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter("  [rank %(rank)s] %(message)s", defaults={"rank": os.environ.get("RANK", "?")})
    )
    library = logging.getLogger("collective_loader")
    library.addHandler(handler)
    library.setLevel(logging.INFO)


def stream_from(a: DemoArgs, run: str) -> dict[str, Any]:
    """StreamingDataset's ``local`` (and ``remote``) for ``run``: with ``--remote``, a cache dir
    of the run's own, so that the naive run downloads for itself rather than finding ours."""
    if not a.remote:
        return {"local": a.data}
    return {"remote": a.remote, "local": os.path.join(a.data, run)}


def naive_ids(
    a: DemoArgs, layout: MeshLayout, group: dist.ProcessGroup, failed: Callable[[int, str], Exception]
) -> list[list[int]]:
    """The seed's set-up: every rank builds StreamingDataset with replication = tp * cp.

    Streaming's barriers (and ours) run as agreements over ``group``: a rank that fails here
    makes the others raise ``failed(rank, text)`` at their next barrier."""
    from streaming import StreamingDataset

    replication = math.prod(s for s, r in zip(layout.shape, layout.roles) if r in ("replicate", "shard"))
    with leaders_world({}, group, failed):
        dataset = StreamingDataset(
            **stream_from(a, "naive"),
            batch_size=a.batch_size,
            shuffle=True,
            shuffle_seed=SHUFFLE_SEED,
            replication=replication,
        )
        ids = [b["sample_id"].tolist() for b in DataLoader(dataset, batch_size=a.batch_size, collate_fn=lm_collate)]
        dist.barrier()  # every rank of the node is done with the blocks before they go
    release(dataset)
    return ids


# --- the report (rank 0) ----------------------------------------------------------------------


def _describe(batch: dict[str, Any]) -> str:
    if not batch:
        return "{} (nothing: middle stage)"
    return " ".join(f"{k}={v.tolist()}" if k == "sample_id" else f"{k}{list(v.shape)}" for k, v in batch.items())


def samples_per_replica(records: list[invariants.RankRecord]) -> dict[int, int]:
    """Samples each replica trained on, counted on its lowest first-stage rank: the ranks that
    hold sample ids (a leader may sit on a middle stage, whose batches are empty)."""
    counted: dict[int, int] = {}
    for rec in sorted(records, key=lambda r: r.rank):
        if rec.stage in ("first", "both") and rec.dp_rank not in counted:
            counted[rec.dp_rank] = sum(len(b["sample_id"]) for b in rec.steps)
    return dict(sorted(counted.items()))


def label_mismatch(stage_of: dict[int, str], dp_of: dict[int, int], ids: dict[int, list]) -> tuple[int, int]:
    """(mismatched, total) (replica, last-stage rank, step) triples: labels from other samples."""
    bad = total = 0
    for rank, stage in stage_of.items():
        if stage != "last":
            continue
        first = next(r for r, s in stage_of.items() if s == "first" and dp_of[r] == dp_of[rank])
        for got, want in zip(ids[rank], ids[first]):
            total += 1
            bad += got != want
    return bad, total


def dataset_ids(path: str) -> list[int]:
    """The ``id`` of every sample of the MDS dataset at ``path``: the set one epoch must cover.

    Read from the dataset itself, not from what the leaders delivered, which would make a lost
    or foreign sample part of its own yardstick. Plain file reads (no shared memory, no ranks).
    """
    from streaming import LocalDataset

    dataset = LocalDataset(path)
    return [int(dataset[i]["id"]) for i in range(len(dataset))]


def verdicts(
    records: list[invariants.RankRecord], routing: Routing, seq_len: int, dataset: list[int]
) -> list[invariants.Verdict]:
    """Checks (a)-(e) over one epoch, with ``dataset`` (the dataset's own sample ids) as the set
    the replicas must cover exactly once: a leader that skips, repeats or invents a sample fails
    (d)."""
    return invariants.check(records, routing, lambda ids: expected(ids, seq_len), dataset)


def report(
    a: DemoArgs, layout: MeshLayout, routing: Routing, dp_size: int, ours: list[Any], naive: list[list[list[int]]]
) -> int:
    records = [o[0] for o in ours]
    steps = len(records[0].steps)
    made = {ids: batch for o in ours if o[5] is not None for ids, batch in o[5][0].items()}
    if a.layout is None:
        # --remote: the ids this demo wrote (sample i has id i); reading the leaders' cache back would
        # hold the epoch to what they downloaded
        dataset = list(range(a.samples)) if a.remote else dataset_ids(a.data)
        what = f"{len(dataset)} samples"
    else:  # the rows of the delivered steps, as their leaders made them
        dataset = [i for o in ours if o[5] is not None for ids in list(o[5][0])[:steps] for i in ids]
        read = (
            f"text tokenized by {a.layout.tokenizer}"
            if isinstance(a.layout, TextColumn)
            else f"tokens as {a.layout.dtype or 'stored'}"
        )
        what = f"documents ({read}) packed into rows of {a.seq_len} + 1 tokens"
    where = f"{a.remote} (cached in {a.data})" if a.remote else a.data
    print(
        f"\ncollective_loader demo: mesh [{layout.describe()}], {what} in {where}, "
        f"per-replica batch {a.batch_size} x seq {a.seq_len}, split={a.split}, delivery={a.delivery}, "
        f"num_workers={a.num_workers}"
    )
    print(f"{dp_size} replicas, {group_count(dp_size, layout.pp_size)} process groups per loader\n")
    width = 4 * len(a.dims) + 8
    print(f"{'rank':>4}  {'coords':<{width}} {'role':<32} first batch received")
    for record, coords, is_leader, *_ in ours:
        where = " ".join(f"{n}={c}" for n, c in zip(a.dims, coords))
        role = ("leader, " if is_leader else "") + {"both": "all stages"}.get(record.stage, f"{record.stage} stage")
        role += f", dp_rank {record.dp_rank}"
        print(f"{record.rank:>4}  {where:<{width}} {role:<32} {_describe(record.steps[0] if record.steps else {})}")
    per_replica = samples_per_replica(records)
    sent = sum(o[3]["bytes_sent"] for o in ours)
    collectives = sum(o[3]["collectives"] for o in ours if layout.place(o[0].rank).is_leader)
    unit = "samples" if a.layout is None else "rows"
    print(
        f"\n{steps} steps; {unit} per replica: {per_replica}; leaders sent {sent / 2**20:.2f} MiB in "
        f"{collectives} collectives ({collectives / max(steps, 1) / dp_size:.1f} per leader per step); "
        f"slowest rank {max(o[4] for o in ours):.2f}s"
    )
    if a.layout is None:
        checks = verdicts(records, routing, a.seq_len, dataset)
    else:
        print_packing(a, ours, steps)
        checks = invariants.check(records, routing, lambda ids: made[tuple(ids)], dataset)
    print("\nverdict:")
    for v in checks:
        print(f"  [{'ok' if v.ok else 'FAIL'}] {v.name}" + (f": {v.detail}" if v.detail else ""))
    stage_of = {rec.rank: ("first" if rec.stage == "both" else rec.stage) for rec in records}
    dp_of = {rec.rank: rec.dp_rank for rec in records}
    our_ids = {rec.rank: [b["sample_id"].tolist() if b else None for b in rec.steps] for rec in records}
    naive_by_rank = dict(enumerate(naive))
    ours_bad, ours_total = label_mismatch(stage_of, dp_of, our_ids)
    if a.layout is not None:  # no naive run on LLM data: every rank tokenizing for itself is bench/packing.py
        ok = all(v.ok for v in checks) and ours_bad == 0
        print(f"\nsteps whose last-stage labels do not belong to the first stage's inputs: {ours_bad} of {ours_total}")
        print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
        return 0 if ok else 1
    naive_bad, naive_total = label_mismatch(stage_of, dp_of, naive_by_rank)
    replication = math.prod(s for s, r in zip(layout.shape, layout.roles) if r in ("replicate", "shard"))
    print("\nsteps whose last-stage labels do not belong to the first stage's inputs:")
    if layout.pp_size == 1:
        print("  (one pipeline stage: every rank holds inputs and labels; use a mesh with pp > 1)")
    naive_steps = len(naive[0])
    print(
        f"  naive, every rank builds StreamingDataset(replication={replication}): "
        f"{100 * naive_bad / max(naive_total, 1):5.1f}% ({naive_bad} of {naive_total} last-stage rank-steps; "
        f"{naive_steps} steps per epoch)"
    )
    print(
        f"  collective_loader:                                  "
        f"{100 * ours_bad / max(ours_total, 1):5.1f}% ({ours_bad} of {ours_total} last-stage rank-steps; "
        f"{steps} steps per epoch)"
    )
    ok = all(v.ok for v in checks) and ours_bad == 0
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


def print_packing(a: DemoArgs, ours: list[Any], steps: int) -> None:
    """Each leader's packing figures (over the rows it made, the last of which, on all but the
    leader that ran out first, are not delivered: every replica stops at the same step)."""
    print(f"\npacking (each leader, rows of {a.seq_len} + 1 tokens, at_end={a.at_end}):")
    total: dict[str, int] = {}
    for o in sorted((o for o in ours if o[5] is not None), key=lambda o: o[0].dp_rank):
        made, stats = o[5]
        for k, v in stats.items():
            total[k] = total.get(k, 0) + v
        print(f"  replica {o[0].dp_rank}: {_figures(stats)}; {len(made)} batches made, {steps} delivered")
    print(f"  all: {_figures(total)}")


def _figures(s: dict[str, int]) -> str:
    slots = s["tokens"] + s["padding"]
    return (
        f"{s['documents']} documents, {s['rows']} rows, {s['tokens']} tokens, {s['carried']} carried over into a "
        f"next row, padding {100 * s['padding'] / max(slots, 1):.1f}% of the token slots"
        + (f", {s['dropped']} tokens dropped at the end" if s["dropped"] else "")
    )


def dataset_columns(path: str) -> dict[str, str]:
    """Column name -> MDS encoding of the dataset at ``path`` (its index.json's first shard)."""
    with open(os.path.join(path, "index.json")) as f:
        shards = json.load(f)["shards"]
    if not shards:
        raise ValueError(f"--data {path}: the dataset has no shards")
    return dict(zip(shards[0]["column_names"], shards[0]["column_encodings"]))


def data_layout(path: str, tokenizer: str | None, token_dtype: str | None) -> Layout | None:
    """How the demo reads ``--data``: ``None`` for its own data (``tokens`` ndarray rows with an
    ``id``), else the layout of LLM data, or a ValueError saying what to pass."""
    columns = dataset_columns(path)
    if tokenizer and token_dtype:
        raise ValueError("give --tokenizer for a text column or --token-dtype for token bytes, not both")
    if columns.get("text") == "str":
        if not tokenizer:
            raise ValueError(
                f"--data {path} holds a text column: give --tokenizer PATH (a tokenizer.json or its directory)"
            )
        return TextColumn(tokenizer)
    encoding = columns.get("tokens", "")
    if tokenizer:
        raise ValueError(f"--tokenizer is for a text column; --data {path} has columns {columns}")
    if encoding == "bytes":
        return TokenColumn(dtype=token_dtype)  # int64 when none is given, as LLM Foundry reads them
    if encoding.startswith("ndarray"):
        if token_dtype:
            raise ValueError(f"--token-dtype is for token bytes; the tokens of --data {path} are {encoding}")
        return None if "id" in columns else TokenColumn()
    raise ValueError(
        f"--data {path} has columns {columns}: the demo reads a text column (str), a tokens column (bytes or ndarray), "
        "or its own data (tokens ndarray and id)"
    )


# --- --remote: the endpoint, in this process -----------------------------------------------------


def run_remote(a: DemoArgs, timeout: float) -> int:
    """Both runs of the demo streaming from a local S3 endpoint that this process serves; then the
    requests and bytes each rank fetched. The ranks, spawned from here, inherit its address."""
    cache = tempfile.mkdtemp(prefix="collective_loader_demo_cache_")
    try:
        with S3Endpoint() as s3:
            os.environ.update(s3.client_env(), **{APP_ID_VARIABLE: UPLOAD})  # for the upload and for every rank
            s3.create_bucket(BUCKET)
            remote = f"s3://{BUCKET}/tokens"
            write_dataset(remote, a.samples, a.seq_len, shard_bytes=shard_bytes_for(a.samples, a.seq_len))
            code = launch.run(rank_main, replace(a, data=cache, remote=remote), math.prod(a.shape), timeout)
            return max(code, fetch_report(s3, a, remote))
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def fetched(s3: S3Endpoint, prefix: str, n: int) -> list[tuple[int, int]]:
    """(requests, bytes) that each of ``n`` ranks, named ``<prefix><rank>``, fetched from ``s3``."""
    requests, sent = s3.requests_by_client(), s3.bytes_by_client()
    return [(requests.get(f"{prefix}{r}", 0), sent.get(f"{prefix}{r}", 0)) for r in range(n)]


def fetch_report(s3: S3Endpoint, a: DemoArgs, remote: str) -> int:
    """Print what each rank fetched from ``s3`` in both runs; 1 unless, in
    ours, leaders fetched and no other rank did (nor any client other than the ranks and the upload)."""
    n = math.prod(a.shape)
    leaders = MeshLayout.build(a.dims, a.shape, range(n), placement=a.placement).leaders()
    runs = {run: fetched(s3, prefix, n) for run, prefix in RUNS.items()}
    known = {UPLOAD} | {f"{p}{r}" for p in RUNS.values() for r in range(n)}
    strangers = sorted(set(s3.requests_by_client()) - known)
    print(f"\nfetched from the S3 endpoint {s3.url} ({remote}), per rank:")
    print(f"{'rank':>4}  {'role':<7}" + "".join(f"  {run:<25}" for run in runs).rstrip())
    for rank in range(n):
        cells = "".join(f"  {k:>4} requests {b / 1024:>7.1f} KiB" for k, b in (c[rank] for c in runs.values()))
        print(f"{rank:>4}  {'leader' if rank in leaders else '':<7}{cells}")
    for run, counts in runs.items():
        ranks = [r for r, (k, _) in enumerate(counts) if k]
        print(
            f"  {run}: {len(ranks)} of {n} ranks fetched {ranks}: {sum(k for k, _ in counts)} requests, "
            f"{sum(b for _, b in counts) / 1024:.1f} KiB"
        )
    ours = {r for r, (k, _) in enumerate(runs["collective_loader"]) if k}
    ok = bool(ours) and ours <= set(leaders) and not strangers
    print(
        f"  [{'ok' if ok else 'FAIL'}] in collective_loader's run only leaders {list(leaders)} fetched"
        + (f"; requests from clients no rank named: {strangers}" if strangers else "")
    )
    return 0 if ok else 1


def parse_mesh(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``"pp=2,dp=2,tp=2"`` -> ``(("pp", "dp", "tp"), (2, 2, 2))``."""
    try:
        pairs = [item.split("=") for item in text.split(",")]
        return tuple(n.strip() for n, _ in pairs), tuple(int(s) for _, s in pairs)
    except ValueError:
        raise ValueError(f"--mesh wants name=size pairs like pp=2,dp=2,tp=2, got {text!r}") from None


def check_mesh(
    text: str, seq_len: int, split: Split, world_size: int | None
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The dims and sizes of ``--mesh text``, or a ValueError saying what to change.

    Checked here, before any rank starts, so a bad flag is one message rather than the same
    traceback from every rank (or a torchrun world waiting for ranks that never come).
    ``world_size``: the ranks torchrun started (None when the demo starts its own world).
    """
    dims, shape = parse_mesh(text)
    unknown = [n for n in dims if n not in DEFAULT_ROLES]
    if unknown:
        raise ValueError(f"--mesh {text}: dim {unknown[0]!r} is not one of {', '.join(DEFAULT_ROLES)}")
    try:
        roles = MeshLayout.build(dims, shape, range(math.prod(shape))).roles
    except ValueError as e:
        raise ValueError(f"--mesh {text}: {e}") from None
    if world_size is not None and math.prod(shape) != world_size:
        raise ValueError(
            f"--mesh {text}: the mesh has {math.prod(shape)} ranks, the world {world_size}; give sizes whose product "
            "is the number of ranks torchrun starts"
        )
    shard = [(n, size) for n, size, role in zip(dims, shape, roles) if role == "shard"]
    need = sharding.divisor([(size, 0) for _, size in shard], split)
    if seq_len % need:
        over = " x ".join(f"{n}={size}" for n, size in shard)
        raise ValueError(
            f"--mesh {text}: --seq-len {seq_len} cannot be split over {over} by the {split} split; "
            f"use a multiple of {need}"
        )
    return dims, shape


def check_remote(data: str | None, torchrun: bool) -> None:
    """A ValueError saying why ``--remote`` cannot run with these options or here."""
    if torchrun:
        raise ValueError(
            "--remote serves its S3 endpoint from the demo process that starts the ranks, and under torchrun no "
            "such process exists: run python -m collective_loader demo --remote"
        )
    if data:
        raise ValueError("--remote uploads the demo's own dataset; leave out --data")
    if importlib.util.find_spec("moto") is None:
        raise ValueError("--remote needs moto's S3 server: pip install -e '.[s3]'")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m collective_loader demo", description=__doc__.split("\n")[0])
    p.add_argument(
        "--mesh", default="pp=2,dp=2,tp=2", help="dims in mesh order, outermost first (default pp=2,dp=2,tp=2)"
    )
    p.add_argument("--data", help="an MDS dataset with columns tokens and id (default: write one to a temp dir)")
    p.add_argument("--samples", type=int, default=256, help="samples to write when --data is not given")
    p.add_argument(
        "--tokenizer", help="--data with a text column: the tokenizer.json (or its directory) the leaders use"
    )
    p.add_argument(
        "--token-dtype",
        choices=INTEGER_TYPES,
        help="--data with a tokens column of bytes: the type they were written as (LLM Foundry's "
        "token_encoding_type; int64 when not given)",
    )
    p.add_argument(
        "--at-end",
        choices=("pad", "drop"),
        default="pad",
        help="LLM data: pad or drop the last partial row and batch of the epoch",
    )
    p.add_argument("--batch-size", type=int, default=4, help="per-replica batch size")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument(
        "--split", choices=sharding.SPLITS, default="zigzag", help="how a sequence is cut over the shard dims"
    )
    p.add_argument("--delivery", choices=("broadcast", "scatter"), default="broadcast")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per leader")
    p.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="spread",
        help="where each replica's leader sits: spread over the pipeline stages (default) or all on the first",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds before the local world is stopped; also the longest any rank waits for another "
        "in the demo's own exchanges after the epoch",
    )
    p.add_argument(
        "--remote",
        action="store_true",
        help="serve the dataset from a local S3 endpoint (moto) and stream it from there; prints what each "
        "rank fetched",
    )
    ns = p.parse_args(argv)
    torchrun = launch.under_torchrun()
    try:
        dims, shape = check_mesh(ns.mesh, ns.seq_len, ns.split, int(os.environ["WORLD_SIZE"]) if torchrun else None)
        if ns.remote:
            check_remote(ns.data, torchrun)
        layout = data_layout(ns.data, ns.tokenizer, ns.token_dtype) if ns.data else None
        if not ns.data and (ns.tokenizer or ns.token_dtype):
            raise ValueError("--tokenizer and --token-dtype read LLM data given with --data DIR")
    except ValueError as e:
        if not torchrun or os.environ["RANK"] == "0":  # one line, not one per rank
            print(f"{p.prog}: {e}", file=sys.stderr)
        return 2
    a = DemoArgs(
        dims,
        shape,
        ns.data or "",
        ns.samples,
        ns.batch_size,
        ns.seq_len,
        ns.split,
        ns.delivery,
        ns.num_workers,
        ns.placement,
        timeout=ns.timeout,
        layout=layout,
        at_end=ns.at_end,
    )
    if ns.remote:
        return run_remote(a, ns.timeout)
    if ns.data or torchrun:  # under torchrun the ranks write the dataset themselves
        return launch.run(rank_main, a, math.prod(shape), ns.timeout)
    out = tempfile.mkdtemp(prefix="collective_loader_demo_")
    try:
        write_dataset(out, ns.samples, ns.seq_len)
        return launch.run(rank_main, replace(a, data=out), math.prod(shape), ns.timeout)
    finally:
        shutil.rmtree(out, ignore_errors=True)
