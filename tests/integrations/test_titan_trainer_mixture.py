"""TorchTitan 0.3's own Trainer, unmodified, training on a data mixture: ``--dataloader.mixture FILE``
(a TOML file of two ``text`` MDS sources and a schedule, written here) makes
``TitanStreamingDataLoader`` read a ``MixtureSource``, the leaders tokenizing with the Trainer's
tokenizer and packing each source into rows of its own.

The two sources are told apart in every row the Trainer took: one holds lower-case documents, the
other upper-case ones (one byte-level BPE trained on both). Every row comes from the source the
schedule's ``Allocation`` names for it (half and half for the first 4 steps, then 3/4 lower), the
mixture's ``source_id`` does not reach TorchTitan's train step, every rank of a replica takes the
same micro-batches, and only the leaders open the data and tokenize: pp=2 x dp_shard=2 by default
(one Trainer run). ``python -m pytest -m slow tests/integrations/test_titan_trainer_mixture.py``
adds pp=1 x dp_shard=2, whose losses and rows pp=2's equal, and a restart from TorchTitan's
checkpoint of step 4 (each source's cursor and the allocator's counters), which continues with the
same losses and rows.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any

import pytest
import titan_run
import titan_text
import torch
from test_titan_trainer_text import BATCH, DP, SEQ, STEPS, TOLERANCE, Data, Run, assert_packed, rows, train, write_text

from collective_loader.integrations.titan_streaming import (
    GlobalBatch,
    TitanStreamingDataLoader,
    mixture_sources,
    read_as,
)
from collective_loader.integrations.titan_wrap import with_mesh
from collective_loader.streaming import MixtureSource, StreamingSource
from collective_loader.text import MixtureSchedule, Packing, TokenColumn
from collective_loader.text.mixture import Allocation

# the first 4 steps half and half, then 3/4 lower: the change falls on a training step's first
# row (4 steps x DP replicas x BATCH rows x SEQ tokens), so pp=2's micro-batches see pp=1's weights
SWITCH = 4 * DP * BATCH * SEQ
Phase = MixtureSchedule.Phase
SCHEDULE = MixtureSchedule((Phase(0, {"lower": 0.5, "upper": 0.5}), Phase(SWITCH, {"lower": 0.75, "upper": 0.25})))
MIXTURE = """\
unit = "tokens"
[[phase]]
start = 0
weights = {{ lower = 0.5, upper = 0.5 }}
[[phase]]
start = {switch}
weights = {{ lower = 0.75, upper = 0.25 }}

[sources.lower]
local = "{data}/lower"
[sources.upper]
local = "{data}/upper"
shuffle_seed = 5
"""


# --- the config, without processes ----------------------------------------------------------


def write_mixture(path: str, data: str) -> str:
    with open(path, "w") as f:
        f.write(MIXTURE.format(data=data, switch=SWITCH))
    return path


def test_the_command_line_reads_a_mixture_with_the_flags_every_source_shares(tmp_path):
    from torchtitan.config import ConfigManager

    mixture = write_mixture(str(tmp_path / "mixture.toml"), "/data")
    flags = ["--dataloader.mixture", mixture, "--dataloader.pack", "--dataloader.shuffle_seed", "17"]
    config = ConfigManager().parse_args(["--module", "titan_text_configs", "--config", "mds", *flags]).dataloader
    assert isinstance(config, TitanStreamingDataLoader.Config)
    assert (config.mixture, config.pack, config.dataset_path) == (mixture, True, None)
    sources, schedule = mixture_sources(config)
    assert schedule == SCHEDULE
    assert sources == {  # the flags' shuffle settings, but where a source's table sets its own
        "lower": {"local": "/data/lower", "shuffle": True, "shuffle_seed": 17, "num_canonical_nodes": None},
        "upper": {"local": "/data/upper", "shuffle": True, "shuffle_seed": 5, "num_canonical_nodes": None},
    }
    assert read_as(config, None, seq_len=8) == (TokenColumn("tokens"), Packing(seq_len=8))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, "--dataloader.mixture packs every source's documents .*add --dataloader.pack .* or --dataloader.text"),
        ({"token_dtype": "uint16"}, "add --dataloader.pack"),
        ({"pack": True, "balance": True}, "--dataloader.mixture does not balance .*leave out --dataloader.balance"),
        ({"pack": True, "mixture": "missing.toml"}, "missing.toml: cannot read the mixture"),
        ({"pack": True, "mixture": "mixture.yaml"}, "mixture.yaml: a mixture must be a .json or .toml file"),
    ],
)
def test_a_mixture_the_flags_cannot_read_is_refused_naming_the_flag(tmp_path, fields, message):
    fields = {"mixture": write_mixture(str(tmp_path / "mixture.toml"), "/data"), **fields}
    config = with_mesh(TitanStreamingDataLoader.Config(**fields), "a mesh")
    with pytest.raises(ValueError, match=message):  # raised in __init__, which every rank runs, before any collective
        config.build(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=8, local_batch_size=1)


class Loads:
    """Stands in for a CollectiveLoader: records the state it is given."""

    def __init__(self) -> None:
        self.loaded: list[Any] = []

    def load_state_dict(self, state: Any) -> None:
        self.loaded.append(state)


def resumed(mixture: bool, source: dict[str, Any], per_replica: int = 4) -> Loads:
    """A TitanStreamingDataLoader of one replica (documents_per_batch ``per_replica``) loading a
    state saved at dp=2 with ``source``, as TorchTitan's checkpointer hands it over."""
    dataloader = TitanStreamingDataLoader.__new__(TitanStreamingDataLoader)  # no mesh: only load_state_dict runs
    dataloader.loader, dataloader.mixture, dataloader._rank_id = Loads(), mixture, "dp_rank_0"
    kind = MixtureSource if mixture else StreamingSource  # only their saved_global_batches() runs
    dataloader.source = kind.__new__(kind)
    dataloader.global_batch = GlobalBatch(per_replica, 1, "--dataloader.documents_per_batch")
    buffer = io.BytesIO()
    torch.save({"source_elastic": True, "dp_size": 2, "source": source}, buffer)
    dataloader.load_state_dict({"dp_rank_0": buffer.getvalue(), "world_size": 2})
    return dataloader.loader


