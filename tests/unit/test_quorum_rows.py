"""Unit and property tests for packed rows under a changing quorum (no processes): where the
documents of the global order start in its token stream
(:class:`~collective_loader.plan.quorum.DocumentStarts`), the rows a leader reads for any range
of the row order (:class:`~collective_loader.integrations.torchft.RowPositions`), and a random
history of quorums, failed commits and groups healing from a peer's state: over the committed
steps every token of every document once, in the order's sequence."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collective_loader.integrations.quorum_positions import RowPositions, SamplePositions
from collective_loader.integrations.torchft import QuorumData
from collective_loader.plan.quorum import DocumentStarts, GlobalOrder, step_share
from collective_loader.text.layouts import TokenColumn
from collective_loader.text.packing import BOUNDARIES, Packer, Packing, Row, batch_of

PROPS = settings(max_examples=120, deadline=None)
STRIDE = 1000  # token k of document i is i * STRIDE + k: a token says where it comes from


def documents(lengths: list[int]) -> list[dict]:
    return [{"tokens": i * STRIDE + np.arange(n, dtype=np.int64)} for i, n in enumerate(lengths)]


def stream(docs: list[dict], order: GlobalOrder, passes: int = 2) -> np.ndarray:
    """The token stream: the documents in the order, concatenated."""
    return np.concatenate([docs[i]["tokens"] for i in order.indices(0, passes * len(docs))])


def packed(docs: list[dict], order: GlobalOrder, seq_len: int, rows: int) -> list[Row]:
    """The first ``rows`` rows of one Packer over the whole order: the reference."""
    packer, out, position = Packer(seq_len), [], 0
    while len(out) < rows:
        row = packer.next_row()
        if row is None:
            packer.add(position, docs[order.indices(position, position + 1)[0]]["tokens"])
            position += 1
        else:
            out.append(row)
    return out


def row_tokens(batch: dict) -> list[list[int]]:
    """A batch's rows, each ``seq_len + 1`` tokens: the inputs and the last label."""
    return [ids + [labels[-1]] for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist())]


lengths_st = st.lists(st.integers(0, 30), min_size=1, max_size=40).filter(lambda ls: sum(ls) > 0)


@PROPS
@given(lengths=lengths_st, seed=st.integers(0, 1000))
def test_locate_finds_the_document_of_every_token(lengths, seed):
    """From any anchor before it, the document holding a token and its offset, as a scan finds
    them; only lengths from the anchor on are read, each once; empty documents hold no token."""
    rng = random.Random(seed)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    owner = [p for p, n in enumerate(lengths) for _ in range(n)]
    anchor = rng.randrange(len(lengths))
    found = DocumentStarts(anchor, int(starts[anchor])) if anchor else DocumentStarts()
    read: list[int] = []

    def length(p: int) -> int:
        read.append(p)
        return lengths[p]

    tokens = sorted(rng.sample(range(int(starts[anchor]), len(owner)), k=min(8, len(owner) - int(starts[anchor]))))
    for t in tokens:
        p, offset = found.locate(t, length)
        assert (p, offset) == (owner[t], t - int(starts[owner[t]])) and lengths[p] > 0
    assert read == list(range(anchor, anchor + len(read)))  # in order, each once
    if tokens:
        assert found.forget_before(tokens[-1]) == (owner[tokens[-1]], int(starts[owner[tokens[-1]]]))


def test_starts_refuse_what_no_order_has():
    with pytest.raises(ValueError):
        DocumentStarts(0, 5)
    starts = DocumentStarts(3, 40)
    with pytest.raises(ValueError):
        starts.locate(39, lambda p: 1)
    with pytest.raises(ValueError):
        starts.forget_before(10)


@PROPS
@given(
    lengths=lengths_st,
    seq_len=st.integers(1, 12),
    shuffle=st.booleans(),
    cuts=st.lists(st.integers(1, 6), min_size=1, max_size=8),
    given_lengths=st.booleans(),
)
def test_any_ranges_of_rows_are_the_rows_of_one_packer(lengths, seq_len, shuffle, cuts, given_lengths):
    """Rows read as consecutive ranges of any sizes, by one reader, are the rows one Packer cuts
    from the whole order (passes wrap around), batched with every boundary as the packer's are;
    the same when the documents' lengths are given."""
    docs = documents(lengths)
    order = GlobalOrder(len(docs), seed=1, shuffle=shuffle)
    packing = Packing(seq_len, boundaries=BOUNDARIES)
    reader = RowPositions(packing, document_lengths=lengths if given_lengths else None).reader(docs, order)
    reference = packed(docs, order, seq_len, sum(cuts))
    lo = 0
    for size in cuts:
        batch = reader.read(lo, lo + size)
        expected = batch_of(reference[lo : lo + size], packing)
        assert batch.keys() == expected.keys()
        assert all(torch.equal(batch[k], expected[k]) for k in batch), (lo, size)
        assert (batch["labels"][:, :-1] == batch["input_ids"][:, 1:]).all()  # every row full: no padding
        lo += size
    empty = reader.empty()
    assert empty.keys() == expected.keys() and empty["input_ids"].shape == (0, seq_len)


def test_a_leader_reads_about_the_window_it_packs():
    """What reading costs: a leader reading rows [lo, hi) reads the documents from its anchor to
    its last row, each once (and the one its next range begins in, again at most once)."""
    lengths = [7, 3, 12, 5, 9, 1, 4, 8, 6, 10] * 5
    docs = documents(lengths)
    order = GlobalOrder(len(docs), shuffle=False)
    reader = RowPositions(Packing(7)).reader(docs, order)
    reader.read(4, 6)  # tokens 32..47: documents 0 to 7 read, 0-5 for their lengths only
    assert reader.stats()["quorum_documents_read"] == 8
    reader.read(6, 7)  # tokens 48..55: it begins in document 7, the last read (kept), then 8 and 9
    assert reader.stats()["quorum_documents_read"] == 10
    # with the lengths given, only the documents of its rows: 4 to 7 for tokens 32..47
    reader = RowPositions(Packing(7), document_lengths=np.array(lengths)).reader(docs, order)
    reader.read(4, 6)
    assert reader.stats()["quorum_documents_read"] == 4


