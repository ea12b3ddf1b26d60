"""One-shot check of CollectiveLoader on one GPU (or, with ``--cpu``, the same flow on CPUs).

    bash bench/gpu_check.sh            # bench/results/gpu_check_<date>.{json,md} (run time: bench/README.md)
    bash bench/gpu_check.sh --cpu      # the same flow with device "cpu" (a CPU-only machine)
    bash bench/gpu_check.sh --out DIR  # write the report to DIR instead

The package is tested with gloo on CPUs only; this is the first run of its CUDA paths, so it is
built to be run unattended, once, and to say plainly what passed. Exit code 0 only if every
check passed. The checks:

* ``delivery_pp2_tp2`` and ``delivery_dp2_cp2``: 4 ranks sharing the one device, default
  (host) transport, meshes ``pp=2,tp=2`` and ``dp=2,cp=2`` (sequence keys split over cp). Every
  rank compares every tensor of every step, bit for bit, with the batch it computes itself from
  the step and its mesh coordinates (inputs to the first pipeline stage, labels to the last),
  and checks it lies on ``loader.device``. Each batch is also summed by a kernel on the current
  stream as soon as the loop gets it; the sums are compared after the run, so a batch handed
  over before its copy to the GPU is done shows up there, without a sync in the loop.
* ``no_host_sync`` (CUDA only): those loops run under ``torch.cuda.set_sync_debug_mode("error")``,
  so a host sync anywhere while they run (``next()``, the transfer thread) raises.
* ``exposed_wait``: on the ``pp=2,tp=2`` mesh, the time inside ``next()`` per step with no
  compute (the transfer cannot overlap anything: synchronous delivery) and with a loop of
  matmuls between steps (the transfer should hide behind it). Passes when the median wait with
  compute is at most ``HIDDEN`` of the synchronous one and the batches' kernel sums match; not
  applicable (figures only) on a machine with fewer than 2 cores per rank, where the transfer
  threads have no core to run on while the compute runs.
* ``device_transport_1rank``: ``transport="device"`` with world size 1 (NCCL on CUDA, with the
  default group ``cpu:gloo,cuda:nccl``; gloo with ``--cpu``): bit-exact batches over an epoch.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from gpu_check_ranks import (  # tests/integrations/test_gpu_check_on_cpu.py uses these from here too
    CPU,
    CUDA,
    HIDDEN,
    WARMUP,
    WORLD_TIMEOUT,
    Case,
    Job,
    Settings,
    Where,
    compare,
    expected,
    rank_main,
    run_alone,
    sample_batch,
    target_device,
)
from harness import RESULTS, Run, kept, slowest  # bench/harness.py: run as python bench/<name>.py

from collective_loader.testing import launch

__all__ = ["CPU", "Where", "compare", "expected", "main", "overlap_possible", "verdict"]  # what the tests use


@dataclasses.dataclass(frozen=True)
class Verdict:
    name: str
    status: str  # "passed", "failed" or "not applicable"
    detail: str


# --- the parent: worlds, verdicts, report ---------------------------------------------------


@dataclasses.dataclass
class Result:
    """What every rank recorded for one case, and the exit code of the world that ran it."""

    case: Case
    settings: Settings
    code: int
    records: dict[int, dict[str, Any]]

    @property
    def size(self) -> int:
        return self.case.size

    def errors(self) -> list[str]:
        """Ranks that ended without a record or with an exception (a host sync under the
        sync-debug window is one): every check of the case fails on them, as none was verified."""
        out = []
        for rank in range(self.size):
            record = self.records.get(rank)
            if record is None:
                out.append(f"rank {rank}: no record (world exit code {self.code})")
            elif "error" in record:
                out.append(f"rank {rank}: {record['error'].strip().splitlines()[-1]}")
        return out

    def problems(self) -> list[str]:
        """The errors, and every rank's differences from the expected batches."""
        found = [f"rank {rank}: {p}" for rank, r in sorted(self.records.items()) for p in r.get("problems", [])]
        return self.errors() + found


def run_world(job: Job) -> list[Result]:
    """Run the job's cases in one world (they share its size); a result per case."""
    start = time.monotonic()
    size = job.cases[0].size
    code = launch.run(rank_main, job, size, WORLD_TIMEOUT) if size > 1 else run_alone(job)
    print(f"{', '.join(c.name for c in job.cases)}: exit code {code} in {time.monotonic() - start:.0f}s", flush=True)
    return [Result(case, job.settings, code, read_records(job.records, case)) for case in job.cases]


def read_records(records: str, case: Case) -> dict[int, dict[str, Any]]:
    """Each rank's record of ``case`` (ranks that kept none are absent)."""
    return {rank: mine[0] for rank, mine in kept(os.path.join(records, case.name)).items()}


def verdict(name: str, problems: list[str], passed: str) -> Verdict:
    """Passed with ``passed`` as detail when nothing went wrong; else failed, naming the first problems."""
    if not problems:
        return Verdict(name, "passed", passed)
    shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
    return Verdict(name, "failed", shown)


def delivery_verdict(result: Result) -> Verdict:
    s = result.settings
    mesh = ",".join(f"{d}={n}" for d, n in zip(result.case.dims, result.case.shape))
    return verdict(
        result.case.name,
        result.problems(),
        f"{mesh}, transport={result.case.transport}: {result.size} rank{'s' * (result.size > 1)} x {s.steps} steps, "
        f"every tensor bit-exact on {target_device(s)}, kernel sums on arrival match",
    )


