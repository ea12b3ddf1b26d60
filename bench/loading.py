"""Loading cost: CollectiveLoader (leaders load) vs every rank loading its own StreamingDataset.

    python bench/loading.py              # bench/results/loading.{json,md}
    python bench/loading.py --quick      # a small dataset, one round: bench/results/loading_quick.* (git-ignored)
    python bench/loading.py --placement  # per-node loading CPU of both leader placements, pp outermost
    python bench/loading.py --remote     # the data local and on a local S3 endpoint: first batch, epoch, fetches

(Run times: bench/README.md.)

An 8-rank gloo world on the mesh ``(dp, pp, tp) = (2, 2, 2)``: two replicas, model-parallel size 4
(pp x tp). One epoch of a real ``StreamingDataset`` over MDS shards of text written here, with a
tokenization-like transform in the collate (a pure-Python hash of every byte of every word, then
a look-up in a 200,000-entry vocabulary table that each process which tokenizes builds once):

* *collective_loader*: ``StreamingSource`` builds the dataset on the two leaders only;
  ``CollectiveLoader`` delivers inputs to the first stage and labels to the last.
* *every rank loads* (the TorchTitan way): every rank builds ``StreamingDataset`` with
  ``replication = 4``, so the 4 ranks of a replica (adjacent in this mesh order) read the same
  samples, and runs the same collate.

Each variant runs in its own world (peak RSS is per process), the variants alternate, twice. Per
rank: CPU seconds (user + system) and peak RSS, both total and above what the rank had when the
variant started (after importing torch and streaming and joining the world: what the data path
adds); the tables sum them over the 8 ranks. DataLoader workers: none (``num_workers=0``), so
every second of loading is on the rank's own process and counted.

``--remote`` runs both variants with the data local and on a local S3 endpoint
(:class:`collective_loader.testing.s3_endpoint.S3Endpoint`, served from this process, ``REMOTE_LATENCY``
added before each object GET); each remote world streams into a fresh cache directory (one per
world: the ranks share it, as streaming's ranks on one node do). Per case: the time to the first
batch and the epoch's wall time (slowest rank), and the requests and bytes each rank fetched.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from harness import (  # bench/harness.py: run as python bench/<name>.py
    Run,
    cpu_seconds,
    keep,
    peak_rss_bytes,
    rank_table,
    rss_bytes,
    runs_of,
    worlds_in_rounds,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader

from collective_loader import CollectiveLoader
from collective_loader.plan.mesh import MeshLayout
from collective_loader.streaming import StreamingSource
from collective_loader.streaming.cleanup import release
from collective_loader.testing import launch
from collective_loader.testing.s3_endpoint import APP_ID_VARIABLE, S3Endpoint

MESH = (("dp", "pp", "tp"), (2, 2, 2))
REPLICATION = 4  # pp x tp: the ranks of one replica, adjacent in this mesh order
VOCAB = 32000
VOCAB_ENTRIES = 200_000
WORDS = [f"w{i:x}{'abcdefgh'[i % 8] * (i % 7)}" for i in range(5000)]
VARIANTS = ("collective_loader", "every_rank_loads")
REMOTE_CASES = tuple((data, v) for data in ("local", "remote") for v in VARIANTS)
REMOTE_LATENCY = 0.05  # seconds before each object GET: an object store's time to first byte, not a disk's
BUCKET, PREFIX = "bench", "mds"
UPLOAD = "upload"  # --remote: the client name of this process, which uploads (the ranks name themselves)


@dataclasses.dataclass(frozen=True)
class Settings:
    samples: int
    words_per_sample: int
    seq_len: int
    batch_size: int  # per replica
    rounds: int
    data: str = ""
    out: str = ""  # the records' path (harness.keep): every rank keeps one per world


FULL = Settings(samples=4096, words_per_sample=600, seq_len=512, batch_size=8, rounds=2)
QUICK = Settings(samples=512, words_per_sample=300, seq_len=128, batch_size=8, rounds=1)


# --- the data and its transform -----------------------------------------------------------------


def write_dataset(out: str, s: Settings) -> None:
    """MDS shards with columns ``text`` (str) and ``id``."""
    from streaming import MDSWriter

    rng = np.random.default_rng(0)
    with MDSWriter(out=out, columns={"text": "str", "id": "int"}, size_limit=1 << 20) as writer:
        for i in range(s.samples):
            words = rng.integers(0, len(WORDS), s.words_per_sample)
            writer.write({"text": " ".join(WORDS[w] for w in words), "id": i})


_VOCAB_TABLE: dict[str, int] = {}


def vocab_table() -> dict[str, int]:
    """A word -> id table of ``VOCAB_ENTRIES`` entries, built once per process that tokenizes
    (as a real tokenizer loads its vocabulary and merges): the memory every loading rank holds."""
    if not _VOCAB_TABLE:
        _VOCAB_TABLE.update((f"{word}{i}", i % VOCAB) for i, word in enumerate(WORDS * (VOCAB_ENTRIES // len(WORDS))))
    return _VOCAB_TABLE


def tokenize(text: str, length: int) -> list[int]:
    """``length`` token ids from ``text``: every byte of every word hashed (the CPU work per
    sample), then looked up in the vocabulary table."""
    table, ids = vocab_table(), []
    for word in text.split():
        h = 7
        for byte in word.encode():
            h = (h * 131 + byte) % VOCAB
        ids.append(table.get(f"{word}{h % 40}", h))
    return (ids + [0] * length)[:length]


def tokenize_collate(samples: list[dict[str, Any]], seq_len: int) -> dict[str, torch.Tensor]:
    """Samples -> ``input_ids``, ``labels`` (shifted by one), ``position_ids``, ``sample_id``."""
    tokens = torch.tensor([tokenize(s["text"], seq_len + 1) for s in samples], dtype=torch.int64)
    return {
        "input_ids": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(seq_len).expand(len(samples), seq_len).contiguous(),
        "sample_id": torch.tensor([int(s["id"]) for s in samples]),
    }


class Collate:
    """A picklable collate with the sequence length bound."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return tokenize_collate(samples, self.seq_len)


