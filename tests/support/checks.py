"""Test-side checks over what every rank of a world received: the package's invariants plus
what only a test knows (exact step counts, each replica's share in order, who built a source)."""

from __future__ import annotations

from typing import Any

from ranks import KEYS, sample_batch

from collective_loader.plan.routing import Routing
from collective_loader.plan.split import RowSplit
from collective_loader.testing import invariants


def verify(
    records: list[dict[str, Any]],
    *,
    n_samples: int,
    batch_size: int,
    seq_len: int,
    layout: str = "zigzag",
    epochs: int = 1,
    every_stage: tuple[str, ...] = (),
) -> None:
    dp_size = records[0]["dp_size"]
    routing = Routing(KEYS["inputs"], KEYS["labels"], KEYS["seq_dims"], RowSplit(layout), every_stage=every_stage)
    packed = bool(every_stage)
    for rec in records:
        assert rec["touched_source"] == ([rec["rank"]] if rec["is_leader"] else []), "only leaders build the source"
    steps = n_samples // dp_size // batch_size
    for epoch in range(epochs):
        epoch_records = [
            invariants.RankRecord(r["rank"], r["dp_rank"], r["stage"], r["shard"], r["epochs"][epoch]) for r in records
        ]
        for rec in epoch_records:
            assert len(rec.steps) == steps, f"rank {rec.rank} got {len(rec.steps)} steps in epoch {epoch}, want {steps}"
        verdicts = invariants.check(
            epoch_records, routing, lambda ids: sample_batch(ids, seq_len, packed), range(n_samples)
        )
        failed = [f"{v.name}: {v.detail}" for v in verdicts if not v.ok]
        assert not failed, f"epoch {epoch}:\n" + "\n".join(failed)
        for rec in epoch_records:
            if rec.stage != "middle":
                got = [i for b in rec.steps for i in b["sample_id"].tolist()]
                share = list(range(rec.dp_rank, n_samples, dp_size))[: steps * batch_size]
                assert got == share, f"rank {rec.rank} epoch {epoch}: ids {got}, want replica share {share}"
