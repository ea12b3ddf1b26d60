"""Live elasticity under torchft (issue 50, item 7): replica groups killed mid-step and
restarted, leaving for good and joining a running job, with ``QuorumData`` and with torchft's
own ``DistributedSampler``, side by side; and the per-step cost of the quorum-aware split.

    python bench/elastic.py           # bench/results/elastic.{json,md}
    python bench/elastic.py --quick   # one kill and restart per mode, one cost round: elastic_quick.* (git-ignored)
    python bench/elastic.py --report  # elastic.md again from elastic.json (the wording only; no run)

(Run times: bench/README.md.)

Every run is a real torchft job on this machine, as ``tests/integrations/test_torchft_elastic.py``
runs it (``tests/support/ft_job.py``'s ``FtJob``: a lighthouse on 127.0.0.1 with a 2 s
heartbeat timeout, replica groups as 2-rank ``torchrun`` jobs of ``bench/elastic_group.py``,
SIGKILL of a group's whole process tree at a seeded step and phase, a restarted or new group's
processes started ahead and released when it is to join). Each scenario runs once with each
loader, the order alternating. Groups train ``nn.Linear`` on 24,000 samples, global batch 12:
``QuorumData`` in micro-batches of 3; torchft's sampler sharded over the most groups the
scenario has (2, or 3 when one joins) x the group's data-parallel ranks, ``12 / shards``
samples per shard and step. Both use torchft's ``Manager`` with the same settings (generous
timeouts: the cores are shared; ``init_sync`` only in the synchronous mode, as ``QuorumData``
needs). What is counted, and how: ``bench/elastic_analysis.py``; the torchft loop:
``bench/elastic_group.py``; the per-step cost: ``bench/elastic_cost.py``. For ``QuorumData`` the
tests' full check (``ft_job.check``: every committed step trained exactly its window of the
global order, final weights those of one plain process on the same global batches) runs too.

Kill points, steps to heal and the lost counts of torchft's sampler depend on timing (how many
steps the job commits while a group is down or restarting): the scenarios are seeded, their
figures move with the machine's load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import elastic_analysis
import elastic_cost
import elastic_report
import harness  # bench/harness.py: run as python bench/<name>.py

SUPPORT = Path(harness.REPO) / "tests" / "support"
sys.path.insert(0, str(SUPPORT))  # the tests' torchft job: FtJob, check, and their helpers

import ft_job  # noqa: E402

from collective_loader.testing import launch  # noqa: E402

LOADERS = ("ours", "torchft")
PHASES = ("before", "during", "after")
GLOBAL_BATCH, MICRO_BATCH, SAMPLES = 12, 3, 24000  # 24,000 divides by every shard count (2, 4, 6)
STARTUP = 300.0  # seconds for groups to start and commit on 2 loaded cores
WAIT = 180.0  # seconds for anything else the job must do
PACE = 0.05  # seconds each group sleeps per step (kills land mid-run)
TITLE = "Live elasticity under torchft: QuorumData against torchft's DistributedSampler"
TIMEOUT = 60  # seconds for torchft's process group and operations (ELASTIC_TIMEOUT)


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    kind: str  # "restart", "leave" or "join"
    mode: str  # torchft's quorum: "sync" or "async"
    dim: str  # each group's mesh: "tp" (2 ranks, one replica) or "dp_shard" (2 replicas)
    seed: int
    phase: str = ""  # restart: where in the step the group is killed

    @property
    def groups(self) -> int:
        return 3 if self.kind == "join" else 2  # every group the scenario ever starts


def scenarios(quick: bool) -> list[Scenario]:
    if quick:
        return [
            Scenario(f"restart-{p}-{m}", "restart", m, "tp", 3, p) for m, p in (("sync", "during"), ("async", "after"))
        ]
    out = [Scenario(f"restart-{p}-{m}", "restart", m, "tp", 3, p) for m in ("sync", "async") for p in PHASES]
    out += [Scenario(f"{k}-{m}", k, m, "dp_shard", 4) for k in ("leave", "join") for m in ("sync", "async")]
    return out


def kill_point(seed: int, phase: str = "") -> str:
    """``k:phase``: the group stops in the k-th step it takes part in (k from 2 to 4, seeded)."""
    rng = random.Random(seed)
    step = rng.randint(2, 4)
    return f"{step}:{phase or rng.choice(PHASES)}"


def restart(job: ft_job.FtJob, s: Scenario) -> dict[str, Any]:
    """g0 and g1 start; g1 stops at a seeded point, is SIGKILLed, and restarts once g0 has
    committed a step without it; it heals from g0 and trains again."""
    stop_at = kill_point(s.seed, s.phase)
    job.start("g0", start_with=2)
    job.start("g1", stop_at, start_with=2)
    job.start("g1", standby=True)
    job.wait_for(job.stopped("g1"), STARTUP, f"g1 to reach {stop_at}")
    job.kill("g1")
    killed = time.time()
    before = job.committed_steps("g0")
    job.wait_for(job.committed("g0", before + 1), WAIT, "the survivors to commit without g1")
    trained = job.committed_steps("g1", trained=True)
    released = time.time()
    job.release("g1")
    job.wait_for(job.committed("g1", trained + 1, trained=True), STARTUP, "the restarted g1 to train")
    job.finish(extra_steps=3, timeout=WAIT)
    return {"kill_at": stop_at, "killed": {"g1": killed}, "released": {"g1": released}}


def leave(job: ft_job.FtJob, s: Scenario) -> dict[str, Any]:
    """g0 and g1 start; g1 stops at a seeded point and is SIGKILLed for good; g0 goes on alone (10 steps)."""
    stop_at = kill_point(s.seed)
    job.start("g0", start_with=2)
    job.start("g1", stop_at, start_with=2)
    job.wait_for(job.stopped("g1"), STARTUP, f"g1 to reach {stop_at}")
    job.kill("g1")
    killed = time.time()
    before = job.committed_steps("g0")
    job.wait_for(job.committed("g0", before + 10), WAIT, "g0 to go on alone")
    job.finish(extra_steps=2, timeout=WAIT)
    return {"kill_at": stop_at, "killed": {"g1": killed}}


def join(job: ft_job.FtJob, s: Scenario) -> dict[str, Any]:
    """g0 and g1 start; once they have committed 3 steps, g2, new, joins the running job."""
    job.start("g0", start_with=2)
    job.start("g1", start_with=2)
    job.start("g2", standby=True)
    job.wait_for(job.committed("g0", 3), STARTUP, "g0 and g1 to commit 3 steps")
    released = time.time()
    job.release("g2")
    job.wait_for(job.committed("g2", 1, trained=True), STARTUP, "the new g2 to train")
    job.finish(extra_steps=3, timeout=WAIT)
    return {"released": {"g2": released}}


KINDS: dict[str, Callable[[ft_job.FtJob, Scenario], dict[str, Any]]] = {
    "restart": restart,
    "leave": leave,
    "join": join,
}


def run_one(s: Scenario, loader: str, root: Path) -> dict[str, Any]:
    """One scenario with one loader: the job, then its figures (or why it failed)."""
    os.environ.update(ELASTIC_LOADER=loader, ELASTIC_GROUPS=str(s.groups), ELASTIC_TIMEOUT=str(TIMEOUT))
    job = ft_job.FtJob(root, s.mode, s.dim, global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH, samples=SAMPLES)
    started = time.monotonic()
    out: dict[str, Any] = {"scenario": s.name, "loader": loader, **dataclasses.asdict(s)}
    try:
        events = KINDS[s.kind](job, s)
    except AssertionError as e:  # a job that did not get through: reported as such, never dropped
        out.update(failed=str(e).splitlines()[0], detail=str(e)[-3000:], seconds=round(time.monotonic() - started, 1))
        return out
    finally:
        job.close()
    out["seconds"] = round(time.monotonic() - started, 1)
    records = job.records()
    out.update(events=events, **elastic_analysis.figures(records, loader, SAMPLES, s.groups, dp(s), events))
    if loader == "ours":
        try:
            ft_job.check(job)
            out["check"] = "passed"
        except AssertionError as e:
            out["check"] = f"FAILED: {str(e)[:300]}"
    return out


def dp(s: Scenario) -> int:
    return 1 if s.dim == "tp" else 2


def cost(quick: bool, tmp: str) -> dict[str, Any]:
    """The per-step cost world (``bench/elastic_cost.py``), every rank's records."""
    payloads = (
        elastic_cost.Payload("x of 4 floats (the scenarios' samples)", 4, GLOBAL_BATCH, MICRO_BATCH),
        elastic_cost.Payload("x of 16,384 floats", 16384, 32, 8),
    )
    s = elastic_cost.Settings(
        payloads, steps=20 if quick else 60, rounds=1 if quick else 3, out=os.path.join(tmp, "cost")
    )
    code = launch.run(elastic_cost.world_main, s, 2, timeout=900)
    if code:
        raise SystemExit(f"the per-step cost world failed with exit code {code}")
    return {"settings": dataclasses.asdict(s) | {"out": None}, "ranks": harness.kept(s.out)}