def test_a_mixtures_state_resumes_with_every_sources_global_batch():
    saved = {"mixture": {}, "progress": 1024.0, "sources": {"lower": {"global_batch": 8}, "upper": None}}
    assert resumed(True, saved, per_replica=8).loaded[0]["source"] == saved  # dp 2 -> 1: 4 x 2 = 8 x 1
    with pytest.raises(ValueError, match="global batch of 8 samples .*set --dataloader.documents_per_batch 8"):
        resumed(True, saved)
    with pytest.raises(
        ValueError, match="saved reading a mixture and this run reads one dataset .*exclude_from_loading"
    ):
        resumed(False, saved, per_replica=8)
    with pytest.raises(ValueError, match="saved reading one dataset and this run reads a mixture"):
        resumed(True, {"global_batch": 8, "sample_in_epoch": 0})


# --- TorchTitan's Trainer ---------------------------------------------------------------------


@dataclass
class MixtureData(Data):
    decode: Any  # token ids -> text (the tokenizer the Trainer loads)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> MixtureData:
    """The tokenizer, two text sources (short lower-case documents; long upper-case ones, which span
    rows) under ``data/``, the mixture file beside it (every rank reads it: not watched), and the
    flags of every run, from the session's seed checkpoint (``titan_run.llama3_seed``)."""
    from tokenizers import Tokenizer

    root = str(tmp_path_factory.mktemp("titan_mixture"))
    lower = titan_text.documents(200, seed=1)
    upper = [text.upper() for text in titan_text.documents(40, seed=2, words=(60, 200))]
    titan_text.write_tokenizer(f"{root}/tokenizer", lower + upper, vocab_size=1024)
    write_text(f"{root}/data/lower", lower)
    write_text(f"{root}/data/upper", upper)
    mixture = write_mixture(f"{root}/mixture.toml", f"{root}/data")
    env = {"CL_DATA": f"{root}/data", "CL_WATCH_DIR": f"{root}/data"}
    flags = [
        f"--hf_assets_path={root}/tokenizer",
        f"--dataloader.mixture={mixture}",
        "--dataloader.text",
        f"--dataloader.documents_per_batch={BATCH}",  # the same rows whatever the micro-batch
        f"--training.seq_len={SEQ}",
        f"--training.local_batch_size={BATCH}",
        "--parallelism.pipeline_parallel_microbatch_size=1",
        "--training.mixed_precision_param=float32",
        "--metrics.disable_color_printing",
        "--checkpoint.enable",
    ]
    tokenizer = Tokenizer.from_file(f"{root}/tokenizer/tokenizer.json")
    bos = tokenizer.token_to_id("<|bos|>")
    return MixtureData(root, env, [*flags, titan_run.llama3_seed(tmp_path_factory)], bos, tokenizer.decode)


def source_of(row: dict[str, list], decode: Any) -> str:
    """The source a row was packed from: its text is all lower case or all upper case."""
    text = decode(row["input"])
    assert text.islower() or text.isupper(), text  # one source per row
    return "lower" if text.islower() else "upper"


