"""Megatron-core's own pipeline schedule trains a GPTModel on CollectiveLoader's ``get_batch``.

    python examples/megatron_schedule.py              # pp=1 x dp=2 x tp=2, pp=2 x dp=2, pp=4 x dp=1
    python examples/megatron_schedule.py --steps 6

A small GPTModel (megatron-core's local layer spec: 4 layers, hidden 32, vocabulary 64, sequences
of 16) is trained for a few steps by ``get_forward_backward_func()`` (1F1B with pp > 1, no
pipelining at pp = 1), on one world of 4 gloo ranks, with the global batch of 8 sequences per step cut into
micro-batches of 2. Its ``forward_step`` takes each micro-batch from
``collective_loader.integrations.megatron.get_batch``: one leader per replica builds the source,
the first stage gets tokens and position ids, the last stage labels and loss mask, tensor-parallel
peers the same copies (Megatron's ``get_batch_on_this_tp_rank`` broadcast). Middle stages
(pp = 4) get no data iterator at all, as in Megatron's own training loop, and never touch the
loader. Every layout trains the same global batches from the same weights (set by each
parameter's name, whatever stage or tp rank holds it), so the per-step losses of pp=2 x dp=2 and
pp=4 x dp=1 must equal those of the unpipelined pp=1 x dp=2 (its 4 ranks as 2 tensor-parallel pairs,
whose vocabulary-parallel loss is the whole model's): exit 1 if a relative gap exceeds 1e-5.

What is ours, not Megatron's: data parallelism is a gradient all-reduce over Megatron's data
parallel group, then ``torch.optim.SGD`` (Megatron's DDP and optimizer wrap CUDA buffers); the
embedding and output weights are untied (tied, they need Megatron's embedding group all-reduce,
which its DDP does). On a CPU-only machine, ``tests/support/megatron_cpu.py`` points the few
tensors megatron-core's schedules put on ``"cuda"`` at the CPU; on GPUs drop that line, build the
mesh on ``"cuda"`` and initialize NCCL.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import zlib
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from collective_loader import mesh_place
from collective_loader.integrations.megatron import MegatronBatch, get_batch, megatron_loader
from collective_loader.testing import launch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "support"))
import megatron_cpu  # noqa: E402  (the CPU stand-ins; not needed on GPUs)

VOCAB, SEQ, HIDDEN, HEADS, LAYERS = 64, 16, 32, 4, 4
MICRO, GLOBAL = 2, 8  # sequences per micro-batch, per step (all replicas)
SEED, LR = 1234, 0.5
RTOL = 1e-5  # float32: micro-batching, tp's partial sums and the dp all-reduce change the summation order
WORLD = 4  # ranks
LAYOUTS = [(1, 2, 2), (2, 2, 1), (4, 1, 1)]  # (pp, dp, tp): the first is the reference


def sample(i: int) -> torch.Tensor:
    """Sequence ``i``: SEQ + 1 token ids, a repeated pattern the model can learn."""
    g = torch.Generator().manual_seed(i)
    period = int(torch.randint(2, 6, (1,), generator=g))
    pattern = torch.randint(0, VOCAB, (period,), generator=g)
    return pattern.repeat(SEQ // period + 2)[: SEQ + 1]


def micro_batches(dp_rank: int, dp_size: int, steps: int):
    """A replica's micro-batches (on its leader only): each step's global batch is sequences
    ``[GLOBAL * step, GLOBAL * (step + 1))``, replica ``d`` training the d-th of dp_size slices."""
    per_replica = GLOBAL // dp_size
    for step in range(steps):
        for k in range(0, per_replica, MICRO):
            first = GLOBAL * step + per_replica * dp_rank + k
            tokens = torch.stack([sample(i) for i in range(first, first + MICRO)])
            yield {
                "tokens": tokens[:, :-1],
                "labels": tokens[:, 1:],
                "loss_mask": torch.ones(MICRO, SEQ),
                "position_ids": torch.arange(SEQ).expand(MICRO, SEQ),
            }


def set_weights(model: torch.nn.Module, tp: int, tp_rank: int) -> None:
    """Every matrix drawn from a generator seeded by its name in the whole model (a decoder layer
    by its global number), so a parameter is the same whatever stage holds it. Megatron's own
    init draws in construction order, which differs by stage; biases (0) and norms (1) are kept.
    A tensor-parallel parameter is its tp rank's slice of the whole matrix, along its partition dim."""
    layers = model.decoder.layers

    def global_name(name: str) -> str:
        return re.sub(
            r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{layers[int(m[1])].layer_number - 1}.", name
        )

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2:
                continue
            name = global_name(name)
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
            shape = [n * tp if d == dim else n for d, n in enumerate(param.shape)]
            whole = torch.randn(shape, generator=g) * 0.05
            param.copy_(whole if dim is None else whole.chunk(tp, dim)[tp_rank])


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's three-value loss: summed loss, tokens, and what to report (both, to reduce over dp)."""
    loss = torch.sum(output_tensor.float() * loss_mask)
    tokens = loss_mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}


