"""Pipeline-parallel training whose loss matches single-process training, and the seed's naive
set-up whose loss does not.

    python examples/pipeline_parity.py                       # GPipe and 1F1B, mesh (pp, dp) = (2, 2)
    python examples/pipeline_parity.py --schedule 1F1B --steps 30

A tiny decoder-only transformer (embedding, causal self-attention blocks, head) is split into two
pipeline stages and trained with ``torch.distributed.pipelining`` (``ScheduleGPipe`` or
``Schedule1F1B``, 4 micro-batches per step) on a 4-rank gloo world, data parallel over 2 replicas
(gradients averaged over the dp group). CollectiveLoader over a real ``StreamingDataset`` on MDS
shards written here feeds it: the first stage passes ``input_ids`` to ``schedule.step``, the last
stage passes ``labels`` as the target.

Then the same model, initial weights and global batches (the replicas' batches of each step, in
dp order) are trained in one process, and the per-step losses are compared. Last, the seed's
naive set-up (mosaicml/streaming#827): every rank builds its own ``StreamingDataset`` with
``replication = tp * cp`` (= 1 here), so the last stage computes the loss against labels of other
samples than the first stage's inputs. Exit code 1 unless ours matches and the naive one does not.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.data import DataLoader

from collective_loader import CollectiveLoader, launch
from collective_loader.streaming import StreamingSource, lm_collate, release

VOCAB, SEQ, DIM, HEADS, LAYERS = 61, 32, 32, 4, 4
SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
MESH = (("pp", "dp"), (2, 2))
SAMPLES = 512


@dataclass(frozen=True)
class Args:
    data: str
    schedule: str
    steps: int
    batch_size: int = 8  # per replica and step; split into `microbatches`
    microbatches: int = 4
    lr: float = 0.5
    naive: bool = False
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
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, DIM)
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (batch, heads, seq, head_dim)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, DIM))
        return x + self.mlp(self.norm2(x))


class FirstStage(nn.Module):
    """token ids (batch, seq) -> hidden states (batch, seq, DIM)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS // 2)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.embed(ids))


class LastStage(nn.Module):
    """hidden states (batch, seq, DIM) -> logits (batch, seq, VOCAB)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS - LAYERS // 2)])
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(h)))


def build_model() -> nn.ModuleList:
    """The two stages with the same initial weights on every rank and in the reference."""
    torch.manual_seed(0)
    return nn.ModuleList([FirstStage(), LastStage()])


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


# --- one rank -------------------------------------------------------------------------------------


def batches(a: Args, mesh):
    """This rank's batches: CollectiveLoader's, or the naive set-up's own StreamingDataset's."""
    if not a.naive:
        source = StreamingSource(mesh, local=a.data, batch_size=a.batch_size, shuffle=True, shuffle_seed=3)
        loader = CollectiveLoader(source, mesh, inputs=("input_ids", "position_ids", "sample_id"),
                                  labels=("labels", "sample_id"))
        try:
            yield from loader
        finally:
            loader.close()
        return
    from streaming import StreamingDataset

    replication = 1  # tp * cp: this mesh has neither
    dataset = StreamingDataset(local=a.data, batch_size=a.batch_size, shuffle=True, shuffle_seed=3,
                               replication=replication)
    try:
        yield from DataLoader(dataset, batch_size=a.batch_size, collate_fn=lm_collate)
    finally:
        dist.barrier()
        release(dataset)


def rank_main(a: Args) -> int:
    mesh = init_device_mesh("cpu", MESH[1], mesh_dim_names=MESH[0])
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    part = build_model()[pp_rank]
    stage = PipelineStage(part, pp_rank, MESH[1][0], torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = SCHEDULES[a.schedule](stage, n_microbatches=a.microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(part.parameters(), lr=a.lr)
    dp_group, dp_size = mesh["dp"].get_group(), MESH[1][1]
    losses, ids = [], []
    stream = batches(a, mesh)
    for step, batch in zip(range(a.steps), stream):
        optimizer.zero_grad()
        if pp_rank == 0:
            schedule.step(batch["input_ids"])
            ids.append(batch["sample_id"].tolist())
        else:
            mb_losses: list[torch.Tensor] = []
            schedule.step(target=batch["labels"], losses=mb_losses)
            loss = torch.stack(mb_losses).mean().detach()
            dist.all_reduce(loss, group=dp_group)
            losses.append(loss.item() / dp_size)
        for p in part.parameters():  # data parallel: average the gradients over the replicas
            dist.all_reduce(p.grad, group=dp_group)
            p.grad /= dp_size
        optimizer.step()
    stream.close()  # the loader or the naive dataset is released here, on every rank
    records: list = [None] * dist.get_world_size()
    dist.all_gather_object(records, {"pp": pp_rank, "dp": dp_rank, "losses": losses, "ids": ids})
    if dist.get_rank() == 0:
        torch.save(records, a.out)
    return 0


# --- the reference and the report -------------------------------------------------------------------


def reference_losses(a: Args, global_ids: list[list[int]]) -> list[float]:
    """Single-process training of the same model on the same global batches."""
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=a.lr)
    out = []
    for ids in global_ids:
        batch = lm_collate([{"tokens": tokens(i), "id": i} for i in ids])
        optimizer.zero_grad()
        loss = loss_fn(model[1](model[0](batch["input_ids"])), batch["labels"])
        loss.backward()
        optimizer.step()
        out.append(loss.item())
    return out


def run(a: Args) -> tuple[list[float], list[float]]:
    """(distributed losses, reference losses on the first stage's global batches) for one set-up."""
    code = launch.run(rank_main, a, math.prod(MESH[1]), timeout=600)
    if code:
        raise SystemExit(f"the {a.schedule} world failed with exit code {code}")
    records = torch.load(a.out, weights_only=False)
    last = next(r for r in records if r["pp"] == 1)
    firsts = sorted((r for r in records if r["pp"] == 0), key=lambda r: r["dp"])
    global_ids = [sum((r["ids"][step] for r in firsts), []) for step in range(len(last["losses"]))]
    return last["losses"], reference_losses(a, global_ids)


RTOL = 1e-5  # float32: micro-batching and DP averaging change the summation order (measured: ~2e-7)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schedule", choices=[*SCHEDULES, "all"], default="all")
    # 16 steps: one epoch of the naive set-up, where every rank reads a quarter of the samples
    p.add_argument("--steps", type=int, default=16)
    ns = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="cl_parity_")
    ok = True
    try:
        data = os.path.join(tmp, "mds")
        write_dataset(data, SAMPLES)
        for name in SCHEDULES if ns.schedule == "all" else [ns.schedule]:
            for naive in (False, True):
                a = Args(data, name, ns.steps, naive=naive, out=os.path.join(tmp, "records.pt"))
                got, want = run(a)
                worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
                label = "naive replication" if naive else "collective_loader"
                print(f"{name:5s} {label:18s} loss step 1 {got[0]:.4f} -> step {len(got)} {got[-1]:.4f}; "
                      f"single process {want[0]:.4f} -> {want[-1]:.4f}; worst relative gap {worst:.2e}")
                ok &= (worst > 0.1) if naive else (worst <= RTOL)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("parity holds, and the naive set-up diverges" if ok else "PARITY CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