def scheduled(rows_per_batch: int, batches: int) -> list[list[str]]:
    """Per replica, the source of each row it takes, as the schedule's allocator names them for
    batches of ``rows_per_batch`` rows per replica."""
    allocation = Allocation.start(SCHEDULE, DP)
    out: list[list[str]] = [[] for _ in range(DP)]
    for step in range(batches):
        every, allocation = allocation.allocate(step * DP * rows_per_batch * SEQ, rows_per_batch)
        for dp_rank, names in enumerate(every):
            out[dp_rank] += names
    return out


def assert_mixed(run: Run, data: MixtureData, rows_per_batch: int) -> None:
    """Each replica's rows came from the sources the schedule names, row by row; no key but
    TorchTitan's reached the Trainer."""
    want = scheduled(rows_per_batch, STEPS * BATCH // rows_per_batch)
    every = [name for names in want for name in names]
    assert every.count("lower") == DP * (8 + 12) and every.count("upper") == DP * (8 + 4)  # 2:2 per step, then 3:1
    for dp_rank in range(DP):
        assert [source_of(row, data.decode) for row in rows(run, dp_rank)] == want[dp_rank], dp_rank
    for batches in run.batches.values():
        assert all(set(batch) == {"input", "positions", "labels"} for batch in batches)


def assert_leaders_only(run: Run) -> None:
    """One process per replica opened the sources and tokenized, no other rank."""
    encoders = run.touches["encode"]
    assert len(encoders) == DP and {rank % DP for rank in encoders} == set(range(DP)), run.touches
    assert run.touches["open"] == encoders, run.touches


@pytest.fixture(scope="module")
def pipelined(data) -> Run:
    """pp=2 x dp_shard=2 (Interleaved1F1B, 4 micro-batches of 1 row per step); TorchTitan's
    checkpointer saves step 4 (each source's hand-over, gathered by the leaders)."""
    return train(data, "pp2-dp2", pp=2, flags=("--checkpoint.interval=4",))


@pytest.mark.slow  # a Trainer run (4 ranks); by default the mixture runs in test_mixture_source and demo --mix
@pytest.mark.timeout(600)
def test_a_mixture_trains_under_torchtitans_trainer_row_by_row_as_scheduled(data, pipelined):
    assert sorted(pipelined.losses) == list(range(1, STEPS + 1))
    assert pipelined.losses[STEPS] < pipelined.losses[1] - 0.3  # it learns
    assert_mixed(pipelined, data, rows_per_batch=1)  # under pp the dataloader's batch is the micro-batch
    assert rows(pipelined, 0) != rows(pipelined, 1)  # each replica its own documents
    assert_packed(pipelined, data.bos)  # every rank of a replica the same micro-batches; positions per document
    assert_leaders_only(pipelined)
    assert os.path.isdir(os.path.join(data.root, "pp2-dp2", "checkpoint", "step-4"))


@pytest.mark.slow  # a second Trainer run (2 ranks, 33 s here); the default run checks pp=2's rows against the schedule
@pytest.mark.timeout(900)
def test_pipeline_parallel_trains_on_the_mixture_with_the_losses_of_pp1(data, pipelined):
    reference = train(data, "pp1-dp2", flags=("--checkpoint.load_only",))
    assert sorted(reference.losses) == list(range(1, STEPS + 1))
    gaps = {step: abs(pipelined.losses[step] - reference.losses[step]) for step in reference.losses}
    assert max(gaps.values()) <= TOLERANCE, gaps
    assert_mixed(reference, data, rows_per_batch=BATCH)
    for dp_rank in range(DP):
        assert rows(pipelined, dp_rank) == rows(reference, dp_rank), dp_rank


@pytest.mark.slow  # 4 more ranks (35 s here)
@pytest.mark.timeout(600)
def test_restart_from_torchtitans_checkpoint_continues_the_mixture(data, pipelined):
    restarted = train(
        data,
        "pp2-dp2-resumed",
        pp=2,
        dump=os.path.join(data.root, "pp2-dp2"),
        flags=("--checkpoint.load_step=4", "--checkpoint.load_only"),
    )
    assert sorted(restarted.losses) == list(range(5, STEPS + 1))
    assert all(abs(restarted.losses[s] - pipelined.losses[s]) <= TOLERANCE for s in restarted.losses)
    for rank, batches in restarted.batches.items():
        assert batches == pipelined.batches[rank][4 * BATCH :], rank  # 4 micro-batches per step
    assert_leaders_only(restarted)
