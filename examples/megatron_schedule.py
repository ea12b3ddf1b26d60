"""Megatron-core's own pipeline schedule trains a GPTModel on CollectiveLoader's ``get_batch``,
from a Megatron ``.bin``/``.idx`` corpus read on the leaders only, and resumes exactly.

    python examples/megatron_schedule.py       # pp=1 x dp=2 x tp=2; pp=2 x dp=2; pp=4 x dp=1; pp=2 x dp=2 x vp=2
    python examples/megatron_schedule.py --steps 6

Rank 0 first writes a corpus as Megatron's preprocess_data.py does (``IndexedDatasetBuilder``:
documents of token ids, each ending with the tokenizer's end of document, ``NullTokenizer.eod``,
which megatron-core 0.18 moved). Then, on one world of 4 gloo ranks,
a small GPTModel (megatron-core's local layer spec: 4 layers, hidden 32, vocabulary 64, sequences
of 16) is trained for a few steps by ``get_forward_backward_func()`` (no pipelining at pp = 1,
1F1B with pp > 1, the interleaved 1F1B with two model chunks per pp rank, vp = 2), the global batch of 8 sequences per step cut into micro-batches of 2. Its
``forward_step`` takes each micro-batch from ``collective_loader.integrations.megatron.get_batch``:
one leader per replica builds megatron-core's GPTDataset of the corpus's train split (Megatron-LM's
default ``--split 969,30,1``) and reads it in Megatron-LM's sampler order
(``collective_loader.integrations.megatron_data``), with ``eod_mask_loss`` (every micro-batch's loss
mask must hide exactly the positions after an end of document, or the rank raises); the first stage gets tokens and
position ids, the last stage labels and loss mask, tensor-parallel peers the same copies (what
Megatron's ``get_batch_on_this_tp_rank`` broadcasts). Middle stages (pp = 4) get no data iterator
at all, as in Megatron's own training loop, and never touch the loader; every rank closes it.
Under vp = 2 each pp rank holds two chunks (virtual stages): only the chunk that embeds (pp rank 0's
first) and the one with the loss (the last pp rank's second) read micro-batches.

Every layout trains the same global batches from the same weights (set by each parameter's name,
whatever stage or tp rank holds it), so the per-step losses of pp=2 x dp=2, pp=4 x dp=1 and
pp=2 x dp=2 x vp=2 must equal those of the unpipelined pp=1 x dp=2 (its 4 ranks as 2 tensor-parallel pairs, whose
vocabulary-parallel loss is the whole model's) within a relative 1e-5. pp=2 x dp=2 also saves
every rank's loader and model state after step 1, and a new run of that layout resumed from it
must give the uninterrupted run's later losses exactly. Exit 1 otherwise.

What is ours, not Megatron's: data parallelism is a gradient all-reduce over Megatron's data
parallel group, then ``torch.optim.SGD`` (Megatron's DDP and optimizer wrap CUDA buffers); the
embedding and output weights are untied (tied, they need Megatron's embedding group all-reduce,
which its DDP does). On a CPU-only machine, ``tests/support/megatron_cpu.py`` points the few
tensors megatron-core's schedules put on ``"cuda"`` at the CPU; on GPUs drop that line, build the
mesh on ``"cuda"`` and initialize NCCL.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import re
import sys
import tempfile
import zlib
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from collective_loader import mesh_place
from collective_loader.integrations.megatron import MegatronBatch, get_batch, megatron_loader
from collective_loader.integrations.megatron_data import MegatronSamples, gpt_dataset
from collective_loader.testing import launch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "support"))
import megatron_cpu  # noqa: E402  (the CPU stand-ins; not needed on GPUs)

VOCAB, SEQ, HIDDEN, HEADS, LAYERS = 64, 16, 32, 4, 4
DOCUMENTS = 64
MICRO, GLOBAL = 2, 8  # sequences per micro-batch, per step (all replicas)
SEED, LR = 1234, 0.5
RTOL = 1e-5  # float32: micro-batching, tp's partial sums and the dp all-reduce change the summation order
WORLD = 4  # ranks
# (pp, dp, tp, vp: model chunks per pp rank, Megatron's virtual stages); the first is the reference
LAYOUTS = [(1, 2, 2, 1), (2, 2, 1, 1), (4, 1, 1, 1), (2, 2, 1, 2)]
RESUMED, RESUME_AFTER = (2, 2, 1, 1), 1  # this layout is checkpointed after this step and resumed


class Checkpoint(NamedTuple):
    """One rank's checkpoint: its loader's state and its model's."""

    loader: dict
    model: dict


