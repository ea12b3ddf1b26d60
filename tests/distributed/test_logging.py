"""The loader logs what it decided (INFO at construction: the mesh on rank 0, its replica on each
leader), a slow source (WARNING, before the stall error) and each step (DEBUG); and prints
nothing when the application has not configured logging."""

from __future__ import annotations

import contextlib
import io
import logging
import threading

import ranks
import torch.distributed as dist

from collective_loader import CollectiveLoader


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


class SlowSourceWarned(logging.Handler):
    """Sets ``event`` when a leader warns that its source is slow; prints nothing."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "has not returned step 0" in record.getMessage():
            self.event.set()


def slow_until_warned(warned: threading.Event):
    """Two batches, the first once the leader has warned that it is slow (no timing window: the
    stall error comes 0.375 x timeout after the warning)."""

    def batches():
        assert warned.wait(60), "no slow-source warning within 60 s"
        yield ranks.sample_batch([0, 1], 8)
        yield ranks.sample_batch([2, 3], 8)

    return batches


def run_loader(configured: bool) -> dict:
    """One epoch on pp=2 x dp=2 (leaders 0 and 3) whose first batch waits until its leader logs
    it as slow (after half the stall time: 3 s, with an 8 s timeout); with logging configured (a
    handler at DEBUG on the library's logger) or not at all."""
    logger = logging.getLogger("collective_loader")
    records = Records()
    warned = SlowSourceWarned()
    stderr = io.StringIO()
    logger.addHandler(warned)
    if configured:
        logger.addHandler(records)
        logger.setLevel(logging.DEBUG)
    try:
        with contextlib.redirect_stderr(stderr):
            mesh = ranks.make_mesh(("pp", "dp"), (2, 2))
            loader = CollectiveLoader(slow_until_warned(warned.event), mesh, **ranks.KEYS, timeout=8.0)
            steps = sum(1 for _ in loader)
            loader.close()
    finally:
        logger.removeHandler(records)
        logger.removeHandler(warned)
        logger.setLevel(logging.NOTSET)
    return {"rank": dist.get_rank(), "steps": steps, "lines": records.lines, "stderr": stderr.getvalue()}


def test_a_built_loader_logs_its_decisions_a_slow_source_and_each_step(worlds):
    results = worlds.get(4).run(run_loader, True, timeout=120)
    by_rank = {r["rank"]: r for r in results}
    assert all(r["steps"] == 2 for r in results)
    info = {rank: [m for level, m in r["lines"] if level == "INFO"] for rank, r in by_rank.items()}
    assert any("mesh [pp=2(pipeline) dp=2(data)]" in m and "leaders [0, 3]" in m for m in info[0]), info[0]
    for leader, dp in ((0, 0), (3, 1)):
        assert any(f"rank {leader} leads replica {dp}" in m for m in info[leader]), info[leader]
    assert not any("leads replica" in m for m in info[1] + info[2]), info
    warnings = {rank: [m for level, m in r["lines"] if level == "WARNING"] for rank, r in by_rank.items()}
    for leader in (0, 3):
        assert any("has not returned step 0" in m for m in warnings[leader]), warnings[leader]
    for rank, r in by_rank.items():
        debug = [m for level, m in r["lines"] if level == "DEBUG"]
        assert [m.split(":")[0] for m in debug] == [f"rank {rank} step 0", f"rank {rank} step 1"], debug


def test_nothing_is_printed_when_logging_is_not_configured(worlds):
    """Without the library's NullHandler, Python's last-resort handler would print the slow
    source's WARNING to stderr."""
    for r in worlds.get(4).run(run_loader, False, timeout=120):
        assert r["steps"] == 2 and r["lines"] == []
        assert r["stderr"] == "", (r["rank"], r["stderr"])
