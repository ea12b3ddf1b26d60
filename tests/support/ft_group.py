"""One rank of a torchft replica group (a 2-rank job, as ``torchrun --nproc-per-node 2`` runs it): a tiny model trained
under torchft's ``Manager`` on ``QuorumData``, every step logged for
``tests/integrations/test_torchft_elastic.py``.

Environment: ``TORCHFT_LIGHTHOUSE``; ``FT_STORE`` (``host:port`` of the ``TCPStore`` the test
hosts, through which this rank and the test wait for each other); ``FT_GROUP`` (the group's name), ``FT_MODE`` (``sync`` or
``async`` quorum), ``FT_DIM`` (the group's mesh: ``tp`` or ``dp_shard``, 2 ranks), ``FT_DIR`` (logs,
and the ``finish`` file: the step to stop at), ``FT_STOP_AT`` (``k:phase``: stop in the k-th step
this group takes part in (from 0), set the key ``stopped_<group>_<rank>`` and wait to be killed;
phases ``before``, ``during`` and ``after`` the gradient all-reduce), ``FT_G``, ``FT_M`` (global and micro batch), ``FT_N`` (samples),
``FT_HOLD`` (1: a standby, started ahead: wait for the key ``go_<group>`` before joining
the job, so that a restart or a new group costs the test no process start), ``FT_START_WITH`` (groups to wait for before the first step: those the test starts
together), ``FT_MAX_STEPS``, ``FT_SLEEP`` (seconds per step: the pace, so that a restarted group meets a job
still running); ``FT_DATA``: ``samples`` (a map-style dataset of ``FT_N`` samples) or ``rows``
(packed rows of ``FT_SEQ + 1`` tokens from the MDS documents in ``FT_MDS``, token ids uint32, read
by a ``StreamingDataset`` the group's leaders build: :class:`LeaderStreamingDataset`).

Keys rank 0 sets after each committed step: ``commits_<group>_<n>`` (the group's n-th committed
step, from 1, restarts included; the counter ``commits_<group>``) and ``trained_<group>_<n>``
(the n-th of those the group took part in).
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.device_mesh import init_device_mesh
from torchft import Manager, ProcessGroupGloo

from collective_loader.integrations.torchft import QuorumData
from collective_loader.streaming import LeaderStreamingDataset
from collective_loader.text import Packing, TokenColumn

D = 4  # features
TRUE_W = torch.arange(1.0, D + 1)
WAIT = timedelta(seconds=600)  # the longest a rank waits on the store: past the tests' own timeouts


def features(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sample's inputs and labels (the same in every process, and in the test)."""
    x = torch.randn(n, D, generator=torch.Generator().manual_seed(0))
    return x, x @ TRUE_W


class Samples:
    def __init__(self, n: int) -> None:
        self.x, self.y = features(n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "sample_id": i}