class Trained(NamedTuple):
    """What one layout's run gives a rank: the losses (on the rank that reports them), its
    checkpoint (when asked for one), and the name of megatron-core's schedule that ran."""

    losses: list[float] | None
    checkpoint: Checkpoint | None
    schedule: str


@functools.cache
def tokenizer():
    """megatron-core's NullTokenizer within the model's vocabulary of VOCAB. Its end of document
    depends on the version: ``NullTokenizer(63).eod`` is 63 in 0.16 (vocabulary 64), 62 from 0.18
    on (vocabulary 63); everything here reads ``.eod``."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return NullTokenizer(VOCAB - 1)


def write_corpus(prefix: str) -> None:
    """What Megatron's preprocess_data.py writes: documents of token ids (repeated patterns the
    model can learn), each ending with the tokenizer's end of document (and holding it nowhere
    else), as ``prefix.bin/.idx``."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    eod = tokenizer().eod
    g = torch.Generator().manual_seed(SEED)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(DOCUMENTS):
        period, length = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((2, 6), (8, 48)))
        pattern = torch.randint(0, eod, (period,), generator=g)
        document = torch.cat([pattern.repeat(length // period + 1)[:length], torch.tensor([eod])])
        builder.add_document(document.numpy(), [len(document)])
    builder.finalize(prefix + ".idx")


def samples(prefix: str, dp_rank: int, dp_size: int) -> MegatronSamples:
    """A replica's micro-batches (built on its leader only): megatron-core's GPTDataset of the
    corpus, in Megatron-LM's sampler order, so every layout trains the same global batches."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=SEQ,
        blend=([prefix], None),  # Megatron-LM's --data-path
        split="969,30,1",  # and --split (its default): the first 62 of the 64 documents train
        tokenizer=tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=True,  # --eod-mask-loss: no loss on predicting the token after an end of document
        create_attention_mask=False,  # forward_step makes the causal mask: no tensor to send
    )
    return MegatronSamples(gpt_dataset(config), MICRO, dp_rank, dp_size)


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


def masks_the_ends_of_documents(b: MegatronBatch) -> bool:
    """Whether the loss mask is 0 exactly after each end of document (Megatron's eod_mask_loss
    masks the positions whose input is one): the input of each position but the first is the
    label before it."""
    ends = b.labels[:, :-1] == tokenizer().eod
    return torch.equal(b.loss_mask[:, 1:], (~ends).to(b.loss_mask.dtype))


def forward_step(data_iterator, model):
    """Megatron's forward step: only a model chunk that embeds or computes the loss reads a
    micro-batch (a middle stage has no iterator at all)."""
    reads = data_iterator is not None and (model.pre_process or model.post_process)
    b = get_batch(data_iterator) if reads else MegatronBatch(None, None, None, None, None)
    if b.loss_mask is not None and not masks_the_ends_of_documents(b):
        raise RuntimeError(f"the loss mask does not hide exactly the ends of documents ({tokenizer().eod})")
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)  # True = masked
    output = model(b.tokens, b.position_ids, causal, labels=b.labels)
    return output, partial(loss_func, b.loss_mask)


def train(
    prefix: str,
    layout: tuple[int, int, int, int],
    steps: int,
    resume: Checkpoint | None = None,
    save_after: int = 0,
) -> Trained:
    """One layout on this world, ``steps`` steps (from ``resume``, this rank's checkpoint of the same
    layout): the per-step losses on pp rank pp - 1, tp rank 0 of replica 0 (else None), and this
    rank's checkpoint after step ``save_after`` (None if 0)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    pp, dp, tp, vp = layout
    virtual = vp if vp > 1 else None
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=virtual
    )
    model_parallel_cuda_manual_seed(SEED, inference_rng_tracker=True)
    # Megatron's rank order (tp innermost, then cp, dp, pp) is this mesh's row-major order
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    place = mesh_place(mesh, dist.get_rank())
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    assert (place.pp_rank, place.dp_rank) == (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
    )
    last = parallel_state.is_pipeline_last_stage()  # this pp rank holds the loss

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,  # each stage builds its LAYERS / (pp * vp) layers from these
        virtual_pipeline_model_parallel_size=virtual,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        batch_p2p_sync=False,  # its torch.cuda.synchronize() after each batched send/receive
    )
    stages = [None] if virtual is None else list(range(vp))  # this pp rank's model chunks
    chunks = [
        GPTModel(
            config,
            get_gpt_layer_local_spec(),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=False,
            vp_stage=stage,
        )
        for stage in stages
    ]
    model = torch.nn.ModuleList(chunks)  # one state dict and parameter list for them all
    for chunk in chunks:
        set_weights(chunk, tp, tp_rank)
    if resume is not None:
        model.load_state_dict(resume.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    megatron_cpu.use_cpu()
    forward_backward = get_forward_backward_func()

    loader = megatron_loader(lambda: samples(prefix, place.dp_rank, place.dp_size), mesh, timeout=120)
    if resume is not None:
        loader.load_state_dict(resume.loader)
    data_iterator = iter(loader) if loader.in_delivery else None  # middle stages: none, as in Megatron
    # one iterator per chunk, all the same: a micro-batch is read by the chunk that embeds or the one with the loss
    dp_group = parallel_state.get_data_parallel_group()
    losses, saved = [], None
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        reported = forward_backward(
            forward_step_func=forward_step,
            data_iterator=[data_iterator] * len(chunks),
            model=chunks,
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
        if step == save_after:  # every rank, after the same step (SGD without momentum keeps no state)
            saved = Checkpoint(loader.state_dict(), copy.deepcopy(model.state_dict()))
    loader.close()  # every rank, middle stages included: a leader's failure would be raised here
    parallel_state.destroy_model_parallel()
    reports = last and place.dp_rank == 0 and tp_rank == 0
    return Trained(losses if reports else None, saved, forward_backward.__name__)


def rank_main(paths: tuple[str, str], steps: int = 3) -> int:
    prefix, out = paths
    if dist.get_rank() == 0:
        write_corpus(prefix)  # Megatron's preprocessing, before training
    dist.barrier()
    found = {}
    for layout in LAYOUTS:
        run = train(prefix, layout, steps, save_after=RESUME_AFTER if layout == RESUMED else 0)
        if run.losses is not None:
            found[layout] = run.losses
            found[layout, "schedule"] = run.schedule
        if run.checkpoint is not None:  # a new run of the same layout from that checkpoint
            resumed = train(prefix, layout, steps - RESUME_AFTER, resume=run.checkpoint).losses
            if resumed is not None:
                found["resumed"] = resumed
    torch.save(found, f"{out}.{dist.get_rank()}")  # each layout's losses come from one rank
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    ns = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cl_megatron_") as tmp:
        out = os.path.join(tmp, "losses")
        code = launch.run(
            partial(rank_main, steps=ns.steps), (os.path.join(tmp, "corpus_text_document"), out), WORLD, timeout=300
        )
        if code:
            print(f"the world of {WORLD} ranks failed with exit code {code}")
            return 1
        losses = {k: v for rank in range(WORLD) for k, v in torch.load(f"{out}.{rank}").items()}
    want = losses[LAYOUTS[0]]
    ok = True
    for pp, dp, tp, vp in LAYOUTS:
        got = losses.get((pp, dp, tp, vp), [])
        gap = max((abs(g - w) / abs(w) for g, w in zip(got, want)), default=float("inf"))
        ok &= gap <= RTOL and len(got) == len(want)
        shown = " ".join(f"{x:.6f}" for x in got)
        schedule = losses.get(((pp, dp, tp, vp), "schedule"), "?")
        print(
            f"pp={pp} dp={dp} tp={tp} vp={vp} {schedule}  losses {shown}  worst relative gap to pp=1 dp=2 tp=2 {gap:.2e}"
        )
    resumed, tail = losses.get("resumed", []), losses[RESUMED][RESUME_AFTER:]
    exact = resumed == tail
    ok &= exact
    pp, dp, tp, vp = RESUMED
    shown = " ".join(f"{x:.6f}" for x in resumed)
    print(f"pp={pp} dp={dp} tp={tp} vp={vp}  resumed after step {RESUME_AFTER}: losses {shown}  exact: {exact}")
    print("Megatron's schedule on the loader: parity holds" if ok else "PARITY CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
