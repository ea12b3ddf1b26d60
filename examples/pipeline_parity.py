"""N-D parallel training whose loss matches single-process training, and the seed's naive set-up
whose loss does not.

    python examples/pipeline_parity.py            # the four default cases below
    python examples/pipeline_parity.py --all      # every case with every schedule it supports
    python examples/pipeline_parity.py --case pp2-dp2 --schedule GPipe  # a run the test suite makes
    python examples/pipeline_parity.py --case pp2-dp2-tp2 --schedule GPipe --steps 30

A tiny decoder-only transformer (embedding, 8 causal self-attention blocks, head) is split into
pipeline stages and trained with ``torch.distributed.pipelining`` schedules (4 micro-batches per
step) on a gloo world whose mesh is built by TorchTitan's own ``ParallelDims``:

* ``pp2-dp2`` (4 ranks): two stages, data parallel over 2 replicas with FSDP2 (``fully_shard``
  of each stage over the ``dp_shard`` mesh); GPipe, 1F1B;
* ``pp2-dp2-tp2`` (8 ranks): the same with DTensor tensor parallelism inside each stage
  (``parallelize_module``: column-wise q, k, v and first MLP layer, row-wise attention output
  and second MLP layer); GPipe, 1F1B;
* ``pp4-interleaved`` (4 ranks): four pipeline ranks with two stages each (8 stages, stage ``s``
  on pp rank ``s % 4``); Interleaved1F1B, LoopedBFS;
* ``pp2-v`` (4 ranks): two pipeline ranks with two stages each in a V (4 stages; pp rank ``r``
  holds stages ``r`` and ``3 - r``, so pp rank 0 holds the first stage and the last, the
  loss), data parallel over 2 replicas with FSDP2 of each stage as in ``pp2-dp2``;
  ZBVZeroBubble, DualPipeV.

In the tp case data parallelism is a gradient all-reduce over the ``dp_shard`` mesh (on the local
shards of the DTensor gradients); FSDP2 over TP's DTensors would need a 2-D (dp_shard, tp) mesh
and is not covered here. CollectiveLoader over a real ``StreamingDataset`` on MDS shards
written here feeds it, built with the case's ``stage_style`` ("loop", or "v" for ``pp2-v``) and
``schedule=`` this rank's schedule, which it checks against that style: the first stage passes
``input_ids`` to ``schedule.step``, the last stage passes ``labels`` as the target; under "v",
pp rank 0 passes both. The other pipeline ranks (pp ranks 1 and 2 of ``pp4-interleaved``, pp rank
1 of ``pp2-v``) are middle stages: they build the loader (construction is collective) but never
iterate it, as Megatron's middle stages never touch theirs (``loader.in_delivery`` is False
there); they only call ``schedule.step()``, for a step count fixed up front (at most one epoch,
so that the ranks that do iterate have a batch at every step).

Then, in the same world with a fresh copy of the model, the seed's naive set-up
(mosaicml/streaming#827): every rank builds its own ``StreamingDataset`` with
``replication = tp * cp`` and iterates it, and the first stage is pp rank 0 and the last pp rank
``pp - 1``, as the docs used to say. Under "loop" the last stage then computes the loss
against labels of other samples than the first stage's inputs. For each set-up, rank 0 then
trains the same model, initial weights and global batches (the replicas' first-stage batches of
each step, in dp order) in its own process alone, and the per-step losses are compared. Under
"v" the naive set-up does not train at all: at its first ``schedule.step`` pp rank 0, which
holds the last stage but has no labels, raises ``PipeliningMetadataError: Stage 3: loss_fn and
target required for last stage`` (torch's shape inference, before any micro-batch runs), and pp
rank 1, which passed its labels to a schedule that has no use for them, waits for stage 3's
metadata until its group's timeout. On a real job that is a crash of pp rank 0 and the rest of
its pipeline stuck until the process group's timeout; here the naive set-up's pipeline group
under "v" has a ``NAIVE_V_TIMEOUT_S`` (5 s) timeout so that the run ends and is reported.
(Giving pp rank 0 the labels of its own dataset instead, measured with ZBVZeroBubble: the
per-step losses match single-process training on those batches, 2.2e-7, but pp rank 1's
dataset partition is read and never trained on, so the naive epoch ends after 16 steps having
trained 256 of the 512 samples; this example does not run that variant.) Exit code 1 unless
ours matches, and the naive one does not (under "loop") or fails (under "v"), in every case run.

The V schedules on this CPU (torch 2.14, gloo): both ZBVZeroBubble and DualPipeV train here with
FSDP2 at pp=2 (no CUDA in their code paths). Both take exactly two stages per rank;
DualPipeV refuses fewer micro-batches than stages (``n_microbatches >= 2 * pp``: 4 here);
ZBVZeroBubble runs any number (it plans for at least ``2 * pp - 1`` and drops the rest).
FSDP2 warns that its wrapped stages return view tensors (``FSDP2-wrapped module (FSDPStage)
returned a view tensor``: nothing here changes them in place); the losses match all the same.

TorchTitan on CPU: ``ParallelDims.build_mesh`` takes its device type from
``torchtitan.tools.utils``, which falls back to "cuda" without an accelerator, so this sets
``torchtitan.distributed.parallel_dims.device_type = "cpu"`` first; and it builds its size-1 dims
and its ``batch`` dim on the "fake" backend, which only ``torch.testing._internal.distributed.
fake_pg`` registers on a CPU build. With those two lines the mesh is TorchTitan's, unchanged.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from collective_loader import CollectiveLoader
from collective_loader.streaming import StreamingSource
from collective_loader.streaming.cleanup import release
from collective_loader.testing import launch
from collective_loader.text import lm_collate

VOCAB, SEQ, DIM, HEAD_DIM, LAYERS = 61, 32, 32, 8, 8
SAMPLES = 512
# torch.distributed.pipelining.Schedule<name>
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "ZBVZeroBubble", "DualPipeV")
NAIVE_V_TIMEOUT_S = 5  # the naive set-up's pipeline group under "v", where a rank is left waiting


@dataclass(frozen=True)
class Case:
    """A mesh (TorchTitan's degrees), the schedules that fit its stages per rank, and where they
    put the stages (``style``: CollectiveLoader's ``stage_style``)."""

    pp: int
    dp: int
    tp: int
    stages_per_rank: int
    schedules: tuple[str, ...]
    fsdp: bool = False  # data parallel by FSDP2's fully_shard, else by a gradient all-reduce
    style: str = "loop"  # "loop": stage s on pp rank s % pp; "v": pp rank r holds stages r and 2 pp - 1 - r

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The stages pp rank ``pp_rank`` holds, in the order its schedule takes them."""
        if self.style == "v":
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + i * self.pp for i in range(self.stages_per_rank)]

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp


CASES = {
    "pp2-dp2": Case(pp=2, dp=2, tp=1, stages_per_rank=1, schedules=("GPipe", "1F1B"), fsdp=True),
    "pp2-dp2-tp2": Case(pp=2, dp=2, tp=2, stages_per_rank=1, schedules=("GPipe", "1F1B")),
    "pp4-interleaved": Case(pp=4, dp=1, tp=1, stages_per_rank=2, schedules=("Interleaved1F1B", "LoopedBFS")),
    "pp2-v": Case(pp=2, dp=2, tp=1, stages_per_rank=2, schedules=("ZBVZeroBubble", "DualPipeV"), fsdp=True, style="v"),
}
DEFAULT_RUNS = (
    ("pp2-dp2", "GPipe"),
    ("pp2-dp2-tp2", "1F1B"),
    ("pp4-interleaved", "Interleaved1F1B"),
    ("pp2-v", "ZBVZeroBubble"),
)


@dataclass(frozen=True)
class Args:
    data: str
    case: str
    schedule: str
    steps: int
    batch_size: int = 8  # per replica and step; split into `microbatches`
    microbatches: int = 4
    lr: float = 0.5
    out: str = ""


# --- data -----------------------------------------------------------------------------------------


def tokens(sample_id: int) -> np.ndarray:
    """``SEQ + 1`` tokens of one sample: a fixed permutation of the vocabulary applied again and
    again from a start token, so the next token is learnable from the current one."""
    out = [sample_id % VOCAB]
    for _ in range(SEQ):
        out.append((7 * out[-1] + 3) % VOCAB)
    return np.array(out, dtype=np.int32)


def write_dataset(out: str, samples: int) -> None:
    from streaming import MDSWriter

    with MDSWriter(out=out, columns={"tokens": "ndarray:int32", "id": "int"}, size_limit=1 << 16) as writer:
        for i in range(samples):
            writer.write({"tokens": tokens(i), "id": i})


# --- model ----------------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP; q, k, v are separate so a column split keeps whole heads."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.k, self.v, self.proj = (nn.Linear(DIM, DIM) for _ in range(4))
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, DIM)
        b, s, _ = x.shape
        h = self.norm1(x)
        # (batch, heads on this rank, seq, HEAD_DIM): all heads, or this tp rank's share
        q, k, v = (lin(h).view(b, s, -1, HEAD_DIM).transpose(1, 2) for lin in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    """token ids (batch, seq) -> logits (batch, seq, VOCAB)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)


class Stage(nn.Module):
    """Stage ``k`` of ``n``: blocks ``[k L/n, (k+1) L/n)``, the embedding on the first stage, norm
    and head on the last. Maps token ids (batch, seq) or hidden states (batch, seq, DIM) to hidden
    states or, on the last stage, logits (batch, seq, VOCAB). Shares ``model``'s parameters."""

    def __init__(self, model: Model, k: int, n: int) -> None:
        super().__init__()
        per = LAYERS // n
        self.embed = model.embed if k == 0 else None
        self.blocks = nn.Sequential(*model.blocks[k * per : (k + 1) * per])
        self.norm, self.head = (model.norm, model.head) if k == n - 1 else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        x = self.blocks(x)
        return self.head(self.norm(x)) if self.head is not None else x


def build_model() -> Model:
    """The same initial weights on every rank and in the reference."""
    torch.manual_seed(0)
    return Model()


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


# --- one rank -------------------------------------------------------------------------------------
# Only the ranks run these functions, and they import torch's distributed training APIs (FSDP2,
# pipelining, DTensor), TorchTitan and streaming (also write_dataset's): the launching process
# only starts the world and prints what rank 0 found, and would spend seconds importing them.


def titan_dims(pp: int, dp: int, tp: int):
    """TorchTitan's ParallelDims with these degrees, its mesh built on the CPU (see the module
    docstring); ``tests/integrations/test_titan_dataloader.py`` uses it too."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = "cpu"
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=pp, ep=1, world_size=pp * dp * tp)
    dims.build_mesh()
    return dims


def naive_batches(a: Args, tp: int):
    """The naive set-up's batches on this rank: its own StreamingDataset's."""
    from streaming import StreamingDataset

    replication = tp  # tp * cp, with cp = 1 here
    dataset = StreamingDataset(
        local=a.data,
        batch_size=a.batch_size,
        shuffle=True,
        shuffle_seed=3,
        replication=replication if replication > 1 else None,
    )
    try:
        yield from DataLoader(dataset, batch_size=a.batch_size, collate_fn=lm_collate)
    finally:
        dist.barrier()
        release(dataset)


def tp_plan() -> dict:
    """Column-wise q, k, v and first MLP layer, row-wise attention output and second MLP layer."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "q": ColwiseParallel(),
        "k": ColwiseParallel(),
        "v": ColwiseParallel(),
        "proj": RowwiseParallel(),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(),
    }


