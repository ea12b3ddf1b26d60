"""StreamingSource over a real S3 endpoint: moto's S3 server (``collective_loader.testing.s3_endpoint``) on
127.0.0.1, a bucket written by streaming's own ``MDSWriter(out="s3://...")``, streaming pointed at
it with ``S3_ENDPOINT_URL`` and dummy credentials.

Every rank names itself to the endpoint (``AWS_SDK_UA_APP_ID=rank<R>``, which botocore puts in
its User-Agent), so the endpoint counts requests per rank. Cases: only leaders fetch and every
sample arrives once; ``cache_limit`` evicts shards that a second epoch fetches again;
``predownload`` bounds how far ahead the leader fetches; a shard deleted from the bucket and the
endpoint going away mid-epoch end on every rank with ``LeaderError`` naming the leader, the step
and streaming's message (the shard), after ``download_retry`` attempts; the job resumed from its
last checkpoint with the endpoint back continues exactly; a slow endpoint is the stall report,
and one slower than ``download_timeout`` is streaming's read timeout. The per-node caches of a
two-node job are in ``test_remote_nodes.py``.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import tempfile
import threading
import time
from pathlib import Path

import pytest
import ranks
import torch.distributed as dist
from s3_bucket import S3_BUCKET, s3_shards

from collective_loader import CollectiveLoader, LeaderError
from collective_loader.plan.routing import Routing
from collective_loader.plan.split import RowSplit
from collective_loader.streaming import StreamingSource
from collective_loader.streaming.cleanup import remove_stale
from collective_loader.testing import invariants, launch
from collective_loader.testing.data import INPUTS, LABELS, SEQ_DIMS, expected, write_dataset
from collective_loader.testing.s3_endpoint import APP_ID_VARIABLE, S3Endpoint

SAMPLES, SEQ, BATCH = 128, 16, 4
SHARD_BYTES = 1 << 11  # about 20 samples a shard: 7 shards
REPLICAS = ("pp", "dp"), (2, 2)  # two replicas, leaders ranks 0 and 1
ONE_REPLICA = ("pp", "tp"), (2, 2)  # one leader, rank 0


@pytest.fixture
def remote(s3, request) -> str:
    """A fresh copy of the dataset in the bucket, under a prefix of this test's own."""
    prefix = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())
    url = f"s3://{S3_BUCKET}/{prefix}"
    write_dataset(url, SAMPLES, SEQ, shard_bytes=SHARD_BYTES)
    return url


@pytest.fixture
def world(worlds):
    return worlds.get(4)


def shard_gets(s3: S3Endpoint, since: float = 0.0, until: float = float("inf")) -> list[str]:
    """Keys of the shards fetched (GET answered 200) between two times."""
    return [
        r.key
        for r in s3.requests()
        if r.method == "GET" and r.key.endswith(".mds") and r.status == 200 and since <= r.time < until
    ]


# --- on the ranks ----------------------------------------------------------------------------


def _loader(env, remote, cache, dims, shape, timeout=60.0, shuffle=True, **dataset_kwargs) -> CollectiveLoader:
    os.environ.update(env)
    os.environ[APP_ID_VARIABLE] = f"rank{dist.get_rank()}"
    mesh = ranks.make_mesh(dims, shape)
    source = StreamingSource(
        mesh, remote=remote, local=cache, batch_size=BATCH, shuffle=shuffle, shuffle_seed=7, **dataset_kwargs
    )
    return CollectiveLoader(source, mesh, inputs=INPUTS, labels=LABELS, seq_dims=SEQ_DIMS, timeout=timeout)


def _ids(batch) -> list[int]:
    return batch["sample_id"].tolist()


def epochs(env, remote, cache, dims, shape, n_epochs, **dataset_kwargs):
    """``n_epochs`` epochs; returns this rank's place, batches and when each epoch started."""
    loader = _loader(env, remote, cache, dims, shape, **dataset_kwargs)
    started, batches = [], []
    for _ in range(n_epochs):
        dist.barrier()
        started.append(time.time())
        batches.append([b for b in loader])
    loader.close()
    return {"place": loader.place, "epochs": batches, "started": started}