# --- one rank -----------------------------------------------------------------------------------


def drain(batches: Iterable[dict[str, Any]], start: float) -> tuple[list[int], float]:
    """Every batch's sample ids, and the seconds from ``start`` until the first batch was in hand."""
    ids: list[int] = []
    first = math.nan
    for batch in batches:
        if math.isnan(first):
            first = time.perf_counter() - start
        ids += batch.get("sample_id", torch.empty(0)).tolist()
    return ids, first


def epoch_collective(s: Settings, mesh: Any, where: dict[str, str], start: float) -> tuple[list[int], float]:
    source = StreamingSource(mesh, **where, batch_size=s.batch_size, collate=Collate(s.seq_len), shuffle=False)
    loader = CollectiveLoader(
        source, mesh, inputs=("input_ids", "position_ids", "sample_id"), labels=("labels", "sample_id")
    )
    ids, first = drain(loader, start)
    loader.close()
    return ids, first


def epoch_every_rank(s: Settings, mesh: Any, where: dict[str, str], start: float) -> tuple[list[int], float]:
    from streaming import StreamingDataset

    dataset = StreamingDataset(**where, batch_size=s.batch_size, shuffle=False, replication=REPLICATION)
    loader = DataLoader(dataset, batch_size=s.batch_size, collate_fn=Collate(s.seq_len))
    ids, first = drain(loader, start)
    del loader
    dist.barrier()  # every rank of the node is done with the blocks before they go
    release(dataset)
    return ids, first


