"""What the ranks of one ``bench/elastic.py`` run logged, counted the same way for both loaders.

- **The committed steps** are the surviving lineage: per step, the last quorum (``qid``) in which
  some group committed it (as ``tests/support/ft_job.py``'s ``check``). A step's trained samples
  are those of every rank that took part in that attempt (``participating_rank()`` not
  ``None``: torchft zeroes the gradient of a rank outside the step), one copy per replica
  (``group``, ``dp_rank``: tp peers train the same samples, checked).
- **Repeated**: samples trained in committed steps beyond their first time.
- **Lost**: samples of the pass that the job has moved past without training them in a
  committed step. Ours: the positions of the global order before the final cursor. torchft's
  sampler: every shard (``num_replica_groups x dp`` of them) is read one batch a step, its
  groups in lock step (a healing group takes a live peer's position); the positions before the
  furthest any rank fetched, in every shard, a shard whose group is down included: the pass ends
  when the live shards end, so what is behind that frontier is not trained in this pass.
- **Steps to heal**: from a group's restart (its standby released) to its first committed step
  it trained in, in the job's committed steps (1: it trained in the first step the job committed
  after the restart) and in seconds, of which its set-up (``init_process_group``, the
  ``Manager``, the loader); and in its own steps, from its first quorum.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from collective_loader.plan.quorum import GlobalOrder

SEED = 5  # both loaders' order (elastic_group.SEED)


def lineage(records: list[dict]) -> dict[int, int]:
    """Committed step -> the quorum of its surviving attempt."""
    out: dict[int, int] = {}
    for r in records:
        if r["event"] == "commit" and r["committed"]:
            out[r["step"]] = max(out.get(r["step"], -1), r["qid"])
    steps = sorted(out)
    if steps != list(range(len(steps))):
        raise AssertionError(f"committed steps with gaps: {steps}")
    return out


def last_serves(records: list[dict]) -> dict[tuple[int, int], list[dict]]:
    """(step, qid) -> the last serve of each process in that attempt."""
    last: dict[tuple[int, int, int, int], dict] = {}
    for r in records:
        if r["event"] == "serve":
            last[(r["step"], r["qid"], r["pid"], r["rank"])] = r
    out: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for (step, qid, _, _), r in last.items():
        out[(step, qid)].append(r)
    return out


def trained_steps(records: list[dict]) -> tuple[list[list[int]], list[int], bool]:
    """Per committed step, the samples trained (replicas in a fixed order), the participants, and
    whether every replica's tp peers trained the same samples."""
    steps = lineage(records)
    serves = last_serves(records)
    out, sizes, peers_agree = [], [], True
    for s in range(len(steps)):
        replicas: dict[tuple, list[list[int]]] = defaultdict(list)
        attempt = serves[(s, steps[s])]
        for r in attempt:
            if r["participant"] is not None:
                replicas[(r["participant"], r["dp_rank"], r["group"])].append(r["ids"])
        peers_agree &= all(all(c == copies[0] for c in copies) for copies in replicas.values())
        out.append([i for key in sorted(replicas) for i in replicas[key][0]])
        sizes.append(max(r["participants"] for r in attempt))
    return out, sizes, peers_agree


def shard_positions(samples: int, groups: int, dp: int) -> dict[int, int]:
    """torchft's ``DistributedSampler``: sample -> its position in its shard (pass 0), for every
    replica group and data-parallel rank; ``samples`` divides by ``groups x dp`` (no padding)."""
    from torchft.data import DistributedSampler

    out: dict[int, int] = {}
    for slot in range(groups):
        for rank in range(dp):
            shard = DistributedSampler(
                range(samples),
                replica_rank=slot,
                num_replica_groups=groups,
                group_rank=rank,
                num_replicas=dp,
                seed=SEED,
            )
            out.update((int(i), p) for p, i in enumerate(shard))
    return out


def reached(records: list[dict], loader: str, samples: int, groups: int, dp: int, committed: int) -> set[int]:
    """The samples of the pass the job has moved past (see the module's docstring)."""
    if loader == "ours":
        return set(GlobalOrder(samples, seed=SEED).indices(0, committed))
    position = shard_positions(samples, groups, dp)
    fetched = [position[i] for r in records if r["event"] == "serve" for i in r["ids"]]
    frontier = max(fetched, default=-1) + 1
    return {i for i, p in position.items() if p < frontier}


def heal(records: list[dict], group: str, released: float, steps: dict[int, int]) -> dict[str, Any]:
    """Steps and seconds from the release of ``group``'s standby to its first committed step it
    trained in."""
    commit_time: dict[int, float] = {}
    for r in records:
        if r["event"] == "commit" and r["committed"] and steps.get(r["step"]) == r["qid"]:
            commit_time[r["step"]] = min(commit_time.get(r["step"], r["t"]), r["t"])
    starts = [r for r in records if r["event"] == "start" and r["group"] == group and r["t"] >= released]
    new = {r["pid"] for r in starts}
    serves = [r for r in records if r["event"] == "serve" and r["pid"] in new]
    trained = sorted(
        r["step"] for r in serves if r["participant"] is not None and steps.get(r["step"]) == r["qid"] and r["ids"]
    )
    if not trained:
        return {"group": group, "healed": False}
    first = trained[0]
    before = sum(1 for t in commit_time.values() if t < released)
    return {
        "group": group,
        "healed": True,
        "first_trained_step": first,
        "job_steps": first - before + 1,
        "own_steps": first - min(r["step"] for r in serves) + 1,
        "seconds": round(commit_time[first] - released, 2),
        "setup_s": round(min(r["t"] for r in starts) - released, 2),  # to its Manager and loader built
    }


def resumed(records: list[dict], killed: str, at: float) -> float | None:
    """Seconds from the kill of ``killed`` to the next step another group committed."""
    times = [r["t"] for r in records if r["event"] == "commit" and r["committed"] and r["group"] != killed]
    later = [t for t in times if t > at]
    return round(min(later) - at, 2) if later else None


def figures(records: list[dict], loader: str, samples: int, groups: int, dp: int, events: dict) -> dict[str, Any]:
    """Everything the report shows for one run."""
    steps = lineage(records)
    per_step, sizes, peers_agree = trained_steps(records)
    trained = [i for ids in per_step for i in ids]
    distinct = set(trained)
    batch = [len(ids) for ids in per_step]
    passed = reached(records, loader, samples, groups, dp, len(trained))
    if len(trained) > samples:
        raise AssertionError(f"{len(trained)} samples trained: more than one pass of {samples}")
    attempts = len({(r["step"], r["qid"]) for r in records if r["event"] == "serve"})
    out: dict[str, Any] = {
        "steps": len(steps),
        "samples": len(trained),
        "lost": len(passed - distinct),
        "repeated": len(trained) - len(distinct),
        "beyond": len(distinct - passed),
        "batch_min": min(batch),
        "batch_max": max(batch),
        "participants_min": min(sizes),
        "participants_max": max(sizes),
        "failed_attempts": attempts - len(steps),
        "step_s_median": statistics.median(r["seconds"] for r in records if r["event"] == "commit" and r["committed"]),
        "labels_ok": all(r["labels_ok"] for r in records if r["event"] == "serve"),
        "tp_peers_agree": peers_agree,
        "heals": [heal(records, g, t, steps) for g, t in events.get("released", {}).items()],
    }
    for group, t in events.get("killed", {}).items():
        out["survivors_resumed_s"] = resumed(records, group, t)
    return out
