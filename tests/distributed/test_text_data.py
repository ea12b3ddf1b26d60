"""LLM data end to end: real MDS shards written as LLM Foundry writes them (streaming's MDSWriter
with ``columns={"tokens": "bytes"}`` and ``ids.tobytes()``, ``{"tokens": "ndarray:uint16"}``,
``{"text": "str"}``), a real StreamingDataset on the leaders, real DataLoader workers, a BPE
tokenizer trained here with the ``tokenizers`` package.

Token documents are numbered (token ``k`` of document ``i`` is ``i * STRIDE + k``), so a count over
the delivered rows finds any token lost or trained twice. Checked: each layout loads and packs
every token once (bare leader streams, drained); a mid-epoch resume through CollectiveLoader
(state saved with ``torch.save`` and read back with ``weights_only=True``, as TorchTitan's
checkpointer does) gives the uninterrupted run's rows, with 0 and 2 DataLoader workers and two
document-length mixes; a resume on another DP degree trains every token once; a layout that does
not fit the data fails on every rank, naming the column.
"""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
import ranks
import torch
import torch.distributed as dist
from text_rows import all_tokens

from collective_loader import CollectiveLoader, LeaderError
from collective_loader.streaming import StreamingSource
from collective_loader.testing.data import (
    numbered_documents,
    text_documents,
    train_tokenizer,
    write_text_documents,
    write_token_documents,
)
from collective_loader.text import Packing, TextColumn, TokenColumn
from collective_loader.text.packing import BOUNDARIES

STRIDE = 128  # documents shorter than this, ids below 65536: uint16 as LLM Foundry writes them
DOCS = 192
MIXES = {"short": (0, 30), "long": (20, 127)}  # document lengths, drawn uniformly
SPLIT = ("dp", "tp")


def lengths(mix: str) -> list[int]:
    low, high = MIXES[mix]
    return np.random.default_rng(len(mix)).integers(low, high + 1, size=DOCS).tolist()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm")
    out = {}
    for mix in MIXES:
        docs = numbered_documents(lengths(mix), STRIDE)
        out[f"bytes-{mix}"] = str(root / f"bytes-{mix}")
        write_token_documents(out[f"bytes-{mix}"], docs, "bytes", "uint16", shard_bytes=1 << 12)
    out["ndarray"] = str(root / "ndarray")
    # streaming's MDSWriter cannot write an empty ndarray: no empty documents in this one
    write_token_documents(out["ndarray"], numbered_documents(ndarray_lengths(), STRIDE), "ndarray", "uint16", 1 << 12)
    texts = text_documents(DOCS, seed=3)
    out["text"] = str(root / "text")
    write_text_documents(out["text"], texts, shard_bytes=1 << 13)
    out["tokenizer"] = train_tokenizer(texts, str(root / "tokenizer"))
    return out


def ndarray_lengths() -> list[int]:
    return [max(n, 1) for n in lengths("short")]


def every_token(data, name) -> Counter:
    """Every token of every document of dataset ``name``, as the test wrote it."""
    if name == "text":
        column = TextColumn(data["tokenizer"])
        docs = column.documents([{"text": t} for t in text_documents(DOCS, seed=3)])
    else:
        docs = numbered_documents(ndarray_lengths() if name == "ndarray" else lengths(name.split("-")[1]), STRIDE)
    return Counter(int(t) for d in docs for t in d)


def layout_of(data, name):
    if name == "text":
        return TextColumn(data["tokenizer"])
    return TokenColumn(dtype="uint16") if name.startswith("bytes") else TokenColumn()


def build_source(mesh, data, name, seq_len, rows, workers, layout=None, at_end="pad"):
    return StreamingSource(
        mesh,
        local=data[name],
        batch_size=rows,
        shuffle=True,
        shuffle_seed=7,
        num_canonical_nodes=2,
        layout=layout or layout_of(data, name),
        packing=Packing(seq_len, at_end, BOUNDARIES),
        documents_per_batch=4 // mesh["dp"].size(),
        num_workers=workers,
        # these ranks are spawned, so their workers would be too, each importing torch and streaming again
        dataloader_kwargs={"multiprocessing_context": "forkserver"} if workers else None,
    )


def build_loader(data, name, shape, seq_len, rows, workers, **kw):
    mesh = ranks.make_mesh(SPLIT, shape)
    source = build_source(mesh, data, name, seq_len, rows, workers, **kw)
    return CollectiveLoader(
        source,
        mesh,
        inputs=("input_ids", "position_ids", "sequence_id"),
        labels=("labels",),
        every_stage=("cu_seqlens", "max_seqlen"),
    )