def rank_main(args: tuple[Settings, str, dict[str, str]]) -> int:
    """One epoch of ``variant`` from ``where``: StreamingDataset's ``local`` (and ``remote``)."""
    s, variant, where = args
    import streaming  # noqa: F401  (its import is part of the baseline, not of the data path)

    os.environ[APP_ID_VARIABLE] = f"rank{dist.get_rank()}"  # names this rank's requests to the S3 endpoint
    mesh = init_device_mesh("cpu", MESH[1], mesh_dim_names=MESH[0])
    gc.collect()
    dist.barrier()
    cpu0, rss0, wall0 = cpu_seconds(), rss_bytes(), time.perf_counter()
    ids, first = (epoch_collective if variant == "collective_loader" else epoch_every_rank)(s, mesh, where, wall0)
    record = {
        "rank": dist.get_rank(),
        "cpu": cpu_seconds() - cpu0,
        "cpu_total": cpu_seconds(),
        "rss_start": rss0,
        "peak_rss": peak_rss_bytes(),
        "wall": time.perf_counter() - wall0,
        "first": first,
        "ids": ids,
    }
    keep(s.out, {"run": {"variant": variant, "data": "remote" if "remote" in where else "local"}, **record})
    return 0


# --- leader placement: where the loading lands -------------------------------------------------

PLACEMENT_MESH = (("pp", "dp", "tp"), (2, 2, 2))  # pp outermost, as TorchTitan orders its mesh
NODE_SIZE = 4  # ranks per node of the two-node job this stands for: node = rank // NODE_SIZE


def placement_main(args: tuple[Settings, str]) -> int:
    """One epoch through CollectiveLoader with leaders placed by ``placement``; per-rank CPU."""
    s, placement = args
    import streaming  # noqa: F401  (its import is part of the baseline, not of the data path)

    mesh = init_device_mesh("cpu", PLACEMENT_MESH[1], mesh_dim_names=PLACEMENT_MESH[0])
    gc.collect()
    dist.barrier()
    cpu0 = cpu_seconds()
    source = StreamingSource(
        mesh, local=s.data, batch_size=s.batch_size, collate=Collate(s.seq_len), shuffle=False, placement=placement
    )
    loader = CollectiveLoader(
        source,
        mesh,
        inputs=("input_ids", "position_ids", "sample_id"),
        labels=("labels", "sample_id"),
        placement=placement,
    )
    steps = sum(1 for _ in loader)
    loader.close()
    record = {"rank": dist.get_rank(), "cpu": cpu_seconds() - cpu0, "leader": loader.is_leader, "steps": steps}
    keep(s.out, {"run": {"placement": placement}, **record})
    return 0


