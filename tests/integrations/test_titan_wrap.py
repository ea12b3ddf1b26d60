"""TorchTitan's own dataloaders wrapped by ``wrap_dataloader``, on TorchTitan's data-loading mesh
(``ParallelDims`` of pp=2 x dp_shard=2 x cp=2, 8 gloo ranks): every rank of a replica gets exactly
the batches the unwrapped loader gives its dp_rank, only leaders open the data and tokenize,
checkpoints through ``torch.distributed.checkpoint`` resume exactly and load into unwrapped loaders
(and back), each ``build()`` (TorchTitan's validator) starts afresh, and failures reach every rank.

The loaders: TorchTitan's ``HuggingFaceTextDataLoader`` on a local dataset registered in its
``DATASETS``, ``InterleavedHuggingFaceTextDataLoader`` over two of them, ``ChatDataLoader`` on a
local JSON file, and a user's own ``BaseDataLoader`` (``titan_text.Numbered``, with extra keys of
other dtypes). The tokenizer is a byte-level BPE trained here with ``tokenizers``. The unwrapped
reference batches are computed in the test process.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

import pytest
import titan_text
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets.text_datasets import (
    ChatDataLoader,
    HFDataSource,
    HuggingFaceTextDataLoader,
    InterleavedHuggingFaceTextDataLoader,
)

from collective_loader import LeaderError, mesh_place
from collective_loader.integrations.titan_streaming import TitanStreamingDataLoader
from collective_loader.integrations.titan_wrap import ReplicaDataLoader, unwrap_dataloader, with_mesh, wrap_dataloader

PP, DP, CP = 2, 2, 2
RANKS = PP * DP * CP
SEQ, BATCH, STEPS = 32, 2, 6


@dataclass(frozen=True)
class Data:
    root: str
    tokenizer: str  # the folder of tokenizer.json
    text: str  # folders of train.jsonl
    text_b: str
    chat: str  # a JSON-lines file
    numbered: str  # a JSON-lines file
    cache: str  # the datasets cache (under data/: a warm cache is what a loader opens)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Data:
    root = str(tmp_path_factory.mktemp("titan_wrap"))
    docs, docs_b = titan_text.documents(160, seed=1), titan_text.documents(120, seed=2)
    d = Data(
        root,
        f"{root}/tokenizer",
        f"{root}/data/text",
        f"{root}/data/text_b",
        f"{root}/data/chat.jsonl",
        f"{root}/data/numbered.jsonl",
        f"{root}/data/hf_cache",
    )
    titan_text.write_tokenizer(d.tokenizer, docs + docs_b, vocab_size=600)
    titan_text.write_jsonl(f"{d.text}/train.jsonl", [{"text": t} for t in docs])
    titan_text.write_jsonl(f"{d.text_b}/train.jsonl", [{"text": t} for t in docs_b])
    titan_text.write_jsonl(d.chat, titan_text.qa_rows(120, seed=3))
    titan_text.write_jsonl(d.numbered, [{"text": t} for t in docs])
    return d


def loader_config(name: str, d: Data):
    """The user's (unwrapped) dataloader config ``name``."""
    if name == "text":
        return HuggingFaceTextDataLoader.Config(dataset="cl_text", dataset_path=d.text)
    if name == "interleaved":
        return InterleavedHuggingFaceTextDataLoader.Config(
            sources=[
                HFDataSource(dataset="cl_text", dataset_path=d.text, weight=2.0),
                HFDataSource(dataset="cl_text_b", dataset_path=d.text_b, weight=1.0),
            ]
        )
    if name == "chat":
        return ChatDataLoader.Config(
            dataset_path="json",
            sample_processor=titan_text.qa_messages,
            load_dataset_kwargs={"data_files": d.chat, "split": "train", "cache_dir": d.cache},
        )
    if name == "numbered":
        return titan_text.Numbered.Config(dataset_path=d.numbered, extra=True)
    raise ValueError(name)