def test_given_lengths_are_checked_against_the_documents():
    docs = documents([3, 5, 2])
    with pytest.raises(ValueError, match="2 lengths for a dataset of 3"):
        RowPositions(Packing(3), document_lengths=[3, 5]).reader(docs, GlobalOrder(3))
    reader = RowPositions(Packing(3), document_lengths=[3, 4, 2]).reader(docs, GlobalOrder(3, shuffle=False))
    with pytest.raises(ValueError, match=r"document_lengths\[1\] is 4 but sample 1 holds 5"):
        reader.read(0, 2)


@PROPS
@given(
    seed=st.integers(0, 10_000),
    global_batch=st.integers(1, 9),
    seq_len=st.integers(1, 9),
    dp_size=st.integers(1, 3),
    micro_batch=st.integers(1, 4),
)
def test_committed_steps_train_every_token_once(seed, global_batch, seq_len, dp_size, micro_batch):
    """A random history of three groups, each replica's leader with its own reader: each attempt
    has a quorum of some of the groups and commits or not; a group behind the committed cursor
    heals from a peer's state (leader r from leader r, as torchft does), and sometimes a group
    is restarted (new leaders, nothing read yet); some groups know the documents' lengths, some
    read them. Over the committed steps the rows trained are
    the order's rows in sequence: every token of every document once per pass."""
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, 2, 5, 9, 17, 30]) for _ in range(60)]
    lengths = lengths if sum(lengths) else [1]
    docs = documents(lengths)
    order = GlobalOrder(len(docs), seed=seed)
    packing = Packing(seq_len)

    class Group:
        def __init__(self) -> None:
            given = lengths if rng.random() < 0.5 else None  # some groups are given the lengths
            self.leaders = [RowPositions(packing, document_lengths=given) for _ in range(dp_size)]
            self.readers = [leader.reader(docs, order) for leader in self.leaders]
            self.cursor = 0

    groups = [Group() for _ in range(3)]
    cursor, trained, healed = 0, [], 0
    for _ in range(25):
        if rng.random() < 0.1:  # killed and restarted: fresh processes
            groups[rng.randrange(3)] = Group()
        live = [g for g in groups if rng.random() < 0.8] or groups[:1]
        peer = next((g for g in groups if g.cursor == cursor and g.cursor), None)
        for g in live:
            if g.cursor != cursor and peer is not None:  # behind: heals from the peer
                for mine, theirs in zip(g.leaders, peer.leaders):
                    mine.load({"cursor": cursor, **theirs.state()}, cursor)
                g.cursor, healed = cursor, healed + 1
        live = [g for g in live if g.cursor == cursor]  # a fresh job: every group starts at 0
        served = []
        for participant, g in enumerate(live):
            for r in range(dp_size):
                share = step_share(cursor, global_batch, participant, len(live), r, dp_size, micro_batch)
                for lo, hi in share.micro_batches:
                    batch = g.readers[r].read(lo, hi) if hi > lo else g.readers[r].empty()
                    served += row_tokens(batch)
        assert len(served) == global_batch or not live
        if live and rng.random() < 0.7:  # should_commit() True on every live group
            trained += served
            cursor += global_batch
            for g in live:
                g.cursor = cursor
                for leader in g.leaders:
                    leader.committed(cursor)
                    assert leader.anchor[1] <= cursor * (seq_len + 1)
    tokens = [t for row in trained for t in row]
    passes = len(tokens) // max(sum(lengths), 1) + 2
    assert tokens == stream(docs, order, passes)[: len(tokens)].tolist()


def test_row_states_are_checked():
    rows = RowPositions(Packing(4))
    rows.load({"positions": "rows", "seq_len": 4, "anchor": [3, 12]}, cursor=4)
    assert rows.state() == {"positions": "rows", "seq_len": 4, "anchor": [3, 12]}
    with pytest.raises(ValueError, match="seq_len=8"):
        rows.load({"positions": "rows", "seq_len": 8, "anchor": [0, 0]}, cursor=0)
    with pytest.raises(ValueError, match="over samples"):
        rows.load({"positions": "samples"}, cursor=0)
    with pytest.raises(ValueError, match="after its cursor"):
        rows.load({"positions": "rows", "seq_len": 4, "anchor": [3, 30]}, cursor=4)
    with pytest.raises(ValueError, match="over rows"):
        SamplePositions(list).load({"positions": "rows", "seq_len": 4, "anchor": [0, 0]}, cursor=0)


def test_packing_options_that_do_not_apply_are_refused():
    for packing, error in [
        (Packing(4, at_end="drop"), "never ends"),
    ]:
        with pytest.raises(ValueError, match=error):
            RowPositions(packing)
    with pytest.raises(ValueError, match="collate"):
        RowPositions(Packing(4), collate=list)
    with pytest.raises(ValueError, match="layout"):
        SamplePositions(list, layout=TokenColumn())
    with pytest.raises(ValueError, match="document_lengths"):
        SamplePositions(list, document_lengths=[3])
    assert QuorumData.global_samples.__doc__ is not None


def test_a_dataset_of_empty_documents_is_refused_not_read_for_ever():
    reader = RowPositions(Packing(4)).reader(documents([0, 0, 0]), GlobalOrder(3))
    with pytest.raises(ValueError, match="every document"):
        reader.read(0, 1)