def sync_verdict(results: list[Result]) -> Verdict:
    if results[0].settings.device != "cuda":
        return Verdict("no_host_sync", "not applicable", "cpu run: set_sync_debug_mode watches CUDA syncs only")
    problems = [f"{r.case.name}: {p}" for r in results for p in r.errors()]
    return verdict("no_host_sync", problems, f"no host sync while {', '.join(r.case.name for r in results)} iterated")


def quantiles(per_rank: list[list[float]]) -> tuple[float, float]:
    """Median and p90 in ms over steps (warm-up left out) of the slowest rank's time each step."""
    steps = slowest(per_rank)[WARMUP:]
    return statistics.median(steps) * 1e3, statistics.quantiles(steps, n=10)[-1] * 1e3


def figures(result: Result) -> dict[str, tuple[float, float]]:
    timings = [r["timing"] for r in result.records.values()]
    return {key: quantiles([t[key] for t in timings]) for key in ("sync", "wait", "compute")}


def overlap_possible(ranks: int) -> bool:
    """Whether the transfer can hide behind compute here: each rank needs a core for its loop
    (on a GPU: the one waiting in the sync) and one for its transfer thread."""
    return (os.cpu_count() or 1) >= 2 * ranks


def wait_verdict(result: Result) -> Verdict:
    if result.problems():
        return Verdict("exposed_wait", "failed", f"{result.case.name} failed: its figures are not judged")
    problems = [f"rank {rank}: {p}" for rank, rec in result.records.items() for p in rec["timing"]["problems"]]
    fig = figures(result)
    sync_ms, wait_ms = fig["sync"][0], fig["wait"][0]
    measured = f"median wait with compute {wait_ms:.2f} ms, synchronous {sync_ms:.2f} ms"
    if not problems and not overlap_possible(result.size):
        return Verdict(
            "exposed_wait",
            "not applicable",
            f"{measured}; {os.cpu_count()} cores for {result.size} ranks: a transfer thread has no core of its own "
            "while the compute runs, so no overlap is expected (batch sums matched)",
        )
    if wait_ms > HIDDEN * sync_ms:
        problems.append(f"median wait with compute {wait_ms:.2f} ms > {HIDDEN:.0%} of synchronous {sync_ms:.2f} ms")
    return verdict("exposed_wait", problems, measured)


def device_name(s: Settings) -> str:
    if s.device == "cuda":
        return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"cpu {platform.processor() or platform.machine()}, {os.cpu_count()} cores (torch {torch.__version__})"


def report(s: Settings, verdicts: list[Verdict], timed: Result) -> list[str]:
    """The report's body, under the title and header ``harness.Run.write`` adds."""
    lines = [
        f"device: {device_name(s)}",
        "",
        "| check | verdict | detail |",
        "|---|---|---|",
        *(f"| {v.name} | {v.status} | {v.detail.replace('|', '/')} |" for v in verdicts),
        "",
    ]
    if all(r.get("timing") for r in timed.records.values()) and len(timed.records) == timed.size:
        payload = sum(t.nbytes for t in sample_batch(0, 0, 1, s).values()) / 2**20
        reps = max(r["timing"]["reps"] for r in timed.records.values())
        lines += [
            (
                f"Exposed wait on {timed.case.name} ({timed.size} ranks, transport={timed.case.transport}, {s.steps} "
                f"steps per epoch, first {WARMUP} left out, slowest rank per step; batch {payload:.2f} MiB per step; "
                f"compute: {reps} matmuls of {s.matmul}x{s.matmul} float32 per step, then a device sync):"
            ),
            "",
            "| per step | median ms | p90 ms |",
            "|---|---|---|",
        ]
        labels = {
            "sync": "next(), no compute (synchronous delivery)",
            "wait": "next(), with compute",
            "compute": "compute",
        }
        lines += [f"| {labels[k]} | {med:.2f} | {p90:.2f} |" for k, (med, p90) in figures(timed).items()]
        lines.append("")
    lines += [f"- {v.name}: {v.status}" for v in verdicts]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on CPUs (device 'cpu'), on a machine without a GPU")
    parser.add_argument("--out", default=RESULTS, help="directory of the report (default: bench/results)")
    args = parser.parse_args(argv)
    run = Run("gpu_check.sh", argv)
    s = CPU if args.cpu else CUDA
    if s.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here; run with --cpu for the CPU flow", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as records:
        pp_tp, dp_cp = run_world(
            Job(
                (
                    Case("delivery_pp2_tp2", ("pp", "tp"), (2, 2), timed=True),
                    Case("delivery_dp2_cp2", ("dp", "cp"), (2, 2)),
                ),
                s,
                records,
            )
        )
        (alone,) = run_world(Job((Case("device_transport_1rank", ("dp",), (1,), transport="device"),), s, records))
    verdicts = [
        delivery_verdict(pp_tp),
        delivery_verdict(dp_cp),
        sync_verdict([pp_tp, dp_cp, alone]),
        wait_verdict(pp_tp),
        delivery_verdict(alone),
    ]
    today = datetime.date.today().isoformat()
    results = {
        "meta": run.meta(device=device_name(s), settings=dataclasses.asdict(s)),
        "verdicts": [dataclasses.asdict(v) for v in verdicts],
        "records": {r.case.name: r.records for r in (pp_tp, dp_cp, alone)},
    }
    run.write(
        f"gpu_check_{today}", f"CollectiveLoader device check, {today}", results, report(s, verdicts, pp_tp), args.out
    )
    return 0 if all(v.status != "failed" for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
