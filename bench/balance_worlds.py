"""The worlds of ``bench/balance.py`` (parts 2 and 3 of its docstring): a real dp = 2 x cp = 2 world
on MDS datasets of two mixes, balancing off and on, from the leaders' ``stats()`` (:func:`world`);
and a dp = 2 world on the long-tail mix whose "model" sleeps per ``sum(L**2)``, steps per second
off and on, alternating over rounds (:func:`end_to_end`). A mix is ``(description, seq_len,
draw)``, as ``balance.mixes()`` gives it.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np
from harness import keep, runs_of, worlds_in_rounds  # bench/harness.py: run as python bench/<name>.py

from collective_loader.testing import launch

WORLD_ROWS = 2  # rows per replica and step in the dp = 2 x cp = 2 world

# --- a real world of dp = 2 x cp = 2 --------------------------------------------------------------

WORLD_MIXES = {"tiny": 2048, "long tail": 64}  # mix -> documents per sample-batch (a batch's worth or more)


def world_rank_main(args: tuple[str, int, int, str, str]) -> int:
    """On every rank of a dp = 2 x cp = 2 world: one epoch, off (``PerDocument``, rows as packed)
    or on (``Balance()``, ``BalancedDocuments``); the leaders keep their ``stats()``."""
    from torch.distributed.device_mesh import init_device_mesh

    from collective_loader import BalancedDocuments, CollectiveLoader, PerDocument
    from collective_loader.streaming import StreamingSource
    from collective_loader.text import Balance, Packing, TokenColumn

    path, seq_len, documents, variant, out = args
    on = variant == "on"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    source = StreamingSource(
        mesh,
        local=path,
        batch_size=WORLD_ROWS,
        shuffle=True,
        shuffle_seed=5,
        layout=TokenColumn(dtype="uint16"),
        packing=Packing(seq_len, "drop", ("cu_seqlens",), Balance() if on else None),
        documents_per_batch=documents,
    )
    split = (BalancedDocuments if on else PerDocument)(cu_seqlens="cu_seqlens", pad_values={"labels": -100})
    keys = {"input_ids": 1, "labels": 1}
    loader = CollectiveLoader(
        source, mesh, inputs=("input_ids",), labels=("labels",), every_stage=("cu_seqlens",), seq_dims=keys, split=split
    )
    steps = sum(1 for _ in loader)
    loader.close()
    keep(out, {"variant": variant, "leader": loader.place.is_leader, "steps": steps, "stats": loader.stats()})
    return 0


def world(tokens: int, mixes: dict[str, tuple[str, int, Any]]) -> list[dict]:
    """Per mix, off and on: the leaders' figures (mean over the two leaders)."""
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for mix, documents in WORLD_MIXES.items():
            path, out = os.path.join(tmp, mix), os.path.join(tmp, f"{mix}.records")
            _, seq_len, draw = mixes[mix]
            mix_dataset(path, draw, tokens)
            for variant in ("off", "on"):
                code = launch.run(world_rank_main, (path, seq_len, documents, variant, out), 4, timeout=900)
                if code:
                    raise SystemExit(f"{mix} {variant}: the dp = 2 x cp = 2 world failed with exit code {code}")
            for ranks in runs_of(out):
                leaders = [r["stats"] for r in ranks if r["leader"]]
                record = {"mix": mix, "variant": ranks[0]["variant"], "steps": ranks[0]["steps"]}
                for key in ("cost_max_over_mean_packed", "cost_max_over_mean", "cp_cost_max_over_mean", "cp_padding"):
                    if key in leaders[0]:
                        record[key] = statistics.fmean(s[key] for s in leaders)
                records.append(record)
    return records


# --- end to end -----------------------------------------------------------------------------------

SECONDS_PER_COST = 1e-10  # the "model": a 32k-token document alone sleeps 107 ms


def mix_dataset(path: str, draw: Any, tokens: int) -> None:
    """An MDS dataset of at least ``tokens`` tokens in documents of lengths ``draw(rng)`` (one per sample)."""
    from collective_loader.testing.data import write_token_documents

    rng = np.random.default_rng(11)
    docs, total = [], 0
    while total < tokens:
        n = draw(rng)
        docs.append(rng.integers(1, 60000, size=n).astype(np.int64))
        total += n
    write_token_documents(path, docs, "bytes", "uint16", shard_bytes=1 << 22)


def rank_main(args: tuple[str, str, str]) -> int:
    """On every rank of a dp = 2 world: one epoch, balancing off or on; keeps seconds per step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from collective_loader import CollectiveLoader
    from collective_loader.streaming import StreamingSource
    from collective_loader.text import Balance, Packing, TokenColumn

    path, variant, out = args
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    packing = Packing(32768, "drop", ("cu_seqlens",), Balance() if variant == "on" else None)
    source = StreamingSource(
        mesh,
        local=path,
        batch_size=2,
        shuffle=True,
        shuffle_seed=5,
        layout=TokenColumn(dtype="uint16"),
        packing=packing,
        documents_per_batch=64,
    )
    loader = CollectiveLoader(source, mesh, inputs=("input_ids",), labels=("labels",), every_stage=("cu_seqlens",))
    grad = torch.zeros(1 << 18)
    seconds, costs = [], []
    start = time.perf_counter()
    for batch in loader:
        lengths = batch["cu_seqlens"].diff(dim=1).double()
        cost = float((lengths**2).sum())
        time.sleep(cost * SECONDS_PER_COST)  # forward and backward, in proportion to attention
        dist.all_reduce(grad)  # every replica waits for the slowest
        costs.append(cost)
        now = time.perf_counter()
        seconds.append(now - start)
        start = now
    loader.close()
    keep(out, {"variant": variant, "seconds": seconds[1:], "costs": costs})
    return 0


def end_to_end(rounds: int, tokens: int, draw: Any) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path, out = os.path.join(tmp, "long_tail"), os.path.join(tmp, "records")
        mix_dataset(path, draw, tokens)
        code = worlds_in_rounds(
            ("off", "on"), rounds, lambda v, r: launch.run(rank_main, (path, v, out), 2, timeout=900)
        )
        if code:
            raise SystemExit(code)
        runs = runs_of(out)
    result: dict = {"off": {"steps_per_second": []}, "on": {"steps_per_second": []}}
    for ranks in runs:
        mine, variant = ranks[0], ranks[0]["variant"]
        result[variant]["steps_per_second"].append(len(mine["seconds"]) / sum(mine["seconds"]))
        result[variant]["steps"] = len(mine["seconds"]) + 1
        # the model's time alone: each step waits for the costlier replica
        slowest = [max(costs) for costs in zip(*(r["costs"] for r in ranks))][1:]
        result[variant]["model_seconds"] = sum(slowest) * SECONDS_PER_COST
        result[variant]["seconds"] = sum(mine["seconds"])
    return result
