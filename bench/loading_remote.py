"""``python bench/loading.py --remote``: both variants with the data local and on a local S3
endpoint (:class:`collective_loader.testing.s3_endpoint.S3Endpoint`, served from the benchmark's
process, ``REMOTE_LATENCY`` added before each object GET); each remote world streams into a fresh
cache directory (one per world: the ranks share it, as streaming's ranks on one node do). Per
case: the time to the first batch and the epoch's wall time (slowest rank), and the requests and
bytes each rank fetched (:func:`remote_rounds`, :func:`remote_markdown`).
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from harness import rank_table, worlds_in_rounds  # bench/harness.py: run as python bench/<name>.py
from loading_ranks import MESH, VARIANTS, Settings, check_coverage, in_world, rank_main

from collective_loader.plan.mesh import MeshLayout
from collective_loader.testing.s3_endpoint import APP_ID_VARIABLE, S3Endpoint

REMOTE_CASES = tuple((data, v) for data in ("local", "remote") for v in VARIANTS)
REMOTE_LATENCY = 0.05  # seconds before each object GET: an object store's time to first byte, not a disk's
BUCKET, PREFIX = "bench", "mds"
UPLOAD = "upload"  # --remote: the client name of this process, which uploads (the ranks name themselves)


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
