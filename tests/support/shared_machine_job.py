"""One job of ``tests/distributed/test_jobs_share_a_machine.py``: several of these run on one
machine at once, each under its own ``torchrun --standalone --nproc-per-node 2`` (dp=2).

``shared_machine_job.py KIND DATA SYNC JOB JOBS ROUNDS [--prefix-file PATH] [--stop-after STEPS]``

KIND: ``plain`` (``StreamingSource`` of the demo's samples, one DataLoader worker per leader),
``packing`` (``StreamingSource`` packing token documents), ``mixture`` (``MixtureSource`` of two
sources ``a`` and ``b``). DATA: the job's own dataset (``DATA/a``, ``DATA/b`` for a mixture), as
:func:`write` wrote it for JOB.

Each of ROUNDS rounds: the job's ranks get ready, its rank 0 sets ``ready_<round>_<JOB>`` in the
test's key-value store (SYNC: ``host:port`` of a ``TCPStore``; ``-``: no other job to wait for),
and every rank waits until the key of each of the JOBS jobs is there (the test sets those of a
job that exited, and the others go on without it): the store answers every waiting rank of
every job at once, when the last key is set. Then it builds its loader (the leaders build
streaming's datasets then, all jobs at once), runs one epoch, checks it and closes the loader.
Rank 0 prints ``round R ok`` for each round that passed; any failure raises (the job exits
non-zero).

``--remote``, ``--clean-stale`` (plain only): DATA is the local cache of the remote directory
``--remote``; ``StreamingSource(clean_stale=True)``.
``--prefix-file``: a leader writes its datasets' shared-memory prefixes there once built.
``--stop-after``: stop after that many steps of the first round (0: once the loader is built,
before its first step) and wait to be killed (the test's ``kill -9``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from collections import Counter

import numpy as np
import torch.distributed as dist

SAMPLES, SEQ_LEN, BATCH = 64, 16, 4
DOCUMENTS, STRIDE = 90, 64  # token documents: token k of document i is base + i * STRIDE + k
BASE = 20000  # job j's tokens lie in [j * BASE, (j + 1) * BASE): another job's token is caught
TIMEOUT = 60.0  # the loaders' and sources': a job that waits for ever (blocks shared with another job) fails
SYNC_TIMEOUT = 300.0  # seconds a rank waits for the other jobs (their torchrun and imports on a loaded machine)


def lengths(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(8, 40, size=DOCUMENTS).tolist()


def write(kind: str, data: str, job: int) -> None:
    """The job's dataset under ``data`` (run once, before the jobs start)."""
    from collective_loader.testing.data import numbered_documents, write_dataset, write_token_documents

    if kind == "plain":
        write_dataset(data, SAMPLES, SEQ_LEN, shard_bytes=1 << 12)
        return
    for index, name in enumerate(("a", "b") if kind == "mixture" else ("",)):
        base = job * BASE + index * BASE // 2
        docs = [base + d for d in numbered_documents(lengths(10 * job + index), STRIDE)]
        write_token_documents(os.path.join(data, name), docs, "bytes", "uint16", shard_bytes=1 << 10)


def sync_store(sync: str) -> dist.TCPStore | None:
    """A client of the test's store at ``host:port``; ``None`` for ``-``."""
    if sync == "-":
        return None
    host, port = sync.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=SYNC_TIMEOUT))


def wait_for_every_job(store: dist.TCPStore | None, round_: int, job: int, jobs: int) -> None:
    """Every rank of every job returns at the same moment: when the last job is ready (a job that
    failed is not waited for: the test sets its keys)."""
    dist.barrier()  # this job's ranks are ready
    if store is None:
        return
    if dist.get_rank() == 0:
        store.add(f"ready_{round_}_{job}", 1)
    store.wait([f"ready_{round_}_{j}" for j in range(jobs)])


