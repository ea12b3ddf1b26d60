"""One rank of a replica group of ``bench/elastic.py`` (a ``torchrun --nproc-per-node 2`` job that
``tests/support/ft_job.py``'s ``FtJob`` starts, kills and restarts): ``nn.Linear`` trained under
torchft's ``Manager`` on one of two loaders, every step logged in the format of
``tests/support/ft_group.py`` (``ft_job.check`` reads it).

- ``ELASTIC_LOADER=ours``: ``QuorumData``, the loop of ``ft_group.py`` (loss summed over the
  global batch, gradients all-reduced with ``SUM``).
- ``ELASTIC_LOADER=torchft``: torchft's ``DistributedSampler`` as its ``train_ddp.py`` example
  uses it: ``replica_rank`` the group's index, ``num_replica_groups`` the most groups the job
  has (``ELASTIC_GROUPS``), ``group_rank`` / ``num_replicas`` the group's data-parallel rank and
  size, under a ``StatefulDataLoader`` of ``global_batch / (groups x dp)`` samples; the batch is
  taken before ``start_quorum()`` (the example's ``for`` loop hands it before
  ``optimizer.zero_grad()``), the loss is the batch mean and gradients are averaged (torchft's
  DDP). The example leaves the loader's state to a per-group checkpoint; here it is registered
  with the manager (``register_state_dict_fn("dataloader", ...)``), so a healing group takes a
  live peer's position, and a loaded state takes effect at the next batch (a new iterator).

Environment: ``ft_group.py``'s (``FT_*``, set by ``FtJob.start``), plus ``ELASTIC_LOADER``,
``ELASTIC_GROUPS`` and ``ELASTIC_TIMEOUT`` (seconds for torchft's process group and
operations: generous, the machine is shared).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ft_group import WAIT, Samples, count, features, new_model  # tests/support: the tests' workload
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.device_mesh import init_device_mesh
from torchft import Manager, ProcessGroupGloo

from collective_loader.integrations.torchft import QuorumData

SEED = 5  # both loaders' order (ft_job's reference order uses 5)


class Ours:
    """``QuorumData``: this replica's share of the step, chosen after the quorum."""

    reduce_op = ReduceOp.SUM  # the loss is normalised over the global batch already

    def __init__(self, mesh: Any, manager: Manager, global_batch: int, micro_batch: int, n: int) -> None:
        self.data = QuorumData(
            lambda: Samples(n),
            mesh,
            manager,
            global_batch=global_batch,
            micro_batch=micro_batch,
            inputs=("x", "sample_id"),
            labels=("y",),
            seed=SEED,
            timeout=120,
        )
        self.dp_rank = self.data.loader.dp_rank

    def before_quorum(self) -> None:
        pass

    def batches(self) -> tuple[Iterator[dict], int | None, int]:
        batches = self.data.step()
        share = self.data.share
        assert share is not None
        return batches, share.participant, share.participants

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).sum() / self.data.global_samples

    def window(self) -> int:
        """Where the step's window starts (``ft_job.check`` compares it with the lineage)."""
        share = self.data.share
        assert share is not None
        return share.cursor

    def end(self, committed: bool) -> None:
        self.data.end_step(committed)

    def cursor(self) -> int:
        return self.data.cursor

    def close(self) -> None:
        self.data.close()


