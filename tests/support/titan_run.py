"""Test-only: one run of TorchTitan's own ``torchtitan.train`` on this CPU machine, through the
shipped CPU launcher (``-m collective_loader.integrations.titan_cpu``), killed with every rank it
started when it runs past its time.

The ranks are forked by ``forked_ranks.py`` after the launcher's imports (torchrun's workers'
environment, each line prefixed ``[default<rank>]:`` as ``torchrun --tee=3`` does), itself started
from the test process's fork server: of TorchTitan's imports (14 s of CPU a process here) a run
pays the 4 s beyond torch and streaming, once. The seed checkpoint runs under torchrun itself, so
that every session of the suite starts TorchTitan through the launcher the docs show.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import time
from typing import Any

from forked_ranks import run_from_fork_server
from processes import kill_tree

SUPPORT = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(SUPPORT))
LAUNCHER = ("-m", "collective_loader.integrations.titan_cpu")  # TorchTitan on the CPU, as docs/torchtitan.md shows
# training lines only: TorchTitan logs validation as "validate step: N  loss: X"
LOSS = re.compile(r"^\[default(\d+)\]:.*(?<!validate) step:\s*(\d+)\s+loss:\s*(-?[\d.]+)", re.M)
VALIDATION_LOSS = re.compile(r"^\[default(\d+)\]:.*validate step:\s*(\d+)\s+loss:\s*(-?[\d.]+)", re.M)
PREFIX_RACE = re.compile(r"File exists: '/\d{6}_locals'|shared memory prefix=\d+ was not registered by local leader")


def torchrun(
    ranks: int,
    module: str,
    config: str,
    flags: list[str],
    out: str,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    launcher: str = "forked",
) -> float:
    """``-m collective_loader.integrations.titan_cpu --module <module> --config <config> <flags>`` on
    ``ranks`` ranks in ``cwd`` (this process's when None), started by ``launcher`` (``"forked"`` or
    ``"torchrun"``); its log is ``<out>.log``.

    Run again (twice at most) when streaming lost the race for its shared-memory prefix: each rank
    looks for the first free one, then the local leader creates it after a barrier, so a streaming
    job that another process (another test suite on this machine) starts meanwhile can take it or
    make the ranks disagree.
    """
    args = [*LAUNCHER, "--module", module, "--config", config, *flags]
    run_env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([REPO, SUPPORT]), **(env or {})}
    seconds, code, text = STARTERS[launcher](ranks, args, out, timeout, run_env, cwd or os.getcwd())
    for _ in range(2):
        if code == 0 or not PREFIX_RACE.search(text):
            break
        seconds, code, text = STARTERS[launcher](ranks, args, out, timeout, run_env, cwd or os.getcwd())
    assert code == 0, f"exit {code} (-9 or 124: stopped after {timeout}s):\n{text[-6000:]}"
    return seconds


# what TorchTitan's seed checkpoint of llama3_debugmodel depends on: its model config and the
# parameter dtype (the seed holds the model only; the data, the tokenizer and the mesh do not change it)
SEED_FLAGS = ["--training.mixed_precision_param=float32", "--checkpoint.enable"]
_SEEDS: dict[str, str] = {}  # pytest's base temporary directory -> the flag that starts a run from its seed


def llama3_seed(tmp_path_factory: Any) -> str:
    """The flag that starts a run of ``llama3_debugmodel`` (float32) from TorchTitan's seed checkpoint,
    made once per pytest session (under its base temporary directory) and shared by the Trainer
    tests of every module, so that runs on different meshes start from the same weights."""
    base = str(tmp_path_factory.getbasetemp())
    if base not in _SEEDS:
        _SEEDS[base] = seed_checkpoint("titan_trainer_configs", "seed", SEED_FLAGS, os.path.join(base, "titan_seed"))
    return _SEEDS[base]


def seed_checkpoint(module: str, config: str, flags: list[str], out: str, env: dict[str, str] | None = None) -> str:
    """TorchTitan's own seed checkpoint (``--checkpoint.create_seed_checkpoint`` on one rank, weights
    from ``--debug.seed=0``) under ``out``, so that runs on different meshes start from the same
    weights. Returns the flag that starts a run from it."""
    seed_flags = [*flags, f"--dump_folder={out}", "--checkpoint.create_seed_checkpoint", "--debug.seed=0"]
    torchrun(1, module, config, seed_flags, out, timeout=300, env=env, launcher="torchrun")
    return f"--checkpoint.initial_load_path={out}/checkpoint/step-0"


def _clear(out: str) -> None:
    for stale in glob.glob(f"{glob.escape(out)}.*"):
        if not stale.endswith(".log"):
            os.remove(stale)  # what a run that lost the race recorded


def _forked(
    ranks: int, args: list[str], out: str, timeout: float, env: dict[str, str], cwd: str
) -> tuple[float, int, str]:
    """The ranks forked by ``forked_ranks.py``, itself started from this process's fork server
    (torch and streaming imported there already: it imports only TorchTitan)."""
    _clear(out)
    script = [
        os.path.join(SUPPORT, "forked_ranks.py"),
        "--import",
        "collective_loader.integrations.titan_cpu:patch_process",
        "--import",
        "torchtitan.train",
        "--tee",
        str(ranks),
        *args,
    ]
    start = time.perf_counter()
    code, text = run_from_fork_server(script, None, cwd, timeout, env)
    with open(f"{out}.log", "w") as log:
        log.write(text)
    return time.perf_counter() - start, code, f"forked_ranks.py {' '.join(script[1:])}\n{text}"


def _torchrun(
    ranks: int, args: list[str], out: str, timeout: float, env: dict[str, str], cwd: str
) -> tuple[float, int, str]:
    """torchrun itself, in a session of its own."""
    _clear(out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "--tee=3", *args]
    start = time.perf_counter()
    with open(f"{out}.log", "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=cwd, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)  # torchrun and every rank it started
            proc.wait()
    with open(f"{out}.log") as log:
        text = log.read()
    return time.perf_counter() - start, proc.returncode, f"{' '.join(cmd)}\n{text}"


STARTERS = {"forked": _forked, "torchrun": _torchrun}  # what starts the ranks: ``launcher=``


def flag(flags: list[str] | tuple[str, ...], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``flags`` (the last one given), or None."""
    value = None
    for i, word in enumerate(flags):
        if word == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif word.startswith(name + "="):
            value = word.split("=", 1)[1]
    return value