def build(kind: str, data: str, mesh, remote: str | None = None, clean_stale: bool = False):
    from collective_loader import CollectiveLoader
    from collective_loader.streaming import MixtureSource, StreamingSource
    from collective_loader.text import Packing, TokenColumn

    if kind == "plain":
        source = StreamingSource(
            mesh,
            local=data,
            remote=remote,
            batch_size=BATCH,
            shuffle=True,
            shuffle_seed=3,
            num_workers=1,
            clean_stale=clean_stale,
            timeout=TIMEOUT,
        )
        keys = dict(inputs=("input_ids", "position_ids", "sample_id"), labels=("labels", "sample_id"))
        return CollectiveLoader(source, mesh, timeout=TIMEOUT, **keys)
    layout, packing = TokenColumn(dtype="uint16"), Packing(seq_len=SEQ_LEN)
    if kind == "packing":
        source = StreamingSource(
            mesh,
            local=data,
            batch_size=BATCH,
            layout=layout,
            packing=packing,
            shuffle=True,
            shuffle_seed=3,
            timeout=TIMEOUT,
        )
        return CollectiveLoader(source, mesh, inputs=("input_ids", "position_ids"), labels=("labels",), timeout=TIMEOUT)
    # the mixture from its file, as a user writes one (docs/mixtures.md); the sources' shared options given once
    mixture_file = os.path.join(data, "mix.json")
    if not os.path.exists(mixture_file):  # every rank writes the same bytes: no rank waits for another
        sources = {name: {"local": os.path.join(data, name)} for name in ("a", "b")}
        with open(f"{mixture_file}.{os.getpid()}", "w") as f:
            json.dump({"weights": {"a": 0.5, "b": 0.5}, "sources": sources}, f)
        os.replace(f"{mixture_file}.{os.getpid()}", mixture_file)
    mixture = MixtureSource.from_file(
        mesh,
        mixture_file,
        batch_size=BATCH,
        layout=layout,
        packing=packing,
        timeout=TIMEOUT,
        shuffle=True,
        shuffle_seed=3,
    )
    keys = dict(inputs=("input_ids", "position_ids"), labels=("labels", "source_id"))
    return CollectiveLoader(mixture, mesh, timeout=TIMEOUT, **keys)


def datasets(loader) -> list:
    """The leader's StreamingDatasets (one per source of a mixture)."""
    stream = loader.source
    streams = [s.stream for s in stream.sources.values()] if hasattr(stream, "sources") else [stream]
    return [s.dataset for s in streams]


def check(kind: str, job: int, got: list) -> None:
    """Rank 0, over every rank's batches: the job's own data, nothing twice, the plain epoch whole."""
    if kind == "plain":
        ids = Counter(i for steps in got for step in steps for i in step)
        assert sorted(ids) == list(range(SAMPLES)) and set(ids.values()) == {1}, f"epoch not whole: {ids}"
        return
    tokens = Counter(t for steps in got for step in steps for t in step)
    assert tokens, "no tokens delivered"
    assert set(tokens.values()) == {1}, "a token was delivered twice"
    foreign = [t for t in tokens if not job * BASE <= t < (job + 1) * BASE]
    assert not foreign, f"tokens of another job: {foreign[:5]}"


def wait_to_be_killed() -> None:
    dist.barrier()  # every rank got here
    print("stopped", flush=True)
    time.sleep(600)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=("plain", "packing", "mixture"))
    p.add_argument("data")
    p.add_argument("sync")
    p.add_argument("job", type=int)
    p.add_argument("jobs", type=int)
    p.add_argument("rounds", type=int)
    p.add_argument("--prefix-file")
    p.add_argument("--stop-after", type=int)
    p.add_argument("--remote", help="plain: DATA is then the local cache of this remote (a directory)")
    p.add_argument("--clean-stale", action="store_true", help="plain: StreamingSource(clean_stale=True)")
    a = p.parse_args()
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    store = sync_store(a.sync)
    for round_ in range(a.rounds):
        wait_for_every_job(store, round_, a.job, a.jobs)
        loader = build(a.kind, a.data, mesh, a.remote, a.clean_stale)
        if a.prefix_file and loader.is_leader:
            with open(f"{a.prefix_file}.{dist.get_rank()}", "w") as f:
                f.write(" ".join(str(d._shm_prefix_int) for d in datasets(loader)))
        if a.stop_after == 0:
            wait_to_be_killed()
        mine = []
        for step, batch in enumerate(loader, 1):
            if a.kind == "plain":
                mine.append(batch["sample_id"].tolist())
            else:
                labels = batch["labels"]
                mine.append(labels[labels >= 0].tolist())
            if step == a.stop_after:
                wait_to_be_killed()
        loader.close()
        got = [None] * dist.get_world_size()
        dist.all_gather_object(got, mine)
        if dist.get_rank() == 0:
            check(a.kind, a.job, got)
            print(f"round {round_} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
