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
import os
import shutil
import statistics
import sys
import tempfile
from typing import Any

import torch.distributed as dist
from harness import Run, cpu_seconds, keep, rank_table, runs_of, worlds_in_rounds  # bench/: python bench/<name>.py
from loading_ranks import FULL, QUICK, VARIANTS, Collate, Settings, check_coverage, in_world, rank_main, write_dataset
from loading_remote import remote_markdown, remote_rounds
from torch.distributed.device_mesh import init_device_mesh

from collective_loader import CollectiveLoader
from collective_loader.streaming import StreamingSource

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
