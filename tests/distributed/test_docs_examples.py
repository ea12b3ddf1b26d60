"""Every example in README.md and docs/*.md runs.

* Every ```python block is a complete program whose first line says how to run it:
  ``# run: python`` (one process) or ``# run: torchrun N`` (a local world of N gloo ranks, as
  ``torchrun --standalone --nproc-per-node N`` runs it: ``forked_ranks.run_from_fork_server`` gives
  each rank torchrun's environment, forked from the session's fork server, where torch and
  streaming are imported once). It must exit 0. A block without that line fails, naming its file
  and line.
* Every ``python -m collective_loader demo ...`` (or ``torchrun --standalone --nproc-per-node N -m
  collective_loader demo ...``) shown in a ```bash block runs to "all checks passed". A demo
  command this test cannot run as shown (another node, a ``--data`` directory, a variable) fails.
  Runs of more than 8 ranks are ``slow``. Those that ``test_demo.py`` runs with checks of its own
  (``test_demo.RUN_HERE``) are not run twice.

Each runs with a timeout. A demo command runs in a session of its own; on a miss its process
group gets SIGTERM (torchrun then stops its ranks, which it starts in sessions of their own), then
SIGKILL (the whole tree). A block's ranks, and what they started, are killed when one fails or
time runs out.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import test_demo
from forked_ranks import run_from_fork_server
from processes import kill_tree

from collective_loader.cli.args import parse_mesh
from collective_loader.plan.mesh import MeshLayout

REPO = Path(__file__).resolve().parents[2]
RUN_LINE = re.compile(r"#\s*run:\s*(?:(python)|torchrun\s+(\d+))\s*$")
DEMO = ("-m", "collective_loader", "demo")
DEFAULT_MESH = "pp=2,dp=2,tp=2"  # the demo's --mesh default
BLOCK_TIMEOUT = 240.0  # seconds for one python block (4 ranks take 5-20 s here)
DEMO_TIMEOUT = 420.0  # seconds for one demo run (the default, 8 ranks and 256 samples: ~100 s on 2 loaded cores)
TERM_GRACE = 60.0  # seconds torchrun gets to stop its ranks after SIGTERM (it waits 30 s for them)


@dataclass(frozen=True)
class Block:
    """A fenced block of a markdown file: ``line`` is its opening fence's (1-based)."""

    file: str
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Demo:
    """A demo command shown at ``where``: ``argv`` runs it here, on ``ranks`` processes."""

    where: str
    shown: str
    argv: tuple[str, ...]
    ranks: int
    mesh: str


