"""What :class:`~collective_loader.integrations.torchft.QuorumData` takes (no processes): its
``dataset`` is a map-style dataset or a zero-argument callable building one, anything else is
refused; it closes what its callable built, never a dataset given as it is; and packed rows read a
sample's tokens through the layout's ``documents()``, a ``TextColumn``'s tokenizer resolved once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils.data import default_collate

from collective_loader.integrations.quorum_positions import RowPositions, SamplePositions
from collective_loader.integrations.torchft import QuorumData, _step_source
from collective_loader.plan.quorum import GlobalOrder
from collective_loader.text.layouts import TextColumn
from collective_loader.text.packing import Packing


class Closing:
    """A map-style dataset that holds something until closed."""

    def __init__(self) -> None:
        self.closed = 0

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index: int) -> dict:
        return {"x": index}

    def close(self) -> None:
        self.closed += 1


def test_a_dataset_of_neither_kind_is_refused_before_anything_is_built():
    for dataset in (42, iter([{"x": 1}]), {"x"}):  # no __getitem__, or not callable
        with pytest.raises(TypeError, match="map-style dataset .* or a zero-argument callable"):
            QuorumData(dataset, None, None, global_batch=2, micro_batch=1)


def test_a_callable_must_build_a_map_style_dataset():
    with pytest.raises(TypeError, match=r"dataset\(\) returned a list_iterator, not a map-style dataset"):
        _step_source(lambda: iter([{"x": 1}]), SamplePositions(default_collate), 0, False)


def test_what_the_callable_built_is_closed_a_dataset_given_as_it_is_is_not():
    built = Closing()
    source = _step_source(lambda: built, SamplePositions(default_collate), 0, False)
    assert source.reader.read(0, 2)["x"].tolist() == [0, 1]
    source.close()
    assert built.closed == 1
    given = Closing()
    source = _step_source(given, SamplePositions(default_collate), 0, False)
    source.close()
    assert given.closed == 0  # the caller's
    source = _step_source(lambda: [{"x": 1}], SamplePositions(default_collate), 0, False)
    source.close()  # nothing to close


def test_a_layout_is_anything_with_documents():
    with pytest.raises(TypeError, match="TokenLayout"):
        RowPositions(Packing(4), layout="tokens")

    class Reversed:  # not a TokenColumn: a layout of its own
        def documents(self, samples):
            return [np.asarray(s["tokens"][::-1], dtype=np.int64) for s in samples]

    docs = [{"tokens": list(range(10 * i, 10 * i + 4))} for i in range(3)]
    batch = RowPositions(Packing(3), layout=Reversed()).reader(docs, GlobalOrder(3, shuffle=False)).read(0, 1)
    assert batch["input_ids"].tolist() == [[3, 2, 1]]


def test_text_rows_are_the_token_rows_of_the_same_ids_with_one_encoder(monkeypatch):
    made = []
    encoder = TextColumn.encoder
    monkeypatch.setattr(TextColumn, "encoder", lambda self: made.append(1) or encoder(self))
    tok = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate("abcdef")}}, "<s>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = ["a b c", "d", "e f a b", "c c"]
    layout = TextColumn(tok, bos_token="<s>", eos_token="</s>")
    ids = [np.array([0, *("abcdef".index(w) + 2 for w in t.split()), 1]) for t in texts]
    order = GlobalOrder(len(texts), seed=3)
    text_rows = RowPositions(Packing(3), layout=layout).reader([{"text": t} for t in texts], order).read(0, 5)
    token_rows = RowPositions(Packing(3)).reader([{"tokens": i} for i in ids], order).read(0, 5)
    assert text_rows.keys() == token_rows.keys()
    assert all(torch.equal(text_rows[k], token_rows[k]) for k in token_rows)
    assert made == [1]  # documents read one by one, the tokenizer resolved once
