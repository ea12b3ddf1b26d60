"""Rank 0's report: every rank's role and first batch, what moved, the verdict of the invariant
checks (:mod:`collective_loader.testing.invariants`), the packing figures on LLM data, and the
share of steps whose last-stage labels do not belong to the first stage's inputs, ours beside the
naive run's."""

from __future__ import annotations

from typing import Any

from collective_loader.cli.args import DemoArgs
from collective_loader.cli.naive import replication
from collective_loader.plan.mesh import MeshLayout, Stage, group_count
from collective_loader.plan.routing import Routing
from collective_loader.testing import invariants
from collective_loader.testing.data import expected
from collective_loader.text import TextColumn


def _describe(batch: dict[str, Any]) -> str:
    if not batch:
        return "{} (nothing: middle stage)"
    return " ".join(f"{k}={v.tolist()}" if k == "sample_id" else f"{k}{list(v.shape)}" for k, v in batch.items())


def samples_per_replica(records: list[invariants.RankRecord]) -> dict[int, int]:
    """Samples each replica trained on, counted on its lowest first-stage rank: the ranks that
    hold sample ids (a leader may sit on the last stage, which gets labels only)."""
    counted: dict[int, int] = {}
    for rec in sorted(records, key=lambda r: r.rank):
        if rec.stage in (Stage.FIRST, Stage.BOTH) and rec.dp_rank not in counted:
            counted[rec.dp_rank] = sum(len(b["sample_id"]) for b in rec.steps)
    return dict(sorted(counted.items()))


def label_mismatch(stage_of: dict[int, str], dp_of: dict[int, int], ids: dict[int, list]) -> tuple[int, int]:
    """(mismatched, total) (replica, last-stage rank, step) triples: labels from other samples."""
    bad = total = 0
    for rank, stage in stage_of.items():
        if stage != Stage.LAST:
            continue
        first = next(r for r, s in stage_of.items() if s == Stage.FIRST and dp_of[r] == dp_of[rank])
        for got, want in zip(ids[rank], ids[first]):
            total += 1
            bad += got != want
    return bad, total


def dataset_ids(path: str) -> list[int]:
    """The ``id`` of every sample of the MDS dataset at ``path``: the set one epoch must cover.

    Read from the dataset itself, not from what the leaders delivered, which would make a lost
    or foreign sample part of its own yardstick. Plain file reads (no shared memory, no ranks).
    """
    from streaming import LocalDataset

    dataset = LocalDataset(path)
    return [int(dataset[i]["id"]) for i in range(len(dataset))]


def verdicts(
    records: list[invariants.RankRecord], routing: Routing, seq_len: int, dataset: list[int]
) -> list[invariants.Verdict]:
    """Checks (a)-(e) over one epoch, with ``dataset`` (the dataset's own sample ids) as the set
    the replicas must cover exactly once: a leader that skips, repeats or invents a sample fails
    (d)."""
    return invariants.check(records, routing, lambda ids: expected(ids, seq_len), dataset)