def row_features(input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed row's inputs and label for the tiny model: functions of its tokens (the same in
    every process, and in the test's plain run)."""
    x = torch.stack(
        [
            (input_ids % 97).double().mean(1) / 97,
            (labels % 89).double().mean(1) / 89,
            (input_ids % 2).double().mean(1),
            torch.ones(len(input_ids), dtype=torch.double),
        ],
        dim=1,
    ).float()
    return x, x @ TRUE_W


def new_model() -> nn.Linear:
    torch.manual_seed(1)
    return nn.Linear(D, 1)


def main() -> None:
    env = os.environ
    group, mode, dim = env["FT_GROUP"], env["FT_MODE"], env["FT_DIM"]
    out = Path(env["FT_DIR"])
    stop_at = env.get("FT_STOP_AT", "")
    stop_step, stop_phase = (int(stop_at.split(":")[0]), stop_at.split(":")[1]) if stop_at else (-1, "")
    global_batch, micro_batch, n = int(env["FT_G"]), int(env["FT_M"]), int(env["FT_N"])
    max_steps = int(env.get("FT_MAX_STEPS", "3000"))
    pace = float(env.get("FT_SLEEP", "0.05"))
    host, port = env["FT_STORE"].rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=WAIT)

    if env.get("FT_DATA") == "rows":  # before a standby's hold: a restart costs the test no import
        import collective_loader.streaming.dataset  # noqa: F401
    if env.get("FT_HOLD") == "1":
        store.wait([f"go_{group}"], WAIT)  # the test kills a standby it never releases
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(dim,))
    log_file = open(out / f"log_{group}_{rank}_{os.getpid()}.jsonl", "a")

    def log(record: dict) -> None:
        record.update(group=group, rank=rank, pid=os.getpid(), t=round(time.time(), 3))
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()

    model = new_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for p in model.parameters():  # a group outside the step all-reduces zeros
        p.grad = torch.zeros_like(p)

    def load_model(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        load_state_dict=load_model,
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        min_replica_size=1,
        use_async_quorum=mode == "async",
        replica_id=f"ft_{group}",
        hostname="127.0.0.1",
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=10),
        init_sync=mode == "sync",  # QuorumData refuses init_sync in the asynchronous mode
    )
    x_all, y_all = features(n)
    rows = env.get("FT_DATA", "samples") == "rows"
    if rows:
        data = QuorumData(
            LeaderStreamingDataset(mesh, local=env["FT_MDS"]),
            mesh,
            manager,
            global_batch=global_batch,
            micro_batch=micro_batch,
            packing=Packing(int(env["FT_SEQ"])),
            layout=TokenColumn(dtype="uint32"),
            inputs=("input_ids", "position_ids"),
            labels=("labels",),
            seed=5,
            timeout=60,
        )
    else:
        data = QuorumData(
            lambda: Samples(n),
            mesh,
            manager,
            global_batch=global_batch,
            micro_batch=micro_batch,
            inputs=("x", "sample_id"),
            labels=("y",),
            seed=5,
            timeout=60,
        )
    log({"event": "start", "mode": mode, "dim": dim})
    start_with = 2 * int(env.get("FT_START_WITH", "0"))  # ranks started together
    if start_with:
        if store.add("ready", 1) == start_with:  # the last of them
            store.set("all_ready", "")
        store.wait(["all_ready"], WAIT)

    took_part = -1  # steps this process took part in, less one

    def stop(phase: str, step: int) -> None:
        if took_part == stop_step and phase == stop_phase:
            log({"event": "stopped", "step": step, "phase": phase})
            store.set(f"stopped_{group}_{rank}", phase)
            while True:  # the test kills this group's processes
                signal.pause()

    def target() -> int:
        finish = out / "finish"
        return min(max_steps, int(finish.read_text())) if finish.exists() else max_steps

    while manager.current_step() < target():
        time.sleep(pace)  # the pace of the steps (kills land mid-run), not a wait for another process
        started = time.perf_counter()
        cursor_before = data.cursor
        manager.start_quorum()
        ids, positions, labels_ok, micro = [], [], True, 0
        for batch in data.step():
            micro += 1
            if rows:  # a row's tokens: its inputs and its last label
                ids += [i + [lab[-1]] for i, lab in zip(batch["input_ids"].tolist(), batch["labels"].tolist())]
                positions += batch["position_ids"].tolist()
                labels_ok &= torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
                x, y = row_features(batch["input_ids"], batch["labels"])
            else:
                ids += batch["sample_id"].tolist()
                x, y = batch["x"], batch["y"]
                labels_ok &= torch.equal(x, x_all[batch["sample_id"]]) and torch.equal(y, y_all[batch["sample_id"]])
            loss = ((model(x).squeeze(1) - y) ** 2).sum() / data.global_samples
            loss.backward()
        share = data.share
        assert share is not None
        if share.participant is not None:
            took_part += 1
        step = manager.current_step()
        log(
            {
                "event": "serve",
                "step": step,
                "qid": manager._quorum_id,
                "participant": share.participant,
                "participants": share.participants,
                "healing": manager._healing,
                "cursor_before": cursor_before,
                "cursor": share.cursor,
                "ids": ids,  # sample ids, or rows' tokens
                "positions": positions,
                "micro": micro,
                "labels_ok": labels_ok,
                "dp_rank": data.loader.dp_rank,
            }
        )
        stop("before", step)
        params = list(model.parameters())
        if dim != "tp":  # the group's own data-parallel replicas first
            for p in params:
                dist.all_reduce(p.grad, op=ReduceOp.SUM)
        for i, p in enumerate(params):
            manager.allreduce(p.grad, reduce_op=ReduceOp.SUM).wait()
            if i == 0:
                stop("during", step)
        stop("after", step)
        committed = manager.should_commit()
        if committed:
            optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        data.end_step(committed)
        if committed and rank == 0:
            count(store, f"commits_{group}")
            if share.participant is not None:
                count(store, f"trained_{group}")
        log(
            {
                "event": "commit",
                "step": step,
                "qid": manager._quorum_id,
                "committed": committed,
                "cursor_after": data.cursor,
                "errored": str(manager.errored())[:120] if manager.errored() else None,
                "seconds": round(time.perf_counter() - started, 4),
                "weights": _weights(model),
            }
        )
    log({"event": "done", "step": manager.current_step(), "cursor": data.cursor, "weights": _weights(model)})
    data.close()
    log_file.close()
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's server threads would keep the process alive


def count(store: dist.TCPStore, counter: str) -> None:
    """One more on ``counter``; sets the key ``<counter>_<n>`` for the n-th, which the test waits for."""
    n = store.add(counter, 1)
    store.set(f"{counter}_{n}", "")


def _weights(model: nn.Module) -> list[float]:
    return [v for p in model.parameters() for v in p.detach().flatten().tolist()]


if __name__ == "__main__":
    main()
