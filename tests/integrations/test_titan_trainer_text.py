"""TorchTitan 0.3's own Trainer, unmodified, training on a ``text`` MDS dataset (LLM Foundry's layout,
written here with streaming's ``MDSWriter(columns={"text": "str"})``) through
``TitanStreamingDataLoader`` with ``--dataloader.text``: the leaders tokenize with the tokenizer the
Trainer builds from ``--hf_assets_path`` (a byte-level BPE trained here, offline:
``titan_text.write_tokenizer``) and pack the documents into rows with per-document positions.

Every run starts from one seed checkpoint. pp=2 x dp_shard=2 trains with the losses of pp=1 x
dp_shard=2 on the same rows, every rank of a replica fed the same micro-batches, positions
restarting at 0 at each document (BOS) and each row; only one process per replica opened the data
and tokenized (``titan_text.CountingTokenizer``). ``python -m pytest -m slow
tests/integrations/test_titan_trainer_text.py`` adds: a restart from TorchTitan's checkpoint (the
packer's hand-over) continues with the same losses and rows; the same documents tokenized offline and
written as LLM Foundry's ``tokens`` bytes (``--dataloader.pack --dataloader.token_dtype uint16``)
train with the losses of the text; tokenizing in the leaders' DataLoader workers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import pytest
import titan_run
import titan_text
import torch

from collective_loader import LeaderError
from collective_loader.integrations.titan_batches import check_columns, titan_inputs
from collective_loader.integrations.titan_streaming import TitanStreamingDataLoader, read_as
from collective_loader.integrations.titan_wrap import with_mesh
from collective_loader.text import Balance, Packing, TextColumn, TokenColumn

SEQ, BATCH, DP, STEPS = 64, 4, 2, 8
TOLERANCE = 2e-5  # the log prints 5 decimals; float32 sums in another order differ below that
BOS = "<|bos|>"


# --- the config, without processes ----------------------------------------------------------


def test_each_layout_is_read_as_the_flags_say():
    config = TitanStreamingDataLoader.Config
    assert read_as(config(), None, seq_len=8) == (TokenColumn("tokens"), None)
    assert read_as(config(column="ids", token_dtype="uint32"), None, 8) == (TokenColumn("ids", "uint32"), None)
    packing = Packing(seq_len=8, at_end="drop", boundaries=("position_ids",))
    assert read_as(config(pack=True, at_end="drop"), None, 8) == (TokenColumn("tokens"), packing)
    tokenizer = object()  # the Trainer's; used where the leaders first encode
    assert read_as(config(text=True), tokenizer, 8) == (TextColumn(tokenizer, "text"), Packing(seq_len=8))
    assert read_as(config(text=True, column="body"), tokenizer, 8)[0] == TextColumn(tokenizer, "body")
    assert read_as(config(pack=True, balance=True), None, 8)[1].balance == Balance(rows=1)
    blocks = read_as(config(pack=True, balance=True, balance_replicas=4), None, 8)[1].balance
    assert blocks == Balance(rows=1, replicas=4)
    assert read_as(config(pack=True), None, 8)[1].balance is None


@pytest.mark.parametrize(
    "fields, tokenizer, message",
    [
        ({"text": True}, None, "--dataloader.text tokenizes with the tokenizer the Trainer builds.*--hf_assets_path"),
        ({"text": True, "token_dtype": "uint16"}, object(), "leave out --dataloader.token_dtype"),
        ({"token_dtype": "float32"}, None, "--dataloader.token_dtype float32: token ids are integers"),
        ({"documents_per_batch": 8}, None, "add --dataloader.pack .* or --dataloader.text"),
        ({"at_end": "drop"}, None, "add --dataloader.pack .* or --dataloader.text"),
        ({"balance": True}, None, "--dataloader.balance say how documents are packed: add --dataloader.pack"),
        ({"pack": True, "balance_replicas": 2}, None, "--dataloader.balance_replicas .*: add --dataloader.balance"),
    ],
)
def test_flags_that_do_not_fit_together_name_the_flag_to_change(fields, tokenizer, message):
    config = with_mesh(TitanStreamingDataLoader.Config(dataset_path="/data/mds", **fields), "a mesh")
    with pytest.raises(ValueError, match=message):  # raised in __init__, which every rank runs, before any collective
        config.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=8, local_batch_size=1)


@pytest.mark.parametrize(
    "layout, columns, message",
    [
        (TokenColumn(), {"text": "str"}, "no column 'tokens' .*set --dataloader.column .* or --dataloader.text"),
        (TokenColumn("text"), {"text": "str"}, "holds text .*set --dataloader.text"),
        (TextColumn(None), {"tokens": "bytes"}, "no column 'text' .*set --dataloader.column to the column of text"),
        (TextColumn(None, "tokens"), {"tokens": "bytes"}, "holds bytes, not text .*leave out --dataloader.text"),
        (TokenColumn(dtype="uint16"), {"tokens": "ndarray:int32"}, "leave out --dataloader.token_dtype"),
        (TokenColumn(), {"tokens": "json"}, "holds json: token ids are bytes .*--dataloader.token_dtype"),
    ],
)
def test_a_dataset_the_flags_do_not_fit_is_refused_naming_the_flag(layout, columns, message):
    with pytest.raises(ValueError, match=message):
        check_columns(layout, columns)
    for fits in ({"tokens": "bytes"}, {"tokens": "ndarray:uint16"}, {"tokens": "ndarray"}):
        check_columns(TokenColumn(), fits)
    check_columns(TextColumn(None), {"text": "str", "id": "int"})


def test_torchtitans_command_line_sets_the_layout():
    from torchtitan.config import ConfigManager

    flags = ["--dataloader.dataset_path", "/data/mds", "--dataloader.text", "--dataloader.column", "body"]
    flags += ["--dataloader.documents_per_batch", "16", "--dataloader.at_end", "drop"]
    config = ConfigManager().parse_args(["--module", "titan_text_configs", "--config", "mds", *flags])
    dataloader = config.dataloader
    assert isinstance(dataloader, TitanStreamingDataLoader.Config)
    assert (dataloader.text, dataloader.column, dataloader.documents_per_batch, dataloader.at_end) == (
        True,
        "body",
        16,
        "drop",
    )
    config = ConfigManager().parse_args(
        ["--module", "titan_text_configs", "--config", "mds", "--dataloader.pack", "--dataloader.token_dtype", "uint16"]
    )
    assert (config.dataloader.pack, config.dataloader.token_dtype, config.dataloader.text) == (True, "uint16", False)


def test_packed_batches_reach_the_trainer_under_its_names():
    packed = {"input_ids": torch.zeros(1, 4), "position_ids": torch.zeros(1, 4)}
    assert list(titan_inputs(packed)) == ["input", "positions"]
    rows = {"input": torch.zeros(1, 4), "positions": torch.zeros(1, 4)}  # titan_collate's already
    assert titan_inputs(rows).keys() == rows.keys()


# --- the loader on ranks, without the Trainer ---------------------------------------------------

LOADER_STEPS, LOADER_STOP = 6, 2  # micro-batches taken uninterrupted; the step a checkpoint is taken after


@pytest.fixture(scope="module")
def text_data(tmp_path_factory) -> str:
    """A tokenizer and a text dataset, for the loader without the Trainer."""
    root = str(tmp_path_factory.mktemp("titan_text_loader"))
    texts = titan_text.documents(120, seed=7)
    titan_text.write_tokenizer(f"{root}/tokenizer", texts, vocab_size=512)
    write_text(f"{root}/text", texts)
    return root


def titan_text_loader(mesh, root: str, **fields) -> TitanStreamingDataLoader:
    """The loader as the Trainer builds it, with TorchTitan's tokenizer."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    config = TitanStreamingDataLoader.Config(dataset_path=f"{root}/text", text=True, timeout=60, **fields)
    with_mesh(config, mesh)
    tokenizer = HuggingFaceTokenizer(tokenizer_path=f"{root}/tokenizer")
    return config.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=16, local_batch_size=2)


