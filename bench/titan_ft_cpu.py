"""TorchTitan 0.3's fault-tolerant Trainer on this CPU machine: how far it gets (issue 50, item 6).

    python bench/titan_ft_cpu.py             # bench/results/titan_ft_cpu.md (3-4 minutes here; each run stops at --timeout)
    python bench/titan_ft_cpu.py --one-only  # the one-group run alone
    python bench/titan_ft_cpu.py --keep      # and keep the run folder (every group's log)

TorchTitan's own ``FaultTolerantTrainer`` (``torchtitan/experiments/torchft/``, config
``llama3_torchft_debugmodel`` of ``--module torchft.llama3``, ``--fault_tolerance.enable``) with its
stock dataloader (``HuggingFaceTextDataLoader``, ``c4_test`` read from a local JSON-lines folder),
run through this package's CPU launcher (``-m collective_loader.integrations.titan_cpu``: the
device, FSDP's reduction and the config's CPU changes, nothing of torchft), each replica group a
2-rank job (dp_shard=2) whose ranks ``tests/support/forked_ranks.py`` forks after the launcher's
imports (torchrun's environment: torchft's ``Manager`` uses ``MASTER_ADDR``/``MASTER_PORT`` for the
group's store), a torchft lighthouse on 127.0.0.1 in a process of its own (1 s join, 2 s
heartbeat timeouts, as the tests' ``ft_job.py``).

The flags that differ from the config: a BPE tokenizer and JSON-lines documents made here
(``tests/support/titan_text.py``: the config wants TorchTitan's repository assets,
``./tests/assets/tokenizer``, not in the wheel), ``--fault_tolerance.process_group gloo`` (it says
``nccl``), ``--fault_tolerance.semi_sync_method None`` (it says ``diloco``: the per-step quorum path,
where a killed group drops out of a step and a restarted one heals), a small run
(``seq_len`` 64, ``local_batch_size`` 2), no profiler, ``--checkpoint.enable`` (without it the FT
checkpoint manager registers no state with torchft's manager, and a healing group has nothing to
receive).

Runs, each with a timeout and killed with every process it started (``processes.kill_tree``):

1. *one group*: ``replica_id`` 0, ``group_size`` 1, ``--training.steps`` ``--steps``;
2. (only when 1 trained) *two groups*, for each of ``--models``: ``replica_id`` 0 and 1,
   ``group_size`` 2, started together with a step count they do not reach. Group 1 is SIGKILLed
   once it has logged ``--kill-after`` steps; if a group exits by itself first and the other
   runs on, that one is the group restarted. The restarted group is started while the other
   runs; the run ends once it has loaded a peer's state (torchft's "Loaded state dict.") and
   then logged ``--after-restart`` steps and a commit, once it or the other exits, or at the
   timeout. The variants: ``stock`` (TorchTitan's config, the per-step quorum),
   ``unfused`` (the same model with ``fuse_qkv=False``: a config module written into the run's
   folder, TorchTitan unchanged), ``diloco`` (TorchTitan's config with its own
   ``semi_sync_method``, DiLoCo: a synchronous quorum at each sync).

For each group the report gives: whether the Trainer was built (its "Trainer is initialized"
line), the steps it logged, torchft's commits, quorum and healing lines, its exit, the rank that
failed first with its exception and its frames in torchtitan, torchft and collective code, and
for a rank that aborted, the C++ exception and the threads that were in a collective (from
Python's fault handler). Nothing in TorchTitan or
torchft is changed; the lighthouse's quorums come from its log.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import tempfile
import time
from pathlib import Path

import harness  # bench/harness.py: run as python bench/<name>.py
from titan_ft_groups import MODELS, REPO, UNFUSED, Job, Lighthouse, group_command, make_files, wait_until
from titan_ft_logs import describe

RESULTS = REPO / "bench" / "results" / "titan_ft_cpu.md"


def run_one(root: Path, steps: int, timeout: float) -> tuple[list[str], bool]:
    job = Job(root / "one", "")
    job.root.mkdir()
    server = Lighthouse(job.root / "lighthouse.log")
    job.address = server.address
    for name in ("my_tokenizer", "my_text"):
        (job.root / name).symlink_to(root / name)
    group = job.start("group0", 0, 1, steps)
    try:
        wait_until(lambda: group.proc.poll() is not None, [group], time.perf_counter() + timeout)
    finally:
        job.stop_all()
        quorums = server.quorums()
        server.close()
    trained = len(group.steps()) >= steps and group.proc.returncode == 0
    body = [
        f"### One group: replica_id 0, group_size 1, 2 ranks (dp_shard 2), {steps} steps (timeout {timeout:.0f} s)",
        "",
        "```",
        " ".join(["python", "tests/support/forked_ranks.py", *group_command(0, 1, steps)[2:]]),
        "```",
        "",
        *describe(group),
        "Quorums the lighthouse formed: " + "; ".join(quorums) + ".",
        "",
        f"Result: {'trained every step' if trained else 'did not train every step'}.",
        "",
    ]
    return body, trained


def run_two(root: Path, model: str, kill_after: int, after_restart: int, timeout: float) -> tuple[list[str], bool]:
    """Two groups started together. Group 1 is SIGKILLed once it has logged ``kill_after`` steps;
    if a group exits by itself first and the other runs on, that one is the group killed. The
    killed group is restarted while the other runs; the run ends once the restarted group has
    loaded a peer's state and then logged ``after_restart`` steps and a commit, once it or the
    other exits, or at the timeout. Returns the report's lines and whether the restarted group
    trained after healing."""
    job = Job(root / f"two_{model}", "", model)
    job.root.mkdir()
    server = Lighthouse(job.root / "lighthouse.log")
    job.address = server.address
    for name in ("my_tokenizer", "my_text"):
        (job.root / name).symlink_to(root / name)
    if model == "unfused":
        (job.root / "ft_cpu_unfused.py").write_text(UNFUSED)
    steps = 100000  # not reached: the run ends once the restarted group has trained, or at the timeout
    deadline = time.perf_counter() + timeout
    g0 = job.start("group0", 0, 2, steps)
    g1 = job.start("group1", 1, 2, steps)
    notes: list[str] = []
    restarted = None
    healed = False
    try:
        wait_until(
            lambda: len(g1.steps()) >= kill_after or g0.proc.poll() is not None or g1.proc.poll() is not None,
            [g0, g1],
            deadline,
        )
        if g0.proc.poll() is not None or g1.proc.poll() is not None:
            time.sleep(5)  # a group that is going down with the other has gone by then
        for g in (g0, g1):
            if g.proc.poll() is not None:
                g.ended = g.ended or time.perf_counter()
                notes.append(
                    f"{g.name} exited by itself (exit {g.proc.returncode}) after {len(g.steps())} logged steps."
                )
        if g0.proc.poll() is None and g1.proc.poll() is None and len(g1.steps()) >= kill_after:
            g1.stop()
            notes.append(f"group1 SIGKILLed by this script after it logged step {max(g1.steps())}.")
        alive = [g for g in (g0, g1) if g.proc.poll() is None]
        if len(alive) == 1 and time.perf_counter() < deadline:
            survivor = alive[0]
            gone = g1 if survivor is g0 else g0
            at, before = time.perf_counter(), len(survivor.steps())
            notes.append(
                f"{gone.name} restarted while {survivor.name} ran (which had logged {before} steps), to heal from it."
            )
            restarted = job.start(f"{gone.name}_restarted", gone.replica_id, 2, steps)

            def trained_after_heal() -> bool:
                loaded, trained, commits = restarted.after_heal()
                return loaded and trained >= after_restart and commits >= 1

            healed = (
                wait_until(
                    lambda: (
                        trained_after_heal() or restarted.proc.poll() is not None or survivor.proc.poll() is not None
                    ),
                    [survivor, restarted],
                    deadline,
                )
                and trained_after_heal()
                and survivor.proc.poll() is None
            )
            loaded, trained, commits = restarted.after_heal()
            notes.append(
                f"The restarted {gone.name} {'loaded' if loaded else 'did not load'} a peer's state "
                f'(torchft\'s "Loaded state dict." on its rank 0), then logged {trained} steps and {commits} '
                f"commits (should_commit=True); {len(restarted.steps())} steps logged in all, "
                f"{time.perf_counter() - at:.0f} s after its restart. {survivor.name} logged "
                f"{len(survivor.steps()) - before} steps meanwhile and was "
                f"{'running' if survivor.proc.poll() is None else 'gone'} at the end."
            )
        elif not alive:
            notes.append("No group left to heal from: nothing restarted.")
        else:
            notes.append("Both groups still running at the timeout: nothing killed.")
    finally:
        job.stop_all()
        quorums = server.quorums()
        server.close()
    module, config, semi_sync = MODELS[model]
    body = [
        f"### Two groups, `--module {module} --config {config} --fault_tolerance.semi_sync_method {semi_sync}`: "
        f"replica_id 0 and 1, group_size 2, 2 ranks each (dp_shard 2), timeout {timeout:.0f} s",
        "",
        "Each group: the flags above with these three, `--fault_tolerance.replica_id N "
        "--fault_tolerance.group_size 2` and `--training.steps 100000` (the run is ended by this script).",
        "",
        *[f"- {n}" for n in notes],
        "",
        "Quorums the lighthouse formed, in order (each member's step):",
        "",
        *[f"- {q}" for q in quorums],
        "",
    ]
    for group in job.groups:
        body += describe(group)
    return body, healed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="steps of the one-group run")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run (each killed past it)")
    parser.add_argument("--kill-after", type=int, default=8, help="group 1's logged steps before its SIGKILL")
    parser.add_argument(
        "--after-restart", type=int, default=5, help="the restarted group's steps after healing that end the run"
    )
    parser.add_argument(
        "--models",
        default="stock,unfused,diloco",
        help="the two-group runs, in order: stock (TorchTitan's config, per-step quorum), unfused (the same, "
        "fuse_qkv=False), diloco (TorchTitan's config with its own semi_sync_method)",
    )
    parser.add_argument("--one-only", action="store_true", help="the one-group run alone")
    parser.add_argument("--keep", action="store_true", help="keep the run folder (logs) and print its path")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()

    run = harness.Run("titan_ft_cpu.py")
    root = Path(tempfile.mkdtemp(prefix="titan_ft_cpu_"))
    make_files(root)
    body, trained = run_one(root, args.steps, args.timeout)
    if trained and not args.one_only:
        for model in args.models.split(","):
            body += run_two(root, model, args.kill_after, args.after_restart, args.timeout)[0]
    elif not trained:
        body += ["Two groups: not run (one group did not train).", ""]
    meta = run.meta()
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("torch", "torchtitan", "torchft"))
    text = "\n".join(
        [
            "# TorchTitan's fault-tolerant Trainer on the CPU (gloo, this machine)",
            "",
            f"{meta['date']}; {meta['machine']}; {versions}; Python {meta['python']}. "
            f"`{meta['command']}` ran {meta['seconds']:.0f} s; load average (1, 5, 15 min) "
            f"{meta['load_before']} before, {meta['load_after']} after (other processes share the cores).",
            "",
            *body,
        ]
    )
    Path(args.out).write_text(text.rstrip("\n") + "\n")
    print(text)
    if args.keep:
        print(f"logs: {root}")
    else:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
