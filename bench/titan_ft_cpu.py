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
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import harness  # bench/harness.py: run as python bench/<name>.py

REPO = Path(__file__).resolve().parents[1]
SUPPORT = REPO / "tests" / "support"
sys.path.insert(0, str(SUPPORT))

from processes import kill_tree  # noqa: E402  (tests/support)

RESULTS = REPO / "bench" / "results" / "titan_ft_cpu.md"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
PREFIX = re.compile(r"^\[default(\d+)\]:")
STEP = re.compile(r"^\[default(\d+)\]:.*(?<!validate) step:\s*(\d+)\s+loss:\s*(-?[\d.]+|nan|inf)", re.M)
BUILT = "Trainer is initialized"
TORCHFT_LINES = re.compile(
    r"reconfiguring for quorum_id|healing required|peers need recovery|applying pending state dict|"
    r"Loaded state dict|should_commit=False|got exception|Training starts at step|Training completed"
)


# --module, --config and --fault_tolerance.semi_sync_method of each variant: TorchTitan's own FT
# debug config with the per-step quorum; the same with the attention's Q, K and V projections
# unfused (UNFUSED, written into the run's folder); the config's own DiLoCo
MODELS = {
    "stock": ("torchft.llama3", "llama3_torchft_debugmodel", "None"),
    "unfused": ("ft_cpu_unfused", "llama3_torchft_debugmodel_unfused", "None"),
    "diloco": ("torchft.llama3", "llama3_torchft_debugmodel", "diloco"),
}
UNFUSED = '''"""TorchTitan's llama3_torchft_debugmodel with fuse_qkv=False: wq, wk, wv as three Linear layers
in place of one fused wqkv, whose state_dict hook (FusedQKVLinear._split_qkv_on_save) gathers the
sharded weight with a collective."""

import torchtitan.models.llama3 as llama3
from torchtitan.experiments.torchft.llama3.config_registry import llama3_torchft_debugmodel


def llama3_torchft_debugmodel_unfused():
    build = llama3._build_llama3_layers

    def unfused(**kwargs):
        return build(**{**kwargs, "fuse_qkv": False})

    llama3._build_llama3_layers = unfused
    try:
        return llama3_torchft_debugmodel()
    finally:
        llama3._build_llama3_layers = build
'''


def flags(replica_id: int, group_size: int, steps: int, model: str = "stock") -> list[str]:
    """TorchTitan's command line for one replica group (``--module``/``--config`` first)."""
    module, config, semi_sync = MODELS[model]
    return [
        "--module",
        module,
        "--config",
        config,
        "--hf_assets_path",
        "./my_tokenizer",
        "--dataloader.dataset",
        "c4_test",
        "--dataloader.dataset_path",
        "./my_text",
        "--training.steps",
        str(steps),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--profiler.no-enable_profiling",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "100000",
        "--metrics.log_freq",
        "1",
        "--fault_tolerance.enable",
        "--fault_tolerance.process_group",
        "gloo",
        "--fault_tolerance.semi_sync_method",
        semi_sync,
        "--fault_tolerance.replica_id",
        str(replica_id),
        "--fault_tolerance.group_size",
        str(group_size),
    ]


def group_command(replica_id: int, group_size: int, steps: int, model: str = "stock") -> list[str]:
    return [
        sys.executable,
        str(SUPPORT / "forked_ranks.py"),
        "--import",
        "collective_loader.integrations.titan_cpu:patch_process",
        "--import",
        "torchtitan.train",
        "--tee",
        "2",
        "-m",
        "collective_loader.integrations.titan_cpu",
        *flags(replica_id, group_size, steps, model),
    ]


@dataclass
class Group:
    """One start of a replica group: its process (forked_ranks' parent), its log."""

    name: str
    replica_id: int
    log: Path
    proc: subprocess.Popen
    started: float
    ended: float | None = None
    killed: bool = False

    def text(self) -> str:
        return ANSI.sub("", self.log.read_text(errors="replace")) if self.log.exists() else ""

    def steps(self) -> list[int]:
        """The steps the group logged a training loss for (rank 0's lines)."""
        return [int(s) for r, s, _ in STEP.findall(self.text()) if r == "0"]

    def losses(self) -> dict[int, str]:
        return {int(s): loss for r, s, loss in STEP.findall(self.text()) if r == "0"}

    def after_heal(self) -> tuple[bool, int, int]:
        """Whether rank 0 loaded a peer's state (torchft's "Loaded state dict."), and after that
        line its logged steps and its commits (should_commit=True)."""
        text = self.text()
        at = re.search(r"^\[default0\]:.*Loaded state dict\.", text, re.M)
        if not at:
            return False, 0, 0
        rest = text[at.end() :]
        steps = [s for r, s, _ in STEP.findall(rest) if r == "0"]
        commits = re.findall(r"^\[default0\]:.*torchft\.manager - INFO - .* should_commit=True", rest, re.M)
        return True, len(steps), len(commits)

    def stop(self) -> None:
        """SIGKILL every process of the group (the forked ranks and their children)."""
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
            self.killed = True
        self.proc.wait()
        self.ended = self.ended or time.perf_counter()


