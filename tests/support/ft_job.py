"""A torchft job for the tests: a lighthouse on 127.0.0.1, replica groups as 2-rank jobs of
``ft_group.py`` (started as torchrun starts them, by ``forked_ranks.py``) that the test starts,
kills (SIGKILL, whole process trees) and restarts, and the
check of what every rank logged: over the committed steps of the surviving lineage, every sample
once (or, with packed rows of MDS documents, every token of every document once), in the global
order, the global batch constant, tp peers identical, labels of their inputs, and the final
weights those of one plain run over the same global batches.

The test and the ranks wait for each other on a ``TCPStore`` the test hosts (keys the ranks set:
``stopped_<group>_<rank>``, ``commits_<group>_<n>``, ``trained_<group>_<n>``; keys the test
sets: ``go_<group>``), blocking, never polling. A thread per group waits for its exit and, when
a group the test has not killed exits, wakes the test's current wait, which then fails with
every group's exit status and output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from processes import gone, kill_tree

from collective_loader.plan.quorum import GlobalOrder
from collective_loader.streaming.cleanup import remove_stale
from collective_loader.streaming.source import STALE_AFTER
from collective_loader.testing.data import numbered_documents, write_token_documents

WORKER = Path(__file__).with_name("ft_group.py")
REPO = Path(__file__).resolve().parents[2]


@dataclass
class FtJob:
    """The lighthouse and the groups of one test; :meth:`close` kills every process it started."""

    root: Path
    mode: str  # "sync" or "async"
    dim: str = "tp"  # each group's mesh: tp=2 or dp_shard=2
    global_batch: int = 6
    micro_batch: int = 2
    samples: int = 20000  # more than 3000 steps of 6: every sample at most once
    data: str = "samples"  # or "rows": packed rows of MDS documents (ft_group.py's FT_DATA)
    seq_len: int = 7  # rows of 8 tokens
    groups: dict[str, subprocess.Popen] = field(default_factory=dict)
    started: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        from torchft.coordination import LighthouseServer

        self.lighthouse = LighthouseServer(
            bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=50, heartbeat_timeout_ms=2000
        )
        port = self.lighthouse.address().rsplit(":", 1)[1]
        self.address = f"http://127.0.0.1:{port}"
        self.root.mkdir(parents=True, exist_ok=True)
        if self.data == "rows":  # the documents of the first pass: more tokens than 3000 steps of rows
            write_token_documents(str(self.root / "mds"), documents(), "bytes", "uint32", shard_bytes=1 << 14)
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        # the exit watchers' own connection: a client does one operation at a time, and the
        # test's may be a wait
        self._waker = dist.TCPStore("127.0.0.1", self.store.port, is_master=False)
        self._lock = threading.Lock()  # self.groups, self._waiting
        self._waiting: list[str] = []  # the keys the test waits for, set by a watcher to wake it
        self._watchers: list[threading.Thread] = []

    def start(self, group: str, stop_at: str = "", start_with: int = 0, standby: bool = False) -> None:
        """Start group ``group`` (a 2-rank job); ``stop_at="k:phase"`` makes it stop in
        the k-th step it takes part in, and wait to be killed; ``start_with``: the number of
        groups started together, which wait for each other before their first step. A
        ``standby`` waits, its processes started, until :meth:`release` lets it join: a group
        restarted or new, without the seconds a start costs on two loaded cores."""
        env = dict(
            os.environ,
            TORCHFT_LIGHTHOUSE=self.address,
            FT_STORE=f"127.0.0.1:{self.store.port}",
            FT_GROUP=group,
            FT_MODE=self.mode,
            FT_DIM=self.dim,
            FT_DIR=str(self.root),
            FT_STOP_AT=stop_at,
            FT_START_WITH=str(start_with),
            FT_HOLD="1" if standby else "0",
            FT_G=str(self.global_batch),
            FT_M=str(self.micro_batch),
            FT_N=str(self.samples),
            FT_DATA=self.data,
            FT_MDS=str(self.root / "mds"),
            FT_SEQ=str(self.seq_len),
            PYTHONPATH=os.pathsep.join([str(REPO), str(WORKER.parent), os.environ.get("PYTHONPATH", "")]),
        )
        # its 2 ranks forked after the imports, with torchrun's workers' environment: torchrun's
        # agent and each rank would import torch (and torchft, streaming) again, 10 s of CPU each
        cmd = [sys.executable, str(WORKER.with_name("forked_ranks.py")), "--import", "torchft", "2", str(WORKER)]
        output = open(self.root / f"output_{group}.txt", "a")
        proc = subprocess.Popen(cmd, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        with self._lock:
            self.groups[f"{group} (standby)" if standby else group] = proc
        self.started.append(proc)
        watcher = threading.Thread(target=self._watch, args=(proc,), daemon=True)
        watcher.start()
        self._watchers.append(watcher)

    def _watch(self, proc: subprocess.Popen) -> None:
        """Wait for ``proc`` to exit; then mark it (``exited_<pid>``) and, if it is still one of
        :attr:`groups` (not killed by the test), wake the test's current wait."""
        proc.wait()
        with self._lock:
            self._waker.set(f"exited_{proc.pid}", str(proc.returncode))
            if any(p is proc for p in self.groups.values()):
                for key in self._waiting:
                    self._waker.set(key, "woken: a group exited")

    def release(self, group: str) -> None:
        """Let the standby of ``group`` join the job."""
        with self._lock:
            self.groups[group] = self.groups.pop(f"{group} (standby)")
        self.store.set(f"go_{group}", "")

    def kill(self, group: str) -> None:
        """SIGKILL every process of ``group`` (the ranks and the process that forked them)."""
        with self._lock:
            proc = self.groups.pop(group)
        kill_tree(proc.pid)
        proc.wait()

    def records(self) -> list[dict]:
        out = []
        for path in sorted(self.root.glob("log_*.jsonl")):
            for line in path.read_text().splitlines():
                if line.strip():
                    out.append(json.loads(line))
        return out

    def committed_steps(self, group: str, trained: bool = False) -> int:
        """Steps ``group`` has committed so far (its restarted processes too; ``trained``: only
        steps it took part in)."""
        return self.store.add(f"{'trained' if trained else 'commits'}_{group}", 0)

    def committed(self, group: str, steps: int, trained: bool = False) -> list[str]:
        """The key set once ``group`` has committed ``steps`` steps (see :meth:`committed_steps`)."""
        return [f"{'trained' if trained else 'commits'}_{group}_{steps}"]

    def stopped(self, group: str) -> list[str]:
        """The keys set once both ranks of ``group`` have stopped at their ``stop_at``."""
        return [f"stopped_{group}_0", f"stopped_{group}_1"]

    def wait_for(self, keys: list[str], timeout: float, message: str) -> None:
        """Block until the ranks have set ``keys``; fail, with every group's exit status and
        output, if a group the test has not killed exits first or ``timeout`` passes."""
        with self._lock:
            self._fail_if_one_exited(message)
            self._waiting = keys
        try:
            self.store.wait(keys, timedelta(seconds=timeout))
        except dist.DistStoreError:
            raise AssertionError(f"timed out waiting for {message}\n{self.report()}") from None
        finally:
            with self._lock:
                self._waiting = []
        with self._lock:
            self._fail_if_one_exited(message)

    def _fail_if_one_exited(self, message: str) -> None:
        exited = [g for g, p in self.groups.items() if p.returncode is not None]  # set by _watch
        if exited:
            raise AssertionError(f"waiting for {message}, {', '.join(exited)} exited early\n{self.report()}")

    def report(self) -> str:
        """Each group's exit status and the end of its output."""
        return "\n".join(
            f"--- group {g}: {'running' if p.returncode is None else f'exited {p.returncode}'}\n{self.output(g)}"
            for g, p in self.groups.items()
        )

    def max_step(self) -> int:
        return max((r["step"] for r in self.records() if r["event"] == "commit" and r["committed"]), default=-1)

    def finish(self, extra_steps: int, timeout: float) -> None:
        """Every group stops after ``extra_steps`` more steps; wait until all have exited 0."""
        (self.root / "finish").write_text(str(self.max_step() + 1 + extra_steps))
        try:
            self.store.wait([f"exited_{p.pid}" for p in self.groups.values()], timedelta(seconds=timeout))
        except dist.DistStoreError:
            raise AssertionError(f"the groups did not finish\n{self.report()}") from None
        for group, proc in self.groups.items():
            proc.wait()  # exited: _watch has reaped it
            assert proc.returncode == 0, f"group {group} failed\n{self.report()}"

    def output(self, group: str) -> str:
        path = self.root / f"output_{group}.txt"
        return path.read_text()[-3000:] if path.exists() else ""

    def close(self) -> None:
        for proc in self.started:
            if not gone(proc.pid) or proc.poll() is None:
                kill_tree(proc.pid)
            proc.wait()
        for watcher in self._watchers:
            watcher.join()
        self.lighthouse.shutdown()
        # a killed group of packed rows left its StreamingDataset's shared memory, as any killed
        # streaming run does: remove what no live process maps
        remove_stale(min_age=STALE_AFTER)


