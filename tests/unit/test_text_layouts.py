"""LLM Foundry's MDS layouts read into token ids, and the tokenizers users have, without processes.

Each layout is written with streaming's MDSWriter as LLM Foundry writes it (``{"tokens": "bytes"}``
with ``ids.tobytes()`` for every ``token_encoding_type`` int8 ... uint64, ``{"tokens":
"ndarray:<dtype>"}``, ``{"text": "str"}``) and read back with streaming's ``LocalDataset``. The
tokenizer is a byte-level BPE trained here (``tokenizers``), used as a ``tokenizers.Tokenizer``,
as a path, as a ``transformers`` tokenizer built from its tokenizer.json, and as TorchTitan's
``HuggingFaceTokenizer`` reading its directory: all four give the same ids.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from streaming import LocalDataset

from collective_loader.testing.data import (
    BOS,
    EOS,
    text_documents,
    train_tokenizer,
    write_text_documents,
    write_token_documents,
)
from collective_loader.text import TextColumn, TokenColumn, lm_collate
from collective_loader.text.layouts import INTEGER_TYPES
from collective_loader.text.tokenizer import TextEncoder, load_tokenizer

IDS = [np.array([1, 2, 3, 100]), np.array([5]), np.array([7, 8, 9, 10, 11, 12, 120])]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return train_tokenizer(text_documents(100, seed=1), str(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize("dtype", INTEGER_TYPES)
def test_tokens_as_bytes_of_each_encoding_type(tmp_path, dtype):
    write_token_documents(str(tmp_path), IDS, "bytes", dtype)
    samples = list(LocalDataset(str(tmp_path)))
    assert all(isinstance(s["tokens"], bytes) for s in samples)
    got = TokenColumn(dtype=dtype).documents(samples)
    assert [g.tolist() for g in got] == [i.tolist() for i in IDS] and all(g.dtype == np.int64 for g in got)


def test_tokens_as_bytes_are_int64_when_no_type_is_given(tmp_path):
    write_token_documents(str(tmp_path), IDS, "bytes", "int64")
    assert [g.tolist() for g in TokenColumn().documents(list(LocalDataset(str(tmp_path))))] == [i.tolist() for i in IDS]


@pytest.mark.parametrize("dtype", ["uint16", "int32", "uint32"])
def test_tokens_as_ndarray(tmp_path, dtype):
    write_token_documents(str(tmp_path), IDS, "ndarray", dtype)
    samples = list(LocalDataset(str(tmp_path)))
    assert samples[0]["tokens"].dtype == np.dtype(dtype)
    assert [g.tolist() for g in TokenColumn().documents(samples)] == [i.tolist() for i in IDS]


def test_text_column(tmp_path, tokenizer_dir):
    texts = ["the river and the stone.", "", "winter"]
    write_text_documents(str(tmp_path), texts)
    got = TextColumn(tokenizer_dir).documents(list(LocalDataset(str(tmp_path))))
    tok = load_tokenizer(tokenizer_dir)
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    assert [g.tolist() for g in got] == [[bos, *tok.encode(t).ids, eos] for t in texts]
    assert got[1].tolist() == [bos, eos]  # an empty text is still a document


@pytest.mark.parametrize(
    "sample,column,says",
    [
        ({"text": "abc"}, TokenColumn(), "the samples have no column 'tokens' (they hold: text)"),
        ({"tokens": "abc"}, TokenColumn(), "holds text (a str); pass TextColumn(column='tokens'"),
        ({"tokens": b"\x01\x00\x02"}, TokenColumn(dtype="uint16"), "3 bytes, not a whole number of uint16"),
        ({"tokens": b"\x01\x00" * 3}, TokenColumn(), "not a whole number of int64 token ids"),
        ({"tokens": np.array([40000], np.uint16).tobytes()}, TokenColumn(dtype="int16"), "negative token id"),
        ({"tokens": np.array([1.5, 2.0])}, TokenColumn(), "an ndarray of float64"),
        ({"tokens": np.zeros((2, 3), np.int32)}, TokenColumn(), "1-D integer array"),
        ({"tokens": 7}, TokenColumn(), "holds a int"),
        ({"tokens": b"\x01"}, TextColumn("unused", column="tokens"), "holds 1 bytes, not text"),
        ({"id": 3}, TextColumn("unused"), "no column 'text' (they hold: id)"),
    ],
)
def test_what_does_not_fit_is_named(sample, column, says):
    with pytest.raises(ValueError) as e:
        column.documents([sample])
    assert says in str(e.value)


def test_a_token_type_that_is_no_integer_is_refused_at_once():
    with pytest.raises(ValueError, match="token ids are integers"):
        TokenColumn(dtype="float32")


def test_every_tokenizer_kind_gives_the_same_ids(tokenizer_dir):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from transformers import PreTrainedTokenizerFast

    texts = text_documents(12, seed=5)
    kinds = {
        "tokenizers.Tokenizer": TextEncoder(load_tokenizer(tokenizer_dir), True, True, BOS, EOS),
        "directory": TextEncoder(tokenizer_dir, True, True),
        "tokenizer.json": TextEncoder(f"{tokenizer_dir}/tokenizer.json", True, True, BOS, EOS),
        "transformers": TextEncoder(
            PreTrainedTokenizerFast(tokenizer_file=f"{tokenizer_dir}/tokenizer.json", bos_token=BOS, eos_token=EOS),
            True,
            True,
        ),
        "torchtitan": TextEncoder(HuggingFaceTokenizer(tokenizer_path=tokenizer_dir), True, True),
    }
    ids = {name: enc(texts) for name, enc in kinds.items()}
    assert all(v == ids["directory"] for v in ids.values()), {k: v[0][:5] for k, v in ids.items()}
    tok = load_tokenizer(tokenizer_dir)
    assert all(d[0] == tok.token_to_id(BOS) and d[-1] == tok.token_to_id(EOS) for d in ids["directory"])
    bare = TextEncoder(tokenizer_dir, add_bos=False, add_eos=False)(texts)
    assert bare == [d[1:-1] for d in ids["directory"]]
    for name, enc in kinds.items():  # DataLoader workers get a pickled copy; it resolves there again
        assert pickle.loads(pickle.dumps(enc))(texts[:2]) == ids[name][:2], name


def test_a_tokenizer_without_the_special_token_asked_for(tokenizer_dir):
    with pytest.raises(ValueError, match="names no BOS token: pass bos_token="):
        TextEncoder(load_tokenizer(tokenizer_dir), add_bos=True, add_eos=False)(["a"])
    with pytest.raises(ValueError, match="has no token '<eos>'"):
        TextEncoder(tokenizer_dir, add_bos=False, add_eos=True, eos_token="<eos>")(["a"])
    with pytest.raises(ValueError, match="cannot tokenize with a dict"):
        TextEncoder({}, True, True)(["a"])
    with pytest.raises(ValueError, match="no tokenizer at"):
        TextEncoder("/nonexistent", True, True)(["a"])


def test_lm_collate_reads_bytes_of_a_type_and_refuses_ragged_rows():
    rows = [
        {"tokens": np.arange(5, dtype=np.uint16).tobytes()},
        {"tokens": np.arange(5, 10, dtype=np.uint16).tobytes()},
    ]
    b = lm_collate(rows, dtype="uint16")
    assert b["input_ids"].tolist() == [[0, 1, 2, 3], [5, 6, 7, 8]] and b["labels"][:, -1].tolist() == [4, 9]
    with pytest.raises(ValueError, match="rows of different lengths"):
        lm_collate([{"tokens": np.arange(5)}, {"tokens": np.arange(4)}])