def setup_process(d: Data, log: str, env=os.environ) -> None:
    """What every process needs: the registered datasets and the touch log (``env``: a rank's
    environment, or the test process's monkeypatched one)."""
    for key, value in dict(CL_TOUCH_LOG=log, CL_WATCH_DIR=f"{d.root}/data", CL_HF_CACHE=d.cache).items():
        env[key] = value
    titan_text.register_datasets()
    titan_text.watch_opens()


@pytest.fixture
def here(data, tmp_path, monkeypatch) -> Data:
    """``data``, with this (the test) process set up to build the unwrapped reference loaders."""
    setup_process(data, str(tmp_path / "reference"), env=_Setenv(monkeypatch))
    return data


class _Setenv:
    def __init__(self, monkeypatch) -> None:
        self.monkeypatch = monkeypatch

    def __setitem__(self, key: str, value: str) -> None:
        self.monkeypatch.setenv(key, value)


def tokenizer(d: Data) -> HuggingFaceTokenizer:
    return titan_text.CountingTokenizer(tokenizer_path=d.tokenizer)


def build_args(d: Data, dp_rank: int) -> dict:
    return dict(dp_world_size=DP, dp_rank=dp_rank, tokenizer=tokenizer(d), seq_len=SEQ, local_batch_size=BATCH)


_MESH: list = []


def titan_mesh():
    """TorchTitan's data-loading mesh of pp x dp_shard x cp on the CPU, built once per rank process."""
    if not _MESH:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend
        import torchtitan.distributed.parallel_dims as parallel_dims

        parallel_dims.device_type = "cpu"
        dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=DP, cp=CP, tp=1, pp=PP, ep=1, world_size=RANKS)
        dims.build_mesh()
        _MESH.append(dims.get_optional_mesh(["pp", "batch", "cp", "tp"], include_singleton_axes=True))
    return _MESH[0]


def wrapped(name: str, d: Data) -> ReplicaDataLoader:
    """On every rank: the wrapped config ``name`` built as TorchTitan's Trainer builds it."""
    config = wrap_dataloader(loader_config(name, d), mesh=titan_mesh())
    return config.build(**build_args(d, mesh_place(titan_mesh(), dist.get_rank()).dp_rank))


def take(pairs, steps: int) -> list:
    out = []
    for pair in pairs:
        out.append(pair)
        if len(out) == steps:
            break
    return out


def reference(name: str, d: Data, dp_rank: int, steps: int, state: dict | None = None) -> list:
    """What the unwrapped loader yields on ``dp_rank`` (after ``state``), in this process."""
    loader = loader_config(name, d).build(**build_args(d, dp_rank))
    if state is not None:
        loader.load_state_dict(state)
    return take(loader, steps)


def assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for (inputs, labels), (want_inputs, want_labels) in zip(got, want):
        assert sorted(inputs) == sorted(want_inputs)
        for key, value in [*inputs.items(), ("labels", labels)]:
            expected = want_inputs.get(key, want_labels) if key != "labels" else want_labels
            assert value.dtype == expected.dtype and value.shape == expected.shape, key
            assert torch.equal(value, expected), key


# --- on every rank ------------------------------------------------------------------------------


def rank_batches(name: str, d: Data, log: str) -> dict:
    setup_process(d, log)
    loader = wrapped(name, d)
    try:
        return {
            "dp_rank": loader.dp_rank,
            "leader": mesh_place(titan_mesh(), dist.get_rank()).is_leader,
            "batches": take(loader, STEPS),
        }
    finally:
        loader.close()