def report_again(run: harness.Run) -> int:
    """``elastic.md`` from ``elastic.json`` as its run left it (its header, every figure), the
    markdown's wording as this script has it now, and a line saying so."""
    with open(os.path.join(harness.RESULTS, "elastic.json")) as f:
        results = json.load(f)
    note = (
        f"(This page was written again from `bench/results/elastic.json` by `python bench/elastic.py --report` on "
        f"{time.strftime('%Y-%m-%d %H:%M')}: the figures and the header are those of the run it names.)"
    )
    run.write("elastic", TITLE, results, [note, "", *elastic_report.markdown(results)])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one kill and restart per mode, one cost round")
    parser.add_argument("--only", help="run the scenarios whose name contains this (no cost world)")
    parser.add_argument("--keep", metavar="DIR", help="keep each job's logs and output under DIR")
    parser.add_argument("--report", action="store_true", help="write elastic.md again from elastic.json (no run)")
    args = parser.parse_args(argv)
    run = harness.Run("elastic.py", argv)
    if args.report:
        return report_again(run)
    ft_job.WORKER = Path(__file__).with_name("elastic_group.py")  # FtJob.start runs this group script
    os.environ["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), harness.REPO, os.environ.get("PYTHONPATH", "")])
    os.environ["FT_SLEEP"] = str(PACE)
    chosen = [s for s in scenarios(args.quick) if args.only is None or args.only in s.name]
    runs, loads = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, s in enumerate(chosen):
            for loader in harness.rotated(list(LOADERS), i):  # who goes first alternates
                root = Path(args.keep or tmp) / f"{s.name}-{loader}"
                load = os.getloadavg()[0]
                result = run_one(s, loader, root)
                result["load"] = [round(load, 1), round(os.getloadavg()[0], 1)]
                loads += result["load"]
                print(elastic_report.one_line(result), flush=True)
                runs.append(result)
                if not args.keep:
                    shutil.rmtree(root, ignore_errors=True)
        costs = None if args.only else cost(args.quick, tmp)
    settings = {
        "global_batch": GLOBAL_BATCH, "micro_batch": MICRO_BATCH, "samples": SAMPLES, "pace_s": PACE,
        "torchft_timeout_s": TIMEOUT, "lighthouse": "join 1 s, heartbeat timeout 2 s, tick 50 ms",
    }  # fmt: skip
    results = {"meta": run.meta(settings=settings, loads=loads), "runs": runs, "cost": costs}
    name = "elastic_quick" if args.quick or args.only else "elastic"
    run.write(name, TITLE, results, elastic_report.markdown(results))
    return 1 if any("failed" in r or r.get("check", "passed") != "passed" for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