class Torchft:
    """torchft's ``DistributedSampler`` under a ``StatefulDataLoader``, its state registered with
    the manager."""

    reduce_op = ReduceOp.AVG  # torchft's DDP averages over the participants

    def __init__(self, manager: Manager, slot: int, groups: int, dp_rank: int, dp: int, batch: int, n: int) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchft.data import DistributedSampler

        dataset = Samples(n)
        sampler = DistributedSampler(
            dataset, replica_rank=slot, num_replica_groups=groups, group_rank=dp_rank, num_replicas=dp, seed=SEED
        )
        self.loader = StatefulDataLoader(dataset, batch_size=batch, sampler=sampler)
        self.manager, self.dp_rank = manager, dp_rank
        self._it: Iterator[dict] | None = None
        self._batch: dict | None = None
        manager.register_state_dict_fn("dataloader", self._load, self.loader.state_dict)

    def _load(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self._it = None  # a running iterator ignores a loaded state: the next batch comes from a new one

    def before_quorum(self) -> None:
        if self._it is None:
            self._it = iter(self.loader)
        self._batch = next(self._it)

    def batches(self) -> tuple[Iterator[dict], int | None, int]:
        assert self._batch is not None
        # the example trains the batch in hand whatever the quorum; a group outside the step
        # (participating_rank() None) has its gradient zeroed by manager.allreduce
        return iter([self._batch]), self.manager.participating_rank(), self.manager.num_participants()

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()

    def window(self) -> int:
        return -1  # no job-wide window: each group reads its own shard

    def end(self, committed: bool) -> None:
        self._batch = None

    def cursor(self) -> int:
        return -1  # no job-wide cursor: each group reads its own shard

    def close(self) -> None:
        pass


def main() -> None:
    env = os.environ
    group, mode, dim = env["FT_GROUP"], env["FT_MODE"], env["FT_DIM"]
    loader_kind = env["ELASTIC_LOADER"]
    out = Path(env["FT_DIR"])
    stop_at = env.get("FT_STOP_AT", "")
    stop_step, stop_phase = (int(stop_at.split(":")[0]), stop_at.split(":")[1]) if stop_at else (-1, "")
    global_batch, micro_batch, n = int(env["FT_G"]), int(env["FT_M"]), int(env["FT_N"])
    pace = float(env.get("FT_SLEEP", "0.05"))
    timeout = timedelta(seconds=float(env.get("ELASTIC_TIMEOUT", "60")))
    host, port = env["FT_STORE"].rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=WAIT)
    if env.get("FT_HOLD") == "1":
        store.wait([f"go_{group}"], WAIT)  # a standby: its processes started, it joins when released
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(dim,))
    log_file = open(out / f"log_{group}_{rank}_{os.getpid()}.jsonl", "a")

    def log(record: dict) -> None:
        record.update(group=group, rank=rank, pid=os.getpid(), t=round(time.time(), 3), loader=loader_kind)
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
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_model,
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        min_replica_size=1,
        use_async_quorum=mode == "async",
        replica_id=f"ft_{group}",
        hostname="127.0.0.1",
        timeout=timeout,
        quorum_timeout=max(timeout, timedelta(seconds=120)),
        connect_timeout=timeout,
        init_sync=mode == "sync",  # the same for both loaders (QuorumData refuses init_sync in async)
    )
    dp = 1 if dim == "tp" else 2
    feed: Ours | Torchft
    if loader_kind == "ours":
        feed = Ours(mesh, manager, global_batch, micro_batch, n)
    else:
        groups = int(env["ELASTIC_GROUPS"])
        feed = Torchft(
            manager, int(group[1:]), groups, 0 if dim == "tp" else rank, dp, global_batch // (groups * dp), n
        )
    x_all, y_all = features(n)
    log({"event": "start", "mode": mode, "dim": dim})
    start_with = 2 * int(env.get("FT_START_WITH", "0"))  # ranks started together wait for each other
    if start_with:
        if store.add("ready", 1) == start_with:
            store.set("all_ready", "")
        store.wait(["all_ready"], WAIT)
    took_part = -1  # steps this process took part in, less one

    def stop(phase: str, step: int) -> None:
        if took_part == stop_step and phase == stop_phase:
            log({"event": "stopped", "step": step, "phase": phase})
            store.set(f"stopped_{group}_{rank}", phase)
            while True:  # bench/elastic.py kills this group's processes
                signal.pause()

    def target() -> int:
        finish = out / "finish"
        return int(finish.read_text()) if finish.exists() else 3000

    while manager.current_step() < target():
        time.sleep(pace)  # the pace of the steps, so that kills land mid-run
        started = time.perf_counter()
        cursor_before = feed.cursor()
        feed.before_quorum()
        manager.start_quorum()
        batches, participant, participants = feed.batches()
        ids, labels_ok, micro = [], True, 0
        for batch in batches:
            micro += 1
            ids += batch["sample_id"].tolist()
            labels_ok &= torch.equal(batch["x"], x_all[batch["sample_id"]]) and torch.equal(
                batch["y"], y_all[batch["sample_id"]]
            )
            feed.loss(model(batch["x"]).squeeze(1), batch["y"]).backward()
        if participant is not None:
            took_part += 1
        step = manager.current_step()
        log(
            {
                "event": "serve",
                "step": step,
                "qid": manager._quorum_id,
                "participant": participant,
                "participants": participants,
                "healing": manager._healing,
                "cursor_before": cursor_before,
                "cursor": feed.window(),
                "ids": ids,
                "micro": micro,
                "labels_ok": labels_ok,
                "dp_rank": feed.dp_rank,
            }
        )
        stop("before", step)
        all_reduce(model, dim, feed.reduce_op, manager, functools.partial(stop, "during", step))
        stop("after", step)
        committed = manager.should_commit()
        if committed:
            optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        feed.end(committed)
        if committed and rank == 0:
            count(store, f"commits_{group}")
            if participant is not None:
                count(store, f"trained_{group}")
        log(
            {
                "event": "commit",
                "step": step,
                "qid": manager._quorum_id,
                "committed": committed,
                "cursor_after": feed.cursor(),
                "errored": str(manager.errored())[:120] if manager.errored() else None,
                "seconds": round(time.perf_counter() - started, 4),
                "weights": weights(model),
            }
        )
    log({"event": "done", "step": manager.current_step(), "cursor": feed.cursor(), "weights": weights(model)})
    feed.close()
    log_file.close()
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's server threads would keep the process alive


def all_reduce(model: nn.Module, dim: str, op: ReduceOp, manager: Manager, after_first: Callable[[], None]) -> None:
    """The group's data-parallel ranks first (``dp_shard``), then across groups; ``after_first``
    runs after the first parameter's cross-group all-reduce (the "during" kill point)."""
    params = list(model.parameters())
    if dim != "tp":
        for p in params:
            dist.all_reduce(p.grad, op=ReduceOp.SUM)
            if op == ReduceOp.AVG:
                p.grad /= dist.get_world_size()
    for i, p in enumerate(params):
        manager.allreduce(p.grad, reduce_op=op).wait()
        if i == 0:
            after_first()


def weights(model: nn.Module) -> list[float]:
    return [v for p in model.parameters() for v in p.detach().flatten().tolist()]


if __name__ == "__main__":
    main()