def placement_markdown(meta: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    names, shape = PLACEMENT_MESH
    lines = [
        f"Mesh {dict(zip(names, shape))}, pp outermost: 8 ranks standing for two nodes of {NODE_SIZE} (node = rank // "
        f"{NODE_SIZE}; one host, so only the CPU split is measured, not the network). One epoch of "
        f"{meta['settings']['samples']} samples through `StreamingSource` + `CollectiveLoader` with each `placement`; "
        "CPU seconds (user + system) the data path added per rank, summed per node; medians over "
        f"{meta['settings']['rounds']} round(s).",
        "",
        "| placement | leaders (global ranks) | CPU s node 0 | CPU s node 1 | busier / other node | total CPU s |",
        "|---|---|---|---|---|---|",
    ]
    for placement in ("first_stage", "spread"):
        mine = [r for r in runs if r["placement"] == placement]
        nodes = [[sum(x["cpu"] for x in r["ranks"] if x["rank"] // NODE_SIZE == n) for r in mine] for n in (0, 1)]
        med = [statistics.median(n) for n in nodes]
        leaders = sorted(x["rank"] for x in mine[0]["ranks"] if x["leader"])
        lines.append(
            f"| {placement} | {leaders} | {med[0]:.1f} | {med[1]:.1f} | {max(med) / max(min(med), 1e-9):.2f} | "
            f"{sum(med):.1f} |"
        )
    return lines


# --- report -------------------------------------------------------------------------------------


def summarize(run: dict[str, Any]) -> dict[str, float]:
    ranks = run["ranks"]
    return {
        "cpu": sum(r["cpu"] for r in ranks),
        "cpu_total": sum(r["cpu_total"] for r in ranks),
        "rss_added": sum(r["peak_rss"] - r["rss_start"] for r in ranks),
        "peak_rss": sum(r["peak_rss"] for r in ranks),
        "wall": max(r["wall"] for r in ranks),
        "loading_ranks_cpu": sorted(r["cpu"] for r in ranks)[-1],
    }


def check_coverage(run: dict[str, Any], samples: int, batch_size: int) -> str:
    """Each replica's first-stage ranks saw the same ids; the replicas together saw every sample once."""
    names, shape = MESH
    by_replica: dict[int, set[tuple[int, ...]]] = {}
    for r in run["ranks"]:
        dp, pp, _ = np.unravel_index(r["rank"], shape)
        if pp == 0:
            by_replica.setdefault(int(dp), set()).add(tuple(r["ids"]))
    if any(len(v) != 1 for v in by_replica.values()):
        return "ranks of one replica saw different samples"
    seen = [i for v in by_replica.values() for i in next(iter(v))]
    want = samples - samples % (batch_size * shape[0])
    if sorted(seen) != list(range(samples))[: len(seen)] or len(seen) != want:
        return f"replicas saw {len(seen)} samples ({len(set(seen))} distinct), want {want} once each"
    return "ok"


def markdown(meta: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    s = {v: [summarize(r) for r in runs if r["variant"] == v] for v in VARIANTS}
    med = {v: {k: statistics.median(x[k] for x in s[v]) for k in s[v][0]} for v in VARIANTS}
    ratio = {k: med["collective_loader"][k] / med["every_rank_loads"][k] for k in med["collective_loader"]}
    ok = {
        "cpu": ratio["cpu"] <= 0.35,
        "rss_added": ratio["rss_added"] <= 0.35,
    }
    gib, mib = 2**30, 2**20
    lines = [
        f"Mesh (dp, pp, tp) = (2, 2, 2): 8 ranks, 2 replicas, model-parallel size 4. One epoch of "
        f"{meta['settings']['samples']} samples of {meta['settings']['words_per_sample']} words, per-replica batch "
        f"{meta['settings']['batch_size']}, sequence {meta['settings']['seq_len']} tokens, tokenization-like collate, "
        f"no DataLoader workers, `shuffle=False`. Sums over the 8 ranks, medians over {meta['settings']['rounds']} "
        "round(s) of separate worlds; *added* is what the data path adds to a rank that has imported torch and "
        "streaming and joined the world.",
        "",
        "## Targets",
        "",
        f"- summed loader CPU seconds <= 0.35x every-rank-loads: **{'met' if ok['cpu'] else 'MISSED'}** "
        f"({ratio['cpu']:.2f})",
        f"- summed loader peak RSS (added) <= 0.35x every-rank-loads: **{'met' if ok['rss_added'] else 'MISSED'}** "
        f"({ratio['rss_added']:.2f})",
        "",
        "| | CPU s added (sum) | CPU s of the busiest rank | CPU s whole processes (sum) | peak RSS added (sum) | "
        "peak RSS whole processes (sum) | wall s per epoch (slowest rank) | coverage |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in VARIANTS:
        m = med[v]
        cover = ", ".join(
            sorted(
                {
                    check_coverage(r, meta["settings"]["samples"], meta["settings"]["batch_size"])
                    for r in runs
                    if r["variant"] == v
                }
            )
        )
        lines.append(
            f"| {v.replace('_', ' ')} | {m['cpu']:.1f} | {m['loading_ranks_cpu']:.1f} | {m['cpu_total']:.1f} | "
            f"{m['rss_added'] / mib:.0f} MiB | {m['peak_rss'] / gib:.2f} GiB | {m['wall']:.1f} | {cover} |"
        )
    lines.append(
        f"| ratio | {ratio['cpu']:.2f} | {ratio['loading_ranks_cpu']:.2f} | {ratio['cpu_total']:.2f} | "
        f"{ratio['rss_added']:.2f} | {ratio['peak_rss']:.2f} | {ratio['wall']:.2f} | |"
    )
    firsts = {v.replace("_", " "): next(r for r in runs if r["variant"] == v)["ranks"] for v in VARIANTS}
    cells = {
        v: [f"{r['cpu']:.1f} / {(r['peak_rss'] - r['rss_start']) / mib:.0f}" for r in ranks]
        for v, ranks in firsts.items()
    }
    return [*lines, "", "Per rank (first round): CPU s added / peak RSS added (MiB)", "", *rank_table("variant", cells)]


def fetch_summary(run: dict[str, Any]) -> dict[str, float]:
    """What the leaders and the other ranks (and any unnamed client) fetched in one world."""
    leaders = {f"rank{r}" for r in MeshLayout.build(*MESH, range(8)).leaders()}
    requests, sent = ({c: k for c, k in run["fetched"][x].items() if c != UPLOAD} for x in ("requests", "bytes"))
    return {
        "fetching_ranks": sum(1 for c, k in requests.items() if k and c.startswith("rank")),
        "leader_requests": sum(k for c, k in requests.items() if c in leaders),
        "other_requests": sum(k for c, k in requests.items() if c not in leaders),
        "leader_bytes": sum(b for c, b in sent.items() if c in leaders),
        "other_bytes": sum(b for c, b in sent.items() if c not in leaders),
    }


def remote_markdown(meta: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    settings, mib = meta["settings"], 2**20
    lines = [
        f"Mesh (dp, pp, tp) = (2, 2, 2): 8 ranks, leaders {list(MeshLayout.build(*MESH, range(8)).leaders())}. One "
        f"epoch of {settings['samples']} samples of {settings['words_per_sample']} words, per-replica batch "
        f"{settings['batch_size']}, tokenization-like collate, no DataLoader workers, `shuffle=False`. *remote*: "
        f"moto's S3 server in the benchmark's process (`collective_loader.testing.s3_endpoint`), {REMOTE_LATENCY * 1000:.0f} "
        "ms added before each object GET, a fresh `local` cache directory per world shared by its ranks (one host: "
        "streaming's one-node layout). Times from the world's start barrier, slowest rank; medians over "
        f"{settings['rounds']} round(s) of separate worlds. Requests and bytes: as the endpoint counted them, by each "
        "rank's `AWS_SDK_UA_APP_ID`.",
        "",
        "| data | loader | first batch s | wall s per epoch | CPU s added (sum) | ranks that fetched | "
        "requests: leaders / other ranks | MiB fetched: leaders / other ranks | coverage |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for data, variant in REMOTE_CASES:
        mine = [r for r in runs if r["data"] == data and r["variant"] == variant]
        times = [
            {
                "first": max(x["first"] for x in r["ranks"]),
                "wall": max(x["wall"] for x in r["ranks"]),
                "cpu": sum(x["cpu"] for x in r["ranks"]),
            }
            | fetch_summary(r)
            for r in mine
        ]
        m = {k: statistics.median(t[k] for t in times) for k in times[0]}
        cover = ", ".join(sorted({check_coverage(r, settings["samples"], settings["batch_size"]) for r in mine}))
        lines.append(
            f"| {data} | {variant.replace('_', ' ')} | {m['first']:.2f} | {m['wall']:.1f} | {m['cpu']:.1f} | "
            f"{m['fetching_ranks']:.0f} | {m['leader_requests']:.0f} / {m['other_requests']:.0f} | "
            f"{m['leader_bytes'] / mib:.1f} / {m['other_bytes'] / mib:.1f} | {cover} |"
        )
    cells = {}
    for variant in VARIANTS:
        first = next(r for r in runs if r["data"] == "remote" and r["variant"] == variant)
        requests, sent = first["fetched"]["requests"], first["fetched"]["bytes"]
        cells[variant.replace("_", " ")] = [
            f"{requests.get(f'rank{i}', 0)} / {sent.get(f'rank{i}', 0) / mib:.1f}" for i in range(8)
        ]
    return [*lines, "", "Per rank, remote data (first round): requests / MiB fetched", "", *rank_table("loader", cells)]


def in_world(entry: Callable[[Any], int], arg: Any) -> int:
    """``entry(arg)`` on the 8 ranks of a world of its own; their exit code."""
    return launch.run(entry, arg, 8, timeout=1200)


def remote_rounds(s: Settings, tmp: str) -> tuple[int, list[dict[str, Any]]]:
    """``REMOTE_CASES`` with the remote data on an S3 endpoint served from this process; the exit
    code and, per world in the order run, the requests and bytes each client fetched."""
    fetches: list[dict[str, Any]] = []
    with S3Endpoint(latency=REMOTE_LATENCY) as s3:
        os.environ.update(s3.client_env(), **{APP_ID_VARIABLE: UPLOAD})  # the ranks, spawned from here, inherit it
        s3.create_bucket(BUCKET)
        client = s3.client()
        for name in sorted(os.listdir(s.data)):
            client.upload_file(os.path.join(s.data, name), BUCKET, f"{PREFIX}/{name}")
        s3.clear()

        def world(case: tuple[str, str], r: int) -> int:
            data, variant = case
            where = (
                {"local": s.data}
                if data == "local"
                else {"remote": f"s3://{BUCKET}/{PREFIX}", "local": os.path.join(tmp, f"cache_{r}_{variant}")}
            )
            code = in_world(rank_main, (s, variant, where))
            fetches.append({"requests": s3.requests_by_client(), "bytes": s3.bytes_by_client()})
            s3.clear()
            return code

        return worlds_in_rounds(REMOTE_CASES, s.rounds, world), fetches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small dataset, one round")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--placement", action="store_true", help="per-node loading CPU of both leader placements")
    mode.add_argument(
        "--remote",
        action="store_true",
        help="data local and on a local S3 endpoint: first batch, epoch time, fetches per rank",
    )
    args = parser.parse_args(argv)
    name = "loading_placement" if args.placement else "loading_remote" if args.remote else "loading"
    name += "_quick" if args.quick else ""
    run = Run("loading.py", argv)
    tmp = tempfile.mkdtemp(prefix="cl_loading_")
    try:
        s = dataclasses.replace(
            QUICK if args.quick else FULL, data=os.path.join(tmp, "mds"), out=os.path.join(tmp, "records")
        )
        write_dataset(s.data, s)
        fetches: list[dict[str, Any]] = []
        if args.remote:
            code, fetches = remote_rounds(s, tmp)
        elif args.placement:
            code = worlds_in_rounds(("first_stage", "spread"), s.rounds, lambda p, r: in_world(placement_main, (s, p)))
        else:
            code = worlds_in_rounds(VARIANTS, s.rounds, lambda v, r: in_world(rank_main, (s, v, {"local": s.data})))
        if code:
            return code
        runs = [
            {**ranks[0]["run"], "ranks": [{k: v for k, v in x.items() if k != "run"} for x in ranks]}
            for ranks in runs_of(s.out)
        ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if fetches:
        runs = [{**run, "fetched": fetched} for run, fetched in zip(runs, fetches, strict=True)]
    results = {
        "meta": run.meta(settings=dataclasses.asdict(s) | {"data": None, "out": None}),
        "runs": [
            {
                **r,
                "ranks": [
                    {k: v for k, v in x.items() if k != "ids"} | {"ids_n": len(x.get("ids", ()))} for x in r["ranks"]
                ],
            }
            for r in runs
        ],
    }
    if args.placement:
        title, body = "Leader placement: loading CPU per node", placement_markdown(results["meta"], runs)
    elif args.remote:
        title = "Remote data: collective_loader vs every rank loads, data local and on an S3 endpoint"
        body = remote_markdown(results["meta"], runs)
    else:
        title, body = "Loading cost: collective_loader vs every rank loads", markdown(results["meta"], runs)
    run.write(name, f"{title} (gloo, this machine)", results, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
