"""Reading the logs of ``bench/titan_ft_cpu.py``'s replica groups; nothing here starts or stops a
process. The patterns of their lines (a rank's prefix, a logged step, torchft's quorum and healing
lines, the frames of a traceback and of Python's fault handler), the rank that failed first with its
traceback (:func:`exit_traceback`), the ranks that aborted and their threads in a collective
(:func:`aborts`), rank 0's torchft and Trainer lines (:func:`events`), and a group's section of the
report from its log (:func:`describe`).
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from titan_ft_groups import Group

ANSI = re.compile(r"\x1b\[[0-9;]*m")
PREFIX = re.compile(r"^\[default(\d+)\]:")
STEP = re.compile(r"^\[default(\d+)\]:.*(?<!validate) step:\s*(\d+)\s+loss:\s*(-?[\d.]+|nan|inf)", re.M)
BUILT = "Trainer is initialized"
TORCHFT_LINES = re.compile(
    r"reconfiguring for quorum_id|healing required|peers need recovery|applying pending state dict|"
    r"Loaded state dict|should_commit=False|got exception|Training starts at step|Training completed"
)


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
