"""The processes of ``bench/titan_ft_cpu.py``: each replica group's command line (TorchTitan's flags,
the ``titan_cpu`` launcher under ``tests/support/forked_ranks.py``), the run's files (tokenizer and
documents), starting a group with its log, waiting on and killing groups, and torchft's lighthouse
in a process of its own.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from titan_ft_logs import ANSI, STEP  # bench/: run as python bench/<name>.py

REPO = Path(__file__).resolve().parents[1]
SUPPORT = REPO / "tests" / "support"
sys.path.insert(0, str(SUPPORT))

from processes import kill_tree  # noqa: E402  (tests/support)

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


def wait_until(condition: Callable[[], bool], groups: list[Group], deadline: float, poll: float = 1.0) -> bool:
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
