"""Every TorchTitan command line shown in README.md and docs/*.md trains, run as shown on this CPU machine.

A TorchTitan command line is a line of a ```bash block (backslash continuations joined) that runs
``-m torchtitan.train`` or ``-m collective_loader.integrations.titan_cpu`` under ``torchrun
--nproc-per-node N``. Each runs here as docs/torchtitan.md's "On a CPU" section says to run it:
``torchrun --standalone --nproc-per-node N -m collective_loader.integrations.titan_cpu <its flags>``,
every flag as shown, in a fresh directory holding the local files the flags name:

* ``--hf_assets_path P``: a byte-level BPE of 1024 tokens trained on the documents (``titan_text``);
* ``--dataloader.dataset_path P``: the documents as JSON lines (``P/train.jsonl``, ``{"text": ...}``),
  or, with ``--dataloader.text``, as an MDS dataset with a ``text`` column;
* ``--dataloader.mixture P`` (with ``--dataloader.text``): ``P``, the ```toml block of the same page
  whose first line is ``# <P's name>``, and an MDS dataset with a ``text`` column at each source's
  ``local`` (a relative path), each of other documents;
* ``--module M`` other than ``collective_loader.integrations.titan_configs``: ``M.py``, the ```python block of
  the same page whose second line starts with ``# M.py``.

It trains when it exits 0 with a finite loss logged at every step up to its ``--training.steps``
(which the command must give, to end) on the rank that computes it (the first rank of the last
stage: of pp rank 0 under a V schedule, ``titan_run.loss_rank``), the last below the first. A
command that cannot run here (another launcher, an absolute path, no ``--training.steps``) fails,
naming its place. A command shown twice (under both launchers) runs once. The commands on
``collective_loader.integrations.titan_configs`` run by default (20-30 s each on 2 cores), the
others, and those with a V schedule (which test_titan_trainer's default ZBVZeroBubble run covers),
are ``slow``. The selected runs go two at a time from the module's first test on; each has a
timeout and is killed with every rank it started. The ranks start as ``titan_run`` starts them
(forked with torchrun's environment; the seed checkpoint of the Trainer tests runs under torchrun).
"""

from __future__ import annotations

import math
import os
import re
import shlex
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import titan_run
import titan_text
from processes import runs_in_background

from collective_loader.integrations.titan import titan_stage_style

REPO = Path(__file__).resolve().parents[2]
LAUNCHERS = ("torchtitan.train", "collective_loader.integrations.titan_cpu")
STOCK_MODULE = "collective_loader.integrations.titan_configs"
SCHEDULE = "--parallelism.pipeline_parallel_schedule"
RUN_TIMEOUT = 480.0  # seconds for one run: 4 ranks start in ~50 s on 2 loaded cores, then a few s per step
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # TorchTitan colours its metrics line unless told not to