@dataclass
class Job:
    root: Path
    address: str
    model: str = "stock"
    groups: list[Group] = field(default_factory=list)

    def start(self, name: str, replica_id: int, group_size: int, steps: int) -> Group:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(SUPPORT)]),
            "TORCHFT_LIGHTHOUSE": self.address,
        }
        log = self.root / f"{name}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                group_command(replica_id, group_size, steps, self.model),
                cwd=self.root,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        group = Group(name, replica_id, log, proc, time.perf_counter())
        self.groups.append(group)
        return group

    def stop_all(self) -> None:
        for group in self.groups:
            group.stop()


def exit_traceback(text: str, keep: int = 10) -> list[str]:
    """The rank that failed first (forked_ranks' "rank R exited" line) and, from the last traceback
    it printed (tracebacks of logging's own errors, which do not stop a rank, left out), its
    innermost ``keep`` frames in torchtitan, torchft or collective code and its exception line;
    [] if no rank exited."""
    exited = re.search(r"^forked_ranks: rank (\d+) exited (-?\d+)", text, re.M)
    if not exited:
        return []
    rank = exited.group(1)
    lines = []
    for line in text[: exited.start()].splitlines():
        m = PREFIX.match(line)
        if m and m.group(1) == rank:
            lines.append(line[m.end() :])
    start = None
    for i, body in enumerate(lines):
        if body.startswith("Traceback (most recent call last):") and not (
            i > 0 and lines[i - 1].startswith("--- Logging error ---")
        ):
            start = i
    if start is None:
        return [f"rank {rank} exited {exited.group(2)}"]
    frames, exception = [], ""
    for body in lines[start + 1 :]:
        if fm := TB_FRAME.match(body):
            if any(k in fm.group(1) for k in KEY_FRAME):
                frames.append(f"  {fm.group(1)}:{fm.group(2)} {fm.group(3)}")
        elif re.match(r"[A-Za-z_][\w.]*: ", body):
            exception = body[:300]  # the exception line (other lines: log lines of the rank's other threads)
            break
    return [
        f"rank {rank} exited {exited.group(2)}; its frames in torchtitan, torchft, collectives (outermost first):",
        *frames[-keep:],
        exception,
    ]


FRAME = re.compile(r'^  File "(?:.*/site-packages/|.*/lib/python3[.\d]*/)?([^"]+)", line (\d+) in (\S+)')
TB_FRAME = re.compile(r'^  File "(?:.*/site-packages/|.*/lib/python3[.\d]*/)?([^"]+)", line (\d+), in (\S+)')
COLLECTIVE = ("distributed_c10d", "_functional_collectives", "fsdp/", "torchft/process_group")
KEY_FRAME = ("torchft/", "torchtitan/", *COLLECTIVE, "tensor/_api")


def aborts(text: str, frames: int = 12) -> list[str]:
    """For each rank that aborted: the C++ exception's ``what()`` and, from Python's fault
    handler dump, each thread that was in a collective (torch.distributed, FSDP, torchft's process
    group): its innermost frame, then its torchft/torchtitan/collective frames (innermost first)."""
    out: list[str] = []
    per_rank: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = PREFIX.match(line)
        if m:
            per_rank.setdefault(m.group(1), []).append(line[m.end() :])
    for rank, lines in sorted(per_rank.items()):
        whats = [w.strip()[:300] for w in lines if w.strip().startswith("what():")]
        if not any(w.startswith("Fatal Python error") for w in lines):
            continue
        out.append(f"rank {rank}: {lines[[w.startswith('Fatal Python error') for w in lines].index(True)]}")
        out += [f"  {w}" for w in whats[:1]]
        start = [w.startswith("Fatal Python error") for w in lines].index(True)
        thread: list[str] = []
        threads: list[list[str]] = []
        for body in lines[start + 1 :]:
            if body.startswith(("Thread 0x", "Current thread 0x")):
                thread = [body.split(" (")[0]]
                threads.append(thread)
            elif (fm := FRAME.match(body)) and thread:
                thread.append(f"{fm.group(1)}:{fm.group(2)} {fm.group(3)}")
            elif body.startswith("Extension modules"):
                break
        for t in threads:
            key = [f for f in t[1:] if any(k in f for k in KEY_FRAME)]
            if any(k in f for f in key for k in COLLECTIVE):
                out.append(f"  {t[0]}: " + " <- ".join(dict.fromkeys([t[1], *key[:frames]])))
    return out