def take(dataloader: TitanStreamingDataLoader, steps: int) -> list[dict[str, list]]:
    out = []
    for input_dict, labels in dataloader:
        out.append({**{k: v.tolist() for k, v in input_dict.items()}, "labels": labels.tolist()})
        if len(out) == steps:
            return out
    raise AssertionError(f"the loader ended after {len(out)} steps")


def text_loader_run(root: str) -> dict:
    """On this rank of pp=2 x dp=1 (rank 0 leads): micro-batches uninterrupted; then STOP, TorchTitan's
    state bytes, a new loader resumed from them; then a dataset read with the wrong flag."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1, 1, 1), mesh_dim_names=("pp", "batch", "cp", "tp"))
    full_loader = titan_text_loader(mesh, root)
    full = take(full_loader, LOADER_STEPS)
    full_loader.close()
    first = titan_text_loader(mesh, root)
    head = take(first, LOADER_STOP)
    state = first.state_dict()  # every rank, after the same step: the leaders gather the hand-over
    first.close()
    resumed = titan_text_loader(mesh, root)
    resumed.load_state_dict(state)
    tail = take(resumed, LOADER_STEPS - LOADER_STOP)
    resumed.close()
    try:
        titan_text_loader(mesh, root, column="missing")
        refused = ""
    except LeaderError as e:  # the leader's refusal, raised on every rank while the loader is built
        refused = str(e)
    return {"rank": dist.get_rank(), "full": full, "head": head, "tail": tail, "refused": refused}


@pytest.mark.timeout(300)
def test_the_text_loader_delivers_to_every_stage_resumes_from_its_state_and_refuses_a_wrong_column(worlds, text_data):
    records = worlds.get(2).run(text_loader_run, text_data, timeout=240)
    first, last = records
    assert first["full"] == last["full"] and set(first["full"][0]) == {"input", "positions", "labels"}
    for rec in records:
        assert rec["head"] + rec["tail"] == rec["full"], rec["rank"]  # the resume continues exactly
        assert "no column 'missing'" in rec["refused"] and "set --dataloader.column" in rec["refused"], rec


# --- TorchTitan's Trainer ---------------------------------------------------------------------


@dataclass
class Run:
    losses: dict[int, float]  # step -> TorchTitan's logged global loss
    batches: dict[int, list[dict]]  # rank -> what its training loop took, per next()
    touches: dict[str, set[int]]  # event -> ranks (see titan_text.touched)
    encoders: dict[int, set[int]]  # rank -> the processes (pids) that tokenized for it
    seconds: float


@dataclass
class Data:
    root: str
    env: dict[str, str]
    flags: list[str]
    bos: int  # the tokenizer's BOS id


def write_text(out: str, texts: list[str]) -> None:
    """LLM Foundry's text layout: one document per sample, one shard (the sample order then does
    not depend on how the shards were cut)."""
    from streaming import MDSWriter

    with MDSWriter(out=out, columns={"text": "str"}) as writer:
        for text in texts:
            writer.write({"text": text})


def write_token_bytes(out: str, tokenizer_dir: str, texts: list[str]) -> None:
    """The same documents tokenized offline (BOS, EOS) as LLM Foundry's ``tokens`` bytes of uint16."""
    from streaming import MDSWriter
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(tokenizer_path=tokenizer_dir)
    with MDSWriter(out=out, columns={"tokens": "bytes"}) as writer:
        for text in texts:
            ids = np.array(tokenizer.encode(text, add_bos=True, add_eos=True), dtype=np.uint16)
            writer.write({"tokens": ids.tobytes()})


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Data:
    """The tokenizer, the text dataset and the flags of every run, from the session's seed checkpoint
    (``titan_run.llama3_seed``)."""
    from tokenizers import Tokenizer

    root = str(tmp_path_factory.mktemp("titan_mds_text"))
    texts = titan_text.documents(400, seed=1)
    titan_text.write_tokenizer(f"{root}/tokenizer", texts, vocab_size=1024)  # every rank reads it: not watched
    write_text(f"{root}/data/text", texts)
    env = {"CL_DATA": f"{root}/data", "CL_WATCH_DIR": f"{root}/data"}
    flags = [
        f"--hf_assets_path={root}/tokenizer",
        f"--dataloader.dataset_path={root}/data/text",
        "--dataloader.text",
        f"--dataloader.documents_per_batch={BATCH}",  # the same rows whatever the micro-batch
        f"--training.seq_len={SEQ}",
        f"--training.local_batch_size={BATCH}",
        "--parallelism.pipeline_parallel_microbatch_size=1",
        "--training.mixed_precision_param=float32",
        "--metrics.disable_color_printing",
        "--checkpoint.enable",
    ]
    bos = Tokenizer.from_file(f"{root}/tokenizer/tokenizer.json").token_to_id(BOS)
    return Data(root, env, [*flags, titan_run.llama3_seed(tmp_path_factory)], bos)


