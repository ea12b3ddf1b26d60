"""The markdown of ``bench/elastic.py``'s results: the scenarios side by side, the per-step cost,
how each figure is counted, and a section for the fault-tolerance docs, every figure taken from
the results."""

from __future__ import annotations

import statistics
from typing import Any

import harness

ROLES = {0: "leader", 1: "non-leader"}


def heal_cell(r: dict[str, Any]) -> str:
    heals = r.get("heals") or []
    if not heals:
        return "-"
    return "; ".join(
        f"{h['job_steps']} / {h['own_steps']} / {h['seconds']:.1f} s ({h['setup_s']:.1f} s)"
        if h["healed"]
        else "never trained"
        for h in heals
    )


def one_line(r: dict[str, Any]) -> str:
    if "failed" in r:
        return f"{r['scenario']} {r['loader']}: FAILED ({r['failed']}) after {r['seconds']} s"
    return (
        f"{r['scenario']} {r['loader']}: {r['steps']} steps, {r['samples']} samples, lost {r['lost']}, "
        f"repeated {r['repeated']}, batch {r['batch_min']}-{r['batch_max']}, heal {heal_cell(r)}, "
        f"{r['seconds']} s, load {r['load']}" + (f", check {r['check']}" if "check" in r else "")
    )


def scenario_rows(runs: list[dict[str, Any]]) -> list[tuple[object, ...]]:
    rows: list[tuple[object, ...]] = []
    for r in runs:
        what = {"restart": f"killed {r['phase']} the all-reduce, restarted", "leave": "leaves for good"}
        where = r.get("events", {}).get("kill_at", "")
        label = what.get(r["kind"], "a new group joins") + (f" (at {where})" if where else "")
        if "failed" in r:
            rows.append((label, r["mode"], r["loader"], f"failed: {r['failed'][:80]}", *["-"] * 8))
            continue
        rows.append(
            (
                label,
                r["mode"],
                "QuorumData" if r["loader"] == "ours" else "torchft `DistributedSampler`",
                r["steps"],
                r["lost"],
                r["repeated"],
                f"{r['batch_min']} / {r['batch_max']}",
                r["failed_attempts"],
                f"{r['step_s_median'] * 1e3:.0f} ms",
                heal_cell(r),
                "-" if r.get("survivors_resumed_s") is None else f"{r['survivors_resumed_s']:.1f} s",
                r.get("check", "-"),
            )
        )
    return rows


def cost_summary(cost: dict[str, Any]) -> list[dict[str, Any]]:
    """Per payload, loop and role: medians over rounds of the per-step medians, their difference
    and their ratio (the median of the per-round values)."""
    out = []
    ranks = {int(k): v for k, v in cost["ranks"].items()}  # JSON keys are strings
    payloads = ranks[0][0]["payloads"]
    for i, p in enumerate(payloads):
        for loop in ("back_to_back", "compute_20ms"):
            for rank, role in ROLES.items():
                rounds = ranks[rank][0]["payloads"][i]["rounds"]
                quorum = [r[f"{loop}/quorum"] for r in rounds]
                plain = [r[f"{loop}/plain"] for r in rounds]
                out.append(
                    {
                        "payload": f"{p['payload']}: {nbytes(p['step_bytes'])} a step",
                        "micro_batches": p["micro_batches"],
                        "loop": loop,
                        "role": role,
                        "quorum_ms": statistics.median(quorum) * 1e3,
                        "plain_ms": statistics.median(plain) * 1e3,
                        "added_ms": statistics.median(q - b for q, b in zip(quorum, plain)) * 1e3,
                        "ratio": statistics.median(q / b for q, b in zip(quorum, plain)),
                    }
                )
    return out