def report(
    a: DemoArgs,
    layout: MeshLayout,
    routing: Routing,
    dp_size: int,
    ours: list[Any],
    naive: list[Any],
    naive_failed: str | None = None,
) -> int:
    """Print the report from every rank's record (``ours``) and the naive run's sample ids per
    rank (``naive``, empty on LLM data; ``naive_failed``: why the naive run failed, in one line,
    and then its ids are not there); 0 if every check of our loader passed, else 1: the naive
    run is the comparison, not part of the verdict."""
    records = [o[0] for o in ours]
    steps = len(records[0].steps)
    made = {ids: batch for o in ours if o[5] is not None for ids, batch in o[5][0].items()}
    if a.layout is None:
        # --remote: the ids this demo wrote (sample i has id i); reading the leaders' cache back would
        # hold the epoch to what they downloaded
        dataset = list(range(a.samples)) if a.remote else dataset_ids(a.data)
        what = f"{len(dataset)} samples"
    else:  # the rows of the delivered steps, as their leaders made them
        dataset = [i for o in ours if o[5] is not None for ids in list(o[5][0])[:steps] for i in ids]
        read = (
            f"text tokenized by {a.layout.tokenizer}"
            if isinstance(a.layout, TextColumn)
            else f"tokens as {a.layout.dtype or 'stored'}"
        )
        what = f"documents ({read}) packed into rows of {a.seq_len} + 1 tokens"
    where = f"{a.remote} (cached in {a.data})" if a.remote else a.data
    print(
        f"\ncollective_loader demo: mesh [{layout.describe()}], {what} in {where}, "
        f"per-replica batch {a.batch_size} x seq {a.seq_len}, split={a.split}, delivery={a.delivery}, "
        f"num_workers={a.num_workers}"
    )
    print(f"{dp_size} replicas, {group_count(dp_size, layout.pp_size)} process groups per loader\n")
    width = 4 * len(a.dims) + 8
    print(f"{'rank':>4}  {'coords':<{width}} {'role':<32} first batch received")
    for record, coords, is_leader, *_ in ours:
        where = " ".join(f"{n}={c}" for n, c in zip(a.dims, coords))
        role = ("leader, " if is_leader else "") + {Stage.BOTH: "all stages"}.get(record.stage, f"{record.stage} stage")
        role += f", dp_rank {record.dp_rank}"
        print(f"{record.rank:>4}  {where:<{width}} {role:<32} {_describe(record.steps[0] if record.steps else {})}")
    per_replica = samples_per_replica(records)
    sent = sum(o[3]["bytes_sent"] for o in ours)
    collectives = sum(o[3]["collectives"] for o in ours if layout.place(o[0].rank).is_leader)
    unit = "samples" if a.layout is None else "rows"
    print(
        f"\n{steps} steps; {unit} per replica: {per_replica}; leaders sent {sent / 2**20:.2f} MiB in "
        f"{collectives} collectives ({collectives / max(steps, 1) / dp_size:.1f} per leader per step); "
        f"slowest rank {max(o[4] for o in ours):.2f}s"
    )
    if a.layout is None:
        checks = verdicts(records, routing, a.seq_len, dataset)
    else:
        print_packing(a, ours, steps)
        checks = invariants.check(records, routing, lambda ids: made[tuple(ids)], dataset)
    print("\nverdict:")
    for v in checks:
        print(f"  [{'ok' if v.ok else 'FAIL'}] {v.name}" + (f": {v.detail}" if v.detail else ""))
    stage_of = {rec.rank: (Stage.FIRST if rec.stage == Stage.BOTH else rec.stage) for rec in records}
    dp_of = {rec.rank: rec.dp_rank for rec in records}
    our_ids = {rec.rank: [b["sample_id"].tolist() if b else None for b in rec.steps] for rec in records}
    naive_by_rank = dict(enumerate(naive))
    ours_bad, ours_total = label_mismatch(stage_of, dp_of, our_ids)
    if a.layout is not None:  # no naive run on LLM data: every rank tokenizing for itself is bench/packing.py
        ok = all(v.ok for v in checks) and ours_bad == 0
        print(f"\nsteps whose last-stage labels do not belong to the first stage's inputs: {ours_bad} of {ours_total}")
        print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
        return 0 if ok else 1
    print("\nsteps whose last-stage labels do not belong to the first stage's inputs:")
    if layout.pp_size == 1:
        print("  (one pipeline stage: every rank holds inputs and labels; use a mesh with pp > 1)")
    naive_run = f"  naive, every rank builds StreamingDataset(replication={replication(layout)}): "
    if naive_failed is not None:
        print(f"{naive_run}not compared, the naive run failed (not part of the verdict): {naive_failed}")
    else:
        naive_bad, naive_total = label_mismatch(stage_of, dp_of, naive_by_rank)
        print(
            f"{naive_run}{100 * naive_bad / max(naive_total, 1):5.1f}% ({naive_bad} of {naive_total} last-stage "
            f"rank-steps; {len(naive[0])} steps per epoch)"
        )
    print(
        f"  collective_loader:                                  "
        f"{100 * ours_bad / max(ours_total, 1):5.1f}% ({ours_bad} of {ours_total} last-stage rank-steps; "
        f"{steps} steps per epoch)"
    )
    ok = all(v.ok for v in checks) and ours_bad == 0
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


def print_packing(a: DemoArgs, ours: list[Any], steps: int) -> None:
    """Each leader's packing figures (over the rows it made, the last of which, on all but the
    leader that ran out first, are not delivered: every replica stops at the same step)."""
    print(f"\npacking (each leader, rows of {a.seq_len} + 1 tokens, at_end={a.at_end}):")
    total: dict[str, int] = {}
    for o in sorted((o for o in ours if o[5] is not None), key=lambda o: o[0].dp_rank):
        made, stats = o[5]
        for k, v in stats.items():
            total[k] = total.get(k, 0) + v
        print(f"  replica {o[0].dp_rank}: {_figures(stats)}; {len(made)} batches made, {steps} delivered")
    print(f"  all: {_figures(total)}")


def _figures(s: dict[str, int]) -> str:
    slots = s["tokens"] + s["padding"]
    return (
        f"{s['documents']} documents, {s['rows']} rows, {s['tokens']} tokens, {s['carried']} carried over into a "
        f"next row, padding {100 * s['padding'] / max(slots, 1):.1f}% of the token slots"
        + (f", {s['dropped']} tokens dropped at the end" if s["dropped"] else "")
    )