def leader_streams(data, name, dp, seq_len, rows, workers, state=None):
    """Each leader builds its stream alone (no delivery), resumes from ``state`` if given, and
    drains its epoch: ``(tokens of its rows, its packing figures)``."""
    mesh = ranks.make_mesh(SPLIT, (dp, dist.get_world_size() // dp))
    source = build_source(mesh, data, name, seq_len, rows, workers)
    if not source.place.is_leader:
        return None
    stream = source()
    if state is not None:
        stream.resume(state, steps=0)
    batches = list(stream)
    stats = stream.stats()
    stream.close()
    return all_tokens(batches), stats


def _loader_rows(batches):
    return [{k: v.clone() for k, v in b.items()} for b in batches]


def resumed(data, name, shape, seq_len, rows, workers, stop):
    """The uninterrupted epoch, the one interrupted after ``stop`` steps, and its resumption from
    a state that went through ``torch.save`` / ``torch.load(weights_only=True)``."""
    full_loader = build_loader(data, name, shape, seq_len, rows, workers)
    full = _loader_rows(full_loader)
    full_loader.close()
    first = build_loader(data, name, shape, seq_len, rows, workers)
    it = iter(first)
    head = _loader_rows(next(it) for _ in range(stop))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    first.close()
    second = build_loader(data, name, shape, seq_len, rows, workers)
    second.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    tail = _loader_rows(second)
    second.close()
    return full, head, tail


def save_after(data, name, shape, seq_len, rows, stop):
    """``stop`` steps through CollectiveLoader; the state every rank saves, and what the first
    stage trained (leaders only)."""
    loader = build_loader(data, name, shape, seq_len, rows, 0)
    it = iter(loader)
    head = [next(it) for _ in range(stop)]
    state = loader.state_dict()
    leader = loader.is_leader
    loader.close()
    return state, all_tokens(head) if leader else None


def resume_to_end(data, name, shape, seq_len, rows, state):
    loader = build_loader(data, name, shape, seq_len, rows, 0)
    loader.load_state_dict(state)
    tokens = all_tokens(list(loader))
    leader = loader.is_leader
    loader.close()
    return tokens if leader else None


def wrong_layout(data, name, layout, workers):
    loader = None
    try:
        loader = build_loader(data, name, (dist.get_world_size(), 1), 8, 2, workers, layout=layout)
        list(loader)
    except LeaderError as e:
        return str(e)
    finally:
        if loader is not None:
            loader.close()
    return None


def equal_rows(a, b):
    return len(a) == len(b) and all(set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


# --- the layouts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,seq_len,workers",
    [
        ("bytes-short", 16, 0),  # LLM Foundry's tokens as bytes (token_encoding_type uint16)
        pytest.param("bytes-long", 24, 2, marks=pytest.mark.slow),  # documents longer than a row, DataLoader workers
        ("ndarray", 12, 0),  # tokens as ndarray:uint16
        ("text", 16, 2),  # text tokenized by the workers with a BPE tokenizer (a tokenizer.json path)
    ],
)
def test_each_layout_packs_every_token_once(worlds, data, name, seq_len, workers):
    results = worlds.get(2).run(leader_streams, data, name, 2, seq_len, 3, workers, timeout=240)
    got = Counter(t for tokens, _ in results for t in tokens)
    assert got == every_token(data, name)
    stats = [s for _, s in results]
    assert sum(s["tokens"] for s in stats) == sum(got.values())
    assert all(s["rows"] % 3 == 0 and s["padding"] < 3 * (seq_len + 1) for s in stats), stats


def test_pre_concatenated_windows_without_packing(worlds, tmp_path):
    """LLM Foundry's ``--concat_tokens`` output: bytes of seq_len + 1 ids per sample, read with
    their dtype into whole rows (lm_collate)."""
    path = str(tmp_path / "windows")
    write_token_documents(path, numbered_documents([17] * 32, STRIDE), "bytes", "int32")
    results = worlds.get(2).run(windows_epoch, path, timeout=180)
    got = sorted(t for r in results for t in r)
    assert got == sorted(int(t) for d in numbered_documents([17] * 32, STRIDE) for t in d)


def windows_epoch(path):
    mesh = ranks.make_mesh(("dp",), (2,))
    source = StreamingSource(mesh, local=path, batch_size=4, layout=TokenColumn(dtype="int32"))
    loader = CollectiveLoader(source, mesh, inputs=("input_ids", "position_ids"), labels=("labels",))
    out = []
    for b in loader:
        assert b["input_ids"].shape == (4, 16)
        out += torch.cat([b["input_ids"], b["labels"][:, -1:]], 1).flatten().tolist()
    loader.close()
    return out


# --- exact resume ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,seq_len,workers,stop",
    [
        ("bytes-short", 16, 0, 3),
        ("bytes-long", 24, 0, 5),
        pytest.param("bytes-short", 16, 2, 4, marks=pytest.mark.slow),
        pytest.param("text", 16, 2, 2, marks=pytest.mark.slow),  # 34 s; text resumes in test_titan_trainer_text
    ],
)
def test_resume_gives_the_uninterrupted_rows(worlds, data, name, seq_len, workers, stop):
    # dp=2 x tp=2: the leaders gather their hand-over, each tp peer saves the same state
    results = worlds.get(4).run(resumed, data, name, (2, 2), seq_len, 2, workers, stop, timeout=300)
    for rank, (full, head, tail) in enumerate(results):
        assert len(full) > stop + 1, (rank, len(full))
        assert equal_rows(head, full[:stop]), rank
        assert equal_rows(tail, full[stop:]), rank


@pytest.mark.parametrize("name,stop", [pytest.param("bytes-short", 3, marks=pytest.mark.slow), ("bytes-long", 6)])
def test_resume_on_fewer_replicas_trains_every_token_once(worlds, data, name, stop):
    world = worlds.get(2)
    saved = world.run(save_after, data, name, (2, 1), 16, 2, stop, timeout=240)
    state = saved[0][0]
    assert all(torch.equal(s["source"]["packing"]["entries"], state["source"]["packing"]["entries"]) for s, _ in saved)
    before = [t for _, tokens in saved for t in tokens]
    after = [t for r in world.run(resume_to_end, data, name, (1, 2), 16, 4, state, timeout=240) if r for t in r]
    assert len(before) == 2 * stop * 2 * 17 and len(state["source"]["packing"]["entries"]) > 0
    got = Counter(before + after)
    assert [t for t, n in got.items() if n > 1] == [], "a token was trained twice"
    assert got == every_token(data, name), f"lost {sum((every_token(data, name) - got).values())} tokens"


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_resume_on_more_replicas_trains_every_token_once(worlds, data, workers):
    """Saved by one leader, resumed by two, each draining its stream: no token twice, none lost
    (the hand-over is what every new leader skips)."""
    world = worlds.get(2)
    saved = world.run(save_after, data, "bytes-long", (1, 2), 16, 2, 7, timeout=240)
    state, before = saved[0]
    after = world.run(leader_streams, data, "bytes-long", 2, 16, 1, workers, state["source"], timeout=240)
    assert len(before) == 7 * 2 * 17 and all(tokens for tokens, _ in after)
    got = Counter(before + [t for tokens, _ in after for t in tokens])
    assert [t for t, n in got.items() if n > 1] == [], "a token was trained twice"
    assert got == every_token(data, "bytes-long")


# --- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,layout,workers,says",
    [
        ("bytes-short", TokenColumn(), 0, "not a whole number of int64 token ids"),  # uint16 bytes read as int64
        pytest.param(
            "text", TokenColumn(), 2, "the samples have no column 'tokens' (they hold: text)", marks=pytest.mark.slow
        ),
        ("text", TokenColumn("text"), 0, "holds text (a str); pass TextColumn(column='text'"),
        pytest.param(
            "ndarray", "tokenizer", 0, "the samples have no column 'text' (they hold: tokens)", marks=pytest.mark.slow
        ),
        ("bytes-short", "tokenizer-on-tokens", 2, "bytes, not text; for token ids pass TokenColumn(column='tokens'"),
    ],
)
def test_a_layout_that_does_not_fit_fails_on_every_rank(worlds, data, name, layout, workers, says):
    if layout == "tokenizer":
        layout = TextColumn(data["tokenizer"])
    elif layout == "tokenizer-on-tokens":
        layout = TextColumn(data["tokenizer"], column="tokens")
    messages = worlds.get(2).run(wrong_layout, data, name, layout, workers, timeout=240)
    assert all(m is not None and says in m for m in messages), messages
