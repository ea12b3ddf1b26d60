"""What ``bench/loading.py``'s three modes share: the MDS dataset of text and its tokenization-like
collate, one rank's epoch of either variant (:func:`rank_main`: *collective_loader*, the leaders
load; *every rank loads*, ``StreamingDataset`` with ``replication = 4`` on every rank) with its CPU
seconds and peak RSS, and the check that the replicas saw every sample once (:func:`check_coverage`).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from harness import cpu_seconds, keep, peak_rss_bytes, rss_bytes  # bench/harness.py: run as python bench/<name>.py
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader

from collective_loader import CollectiveLoader
from collective_loader.streaming import StreamingSource
from collective_loader.streaming.cleanup import release
from collective_loader.testing import launch
from collective_loader.testing.s3_endpoint import APP_ID_VARIABLE

MESH = (("dp", "pp", "tp"), (2, 2, 2))
REPLICATION = 4  # pp x tp: the ranks of one replica, adjacent in this mesh order
VOCAB = 32000
VOCAB_ENTRIES = 200_000
WORDS = [f"w{i:x}{'abcdefgh'[i % 8] * (i % 7)}" for i in range(5000)]
VARIANTS = ("collective_loader", "every_rank_loads")


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


def in_world(entry: Callable[[Any], int], arg: Any) -> int:
    """``entry(arg)`` on the 8 ranks of a world of its own; their exit code."""
    return launch.run(entry, arg, 8, timeout=1200)
