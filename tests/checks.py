"""Invariant checks over what every rank of a world received (run in the test process).

Each rank's record comes from :func:`ranks.deliver`. The checks recompute every expected tensor
from the delivered sample ids and the generating formula, so a wrong sample, a wrong shard, a
misaligned label or a duplicated sample all fail.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from collective_loader import sharding
from ranks import KEYS, sample_batch


def verify(
    records: list[dict[str, Any]],
    *,
    n_samples: int,
    batch_size: int,
    seq_len: int,
    layout: str = "zigzag",
    epochs: int = 1,
) -> None:
    """Assert (a)-(e) of the delivery contract for every epoch and step."""
    dp_size = records[0]["dp_size"]
    replicas: dict[int, list[dict]] = defaultdict(list)
    for rec in records:
        replicas[rec["dp_rank"]].append(rec)
    assert sorted(replicas) == list(range(dp_size))
    for rec in records:
        assert rec["touched_source"] == ([rec["rank"]] if rec["is_leader"] else []), "only leaders build the source"
    steps_per_replica = n_samples // dp_size // batch_size
    for epoch in range(epochs):
        seen: dict[int, list[int]] = defaultdict(list)
        for rec in records:
            assert len(rec["epochs"][epoch]) == steps_per_replica, (
                f"rank {rec['rank']} got {len(rec['epochs'][epoch])} steps in epoch {epoch}, want {steps_per_replica}"
            )
        for dp_rank, recs in replicas.items():
            for step in range(steps_per_replica):
                ids = _check_step(recs, epoch, step, seq_len, layout)
                seen[dp_rank].extend(ids)
            share = list(range(dp_rank, n_samples, dp_size))[: steps_per_replica * batch_size]
            assert seen[dp_rank] == share, f"replica {dp_rank} epoch {epoch}: got ids {seen[dp_rank]}, want {share}"
        # (d) disjoint across replicas, and together every sample exactly once
        all_ids = [i for ids in seen.values() for i in ids]
        assert len(all_ids) == len(set(all_ids)), "a sample reached two replicas"
        assert sorted(all_ids) == list(range(n_samples)), "replicas did not cover the data exactly once"


def _check_step(recs: list[dict], epoch: int, step: int, seq_len: int, layout: str) -> list[int]:
    """Check one step of one replica; return its sample ids."""
    where = f"epoch {epoch} step {step} replica {recs[0]['dp_rank']}"
    batches = {rec["rank"]: rec["epochs"][epoch][step] for rec in recs}
    stages = {rec["rank"]: rec["stage"] for rec in recs}
    id_sets = {tuple(b["sample_id"].tolist()) for r, b in batches.items() if stages[r] != "middle"}
    # (c) every first- and last-stage rank holds the same samples at the same step
    assert len(id_sets) == 1, f"{where}: ranks disagree on the samples: {id_sets}"
    ids = list(id_sets.pop())
    full = sample_batch(ids, seq_len)
    want_keys = {
        "first": set(KEYS["inputs"]),
        "last": set(KEYS["labels"]),
        "both": set(KEYS["inputs"]) | set(KEYS["labels"]),
        "middle": set(),
    }
    pieces: dict[str, dict[tuple, torch.Tensor]] = defaultdict(dict)
    for rec in recs:
        batch, stage = batches[rec["rank"]], rec["stage"]
        # (e) middle stages get nothing; other stages exactly their keys
        assert set(batch) == want_keys[stage], f"{where}: rank {rec['rank']} ({stage}) got keys {sorted(batch)}"
        for key, value in batch.items():
            if key in KEYS["seq_dims"]:
                want = sharding.shard(full[key], KEYS["seq_dims"][key], rec["shard"], layout)
                # (a) copies identical across replicate dims; (b) each piece is the right slice
                assert torch.equal(value, want), f"{where}: rank {rec['rank']} has a wrong {key!r} piece"
                pieces[key][tuple(i for _, i in rec["shard"])] = value
            else:
                assert torch.equal(value, full[key]), f"{where}: rank {rec['rank']} has a wrong {key!r}"
    sizes = [size for size, _ in recs[0]["shard"]]
    for key, by_index in pieces.items():
        ordered = [by_index[idx] for idx in sorted(by_index)]
        assert len(ordered) == max(1, _prod(sizes)), f"{where}: {key!r} pieces missing"
        rebuilt = sharding.unshard(ordered, KEYS["seq_dims"][key], sizes, layout)
        assert torch.equal(rebuilt, full[key]), f"{where}: {key!r} pieces do not reassemble"
    return ids


def _prod(xs: list[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out