def _env(env: dict[str, str], out: str) -> dict[str, str]:
    return {**env, "CL_BATCHES": out, "CL_TOUCH_LOG": f"{out}.touches"}


def train(
    data: Data, name: str, *, pp: int = 1, flags: tuple[str, ...] = (), dump: str | None = None, timeout: float = 420
) -> Run:
    """One run of ``pp * DP`` ranks from the seed checkpoint; losses from the first rank of the last stage."""
    out = os.path.join(data.root, name)
    ranks = pp * DP
    all_flags = [
        *data.flags,
        f"--training.steps={STEPS}",
        f"--parallelism.pipeline_parallel_degree={pp}",
        f"--dump_folder={dump or out}",
        *flags,
    ]
    seconds = titan_run.torchrun(ranks, "titan_text_configs", "mds", all_flags, out, timeout, _env(data.env, out))
    batches = {}
    for rank in range(ranks):
        with open(f"{out}.rank{rank}.jsonl") as f:
            batches[rank] = [json.loads(line) for line in f]
    encoders: dict[int, set[int]] = {}
    with open(f"{out}.touches") as f:
        for event, rank, pid in (line.rsplit(" ", 2) for line in f):
            if event == "encode":
                encoders.setdefault(int(rank), set()).add(int(pid))
    touches = titan_text.read_touches(f"{out}.touches")
    run = Run(titan_run.losses(out, ranks - ranks // pp), batches, touches, encoders, seconds)
    print(f"\n{name}: {ranks} ranks, {seconds:.0f}s, losses {[run.losses[s] for s in sorted(run.losses)]}")
    return run


def replica(rank: int) -> int:
    return rank % DP  # TorchTitan numbers the ranks (pp, batch), outermost first


def rows(run: Run, dp_rank: int) -> list[dict[str, list]]:
    """Replica ``dp_rank``'s rows in training order (its first rank's micro-batches, rows joined)."""
    first = min(r for r in run.batches if replica(r) == dp_rank)
    return [
        {key: row for key, row in zip(batch, values)}
        for batch in run.batches[first]
        for values in zip(*(batch[key] for key in batch))
    ]


def assert_packed(run: Run, bos: int) -> None:
    """Every rank of a replica took the same batches; in each row, labels are the inputs shifted by
    one, and positions count up from 0 and restart at each document (its BOS) and at the row's start."""
    restarts = 0
    for rank in run.batches:
        assert run.batches[rank] == run.batches[replica(rank)], rank
    for dp_rank in range(DP):
        for row in rows(run, dp_rank):
            inputs, positions, labels = row["input"], row["positions"], row["labels"]
            assert len(inputs) == len(positions) == len(labels) == SEQ
            assert labels[:-1] == inputs[1:]
            for i in range(SEQ):
                starts = i == 0 or inputs[i] == bos
                assert positions[i] == (0 if starts else positions[i - 1] + 1), (dp_rank, i, row)
                restarts += starts and i > 0
    assert restarts > 10 * DP, restarts  # documents are shorter than rows: most rows hold several


def assert_leaders_only(run: Run, leaders: int = DP) -> None:
    """One process per replica (and its workers) opened the data and tokenized, no other rank."""
    encoders = run.touches["encode"]
    assert len(encoders) == leaders and {replica(r) for r in encoders} == set(range(DP)), run.touches
    assert run.touches["open"] == encoders, run.touches


@pytest.fixture(scope="module")
def reference(data) -> Run:
    """pp=1 x dp_shard=2: the losses the pipeline must not change."""
    return train(data, "pp1-dp2", flags=("--checkpoint.load_only",))


@pytest.fixture(scope="module")
def pipelined(data) -> Run:
    """pp=2 x dp_shard=2 (Interleaved1F1B, 4 micro-batches of 1 row per step); TorchTitan's
    checkpointer saves step 4 (the leaders gather the packer's hand-over)."""
    return train(data, "pp2-dp2", pp=2, flags=("--checkpoint.interval=4",))


# two Trainer runs (about 70 s); the default run checks pp=2's losses against pp=1's on rows
# (test_titan_trainer) and the text loader on every stage (above), and trains on text through
# docs/torchtitan.md's command
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pipeline_parallel_trains_on_the_text_with_the_losses_of_pp1(data, reference, pipelined):
    assert sorted(pipelined.losses) == sorted(reference.losses) == list(range(1, STEPS + 1))
    gaps = {step: abs(pipelined.losses[step] - reference.losses[step]) for step in reference.losses}
    assert max(gaps.values()) <= TOLERANCE, gaps
    assert pipelined.losses[STEPS] < pipelined.losses[1] - 0.3  # it learns
    for dp_rank in range(DP):
        assert rows(pipelined, dp_rank) == rows(reference, dp_rank), dp_rank
    assert rows(pipelined, 0) != rows(pipelined, 1)  # each replica its own documents
    assert_packed(pipelined, data.bos)
    assert_leaders_only(pipelined)
    assert set(reference.touches["encode"]) == {0, 1}  # pp=1: every rank leads its replica


@pytest.mark.slow  # 4 more ranks for about a minute; tests/distributed/test_text_data.py resumes the packer
@pytest.mark.timeout(600)
def test_restart_from_torchtitans_checkpoint_continues_with_the_same_losses_and_rows(data, pipelined):
    resumed = train(
        data,
        "pp2-dp2-resumed",
        pp=2,
        dump=os.path.join(data.root, "pp2-dp2"),
        flags=("--checkpoint.load_step=4", "--checkpoint.load_only"),
    )
    assert sorted(resumed.losses) == list(range(5, STEPS + 1))
    assert all(abs(resumed.losses[s] - pipelined.losses[s]) <= TOLERANCE for s in resumed.losses), resumed.losses
    for rank, batches in resumed.batches.items():
        assert batches == pipelined.batches[rank][4 * BATCH :], rank  # 4 micro-batches per step
    assert_leaders_only(resumed)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_documents_as_token_bytes_train_with_the_losses_of_the_text(data, reference):
    """LLM Foundry's ``tokens`` bytes of the same documents, tokenized offline: the same rows."""
    texts = titan_text.documents(400, seed=1)
    write_token_bytes(f"{data.root}/data/bytes", f"{data.root}/tokenizer", texts)
    run = train(
        data,
        "bytes-pp1-dp2",
        flags=(
            f"--dataloader.dataset_path={data.root}/data/bytes",
            "--dataloader.no-text",
            "--dataloader.pack",
            "--dataloader.token_dtype=uint16",
            "--checkpoint.load_only",
        ),
    )
    assert all(abs(run.losses[s] - reference.losses[s]) <= TOLERANCE for s in reference.losses), run.losses
    for dp_rank in range(DP):
        assert rows(run, dp_rank) == rows(reference, dp_rank), dp_rank
    assert "encode" not in run.touches, run.touches  # nothing to tokenize


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_leaders_workers_tokenize(data):
    run = train(data, "workers-pp2-dp2", pp=2, flags=("--dataloader.num_workers=2", "--checkpoint.load_only"))
    assert sorted(run.losses) == list(range(1, STEPS + 1))
    assert_packed(run, data.bos)
    assert_leaders_only(run)
    assert all(len(pids) == 2 for pids in run.encoders.values()), run.encoders  # each leader's two workers


def step_tokens(run: Run, step: int) -> list[int]:
    """Every token the replicas trained at ``step`` (0-based), sorted: each row's inputs and its last label."""
    out = []
    for dp_rank in range(DP):
        for row in rows(run, dp_rank)[step * BATCH : (step + 1) * BATCH]:
            out += [*row["input"], row["labels"][-1]]
    return sorted(out)


@pytest.mark.slow  # two more Trainer runs (6 ranks, about two minutes)
@pytest.mark.timeout(1200)
def test_balanced_rows_keep_the_pipeline_parity_and_each_steps_tokens(data, reference):
    """``--dataloader.balance``: pp=2 x dp_shard=2 still trains with pp=1's losses and rows; each
    step trains the tokens of the unbalanced run, some on the other replica."""
    balanced = train(data, "pp1-dp2-balanced", flags=("--checkpoint.load_only", "--dataloader.balance"))
    pipelined = train(data, "pp2-dp2-balanced", pp=2, flags=("--checkpoint.load_only", "--dataloader.balance"))
    assert sorted(pipelined.losses) == sorted(balanced.losses) == list(range(1, STEPS + 1))
    gaps = {step: abs(pipelined.losses[step] - balanced.losses[step]) for step in balanced.losses}
    assert max(gaps.values()) <= TOLERANCE, gaps
    for dp_rank in range(DP):
        assert rows(pipelined, dp_rank) == rows(balanced, dp_rank), dp_rank
        for row in rows(pipelined, dp_rank):
            assert row["labels"][:-1] == row["input"][1:]
    for step in range(STEPS):
        assert step_tokens(balanced, step) == step_tokens(reference, step), step
    assert any(rows(balanced, d) != rows(reference, d) for d in range(DP)), "balancing moved no row"
    assert_leaders_only(pipelined)