DOCUMENTS, STRIDE = 9000, 64  # documents of 0 to 40 tokens; token k of document i is i * STRIDE + k


def documents() -> list[np.ndarray]:
    """The MDS documents of a job over packed rows (some empty)."""
    return numbered_documents(np.random.default_rng(6).integers(0, 41, size=DOCUMENTS).tolist(), STRIDE)


class Order:
    """What the positions of the job's global order hold: sample ids, or packed rows (each
    ``seq_len + 1`` tokens of the documents of the order concatenated, with the order position
    of each token's document)."""

    def __init__(self, job: FtJob) -> None:
        self.job = job
        if job.data == "rows":
            docs = documents()
            order = GlobalOrder(len(docs), seed=5).indices(0, len(docs))  # one pass
            self.tokens = np.concatenate([docs[i] for i in order]).tolist()
            self.owner = np.concatenate([np.full(len(docs[i]), p) for p, i in enumerate(order)]).tolist()
            self.size = job.seq_len + 1
            self.length = len(self.tokens) // self.size  # rows of the first pass
        else:
            self.order = GlobalOrder(job.samples, seed=5)
            self.length = job.samples

    def window(self, lo: int, hi: int) -> list:
        """Positions ``[lo, hi)``: sample ids, or rows (lists of tokens)."""
        if self.job.data == "rows":
            return [self.tokens[r * self.size : (r + 1) * self.size] for r in range(lo, hi)]
        return self.order.indices(lo, hi)

    def positions(self, row: int) -> list[int]:
        """The ``position_ids`` of row ``row``: 0 at each document's first token in the row."""
        owner = self.owner[row * self.size : (row + 1) * self.size - 1]
        out: list[int] = []
        for j, doc in enumerate(owner):
            out.append(0 if j == 0 or doc != owner[j - 1] else out[-1] + 1)
        return out

    def features(self, window: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The tiny model's inputs and labels for a window (as ft_group.py computes them)."""
        from ft_group import features, row_features

        if self.job.data == "rows":
            rows = torch.tensor(window)
            return row_features(rows[:, :-1], rows[:, 1:])
        x, y = features(self.job.samples)
        ids = torch.tensor(window)
        return x[ids], y[ids]


def reference_weights(job: FtJob, steps: int) -> list[float]:
    """The weights of one plain process trained on the same global batches (no torchft)."""
    from ft_group import new_model

    order = Order(job)
    model = new_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for s in range(steps):
        x, y = order.features(order.window(s * job.global_batch, (s + 1) * job.global_batch))
        loss = ((model(x).squeeze(1) - y) ** 2).sum() / job.global_batch
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [v for p in model.parameters() for v in p.detach().flatten().tolist()]


def check(job: FtJob) -> dict:
    """What the ranks logged, checked; returns the figures (steps, samples or tokens, quorum sizes, ...)."""
    recs = job.records()
    g = job.global_batch
    order = Order(job)
    serves = [r for r in recs if r["event"] == "serve"]
    commits = [r for r in recs if r["event"] == "commit" and r["committed"]]
    assert all(r["labels_ok"] for r in serves), "a rank got labels that are not its inputs'"
    # the surviving lineage: per step, the last quorum in which some group committed it
    lineage: dict[int, int] = {}
    for c in commits:
        lineage[c["step"]] = max(lineage.get(c["step"], -1), c["qid"])
    steps = sorted(lineage)
    assert steps == list(range(len(steps))), f"committed steps with gaps: {steps}"
    trained: list = []
    quorum_sizes = []
    for s in steps:
        q = lineage[s]
        for c in commits:
            if (c["step"], c["qid"]) == (s, q):
                assert c["cursor_after"] == (s + 1) * g, (
                    f"step {s}: {c['group']} committed to cursor {c['cursor_after']}"
                )
        # the last serve of each process in that attempt
        last: dict[tuple[int, int], dict] = {}
        for r in serves:
            if (r["step"], r["qid"]) == (s, q):
                last[(r["pid"], r["rank"])] = r
        replicas: dict[tuple, list[dict]] = defaultdict(list)
        for r in last.values():
            if r["participant"] is not None:
                assert r["cursor"] == s * g, f"step {s}: served from cursor {r['cursor']}"
                replicas[(r["participant"], r["dp_rank"], r["group"])].append(r)
        for key, copies in replicas.items():
            assert all(c["ids"] == copies[0]["ids"] for c in copies), f"step {s}: tp peers of {key} got different data"
            # .get: a group that logs no positions (samples; bench/elastic_group.py) has none to compare
            assert all(c.get("positions") == copies[0].get("positions") for c in copies), (
                f"step {s}: tp peers' positions"
            )
        step_units = [u for key in sorted(replicas) for u in replicas[key][0]["ids"]]
        assert step_units == order.window(s * g, (s + 1) * g), f"step {s}: trained {step_units}"
        if job.data == "rows":  # positions restart at each document and at each row
            positions = [p for key in sorted(replicas) for p in replicas[key][0]["positions"]]
            assert positions == [order.positions(r) for r in range(s * g, (s + 1) * g)], f"step {s}: positions"
        quorum_sizes.append(max(r["participants"] for r in last.values()))
        trained += step_units
    assert len(steps) * g <= order.length, "the job went past one pass: exactly once is over one"
    if job.data == "rows":
        tokens = [t for row in trained for t in row]
        missing = Counter(order.tokens[: len(tokens)])
        missing.subtract(Counter(tokens))
        lost, repeated = sum((+missing).values()), sum((-missing).values())
        assert tokens == order.tokens[: len(tokens)] and lost == repeated == 0
        units = {"tokens_committed": len(tokens), "documents_begun": len(set(order.owner[: len(tokens)]))}
    else:
        lost = len(set(order.window(0, len(trained))) - set(trained))
        repeated = len(trained) - len(set(trained))
        assert trained == order.window(0, len(steps) * g) and lost == repeated == 0
        units = {"samples_committed": len(trained)}
    done = [r for r in recs if r["event"] == "done"]
    assert done, "no group finished"
    expected = reference_weights(job, len(steps))
    for r in done:
        assert r["step"] == len(steps) and r["cursor"] == len(steps) * g
        assert torch.allclose(torch.tensor(r["weights"]), torch.tensor(expected), atol=1e-5), (r["weights"], expected)
    attempts = len({(r["step"], r["qid"]) for r in serves})
    first: dict[int, dict] = {}
    for r in sorted(serves, key=lambda r: r["t"]):
        first.setdefault(r["pid"], r)
    joined = sorted(
        {(r["group"], r["step"]) for r in first.values() if r["step"] > 0}
    )  # groups that joined a running job: healed to that step, cursor from a live peer
    sizes: dict[int, int] = defaultdict(int)
    for n in quorum_sizes:
        sizes[n] += 1
    return {
        "steps": len(steps),
        **units,
        "lost": lost,
        "repeated": repeated,
        "attempts": attempts,
        "quorum_sizes": quorum_sizes,
        "steps_by_participants": dict(sizes),
        "joined_at_step": joined,
        "step_seconds_median": sorted(c["seconds"] for c in commits)[len(commits) // 2],
    }
