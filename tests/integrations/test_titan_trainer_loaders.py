"""TorchTitan 0.3's own Trainer, unmodified, on TorchTitan's own dataloaders: each unwrapped, and
wrapped by ``load_once_per_replica`` (the one line a config function adds).

TorchTitan's ``HuggingFaceTextDataLoader`` reads a local dataset registered in its ``DATASETS``
and tokenizes with a byte-level BPE trained here (``tokenizer.json`` under ``--hf_assets_path``);
validation runs every 4 steps on another registered dataset, wrapped as well. Every run starts from
one seed checkpoint (TorchTitan's ``--checkpoint.create_seed_checkpoint``). Wrapped at pp=2 x
dp_shard=2, the Trainer trains with the losses (and validates with the validation losses) of the
unwrapped loader at pp=1 x dp_shard=2, on the same global batches, every rank of a replica fed the
same micro-batches; only one rank per replica opened the data (training and validation) and
tokenized. ``python -m pytest -m slow tests/integrations/test_titan_trainer_loaders.py`` adds: a
restart from TorchTitan's checkpoint continues with the same losses and micro-batches; TorchTitan's
interleaved and chat loaders and a ``BaseDataLoader`` of one's own (``titan_text.Numbered``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import titan_run
import titan_text

SEQ, BATCH, DP, STEPS = 64, 4, 2, 8
TOLERANCE = 2e-5  # the log prints 5 decimals; float32 sums in another order differ below that
VALIDATION_TOLERANCE = 1.5e-4  # validation losses are printed with 4 decimals


@dataclass
class Run:
    losses: dict[int, float]  # step -> TorchTitan's logged global loss
    validation: dict[int, float]  # step -> validation loss
    batches: dict[int, list[dict]]  # rank -> what its training loop took, per next()
    touches: dict[str, set[int]]  # event -> ranks (see titan_text.touched)
    replica: dict[int, int]  # rank -> data-parallel replica


@dataclass
class Data:
    root: str
    env: dict[str, str]
    flags: list[str]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Data:
    """The tokenizer, the datasets and the flags of every run, from the session's seed checkpoint
    (``titan_run.llama3_seed``)."""
    root = str(tmp_path_factory.mktemp("titan_text"))
    docs, docs_b, val = (titan_text.documents(n, seed=s) for n, s in ((400, 1), (300, 2), (100, 3)))
    titan_text.write_tokenizer(f"{root}/tokenizer", docs + docs_b, vocab_size=1024)
    for name, rows in (("text", docs), ("text_b", docs_b), ("val", val)):
        titan_text.write_jsonl(f"{root}/data/{name}/train.jsonl", [{"text": t} for t in rows])
    titan_text.write_jsonl(f"{root}/data/chat.jsonl", titan_text.qa_rows(300, seed=4))
    titan_text.write_jsonl(f"{root}/data/numbered.jsonl", [{"text": t} for t in docs])
    cache = f"{root}/data/hf_cache"  # under data/: a warm cache is what a loader opens
    env = {
        "CL_DATA": f"{root}/data",
        "CL_WATCH_DIR": f"{root}/data",
        "CL_HF_CACHE": cache,
        "HF_DATASETS_CACHE": cache,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    flags = [
        f"--hf_assets_path={root}/tokenizer",
        f"--training.seq_len={SEQ}",
        f"--training.local_batch_size={BATCH}",
        "--parallelism.pipeline_parallel_microbatch_size=1",
        "--training.mixed_precision_param=float32",
        "--metrics.disable_color_printing",
        "--checkpoint.enable",
    ]
    return Data(root, env, [*flags, titan_run.llama3_seed(tmp_path_factory)])


def _env(env: dict[str, str], out: str) -> dict[str, str]:
    return {**env, "CL_BATCHES": out, "CL_TOUCH_LOG": f"{out}.touches"}


def train(
    data: Data,
    name: str,
    config: str,
    *,
    pp: int = 1,
    flags: tuple[str, ...] = (),
    dump: str | None = None,
    timeout: float = 600,
) -> Run:
    """One run of ``pp * DP`` ranks from the seed checkpoint."""
    out = os.path.join(data.root, name)
    ranks = pp * DP
    flags = (
        *data.flags,
        f"--training.steps={STEPS}",
        f"--parallelism.pipeline_parallel_degree={pp}",
        f"--dump_folder={dump or out}",
        *flags,
    )
    seconds = titan_run.torchrun(ranks, "titan_text_configs", config, list(flags), out, timeout, _env(data.env, out))
    metrics_rank = ranks - ranks // pp  # the first rank of the last stage
    batches = {}
    for rank in range(ranks):
        with open(f"{out}.rank{rank}.jsonl") as f:
            batches[rank] = [json.loads(line) for line in f]
    run = Run(
        titan_run.losses(out, metrics_rank),
        titan_run.losses(out, metrics_rank, titan_run.VALIDATION_LOSS),
        batches,
        titan_text.read_touches(f"{out}.touches"),
        {rank: rank % DP for rank in range(ranks)},
    )
    print(
        f"\n{name}: {ranks} ranks, {seconds:.0f}s, losses {[run.losses[s] for s in sorted(run.losses)]}, "
        f"validation {run.validation}, touches {run.touches}"
    )
    return run


def steps(run: Run, replica: int, per_step: int) -> list[dict[str, list]]:
    """Per step, what replica ``replica`` trained on: its first rank's micro-batches, rows joined."""
    first = min(r for r, p in run.replica.items() if p == replica)
    records = run.batches[first]
    return [
        {key: [row for mb in records[s : s + per_step] for row in mb[key]] for key in records[0]}
        for s in range(0, len(records), per_step)
    ]


