"""``--remote``: a local S3 endpoint served by the launching process
(:mod:`collective_loader.testing.s3_endpoint`), the demo's dataset written to it, both runs
streaming from it, each into a cache directory of its own; after the world ends, the requests and
bytes each rank fetched in each run. The demo fails if a rank that leads no replica fetched
anything in ours."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import replace

from collective_loader.cli.args import RUNS, DemoArgs, UsageError, first_line
from collective_loader.cli.run import rank_main
from collective_loader.plan.mesh import MeshLayout
from collective_loader.testing import launch
from collective_loader.testing.data import shard_bytes_for, write_dataset
from collective_loader.testing.s3_endpoint import APP_ID_VARIABLE, S3Endpoint

BUCKET = "collective-loader-demo"
UPLOAD = "upload"  # this process's client name (the ranks name themselves before streaming)


def run_remote(a: DemoArgs, timeout: float) -> int:
    """Both runs of the demo streaming from a local S3 endpoint that this process serves; then the
    requests and bytes each rank fetched. The ranks, spawned from here, inherit its address.
    A UsageError, before any rank starts, when the endpoint does not start or answer."""
    cache = tempfile.mkdtemp(prefix="collective_loader_demo_cache_")
    s3 = S3Endpoint()
    try:
        try:
            s3.start()
        except Exception as e:  # moto's application or werkzeug's server: either way, nothing to stream from
            raise UsageError(
                f"--remote: the local S3 endpoint did not start ({type(e).__name__}: {first_line(e)})"
            ) from None
        os.environ.update(s3.client_env(), **{APP_ID_VARIABLE: UPLOAD})  # for the upload and for every rank
        try:
            s3.create_bucket(BUCKET)
        except Exception as e:  # botocore's: the endpoint serves, but its clients (this process, the ranks) miss it
            raise UsageError(
                f"--remote: the local S3 endpoint {s3.url} cannot be reached from here ({type(e).__name__}: {first_line(e)}); "
                "check HTTP_PROXY / NO_PROXY for 127.0.0.1"
            ) from None
        remote = f"s3://{BUCKET}/tokens"
        write_dataset(remote, a.samples, a.seq_len, shard_bytes=shard_bytes_for(a.samples, a.seq_len))
        code = launch.run(rank_main, replace(a, data=cache, remote=remote), math.prod(a.shape), timeout)
        return max(code, fetch_report(s3, a, remote))
    finally:
        s3.stop()
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