def naive_pp_group(mesh, pp: int):
    """A gloo group over this rank's pipeline, like the mesh's ``pp`` group but with a timeout of
    ``NAIVE_V_TIMEOUT_S``: under "v" the naive set-up's first step fails on pp rank 0 and leaves
    the other pp ranks waiting in a receive, which the mesh's group (30 min) would not end."""
    import datetime

    mine = None
    for ranks in mesh.mesh.movedim(0, -1).reshape(-1, pp).tolist():  # every pp group, on every rank
        group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=NAIVE_V_TIMEOUT_S))
        if dist.get_rank() in ranks:
            mine = group
    return mine


def error_text(e: BaseException) -> str:
    """One line: the exception's type and first line, without gloo's source location."""
    lines = str(e).strip().splitlines()
    first = re.sub(r"^\[[^\]]*\] ", "", lines[0]) if lines else ""  # gloo: "[.../pair.cc:561] ..."
    return f"{type(e).__name__}: {first}"


def train(a: Args, dims, naive: bool) -> dict:
    """Train a fresh model for ``a.steps`` steps on this rank, fed by CollectiveLoader or, if
    ``naive``, by the naive set-up; this rank's record of the run."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    case = CASES[a.case]
    mesh = dims.get_optional_mesh(["pp", "batch", "cp", "tp"], include_singleton_axes=True)
    pp_rank, dp_rank, tp_rank = (mesh[d].get_local_rank() for d in ("pp", "batch", "tp"))
    n_stages = case.pp * case.stages_per_rank
    model = build_model()
    stage_ids = case.stage_ids(pp_rank)
    parts = [Stage(model, k, n_stages) for k in stage_ids]
    if case.tp > 1:
        for part in parts:
            for block in part.blocks:
                parallelize_module(block, dims.get_mesh("tp"), tp_plan())
    if case.fsdp:
        for part in parts:
            fully_shard(part, mesh=dims.get_mesh("dp_shard"))
    naive_v = naive and case.style == "v"
    pp_group = naive_pp_group(mesh, case.pp) if naive_v else dims.get_mesh("pp").get_group()
    stages = [
        pipelining.PipelineStage(part, k, n_stages, torch.device("cpu"), group=pp_group)
        for k, part in zip(stage_ids, parts)
    ]
    make = getattr(pipelining, f"Schedule{a.schedule}")
    if case.stages_per_rank == 1:
        schedule = make(stages[0], n_microbatches=a.microbatches, loss_fn=loss_fn)
    else:
        schedule = make(stages, n_microbatches=a.microbatches, loss_fn=loss_fn)
    params = [p for part in parts for p in part.parameters()]
    optimizer = torch.optim.SGD(params, lr=a.lr)
    dp_group = dims.get_mesh("dp_shard").get_group() if case.dp > 1 else None
    average_grads = dp_group is not None and not case.fsdp  # FSDP2 reduce-scatters the mean itself

    if naive:  # every rank reads its own batches; the first and last pp ranks, as the docs used to say
        loader = None
        first, last = pp_rank == 0, pp_rank == case.pp - 1
        stream = naive_batches(a, case.tp)
        steps = a.steps  # and it stops where its own data ends
    else:
        source = StreamingSource(  # the same stage_style as the loader's: it places the leaders
            mesh, local=a.data, batch_size=a.batch_size, shuffle=True, shuffle_seed=3, stage_style=case.style
        )
        loader = CollectiveLoader(
            source,
            mesh,
            inputs=("input_ids", "position_ids", "sample_id"),
            labels=("labels", "sample_id"),
            stage_style=case.style,
            schedule=schedule,  # checked: the loader's last stage must be the schedule's
        )
        first, last = loader.is_first_stage, loader.is_last_stage
        # Middle stages (no every_stage keys) are outside delivery: they never iterate the loader
        # and only call schedule.step(), for a step count fixed up front (Megatron's
        # train_iters): one epoch at most, so every fed rank has a batch at each of them.
        assert loader.in_delivery == (first or last)
        stream = iter(loader) if loader.in_delivery else None
        steps = min(a.steps, SAMPLES // (case.dp * a.batch_size))
    losses, ids, error = [], [], None
    for step in range(1, steps + 1):
        batch = next(stream, None) if stream is not None else {}  # naive middle stages drop theirs
        if batch is None:  # the naive set-up's data ended
            break
        optimizer.zero_grad()
        mb_losses: list[torch.Tensor] = []
        args = (batch["input_ids"],) if first else ()
        kwargs = {"target": batch["labels"], "losses": mb_losses} if last else {}
        if naive_v and step == 1:
            dist.barrier()  # the pipeline group's short timeout then counts from the same moment on every rank
        try:
            schedule.step(*args, **kwargs)
        except Exception as e:  # the naive set-up under "v": see the module docstring
            if not naive_v:
                raise
            error = f"at step {step}: {error_text(e)}"
            break
        if first:
            ids.append(batch["sample_id"].tolist())
        if last:
            loss = torch.stack(mb_losses).mean().detach()
            if dp_group is not None:
                dist.all_reduce(loss, group=dp_group)
            losses.append(loss.item() / case.dp)
        if average_grads:  # data parallel: average the gradients over the replicas
            for p in params:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad  # the shard, in place
                dist.all_reduce(grad, group=dp_group)
                grad /= case.dp
        optimizer.step()
    if naive:
        stream.close()  # the naive datasets are released here, on every rank
        if naive_v:
            dist.destroy_process_group(pp_group)
    else:
        loader.close()  # on every rank, iterated or not
    return {
        "pp": pp_rank,
        "dp": dp_rank,
        "tp": tp_rank,
        "first": first,
        "last": last,
        "losses": losses,
        "ids": ids,
        "error": error,
    }


def rank_main(a: Args) -> int:
    """Both set-ups, one after the other, in this one world: CollectiveLoader's, then the naive
    one; then rank 0 compares each with the single-process reference (``compared``)."""
    case = CASES[a.case]
    if dist.get_rank() == 0 and not os.path.exists(a.data):
        write_dataset(a.data, SAMPLES)  # meanwhile the other ranks import TorchTitan in titan_dims
    dims = titan_dims(case.pp, case.dp, case.tp)
    dist.barrier()  # the shards are complete before any rank reads them
    mine = [train(a, dims, naive) for naive in (False, True)]
    records: list = [None] * dist.get_world_size()
    dist.all_gather_object(records, mine)
    if dist.get_rank() == 0:  # the other ranks are done
        torch.save([compared(a, one_set_up) for one_set_up in zip(*records)], a.out)
    return 0


# --- the reference and the report -------------------------------------------------------------------


def reference_losses(a: Args, global_ids: list[list[int]]) -> list[float]:
    """Single-process training of the same model on the same global batches."""
    model = build_model()
    whole = Stage(model, 0, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=a.lr)
    out = []
    for ids in global_ids:
        batch = lm_collate([{"tokens": tokens(i), "id": i} for i in ids])
        optimizer.zero_grad()
        loss = loss_fn(whole(batch["input_ids"]), batch["labels"])
        loss.backward()
        optimizer.step()
        out.append(loss.item())
    return out


def compared(a: Args, records: tuple[dict, ...]) -> dict:
    """One set-up's distributed losses (``got``) and reference losses on the first stage's global
    batches (``want``), from every rank's record of it; or, for a run that failed, each failed
    pp rank's error (``errors``, replica 0, tp rank 0)."""
    errors = [f"pp rank {r['pp']} {r['error']}" for r in records if r["error"] and r["dp"] == 0 and r["tp"] == 0]
    if errors:
        return {"errors": errors}
    loss_rank = next(r for r in records if r["last"] and r["dp"] == 0 and r["tp"] == 0)
    firsts = sorted((r for r in records if r["first"] and r["tp"] == 0), key=lambda r: r["dp"])
    global_ids = [sum((r["ids"][step] for r in firsts), []) for step in range(len(loss_rank["losses"]))]
    return {"got": loss_rank["losses"], "want": reference_losses(a, global_ids)}