def assert_trained_like(run: Run, reference: Run, per_step: int) -> None:
    """The losses and validation losses of ``reference``, on its global batches; every rank of a
    replica fed alike; one rank per replica opened the data and tokenized."""
    assert sorted(run.losses) == sorted(reference.losses) == list(range(1, STEPS + 1))
    gaps = {step: abs(run.losses[step] - reference.losses[step]) for step in reference.losses}
    assert max(gaps.values()) <= TOLERANCE, gaps
    assert sorted(run.validation) == sorted(reference.validation) == [1, 4, 8], (run.validation, reference.validation)
    gaps = {step: abs(run.validation[step] - reference.validation[step]) for step in reference.validation}
    assert max(gaps.values()) <= VALIDATION_TOLERANCE, gaps
    for replica in range(DP):
        assert steps(run, replica, per_step) == steps(reference, replica, 1), replica
    for rank, replica in run.replica.items():
        assert run.batches[rank] == run.batches[min(r for r, p in run.replica.items() if p == replica)], rank
    assert_leaders_only(run)


def assert_leaders_only(run: Run) -> None:
    """One rank per replica opened the data (training and validation) and tokenized, and no other."""
    leaders = run.touches["encode"]
    assert len(leaders) == DP and {run.replica[r] for r in leaders} == set(range(DP)), run.touches
    for event, ranks in run.touches.items():
        assert ranks == leaders, (event, run.touches)
    assert "open" in run.touches, run.touches


@pytest.fixture(scope="module")
def reference(data) -> Run:
    """TorchTitan's text loader unwrapped at pp=1 x dp_shard=2: every rank loads and tokenizes."""
    run = train(data, "text-pp1-dp2", "text", flags=("--checkpoint.load_only",))
    assert run.touches["encode"] == run.touches["load cl_text"] == run.touches["load cl_val"] == {0, 1}, run.touches
    return run


@pytest.fixture(scope="module")
def wrapped(data) -> Run:
    """The same loader wrapped, at pp=2 x dp_shard=2 (Interleaved1F1B, 4 micro-batches per step);
    TorchTitan's checkpointer saves step 4."""
    return train(data, "text-wrapped-pp2-dp2", "text_wrapped", pp=2, flags=("--checkpoint.interval=4",))


# two Trainer runs (about 70 s); the default run trains a wrapped loader in the Trainer through
# docs/torchtitan-loaders.md's command (test_titan_docs_commands) and checks it in test_titan_wrap
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_wrapped_text_loader_trains_and_validates_with_the_losses_of_the_unwrapped_one(reference, wrapped):
    assert_trained_like(wrapped, reference, per_step=BATCH)
    assert wrapped.losses[STEPS] < wrapped.losses[1] - 0.3  # it learns
    assert set(wrapped.touches) == {"load cl_text", "load cl_val", "encode", "open"}, wrapped.touches


@pytest.mark.slow  # 4 more ranks for about 2 minutes; test_titan_wrap resumes through DCP in the default run
@pytest.mark.timeout(1200)
def test_restart_from_torchtitans_checkpoint_continues_with_the_same_losses_and_batches(data, wrapped):
    resumed = train(
        data,
        "text-wrapped-pp2-dp2-resumed",
        "text_wrapped",
        pp=2,
        dump=os.path.join(data.root, "text-wrapped-pp2-dp2"),
        flags=("--checkpoint.load_step=4", "--checkpoint.load_only"),
    )
    assert sorted(resumed.losses) == list(range(5, STEPS + 1))
    assert all(abs(resumed.losses[s] - wrapped.losses[s]) <= TOLERANCE for s in resumed.losses), resumed.losses
    assert resumed.validation == {s: v for s, v in wrapped.validation.items() if s > 4}
    for rank, batches in resumed.batches.items():
        assert batches == wrapped.batches[rank][4 * BATCH :], rank  # 4 micro-batches per step
    assert_leaders_only(resumed)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("config", ["interleaved", "chat", "numbered"])
def test_other_loaders_wrapped_train_with_the_losses_of_their_unwrapped_selves(data, config):
    reference = train(data, f"{config}-pp1-dp2", config, flags=("--checkpoint.load_only",))
    run = train(data, f"{config}-wrapped-pp2-dp2", f"{config}_wrapped", pp=2, flags=("--checkpoint.load_only",))
    assert_trained_like(run, reference, per_step=BATCH)