def loss_rank(ranks: int, pp: int, schedule: str | None = None) -> int:
    """The rank whose log has the training loss: the first rank of the pp rank that computes it,
    the last stage's. That is pp rank ``pp - 1`` (rank ``ranks - ranks // pp``: TorchTitan numbers
    the ranks pp outermost), or pp rank 0 (rank 0) under a V schedule, ``schedule`` being
    ``--parallelism.pipeline_parallel_schedule`` (None: llama3_debugmodel's Interleaved1F1B).
    TorchTitan's own metrics rank is rank 0 for ZBVZeroBubble only: for DualPipeV it logs from
    pp rank ``pp - 1``, whose loss is ``-1`` per replica.

    >>> loss_rank(4, 2), loss_rank(4, 2, "ZBVZeroBubble"), loss_rank(4, 2, "DualPipeV"), loss_rank(2, 1)
    (2, 0, 0, 0)
    """
    from collective_loader.integrations.titan import titan_stage_style

    if schedule is not None and titan_stage_style(schedule, pp) == "v":
        return 0
    return ranks - ranks // pp


def losses(out: str, rank: int, pattern: re.Pattern = LOSS) -> dict[int, float]:
    """Step -> loss that ``rank`` logged in ``<out>.log`` (every rank logs its own; the loss is on
    :func:`loss_rank`'s)."""
    with open(f"{out}.log") as log:
        return {int(step): float(loss) for r, step, loss in pattern.findall(log.read()) if int(r) == rank}