LOADERS = ["text", "interleaved", "chat", "numbered"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", LOADERS)
def test_every_rank_gets_what_the_unwrapped_loader_gives_its_dp_rank(data, worlds, tmp_path, here, name):
    log = str(tmp_path / "touches")
    results = worlds.get(RANKS).run(rank_batches, name, data, log, timeout=300)
    touches = titan_text.read_touches(log)
    leaders = {r for r, res in enumerate(results) if res["leader"]}
    assert len(leaders) == DP and {results[r]["dp_rank"] for r in leaders} == set(range(DP))
    # only leaders built the loader, opened the data and tokenized; each of them did
    assert touches.get("encode") == leaders, touches
    assert touches.get("open") == leaders, touches
    for dp_rank in range(DP):
        want = reference(name, data, dp_rank, STEPS)
        for res in results:
            if res["dp_rank"] == dp_rank:
                assert_same(res["batches"], want)


def rank_resume(name: str, d: Data, log: str, checkpoints: str, load_from: str | None) -> dict:
    """Run STEPS (save after 2) or, with ``load_from``, load it into a fresh loader and run on."""
    setup_process(d, log)
    loader = wrapped(name, d)
    try:
        if load_from is not None:
            dcp.load({"dataloader": loader}, checkpoint_id=load_from)
            return {"dp_rank": loader.dp_rank, "batches": take(loader, STEPS - 2)}
        it = iter(loader)
        first = take(it, 2)
        dcp.save({"dataloader": loader}, checkpoint_id=checkpoints)
        return {"dp_rank": loader.dp_rank, "batches": first + take(it, STEPS - 2), "state": loader.state_dict()}
    finally:
        loader.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["text", "numbered"])
def test_checkpoints_resume_exactly_and_load_into_unwrapped_loaders_and_back(data, worlds, tmp_path, here, name):
    world = worlds.get(RANKS)
    log, saved = str(tmp_path / "touches"), str(tmp_path / "wrapped")
    full = world.run(rank_resume, name, data, log, saved, None, timeout=300)
    resumed = world.run(rank_resume, name, data, log, saved, saved, timeout=300)
    for a, b in zip(full, resumed):
        assert_same(b["batches"], a["batches"][2:])  # prefetched batches are not skipped
    # non-leaders hold no state; a leader's is the wrapped loader's own, TorchTitan's per-DP-rank form
    states = {(r["dp_rank"], bool(r["state"])) for r in full}
    assert states == {(dp, True) for dp in range(DP)} | {(dp, False) for dp in range(DP)}
    assert all(set(r["state"]) in (set(), {f"dp_rank_{r['dp_rank']}", "world_size"}) for r in full)

    unwrapped = {dp: loader_config(name, data).build(**build_args(data, dp)) for dp in range(DP)}
    for dp, loader in unwrapped.items():  # the wrapped run's checkpoint resumes the unwrapped loaders
        state = loader.state_dict()
        dcp.load({"dataloader": state}, checkpoint_id=saved, no_dist=True)
        loader.load_state_dict(state)
        want = take(loader, STEPS - 2)
        assert_same(want, next(r for r in full if r["dp_rank"] == dp)["batches"][2:])
    # and an unwrapped run's checkpoint resumes the wrapped loaders
    fresh = {dp: loader_config(name, data).build(**build_args(data, dp)) for dp in range(DP)}
    states = {}
    for loader in fresh.values():
        it = iter(loader)
        take(it, 2)
        states.update(loader.state_dict())
    theirs = str(tmp_path / "unwrapped")
    dcp.save({"dataloader": states}, checkpoint_id=theirs, no_dist=True)
    again = world.run(rank_resume, name, data, log, saved, theirs, timeout=300)
    for a, b in zip(full, again):
        assert_same(b["batches"], a["batches"][2:])


def rank_rebuilds(d: Data, log: str) -> dict:
    """TorchTitan's validator: build() at every validation, a few steps each, never closed."""
    setup_process(d, log)
    config = wrap_dataloader(loader_config("text", d), mesh=titan_mesh())
    args = build_args(d, mesh_place(titan_mesh(), dist.get_rank()).dp_rank)
    passes, loaders = [], []
    for steps in (3, 1, 4):
        loaders.append(config.build(**args))
        passes.append(take(loaders[-1], steps))
    loaders[0].close()
    return {"dp_rank": loaders[0].dp_rank, "passes": passes, "same": all(x is loaders[0] for x in loaders)}


@pytest.mark.timeout(600)
def test_each_build_starts_afresh_over_the_same_process_groups(data, worlds, tmp_path, here):
    results = worlds.get(RANKS).run(rank_rebuilds, data, str(tmp_path / "touches"), timeout=300)
    for res in results:
        want = reference("text", data, res["dp_rank"], 4)
        for got in res["passes"]:
            assert_same(got, want[: len(got)])
        assert res["same"]  # one CollectiveLoader: its process groups, its transfer thread