@dataclass(frozen=True)
class Command:
    """A TorchTitan command line shown at ``where`` (``file:line``): ``ranks`` processes, its flags."""

    where: str
    ranks: int
    flags: tuple[str, ...]

    def flag(self, name: str) -> str | None:
        """The value of ``--name VALUE`` or ``--name=VALUE``, or None."""
        for i, word in enumerate(self.flags):
            if word == name and i + 1 < len(self.flags):
                return self.flags[i + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
        return None

    @property
    def module(self) -> str:
        return self.flag("--module") or ""

    @property
    def pp(self) -> int:
        return int(self.flag("--parallelism.pipeline_parallel_degree") or 1)

    @property
    def v_shaped(self) -> bool:
        """Whether its pipeline schedule places the stages in a V (the loss on pp rank 0)."""
        schedule = self.flag(SCHEDULE)
        return schedule is not None and titan_stage_style(schedule, self.pp) == "v"

    @property
    def loss_rank(self) -> int:
        """The rank that logs the training loss (the first of the last stage's; 0 under a V schedule)."""
        return titan_run.loss_rank(self.ranks, self.pp, self.flag(SCHEDULE))

    def other_flags(self) -> list[str]:
        """The flags but ``--module`` and ``--config`` (which ``titan_run.torchrun`` takes apart)."""
        out, skip = [], False
        for word in self.flags:
            if skip:
                skip = False
            elif word in ("--module", "--config"):
                skip = True
            elif not word.startswith(("--module=", "--config=")):
                out.append(word)
        return out


def bash_lines(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every command in the ```bash blocks of ``path``, continuations joined."""
    out: list[tuple[int, str]] = []
    in_bash, pending, start = False, "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            in_bash = not in_bash and stripped[3:].strip().lower() in ("bash", "sh", "shell", "console")
            continue
        if not in_bash:
            continue
        start = start if pending else number
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        out.append((start, pending))
        pending = ""
    return out


def parse(where: str, line: str) -> Command | None:
    """The TorchTitan command a bash line shows, or None. Raises ValueError for one that cannot run here."""
    words = shlex.split(line, comments=True)
    at = [i for i in range(len(words) - 1) if words[i] == "-m" and words[i + 1] in LAUNCHERS]
    if not at:
        return None
    launcher, flags = words[: at[0]], tuple(words[at[0] + 2 :])
    nproc = [launcher[i + 1] for i, w in enumerate(launcher[:-1]) if w == "--nproc-per-node"]
    other = [w for w in launcher[1:] if w not in ("--standalone", "--nproc-per-node")]
    if launcher[:1] != ["torchrun"] or len(nproc) != 1 or other != nproc or not nproc[0].isdigit():
        raise ValueError(f"{where}: runs here as 'torchrun [--standalone] --nproc-per-node N -m ...' only: {line!r}")
    if any("$" in w for w in flags):
        raise ValueError(f"{where}: a variable cannot be run as shown: {line!r}")
    command = Command(where, int(nproc[0]), flags)
    for name in ("--hf_assets_path", "--dataloader.dataset_path", "--dataloader.mixture", "--dump_folder"):
        value = command.flag(name)
        if value is not None and os.path.isabs(value):
            raise ValueError(f"{where}: {name} {value}: give a relative path, which the test can fill with files")
    if command.flag("--training.steps") is None:
        raise ValueError(f"{where}: give --training.steps N, so that the run ends and the test knows its last step")
    return command


def commands(root: Path = REPO) -> list[Command | str]:
    """Every distinct TorchTitan command line shown (the same flags under either launcher are one,
    named by its first place), or the reason one cannot run here."""
    found: list[Command | str] = []
    seen: set[tuple[int, tuple[str, ...]]] = set()
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for number, line in bash_lines(path):
            where = f"{path.relative_to(root)}:{number}"
            try:
                command = parse(where, line)
            except ValueError as e:
                found.append(str(e))
                continue
            if command is not None and (command.ranks, command.flags) not in seen:
                seen.add((command.ranks, command.flags))
                found.append(command)
    return found


def config_module(page: str, module: str, root: Path = REPO) -> str:
    """The ```python block of ``page`` that is ``module``'s file (its second line: ``# <module>.py``)."""
    blocks = re.findall(r"```python\n(.*?)```", (root / page).read_text(), re.S)
    for block in blocks:
        lines = block.splitlines()
        if len(lines) > 1 and lines[1].startswith(f"# {module}.py"):
            return block
    raise AssertionError(f"{page}: --module {module}, and no ```python block of the page starts with '# {module}.py'")


def mixture_file(page: str, name: str, root: Path = REPO) -> str:
    """The ```toml block of ``page`` that is the mixture file ``name`` (its first line: ``# <name>``)."""
    for block in re.findall(r"```toml\n(.*?)```", (root / page).read_text(), re.S):
        if block.startswith(f"# {name}\n"):
            return block
    raise AssertionError(
        f"{page}: --dataloader.mixture {name}, and no ```toml block of the page starts with '# {name}'"
    )


def write_mds_text(out: Path, texts: list[str]) -> None:
    from streaming import MDSWriter

    with MDSWriter(out=str(out), columns={"text": "str"}) as writer:
        for text in texts:
            writer.write({"text": text})


def write_inputs(command: Command, cwd: Path) -> None:
    """The local files the command names, under ``cwd``."""
    texts = titan_text.documents(400, seed=3)
    assets = command.flag("--hf_assets_path")
    if assets is not None:
        titan_text.write_tokenizer(str(cwd / assets), texts)
    data = command.flag("--dataloader.dataset_path")
    if data is not None and "--dataloader.text" in command.flags:
        write_mds_text(cwd / data, texts)
    elif data is not None:
        titan_text.write_jsonl(str(cwd / data / "train.jsonl"), [{"text": t} for t in texts])
    mixture = command.flag("--dataloader.mixture")
    if mixture is not None:
        from collective_loader.streaming.mixture_file import read_mixture

        assert "--dataloader.text" in command.flags, f"{command.where}: a mixture of text sources only"
        (cwd / mixture).write_text(mixture_file(command.where.split(":")[0], Path(mixture).name))
        sources, _ = read_mixture(cwd / mixture)
        for seed, (name, table) in enumerate(sorted(sources.items()), 4):
            assert not os.path.isabs(table["local"]), f"{command.where}: source {name}: give a relative local path"
            write_mds_text(cwd / table["local"], titan_text.documents(200, seed=seed))
    if command.module != STOCK_MODULE:
        page = command.where.split(":")[0]
        (cwd / f"{command.module}.py").write_text(config_module(page, command.module))


def losses(log: str, rank: int) -> dict[int, float]:
    """Step -> training loss that ``rank`` logged (colours stripped)."""
    text = ANSI.sub("", Path(log).read_text())
    return {int(step): float(loss) for r, step, loss in titan_run.LOSS.findall(text) if int(r) == rank}


def _params() -> list:
    params = []
    for command in commands():
        if isinstance(command, str):
            params.append(pytest.param(command, id=command.split(": ", 1)[0]))
            continue
        marks = [] if command.module == STOCK_MODULE and not command.v_shaped else [pytest.mark.slow]
        params.append(pytest.param(command, id=command.where, marks=marks))
    return params


def run_shown(command: Command, cwd: Path) -> str:
    """Run ``command`` in ``cwd`` with the local files its flags name; the path of its log."""
    write_inputs(command, cwd)
    out = str(cwd / "run")
    config = command.flag("--config") or ""
    titan_run.torchrun(command.ranks, command.module, config, command.other_flags(), out, RUN_TIMEOUT, cwd=str(cwd))
    return f"{out}.log"


@pytest.fixture(scope="module")
def shown_runs(request, tmp_path_factory):
    """The selected commands' runs, two at a time from the module's first test on (each leaves a
    core idle while its parent imports TorchTitan); each test awaits its own."""
    runs = {
        f"test_shown_titan_command_trains[{c.where}]": partial(run_shown, c, tmp_path_factory.mktemp("shown"))
        for c in commands()
        if isinstance(c, Command)
    }
    with runs_in_background(request, runs) as started:
        yield started


@pytest.mark.timeout(2 * RUN_TIMEOUT + 120)
@pytest.mark.parametrize("command", _params())
def test_shown_titan_command_trains(command: Command | str, shown_runs, request) -> None:
    if isinstance(command, str):
        pytest.fail(command)
    log = shown_runs[request.node.name].result()
    steps = int(command.flag("--training.steps") or 0)
    logged = losses(log, command.loss_rank)
    assert sorted(logged) == list(range(1, steps + 1)), f"{command.where}: steps logged {sorted(logged)}"
    assert all(math.isfinite(v) for v in logged.values()), logged
    assert logged[steps] < logged[1], f"{command.where}: the loss did not fall: {logged}"


def test_every_shown_command_is_found_and_one_of_each_kind_runs_by_default() -> None:
    """The docs show TorchTitan commands, the stock config module's among them (the default run's)."""
    shown = [c for c in commands() if isinstance(c, Command)]
    assert any(c.module == STOCK_MODULE for c in shown), shown
    assert {c.where.split(":")[0] for c in shown} >= {"docs/torchtitan.md", "docs/torchtitan-loaders.md"}


def test_commands_that_cannot_run_here_are_refused(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "```bash\n"
        "torchrun --nproc-per-node 2 -m torchtitan.train --module collective_loader.integrations.titan_configs \\\n"
        "    --config llama3_debugmodel --training.steps 3   # a comment\n"
        "torchrun --nnodes 2 --nproc-per-node 2 -m torchtitan.train --module m --config c --training.steps 3\n"
        "torchrun --nproc-per-node 2 -m torchtitan.train --module m --config c\n"
        "torchrun --nproc-per-node 2 -m torchtitan.train --hf_assets_path /abs --training.steps 3\n"
        "python -m pytest tests\n"
        "```\n"
    )
    found = commands(tmp_path)
    ok = [c for c in found if isinstance(c, Command)]
    assert [(c.where, c.ranks, c.module, c.flag("--config"), c.flag("--training.steps")) for c in ok] == [
        ("README.md:2", 2, STOCK_MODULE, "llama3_debugmodel", "3")
    ]
    refused = [c for c in found if isinstance(c, str)]
    assert [r.split(": ", 1)[0] for r in refused] == ["README.md:4", "README.md:5", "README.md:6"], refused
    assert "--training.steps" in refused[1] and "relative path" in refused[2]