def forward_step(data_iterator, model):
    """Megatron's forward step: a middle stage has no iterator and asks for no data."""
    b = get_batch(data_iterator) if data_iterator is not None else MegatronBatch(None, None, None, None, None)
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)  # True = masked
    output = model(b.tokens, b.position_ids, causal, labels=b.labels)
    return output, partial(loss_func, b.loss_mask)


def train(pp: int, dp: int, tp: int, steps: int) -> list[float] | None:
    """One layout on this world: the per-step losses on pp rank pp - 1, tp rank 0 of replica 0, else None."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(SEED, inference_rng_tracker=True)
    # Megatron's rank order (tp innermost, then cp, dp, pp) is this mesh's row-major order
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    place = mesh_place(mesh, dist.get_rank())
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    assert (place.pp_rank, place.dp_rank) == (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
    )
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,  # each stage builds its LAYERS / pp layers from this
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        batch_p2p_sync=False,  # its torch.cuda.synchronize() after each batched send/receive
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=first,
        post_process=last,
        share_embeddings_and_output_weights=False,
    )
    set_weights(model, tp, tp_rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    megatron_cpu.use_cpu()
    forward_backward = get_forward_backward_func()

    loader = megatron_loader(lambda: micro_batches(place.dp_rank, place.dp_size, steps), mesh, timeout=120)
    data_iterator = iter(loader) if loader.in_delivery else None  # middle stages: none, as in Megatron
    dp_group = parallel_state.get_data_parallel_group()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        reported = forward_backward(
            forward_step_func=forward_step,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=GLOBAL // dp // MICRO,
            seq_length=SEQ,
            micro_batch_size=MICRO,
        )
        for param in model.parameters():  # data parallel: the replicas' mean gradient
            dist.all_reduce(param.grad, group=dp_group)
            param.grad /= dp
        optimizer.step()
        if last:
            total = torch.stack([r["lm loss"] for r in reported]).sum(0)
            dist.all_reduce(total, group=dp_group)
            losses.append(float(total[0] / total[1]))
    if data_iterator is not None:  # the replica's data ends here, on every rank that iterates
        assert next(data_iterator, None) is None
    loader.close()
    parallel_state.destroy_model_parallel()
    return losses if last and place.dp_rank == 0 and tp_rank == 0 else None


def rank_main(out: str, steps: int = 3) -> int:
    found = {}
    for pp, dp, tp in LAYOUTS:
        losses = train(pp, dp, tp, steps)
        if losses is not None:
            found[(pp, dp, tp)] = losses
    if found:
        torch.save(found, f"{out}.{dist.get_rank()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    ns = p.parse_args(argv)
    losses: dict[tuple[int, int, int], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="cl_megatron_") as tmp:
        out = os.path.join(tmp, "losses")
        code = launch.run(partial(rank_main, steps=ns.steps), out, WORLD, timeout=300)
        if code:
            print(f"the world of {WORLD} ranks failed with exit code {code}")
            return 1
        for name in os.listdir(tmp):
            losses |= torch.load(os.path.join(tmp, name))
    want = losses[LAYOUTS[0]]
    ok = sorted(losses) == sorted(LAYOUTS)
    for pp, dp, tp in LAYOUTS:
        got = losses.get((pp, dp, tp), [])
        gap = max((abs(g - w) / abs(w) for g, w in zip(got, want)), default=float("inf"))
        ok &= gap <= RTOL and len(got) == len(want)
        shown = " ".join(f"{x:.6f}" for x in got)
        print(f"pp={pp} dp={dp} tp={tp}  losses {shown}  worst relative gap to pp=1 dp=2 tp=2 {gap:.2e}")
    print("Megatron's schedule on the loader: parity holds" if ok else "PARITY CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