def run(a: Args) -> list[dict]:
    """For CollectiveLoader's set-up, then the naive one: what ``compared`` found."""
    code = launch.run(rank_main, a, CASES[a.case].world, timeout=600)
    if code:
        raise SystemExit(f"the {a.case} {a.schedule} world failed with exit code {code}")
    return torch.load(a.out)


# float32: micro-batching, DP averaging and TP's partial sums change the summation order
# (measured: worst relative gap below 1e-6 in every case)
RTOL = 1e-5


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--case", choices=list(CASES))
    p.add_argument("--schedule", choices=list(SCHEDULES))
    p.add_argument("--all", action="store_true", help="every case with every schedule it supports")
    # 16 steps: one epoch of the naive set-up, where every replica group reads a quarter of the samples
    p.add_argument("--steps", type=int, default=16)
    ns = p.parse_args(argv)
    if ns.all:
        runs = [(name, s) for name, case in CASES.items() for s in case.schedules]
    elif ns.case or ns.schedule:
        runs = [
            (name, s)
            for name, case in CASES.items()
            for s in case.schedules
            if ns.case in (None, name) and ns.schedule in (None, s)
        ]
        if not runs:
            p.error(f"case {ns.case} does not run schedule {ns.schedule}")
    else:
        runs = list(DEFAULT_RUNS)
    tmp = tempfile.mkdtemp(prefix="cl_parity_")
    ok = True
    try:
        data = os.path.join(tmp, "mds")  # written by the first world's rank 0
        for name, schedule in runs:
            a = Args(data, name, schedule, ns.steps, out=os.path.join(tmp, "records.pt"))
            for naive, found in zip((False, True), run(a)):
                label = "naive replication" if naive else "collective_loader"
                if "errors" in found:  # expected of the naive set-up under "v" only
                    print(
                        f"{name:15s} {schedule:15s} {label:18s} fails: {'; '.join(found['errors'])}",
                        flush=True,
                    )
                    ok &= naive and CASES[name].style == "v"
                    continue
                got, want = found["got"], found["want"]
                worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
                print(
                    f"{name:15s} {schedule:15s} {label:18s} loss step 1 {got[0]:.4f} -> step {len(got)} "
                    f"{got[-1]:.4f}; single process {want[0]:.4f} -> {want[-1]:.4f}; worst relative gap {worst:.2e}",
                    flush=True,
                )
                ok &= (worst > 0.1) if naive else (worst <= RTOL)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("parity holds, and the naive set-up diverges (or fails, under v)" if ok else "PARITY CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