def totals(runs: list[dict[str, Any]], loader: str) -> dict[str, int]:
    mine = [r for r in runs if r["loader"] == loader and "failed" not in r]
    return {
        "runs": len(mine),
        "lost": sum(r["lost"] for r in mine),
        "repeated": sum(r["repeated"] for r in mine),
        "samples": sum(r["samples"] for r in mine),
        "off_batch": sum(r["batch_min"] != r["batch_max"] for r in mine),
    }


def by_mode(runs: list[dict[str, Any]], mode: str, kind: str) -> list[dict[str, Any]]:
    """torchft's sampler's runs of one quorum mode and scenario kind that got through."""
    return [r for r in runs if (r["loader"], r["mode"], r["kind"]) == ("torchft", mode, kind) and "failed" not in r]


def span(runs: list[dict[str, Any]], key: str) -> str:
    """``min-max`` (or one value) of ``key`` over ``runs``."""
    if not runs:
        return "-"
    low, high = min(r[key] for r in runs), max(r[key] for r in runs)
    text = "{:,.1f}" if isinstance(low, float) else "{:,}"
    return text.format(low) if low == high else f"{text.format(low)}-{text.format(high)}"


def nbytes(n: int) -> str:
    return f"{n} B" if n < harness.KIB else harness.size(n)


def markdown(results: dict[str, Any]) -> list[str]:
    runs, cost = results["runs"], results["cost"]
    s = results["meta"]["settings"]
    loads = results["meta"]["loads"]
    lines = [
        f"1-minute load average at the start and end of each run: {min(loads):.1f} to {max(loads):.1f}.",
        "",
        "Each scenario is a real torchft 0.2 job (gloo, CPU) run once per loader, the order alternating: a "
        "lighthouse on 127.0.0.1 (join 1 s, heartbeat timeout 2 s), replica groups as 2-rank `torchrun` jobs of "
        "`bench/elastic_group.py`, a group's processes SIGKILLed at a seeded step and phase, a restarted or new "
        "group's processes started ahead and released when it is to join. "
        f"{s['samples']:,} samples, global batch {s['global_batch']} (QuorumData in micro-batches of "
        f"{s['micro_batch']}; torchft's sampler: {s['global_batch']} / (groups x dp) per shard and step, "
        "`num_replica_groups` = the most groups the scenario has, its `StatefulDataLoader` state registered with the "
        "manager). Restart scenarios: groups of tp=2; leave and join: dp_shard=2. The kill point `k:phase` is the "
        "k-th step the group takes part in, before, during (after the first parameter's) or after the gradient "
        "all-reduce.",
        "",
        "## Scenarios side by side",
        "",
    ]
    lines += harness.table(
        "scenario | quorum | loader | committed steps | lost | repeated | global batch min / max | failed attempts | "
        "median step | heal: job steps / own steps / seconds (set-up) | survivors resumed | full check",
        scenario_rows(runs),
    )
    lines += [
        "- **lost**: samples of the pass the job moved past without training them in a committed step (QuorumData: "
        "the global order before the final cursor; torchft's sampler: every shard before the furthest position any "
        "rank fetched, a down group's shard included, since the pass ends when the live shards end). **repeated**: "
        "samples trained in committed steps more than once. Counted over the surviving lineage (per step, the last "
        "quorum in which a group committed it), from ranks that took part (torchft zeroes the gradient of a rank "
        "outside the step), one copy per replica.",
        "- **global batch**: samples trained per committed step. **failed attempts**: step attempts that no group "
        "committed in the end (the same step is tried again). **median step**: the median wall time of a committed "
        "step on a rank: the whole loop body (the data, torchft's quorum, forward and backward of a model of 5 "
        "weights, the gradient all-reduce, the commit, this bench's logging), the pace's sleep left out.",
        "- **heal**: from the restart (the release of the group's standby processes: the seconds a process start "
        "takes are left out) to its first committed step it trained in: the job's committed steps (1: it trained in "
        "the first step the job committed after its restart), its own steps from its first quorum (1: it trained "
        "in the step it joined), seconds, and of those its set-up (`init_process_group`, the `Manager`, the loader "
        "built: these 2 cores are shared, so the job commits many steps meanwhile). **survivors resumed**: seconds from the kill to the next step another "
        "group committed (torchft waits for the dead group's heartbeat to expire).",
        "- **full check** (QuorumData only): `tests/support/ft_job.py`'s `check`, as the tests run it: every "
        "committed step trained exactly its window of the global order, tp peers the same samples, labels of their "
        "inputs, the final weights those of one plain process on the same global batches.",
        "",
    ]
    if cost is not None:
        rows = cost_summary(cost)
        settings = cost["settings"]
        lines += [
            "## Per-step cost of the quorum-aware split",
            "",
            "One 2-rank gloo world, mesh tp=2 (rank 0 the leader, rank 1 a tp peer that receives a copy), torchft's "
            "manager stood in for (participant 0 of 2 every step, every step committed: torchft's own quorum and "
            "commit RPCs are the same for any loader and left out). *QuorumData*: per step `start_quorum()`, "
            "`data.step()` iterated to its end, `end_step()`. *plain*: one `CollectiveLoader` epoch over a source "
            "that reads the same samples the same way and yields the same micro-batches, `next()` as many times per "
            "step. Time per step: the wall time inside those calls on each rank, the median over "
            f"{settings['steps']} steps (after 5 of warm-up), then over {settings['rounds']} round(s), the variants "
            "alternating. *added* = QuorumData - plain (ms per step); *ratio* = QuorumData / plain (medians of the "
            "per-round values). Back to back: the data path alone; with 20 ms of host-idle work per step (a sleep) "
            "the plain loader prefetches meanwhile and QuorumData cannot read ahead of the quorum, so its whole "
            "step is exposed.",
            "",
        ]
        lines += harness.table(
            "payload (the group's half of the global batch) | micro-batches per step | loop | rank | QuorumData | plain "
            "| added | ratio",
            [
                (
                    c["payload"],
                    c["micro_batches"],
                    c["loop"].replace("_", " "),
                    c["role"],
                    f"{c['quorum_ms']:.2f} ms",
                    f"{c['plain_ms']:.2f} ms",
                    f"{c['added_ms']:+.2f} ms",
                    f"{c['ratio']:.1f}x",
                )
                for c in rows
            ],
        )
    lines += for_the_docs(results)
    return lines