def documents(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def fenced_blocks(path: Path, root: Path = REPO) -> list[Block]:
    """The fenced (```) blocks of a markdown file, in order."""
    blocks, opened, body = [], None, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if opened is None and stripped.startswith("```"):
            opened, body = (number, stripped[3:].strip().lower()), []
        elif opened is not None and stripped == "```":
            blocks.append(Block(str(path.relative_to(root)), opened[0], opened[1], "\n".join(body) + "\n"))
            opened = None
        elif opened is not None:
            body.append(line)
    if opened is not None:
        raise ValueError(f"{path.relative_to(root)}:{opened[0]}: a ``` block that is never closed")
    return blocks


def block_ranks(block: Block) -> int | None:
    """How to run a python block, from its first line: on N ranks (``# run: torchrun N``), or as
    one plain process (``# run: python``: None)."""
    first = block.text.split("\n", 1)[0]
    match = RUN_LINE.fullmatch(first.strip())
    if match is None:
        raise ValueError(
            f"{block.where}: a ```python block must start with '# run: python' or '# run: torchrun N' "
            f"(first line: {first!r}); put text that does not run in a ```text block"
        )
    return None if match[1] else int(match[2])


def logical_lines(block: Block) -> list[tuple[int, str]]:
    """``(line number, text)`` of a bash block's commands, backslash continuations joined."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for offset, line in enumerate(block.text.splitlines(), 1):
        start, text = pending if pending is not None else (block.line + offset, "")
        text += line.rstrip()
        if text.endswith("\\"):
            pending = (start, text[:-1] + " ")
            continue
        pending = None
        out.append((start, text))
    if pending is not None:
        out.append(pending)
    return out


def demo_command(where: str, line: str) -> Demo | None:
    """The demo run a bash line shows, or None when it shows none. Raises ValueError for a demo
    command that cannot run here as shown."""
    words = shlex.split(line, comments=True)
    segments, current = [], []
    for word in words:
        if word in ("&&", ";", "||"):
            segments.append(current)
            current = []
        else:
            current.append(word)
    segments.append(current)
    shown = [s for s in segments if any(tuple(s[i : i + 3]) == DEMO for i in range(len(s)))]
    if not shown:
        return None
    if len(shown) > 1:
        raise ValueError(f"{where}: one demo command per line, please: {line!r}")
    command = shown[0]
    at = next(i for i in range(len(command)) if tuple(command[i : i + 3]) == DEMO)
    program, launcher, args = command[0], command[1:at], command[at + 3 :]
    if any("$" in word for word in command) or "--data" in args:
        raise ValueError(f"{where}: this demo command needs something of yours (a variable, --data DIR): {line!r}")
    mesh = args[args.index("--mesh") + 1] if "--mesh" in args else DEFAULT_MESH
    size = math.prod(parse_mesh(mesh)[1])
    if program == "python" and not launcher:
        return Demo(where, " ".join(command), (sys.executable, *DEMO, *args), size, mesh)
    if program == "torchrun":
        nproc = [
            w.split("=", 1)[1] if "=" in w else launcher[i + 1]
            for i, w in enumerate(launcher)
            if w.startswith("--nproc-per-node")
        ]
        other = [
            w
            for i, w in enumerate(launcher)
            if w != "--standalone"
            and not w.startswith("--nproc-per-node")
            and not (i > 0 and launcher[i - 1] == "--nproc-per-node")
        ]
        if "--standalone" in launcher and len(nproc) == 1 and not other:
            argv = (sys.executable, "-m", "torch.distributed.run", *launcher, *DEMO, *args)
            return Demo(where, " ".join(command), argv, int(nproc[0]), mesh)
    raise ValueError(
        f"{where}: the test runs 'python -m collective_loader demo ...' and 'torchrun --standalone "
        f"--nproc-per-node N -m collective_loader demo ...' only, not {line!r}"
    )


def demos(root: Path = REPO) -> list[Demo | str]:
    """Every distinct demo command shown in bash blocks (first place shown), or the error text
    of one that cannot run here."""
    found: dict[tuple[str, ...], Demo | str] = {}
    for path in documents(root):
        for block in fenced_blocks(path, root):
            if block.lang not in ("bash", "sh", "shell", "console"):
                continue
            for number, line in logical_lines(block):
                where = f"{block.file}:{number}"
                try:
                    demo = demo_command(where, line)
                except ValueError as e:
                    found[(where,)] = str(e)
                    continue
                if demo is not None:
                    found.setdefault(demo.argv[1:], demo)
    return list(found.values())


def run(argv: list[str] | tuple[str, ...], cwd: Path, timeout: float) -> tuple[int, str]:
    """Run a program in a session of its own; ``(exit code, output)``. Fails the test when it
    does not end in time, after stopping it and everything it started."""
    proc = subprocess.Popen(
        list(argv),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun passes it on to its ranks
        try:
            out = proc.communicate(timeout=TERM_GRACE)[0]
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)  # the ranks too: each is in a session of its own
            out = proc.communicate()[0]
        pytest.fail(f"{' '.join(argv)} did not end within {timeout:.0f}s; its output:\n{out[-6000:]}")
    return proc.returncode, out


# --- the examples ----------------------------------------------------------------------------


def _python_blocks() -> list[Block]:
    return [b for path in documents() for b in fenced_blocks(path) if b.lang in ("python", "py", "python3")]


@pytest.mark.timeout(BLOCK_TIMEOUT + TERM_GRACE + 30)
@pytest.mark.parametrize("block", _python_blocks(), ids=lambda b: b.where)
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(block.text)
    try:
        ranks = block_ranks(block)
    except ValueError as e:
        pytest.fail(str(e))
    code, out = run_from_fork_server([str(script)], ranks, str(tmp_path), BLOCK_TIMEOUT)
    assert code == 0, (
        f"the example at {block.where} exited {code} (124: still running after {BLOCK_TIMEOUT:.0f}s):\n{out[-6000:]}"
    )


def _demo_params() -> list:
    """The shown demo commands test_demo does not run itself (it runs those in RUN_HERE, with
    stronger checks)."""
    params = []
    for demo in demos():
        if isinstance(demo, Demo) and demo.argv[1:] in test_demo.RUN_HERE:
            continue
        if isinstance(demo, str):
            params.append(pytest.param(demo, id=demo.split(": ", 1)[0]))
        else:
            marks = [pytest.mark.slow] if demo.ranks > 8 else []
            params.append(pytest.param(demo, id=f"{demo.where} {demo.shown}", marks=marks))
    return params


DEMO_PARAMS = _demo_params()

if DEMO_PARAMS:  # today test_demo runs every shown command; an empty set would collect a skipped test

    @pytest.mark.timeout(DEMO_TIMEOUT + TERM_GRACE + 30)
    @pytest.mark.parametrize("demo", DEMO_PARAMS)
    def test_shown_demo_command_passes(demo: Demo | str, tmp_path: Path) -> None:
        if isinstance(demo, str):
            pytest.fail(demo)
        code, out = run(demo.argv, tmp_path, DEMO_TIMEOUT)
        assert code == 0 and "all checks passed" in out, f"{demo.where}: {demo.shown} exited {code}:\n{out[-6000:]}"


def test_test_demo_runs_only_commands_the_docs_show() -> None:
    """test_demo.RUN_HERE stands in for running those shown commands here: each must still be shown."""
    shown = {d.argv[1:] for d in demos() if isinstance(d, Demo)}
    assert set(test_demo.RUN_HERE) <= shown, sorted(set(test_demo.RUN_HERE) - shown)


def test_the_docs_show_a_demo_with_a_middle_stage() -> None:
    """A middle stage (pp >= 3) is outside delivery and iterates through its leader's bulletin:
    one shown demo command must run such a mesh, so that case stays in front of readers and in
    the suite."""
    shown = [d for d in demos() if isinstance(d, Demo)]
    assert shown, "no demo command found in README.md or docs/"

    def has_middle(mesh: str) -> bool:
        dims, shape = parse_mesh(mesh)
        layout = MeshLayout.build(dims, shape, range(math.prod(shape)))
        return any(layout.place(r).stage == "middle" for r in layout.ranks)

    assert any(has_middle(d.mesh) for d in shown), [d.shown for d in shown]


# --- the convention itself (no processes) ----------------------------------------------------


def test_a_python_block_without_a_run_line_fails_naming_its_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# x\n\n```python\n# run: torchrun 4\nprint(1)\n```\n")
    (tmp_path / "docs" / "page.md").write_text("text\n\n```python\nprint(1)\n```\n")
    readme, page = (fenced_blocks(p, tmp_path)[0] for p in documents(tmp_path))
    assert block_ranks(readme) == 4
    with pytest.raises(ValueError, match=r"^docs/page\.md:3: a ```python block must start with"):
        block_ranks(page)


def test_demo_commands_are_found_and_those_that_cannot_run_here_are_refused(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text(
        "```bash\n"
        "pip install -e . && python -m collective_loader demo\n"
        "python -m collective_loader demo --mesh pp=4,dp=3 \\\n    --samples 48   # a comment\n"
        "torchrun --standalone --nproc-per-node 4 -m collective_loader demo --mesh pp=2,dp=2\n"
        "torchrun --nnodes 2 --nproc-per-node 4 -m collective_loader demo\n"
        "python -m collective_loader demo --data $DATA\n"
        "python -m pytest tests\n"
        "```\n"
    )
    found = demos(tmp_path)
    ok = [d for d in found if isinstance(d, Demo)]
    assert [(d.where, d.ranks, d.mesh) for d in ok] == [
        ("README.md:2", 8, DEFAULT_MESH),
        ("README.md:3", 12, "pp=4,dp=3"),
        ("README.md:5", 4, "pp=2,dp=2"),
    ]
    assert ok[0].argv == (sys.executable, "-m", "collective_loader", "demo")
    assert ok[1].argv[-4:] == ("--mesh", "pp=4,dp=3", "--samples", "48")
    assert ok[2].argv[1:7] == ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m")
    refused = [d for d in found if isinstance(d, str)]
    assert [r.split(": ", 1)[0] for r in refused] == ["README.md:6", "README.md:7"], refused


def test_a_rank_that_fails_ends_the_block_with_its_output_and_stops_the_others(tmp_path: Path) -> None:
    """The runner itself: rank 1 raises while rank 0 would wait forever; the block fails at once
    with rank 1's traceback, and a block that never ends is stopped at its timeout."""
    script = tmp_path / "example.py"
    script.write_text(
        "import os, threading\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise KeyError('rank 1 fails')\n"
        "threading.Event().wait()\n"
    )
    code, out = run_from_fork_server([str(script)], 2, str(tmp_path), BLOCK_TIMEOUT)
    assert code == 1 and "KeyError: 'rank 1 fails'" in out, (code, out)
    code, out = run_from_fork_server([str(script)], None, str(tmp_path), 3.0)  # no RANK: a plain process
    assert code == 1 and "KeyError: 'RANK'" in out, (code, out)
    script.write_text("import threading\nprint('started', flush=True)\nthreading.Event().wait()\n")
    code, out = run_from_fork_server([str(script)], 2, str(tmp_path), 3.0)
    assert code == 124 and out.count("started") == 2, (code, out)