def events(text: str, rank: str = "0", keep: int = 30) -> list[str]:
    """torchft's quorum/healing lines and the Trainer's start/end lines of ``rank``, shortened."""
    out = []
    for line in text.splitlines():
        m = PREFIX.match(line)
        if m and m.group(1) == rank and TORCHFT_LINES.search(line):
            body = re.sub(r"^\S+ \S+ \S+ ", "", line[m.end() :].strip())  # drop the logger's date/time
            out.append(body[:220])
    return out[:keep]


def describe(group: Group) -> list[str]:
    text = group.text()
    steps = group.steps()
    code = group.proc.returncode
    exit_text = "SIGKILLed by this script" if group.killed else f"exit {code}"
    seconds = (group.ended or time.perf_counter()) - group.started
    losses = group.losses()
    commits = re.findall(r"^\[default0\]:.*torchft\.manager - INFO - .* should_commit=(True|False)", text, re.M)
    lines = [
        f"**{group.name}** (replica_id {group.replica_id}): Trainer built: {'yes' if BUILT in text else 'no'}; "
        f"steps logged: {len(steps)}"
        + (f" ({min(steps)}-{max(steps)}; loss {losses[min(steps)]} -> {losses[max(steps)]})" if steps else "")
        + f"; torchft's should_commit on rank 0: {commits.count('True')} True, {commits.count('False')} False"
        + f"; {exit_text} after {seconds:.0f} s.",
        "",
    ]
    tb = exit_traceback(text)
    if tb:
        lines += ["The rank that failed first:", "", "```", *tb, "```", ""]
    crash = aborts(text)
    if crash:
        lines += [
            "Aborted ranks (the C++ exception, and the threads in collective, torchft or torchtitan code):",
            "",
            "```",
            *crash,
            "```",
            "",
        ]
    ev = events(text)
    if ev:
        lines += ["Rank 0's torchft and Trainer lines:", "", "```", *ev, "```", ""]
    return lines


def wait_until(condition, groups: list[Group], deadline: float, poll: float = 1.0) -> bool:
    """Poll ``condition()`` until it holds (True), every group in ``groups`` has exited, or the deadline."""
    while time.perf_counter() < deadline:
        for g in groups:
            if g.ended is None and g.proc.poll() is not None:
                g.ended = time.perf_counter()
        if condition():
            return True
        if all(g.ended is not None for g in groups):
            return condition()
        time.sleep(poll)
    return False


def make_files(root: Path) -> None:
    import titan_text

    texts = titan_text.documents(400, seed=3)
    titan_text.write_tokenizer(str(root / "my_tokenizer"), texts)
    titan_text.write_jsonl(str(root / "my_text" / "train.jsonl"), [{"text": t} for t in texts])


LIGHTHOUSE = """
import sys, time
from torchft.coordination import LighthouseServer
server = LighthouseServer(
    bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=50, heartbeat_timeout_ms=2000
)
print(server.address(), flush=True)
time.sleep(3600)
"""


class Lighthouse:
    """torchft's lighthouse in a process of its own (its log, every quorum it forms, in ``log``)."""

    def __init__(self, log: Path) -> None:
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", LIGHTHOUSE],
                stdout=subprocess.PIPE,
                stderr=out,
                text=True,
                start_new_session=True,
            )
        port = self.proc.stdout.readline().strip().rsplit(":", 1)[1]
        self.address = f"http://127.0.0.1:{port}"

    def quorums(self) -> list[str]:
        """Each new quorum's id and members (replica ids without their uuid), in order."""
        out, last = [], None
        for qid, body in re.findall(
            r"Quorum! Quorum \{ quorum_id: (\d+), participants: \[(.*?)\], created", self.log.read_text()
        ):
            members = re.findall(r'replica_id: "([^":]+)[^"]*", .*? step: (\d+)', body)
            if qid != last:
                out.append(f"quorum {qid}: " + ", ".join(f"{r} (step {st})" for r, st in members))
                last = qid
        return out

    def close(self) -> None:
        kill_tree(self.proc.pid)
        self.proc.wait()


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