def for_the_docs(results: dict[str, Any]) -> list[str]:
    """A section for docs/fault-tolerance.md (fault tolerance), its figures from these results."""
    runs, meta = results["runs"], results["meta"]
    ours, theirs = totals(runs, "ours"), totals(runs, "torchft")
    checks = sum(r.get("check") == "passed" for r in runs if r["loader"] == "ours")
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        if r["loader"] == "torchft" and "failed" not in r:
            by_kind.setdefault(r["kind"], []).append(r)
    kinds = {"restart": "killed and restarted", "leave": "a group leaves", "join": "a group joins"}
    heals: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        for h in r.get("heals", []) if "failed" not in r else []:
            if h["healed"]:
                heals.setdefault((r["mode"], r["loader"]), []).append(h)
    names = {"ours": "QuorumData", "torchft": "torchft's sampler"}

    def healed(mode: str, key: str) -> str:
        found = [f"{names[loader]} {span(hs, key)}" for (m, loader), hs in sorted(heals.items()) if m == mode]
        return ", ".join(found) or "not measured"

    lines = [
        "## For the docs",
        "",
        "### Measured: QuorumData against torchft's `DistributedSampler`",
        "",
        f"`python bench/elastic.py` (`bench/results/elastic.md`, {meta['date']}) runs real torchft jobs on one "
        "machine: replica groups SIGKILLed before, during and after the gradient all-reduce and restarted, a group "
        "that leaves for good, a new group that joins a running job, in both quorum modes, once with `QuorumData` "
        "and once with torchft's `DistributedSampler` (sharded over the most groups the job has, its "
        "`StatefulDataLoader` state registered with the manager so that a healing group takes a live peer's "
        "position).",
        "",
        f"- **QuorumData**: {ours['lost']} samples lost and {ours['repeated']} repeated over {ours['runs']} runs "
        f"({ours['samples']:,} samples in committed steps), the global batch the same on every committed step "
        f"({ours['off_batch']} runs where it varied); the tests' full check (every step exactly its window, final "
        f"weights those of one plain process) passed on {checks} of {ours['runs']}.",
        f"- **torchft's sampler**: {theirs['lost']:,} samples lost and {theirs['repeated']} repeated over "
        f"{theirs['runs']} runs; the global batch shrinks while a group of the job is missing ({theirs['off_batch']} of "
        f"{theirs['runs']} runs). By scenario, per run: "
        + "; ".join(
            f"{kinds[kind]}, {span(v, 'lost')} lost and {span(v, 'repeated')} repeated" for kind, v in by_kind.items()
        )
        + ". Its losses are structural: a step that does not commit drops the batches its groups drew, a "
        "group that is down leaves its shard unread, and a group that heals takes a peer's position in its own "
        "shard, skipping what it missed; the repeats: "
        f"{span(by_mode(runs, 'sync', 'restart'), 'repeated')} per restart in the synchronous quorum, "
        f"{span(by_mode(runs, 'async', 'restart'), 'repeated')} in the asynchronous one (a restarted group in the "
        "synchronous quorum trains the batch its fresh loader drew before `start_quorum()` healed it). The losses "
        "grow with the steps a group is away: a restarted or new group's first trained step here came "
        f"{span([h for hs in heals.values() for h in hs], 'job_steps')} committed steps after its release "
        f"({span([h for hs in heals.values() for h in hs], 'setup_s')} s of set-up on 2 shared cores).",
        "- **Healing**, in the group's own steps from its first quorum to its first trained step (1: it trains "
        f"in the step it joins): synchronous quorum {healed('sync', 'own_steps')}; asynchronous "
        f"{healed('async', 'own_steps')}. The quorum mode decides it, not the loader: in the asynchronous mode "
        "torchft hands the healing group its state only in `should_commit()`, so it sits that step out.",
    ]
    if results["cost"] is not None:
        rows = cost_summary(results["cost"])
        tiny = [c for c in rows if c["payload"] == rows[0]["payload"]]
        b2b = {c["role"]: c for c in tiny if c["loop"] == "back_to_back"}
        idle = {c["role"]: c for c in tiny if c["loop"] == "compute_20ms"}
        steps = {
            loader: statistics.median(r["step_s_median"] for r in runs if r["loader"] == loader and "failed" not in r)
            for loader in ("ours", "torchft")
        }
        lines.append(
            "- **Per step**, the quorum-aware split (a `CollectiveLoader` epoch per step, the step's share read "
            "only once the quorum is known) adds "
            f"{b2b['leader']['added_ms']:.1f} ms on the leader and {b2b['non-leader']['added_ms']:.1f} ms on a "
            "non-leader to a plain loader delivering the same bytes back to back "
            f"({b2b['leader']['ratio']:.1f}x and {b2b['non-leader']['ratio']:.1f}x its time), and with 20 ms of work "
            f"per step, where the plain loader's prefetch hides its reads, {idle['leader']['added_ms']:.1f} ms and "
            f"{idle['non-leader']['added_ms']:.1f} ms exposed (2 shared cores, load "
            f"{min(meta['loads']):.0f}-{max(meta['loads']):.0f}). In the scenario runs a whole committed step of the "
            f"tiny model (torchft's quorum and commit included) took {steps['ours'] * 1e3:.0f} ms with QuorumData and "
            f"{steps['torchft'] * 1e3:.0f} ms with torchft's sampler (medians of the runs' medians)."
        )
    return [*lines, ""]