IN_CLOSE_WRITE, IN_MOVED_TO = 0x8, 0x80  # <sys/inotify.h>


def wait_for_files(directory: str, pattern: str, count: int, timeout: float) -> int:
    """Until ``directory`` holds ``count`` files matching ``pattern``, at most ``timeout`` seconds
    (a bound for a hang); returns how many it holds. Woken by inotify at each file written or
    moved into it (streaming says nothing when it has fetched a shard)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "inotify_init1")
    try:
        if libc.inotify_add_watch(fd, os.fsencode(directory), IN_CLOSE_WRITE | IN_MOVED_TO) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {directory}")
        deadline = time.monotonic() + timeout
        # counted after the watch is in place: a file that came before it is counted, one after wakes us
        while (n := len(list(Path(directory).glob(pattern)))) < count:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                break
            os.read(fd, 1 << 16)
        return n
    finally:
        os.close(fd)


def first_batch_then_wait(env, remote, cache, dims, shape, wait, shards=None, **dataset_kwargs):
    """Take one batch, then let the leader fetch ahead: for ``wait`` seconds (the window in which
    a loader that fetched too far would show it), or, given ``shards``, until its cache holds that
    many (``wait`` then bounds a hang); returns the time the wait ended."""
    loader = _loader(env, remote, cache, dims, shape, shuffle=False, **dataset_kwargs)
    it = iter(loader)
    next(it)
    if shards is None:
        time.sleep(wait)  # the behaviour under test: nothing past the bound is fetched meanwhile
    else:
        wait_for_files(cache, "*.mds", shards, timeout=wait)
    ended = time.time()
    loader.close()
    return ended


def until_failure(
    env, remote, cache, dims, shape, stop=None, checkpoint_at=None, loader_timeout=60.0, **dataset_kwargs
):
    """Iterate until the loader raises; returns (steps taken, the error's text, the checkpoint).

    With ``stop``, two events of the test (a manager's, ``(asked, done)``): rank 0 asks the test
    to stop the endpoint once ``checkpoint_at`` steps are taken and waits until it has."""
    loader = _loader(env, remote, cache, dims, shape, timeout=loader_timeout, **dataset_kwargs)
    taken, checkpoint, error = [], None, None
    try:
        for batch in loader:
            taken.append(_ids(batch) if "sample_id" in batch else None)
            if len(taken) == checkpoint_at:
                checkpoint = loader.state_dict()
                if stop is not None and dist.get_rank() == 0:
                    asked, done = stop
                    asked.set()
                    assert done.wait(60), "the test did not stop the endpoint"
                dist.barrier()
    except LeaderError as e:
        error = str(e)
    loader.close()
    return taken, error, checkpoint


def resumed(env, remote, cache, dims, shape, states, **dataset_kwargs):
    """The rest of the epoch from each rank's own checkpoint (``states`` by rank)."""
    loader = _loader(env, remote, cache, dims, shape, **dataset_kwargs)
    loader.load_state_dict(states[dist.get_rank()])
    rest = [_ids(b) if "sample_id" in b else None for b in loader]
    loader.close()
    return rest


# --- the tests -------------------------------------------------------------------------------


def verify(results) -> list[int]:
    """Every rank's samples pass the invariants; returns the leaders' ids, in order."""
    records = [
        invariants.RankRecord(r["place"].rank, r["place"].dp_rank, r["place"].stage, r["place"].shard, r["epochs"][0])
        for r in results
    ]
    routing = Routing(INPUTS, LABELS, SEQ_DIMS, RowSplit("zigzag"), ())
    verdicts = invariants.check(records, routing, lambda ids: expected(ids, SEQ), range(SAMPLES))
    assert all(v.ok for v in verdicts), [f"{v.name}: {v.detail}" for v in verdicts if not v.ok]
    return [i for r in results if r["place"].is_leader for b in r["epochs"][0] for i in _ids(b)]


def test_only_leaders_fetch_and_every_sample_arrives_once(world, s3, remote, tmp_path):
    s3.clear()
    results = world.run(epochs, s3.client_env(), remote, str(tmp_path / "cache"), *REPLICAS, 2, timeout=180)
    leaders = {r["place"].rank for r in results if r["place"].is_leader}
    assert sorted(verify(results)) == list(range(SAMPLES))
    by_client = s3.requests_by_client()
    assert {c for c in by_client if c.startswith("rank")} == {f"rank{r}" for r in leaders}, by_client
    started = results[0]["started"]
    assert sorted(shard_gets(s3, started[0], started[1])) == s3_shards(s3, remote)  # once: the leaders share the cache
    assert shard_gets(s3, started[1]) == []  # the second epoch reads the cache


def test_cache_limit_evicts_shards_that_the_next_epoch_fetches_again(world, s3, remote, tmp_path):
    s3.clear()
    limit = 4 * SHARD_BYTES  # streaming's least: four of the largest shards
    results = world.run(
        epochs, s3.client_env(), remote, str(tmp_path / "cache"), *ONE_REPLICA, 2, cache_limit=limit, timeout=180
    )
    started = results[0]["started"]
    assert set(shard_gets(s3, started[0], started[1])) == set(s3_shards(s3, remote))
    again = shard_gets(s3, started[1])
    assert len(again) >= len(s3_shards(s3, remote)) - 4, again  # at most four stayed in the cache
    assert sum(p.stat().st_size for p in (tmp_path / "cache").rglob("*.mds")) <= limit


@pytest.mark.parametrize("predownload,most", [(BATCH, 2), (SAMPLES, 7)], ids=["one_batch", "whole_epoch"])
def test_predownload_bounds_how_far_ahead_the_leader_fetches(world, s3, remote, tmp_path, predownload, most):
    # sequential order (no shuffle, one canonical node): step k needs samples 4k..4k+3; after
    # step 0 the loader prefetches two more steps (12 samples in all) and streaming fetches
    # ``predownload`` samples beyond those: 16 samples, the first shard or two
    s3.clear()
    whole = predownload == SAMPLES
    ended = world.run(
        first_batch_then_wait,
        s3.client_env(),
        remote,
        str(tmp_path / "cache"),
        *ONE_REPLICA,
        60.0 if whole else 3.0,
        len(s3_shards(s3, remote)) if whole else None,
        predownload=predownload,
        num_canonical_nodes=1,
        timeout=120,
    )[0]
    fetched = shard_gets(s3, until=ended)
    if whole:  # every shard, each once
        assert sorted(fetched) == s3_shards(s3, remote)
    else:
        assert 1 <= len(fetched) <= most, fetched


def assert_failed_everywhere(results, *texts: str) -> None:
    print(f"rank 0 raised LeaderError: {results[0][1]}")  # docs/failures.md quotes these (pytest -s)
    for rank, (taken, error, _) in enumerate(results):
        assert error is not None, f"rank {rank} took {len(taken)} steps and raised nothing"
        for text in texts:
            assert re.search(text, error), (rank, text, error)


def test_deleted_shard_fails_on_every_rank_after_its_retries(world, s3, remote, tmp_path):
    gone = s3_shards(s3, remote)[3]
    s3.client().delete_object(Bucket=S3_BUCKET, Key=gone)
    s3.clear()
    results = world.run(
        until_failure,
        s3.client_env(),
        remote,
        str(tmp_path / "cache"),
        *ONE_REPLICA,
        download_retry=2,
        timeout=120,
    )
    assert_failed_everywhere(results, r"leader rank 0", r"step \d+", re.escape(gone.rsplit("/", 1)[1]), "not found")
    heads = [r for r in s3.requests() if r.key == gone]
    assert [(r.client, r.method, r.status) for r in heads] == [("rank0", "HEAD", 404)] * 2  # download_retry=2


def test_endpoint_gone_mid_epoch_fails_everywhere_and_resume_continues_exactly(world, s3, remote, tmp_path):
    env, cache = s3.client_env(), str(tmp_path / "cache")
    full = world.run(epochs, env, remote, str(tmp_path / "reference"), *ONE_REPLICA, 1, timeout=120)
    full_ids = [_ids(b) if "sample_id" in b else None for b in full[0]["epochs"][0]]

    manager = launch.CONTEXT.Manager()  # its events reach the ranks (through the world's task queues)
    asked, done = manager.Event(), manager.Event()

    def stop_when_asked() -> None:
        asked.wait()
        if not done.is_set():  # set by the test: the run ended without asking
            s3.stop()
            done.set()

    stopper = threading.Thread(target=stop_when_asked, daemon=True)
    stopper.start()
    checkpoint_at = 3
    try:
        # predownload: one batch ahead, so most shards are still to be fetched when the store goes
        results = world.run(
            until_failure,
            env,
            remote,
            cache,
            *ONE_REPLICA,
            (asked, done),
            checkpoint_at,
            predownload=BATCH,
            download_retry=1,
            timeout=120,
        )
    finally:
        if not asked.is_set():
            done.set()
            asked.set()
        stopper.join()
        manager.shutdown()
        s3.start()  # the store is back, with its data
    assert_failed_everywhere(
        results, r"leader rank 0", r"step \d+", r"Could not connect to the endpoint URL", r"shard\.\d+\.mds"
    )
    assert all(taken[:checkpoint_at] == full_ids[:checkpoint_at] for taken, _, _ in results[:1])
    states = [checkpoint for _, _, checkpoint in results]
    rest = world.run(resumed, env, remote, cache, *ONE_REPLICA, states, predownload=BATCH, timeout=120)
    assert rest[0] == full_ids[checkpoint_at:]


def test_slow_endpoint_is_the_stall_report(world, s3, remote, tmp_path):
    s3.latency, s3.slow_keys = 30.0, r"\.mds$"  # each shard takes 30 s: longer than the loader waits
    try:
        results = world.run(
            until_failure,
            s3.client_env(),
            remote,
            str(tmp_path / "cache"),
            *ONE_REPLICA,
            loader_timeout=12.0,
            timeout=90,
        )
    finally:
        s3.latency = 0.0
        world.kill()  # the leader's thread is still inside streaming, waiting for the shard
        remove_stale()  # what the killed ranks left (streaming's blocks and locks), as after any killed run
    assert_failed_everywhere(results, r"leader rank 0", r"still loading step 0 after 9s", r"timeout=12.0s")
    left = [n for n in os.listdir("/dev/shm") if re.match(r"^\d{6}_", n)]
    left += [n for n in os.listdir(tempfile.gettempdir()) if re.match(r"^\d{6}_.*filelock$", n)]
    assert left == [], left


# slow: once in three full-suite runs here the leader's source had not returned after 90 s although
# both download threads had raised the read timeout (the stall report came instead): streaming's
# epoch end then waited for ever for the threads to count themselves out, which
# DownloadFailureRaisingDataset now makes them do however they end. Alone it passes in about 23 s;
# slow until the fix has been through more full runs.
@pytest.mark.slow
def test_download_timeout_is_streamings_read_timeout(world, s3, remote, tmp_path):
    # botocore reads for download_timeout seconds; boto3 retries a read timeout (15 reads in all),
    # streaming download_retry times: 10-20 s here, well inside the loader's timeout
    s3.latency, s3.slow_keys = 3.0, r"\.mds$"
    try:
        results = world.run(
            until_failure,
            s3.client_env(),
            remote,
            str(tmp_path / "cache"),
            *ONE_REPLICA,
            download_timeout=0.5,
            download_retry=1,
            loader_timeout=120.0,
            timeout=200,
        )
    finally:
        s3.latency = 0.0
        world.kill()  # a stalled leader's threads may still be inside streaming
        remove_stale()  # what the killed ranks left (streaming's blocks and locks), as after any killed run
    assert_failed_everywhere(results, r"leader rank 0", r"Read timeout on endpoint URL", r"shard\.\d+\.mds")