def rank_finite(d: Data, log: str) -> dict:
    """A finite loader (TorchTitan's validator with ``--validator.steps -1``) iterated to its end."""
    setup_process(d, log)
    config = wrap_dataloader(replace(loader_config("text", d), infinite=False), mesh=titan_mesh())
    loader = config.build(**build_args(d, mesh_place(titan_mesh(), dist.get_rank()).dp_rank))
    try:
        return {"dp_rank": loader.dp_rank, "steps": sum(1 for _ in loader)}
    finally:
        loader.close()


@pytest.mark.timeout(600)
def test_a_finite_loader_ends_on_every_rank_where_the_shortest_replica_ends(data, worlds, tmp_path, here):
    results = worlds.get(RANKS).run(rank_finite, data, str(tmp_path / "touches"), timeout=300)
    unwrapped = [
        len(take(replace(loader_config("text", data), infinite=False).build(**build_args(data, dp)), 10**6))
        for dp in range(DP)
    ]
    assert unwrapped[0] != unwrapped[1], unwrapped  # the replicas hold different amounts
    assert {res["steps"] for res in results} == {min(unwrapped)}, (results, unwrapped)


def rank_fails(d: Data, log: str, where: str) -> str:
    setup_process(d, log)
    config = wrap_dataloader(loader_config("text", d), mesh=titan_mesh())
    if where == "build":
        config.dataset = "no_such_dataset"  # fails on the leaders only: they alone build the loader
    args = build_args(d, mesh_place(titan_mesh(), dist.get_rank()).dp_rank)
    try:
        loader = config.build(**args)
    except LeaderError as e:
        return str(e)
    try:
        loader.load_state_dict({f"dp_rank_{loader.dp_rank}": b"", "world_size": DP + 1})
        take(loader, 1)
    except LeaderError as e:
        return str(e)
    finally:
        loader.close()
    return "no error"


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "where, message",
    [
        ("build", "could not build its source: .*Dataset no_such_dataset is not supported"),
        ("resume", "saved with 3 data-parallel ranks and this run has 2: .*per-rank iterator state"),
    ],
)
def test_a_leaders_failure_reaches_every_rank(data, worlds, tmp_path, where, message):
    results = worlds.get(RANKS).run(rank_fails, data, str(tmp_path / "touches"), where, timeout=300)
    for text in results:
        assert re.search(message, text), text


def test_a_wrapped_config_keeps_the_users_class_and_fields_and_needs_the_mesh():
    config = HuggingFaceTextDataLoader.Config(dataset="cl_text", dataset_path="/data", infinite=False, num_workers=2)
    wrapped_config = wrap_dataloader(config)
    assert isinstance(wrapped_config, HuggingFaceTextDataLoader.Config)
    assert unwrap_dataloader(wrapped_config) == config and wrap_dataloader(wrapped_config) is wrapped_config
    # what TorchTitan's validator does to its dataloader config
    assert unwrap_dataloader(replace(wrapped_config, infinite=True)) == replace(config, infinite=True)
    assert wrapped_config.to_dict() == config.to_dict()
    with pytest.raises(ValueError, match="load_once_per_replica"):
        wrapped_config.build(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=8, local_batch_size=1)
    with pytest.raises(ValueError, match=r"wrap_dataloader\(config, mesh=mesh\)"):  # outside the Trainer
        wrapped_config.build(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=8, local_batch_size=1)
    with pytest.raises(TypeError, match=r"takes no mesh: wrap it first, wrap_dataloader\(config, mesh=mesh\)"):
        with_mesh(config, "a mesh")
    given = wrap_dataloader(config, mesh="a mesh")  # what TitanTrainer.init_distributed() hands over, given here
    assert unwrap_dataloader(given) == config and wrap_dataloader(given, mesh="another") is given
    mds = TitanStreamingDataLoader.Config(dataset_path="/data/mds")  # delivers collectively itself
    assert wrap_dataloader(mds) is mds
