"""The packer on its own (no processes): every token of every document in exactly one row, in
order; the boundary keys agree with the documents and with each other; a resume, from any step,
with the same leaders gives the same rows and with another DP degree trains every token once.

Documents are numbered (token ``k`` of document ``i`` is ``i * STRIDE + k``), so each delivered
token says which document and position it is; hypothesis draws the document lengths (empty ones
included), ``seq_len``, rows per batch and documents per sample-batch.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from text_rows import all_tokens, leader_documents, row_tokens

from collective_loader.testing.data import numbered_documents
from collective_loader.text.packing import BOUNDARIES, IGNORE_INDEX, Packer, Packing, Row, batch_of
from collective_loader.text.resume import Cursor, combine
from collective_loader.text.rows import PackedRows

STRIDE = 1 << 16
lengths = st.lists(st.integers(0, 40), min_size=1, max_size=40)
seq_lens = st.integers(1, 24)


def run(packing, batch_rows, docs, dp=1, rank=0, per_batch=4, start=0, entries=None, world=None):
    """One leader's whole epoch: (its batches, its cursor after each, its PackedRows)."""
    rows = PackedRows(packing, batch_rows, rank, world or (dp, dp))
    if entries is not None:
        rows.resume(entries[0], entries[1])
    out, cursors = [], []
    for batch in rows.rows(leader_documents(docs, dp, rank, per_batch, start), lambda: start):
        out.append(batch)
        cursors.append(rows.cursor())
    return out, cursors, rows


@settings(max_examples=100, deadline=None)
@given(lengths, seq_lens, st.integers(1, 4), st.integers(1, 5), st.sampled_from(["pad", "drop"]))
def test_every_token_in_exactly_one_row_in_order(lens, seq_len, batch_rows, per_batch, at_end):
    docs = numbered_documents(lens, STRIDE)
    docs += [np.zeros(0, np.int64)] * (-len(docs) % per_batch)  # whole sample-batches
    packing = Packing(seq_len, at_end, BOUNDARIES)
    batches, _, rows = run(packing, batch_rows, docs, per_batch=per_batch)
    every = [int(t) for d in docs for t in d]
    got = all_tokens(batches)
    for b in batches:
        assert b["input_ids"].shape == b["labels"].shape == (batch_rows, seq_len)
    full = [len(r) for b in batches for r in row_tokens(b)]
    if at_end == "pad":
        assert got == every
        assert all(n == seq_len + 1 for n in full[: len(every) // (seq_len + 1)])
        assert rows.stats["padding"] == len(batches) * batch_rows * (seq_len + 1) - len(every)
    else:
        assert got == every[: len(got)] and len(every) - len(got) == rows.stats["dropped"]
        assert all(n == seq_len + 1 for n in full)  # no padding at all
        assert len(every) - len(got) < batch_rows * (seq_len + 1)  # at most one partial batch dropped
    assert rows.stats["tokens"] == len(got)


@settings(max_examples=100, deadline=None)
@given(lengths, seq_lens, st.integers(1, 3))
def test_boundaries_agree_with_the_documents_and_each_other(lens, seq_len, batch_rows):
    docs = numbered_documents(lens, STRIDE)
    packer, rows = Packer(seq_len), []
    for i, d in enumerate(docs):
        packer.add(i, d)
        while (row := packer.next_row()) is not None:
            rows.append(row)
    rows += [r for r in [packer.finish()] if r is not None]
    for start in range(0, len(rows), batch_rows):
        b = batch_of(rows[start : start + batch_rows], Packing(seq_len, boundaries=BOUNDARIES), batch_rows)
        for r in range(batch_rows):
            seq, pos, cu = b["sequence_id"][r], b["position_ids"][r], b["cu_seqlens"][r]
            real = seq >= 0
            inputs = b["input_ids"][r]
            # a segment starts at the row's start and wherever the document changes (numbered tokens)
            doc = inputs // STRIDE
            starts = torch.ones(seq_len, dtype=torch.bool)
            starts[1:] = (doc[1:] != doc[:-1]) | (real[1:] != real[:-1])
            assert torch.equal(pos == 0, starts)
            assert torch.equal(pos[1:][~starts[1:]], pos[:-1][~starts[1:]] + 1)  # counts up within
            offsets = torch.cat([starts.nonzero().flatten(), torch.tensor([seq_len])]).int()
            assert torch.equal(cu[: len(offsets)], offsets) and bool((cu[len(offsets) :] == seq_len).all())
            assert int(b["max_seqlen"][r]) == int(offsets.diff().max())
            assert torch.equal(seq[real], torch.cumsum(starts.int(), 0)[real] - 1)
            # labels: the next token of the row, ignored where that is padding
            labels, nxt = b["labels"][r], torch.cat([inputs[1:], b["labels"][r][-1:]])
            kept = labels != IGNORE_INDEX
            assert torch.equal(labels[kept], nxt[kept])
            assert torch.equal(real[1:], kept[:-1])


def test_a_row_of_padding_only():
    b = batch_of([], Packing(4, boundaries=BOUNDARIES), batch_rows=1)
    assert b["labels"].tolist() == [[IGNORE_INDEX] * 4] and b["sequence_id"].tolist() == [[-1] * 4]
    assert b["cu_seqlens"].tolist() == [[0, 4]] and b["position_ids"].tolist() == [[0, 1, 2, 3]]


def test_packing_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="seq_len"):
        Packing(0)
    with pytest.raises(ValueError, match="at_end"):
        Packing(8, at_end="truncate")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\['positions'\] unknown"):
        Packing(8, boundaries=("positions",))
    assert Packing(8, boundaries="cu_seqlens").boundaries == ("cu_seqlens",)  # type: ignore[arg-type]


def hand_over(runs, stop):
    """What the leaders' gather makes of their state after ``stop`` batches: (first step, entries)."""
    cursors = [cursors[stop - 1] for _, cursors, _ in runs]
    first = min(c.step for c in cursors)
    parts = [rows.log.hand_over(rows.dp_rank, cursor, first) for (_, _, rows), cursor in zip(runs, cursors)]
    return first, combine(parts, runs[0][2].resumed, first)


@settings(max_examples=80, deadline=None)
@given(lengths, seq_lens, st.integers(1, 3), st.sampled_from([1, 2, 4]), st.data())
def test_resume_with_the_same_leaders_gives_the_same_rows(lens, seq_len, batch_rows, dp, data):
    per_batch = 2
    docs = numbered_documents(lens * dp, STRIDE)
    docs += [np.zeros(0, np.int64)] * (-len(docs) % (dp * per_batch))
    packing = Packing(seq_len, "pad", BOUNDARIES)
    full = [run(packing, batch_rows, docs, dp, r, per_batch) for r in range(dp)]
    steps = min(len(b) for b, _, _ in full)
    if steps == 0:
        return
    stop = data.draw(st.integers(1, steps))
    first, entries = hand_over(full, stop)
    for r in range(dp):
        tail, _, _ = run(packing, batch_rows, docs, dp, r, per_batch, first, (entries, (dp, dp)))
        want = full[r][0][stop:]
        assert len(tail) == len(want) and all(torch.equal(a[k], b[k]) for a, b in zip(tail, want) for k in a), r


@settings(max_examples=80, deadline=None)
@given(lengths, seq_lens, st.integers(1, 3), st.sampled_from([(2, 1), (1, 2), (2, 4), (4, 2), (1, 4)]), st.data())
def test_resume_with_another_dp_degree_trains_every_token_once(lens, seq_len, batch_rows, dps, data):
    global_batch = 4
    docs = numbered_documents(lens * 4, STRIDE)
    docs += [np.zeros(0, np.int64)] * (-len(docs) % global_batch)
    packing = Packing(seq_len, "pad", BOUNDARIES)
    old, new = dps
    first_run = [run(packing, batch_rows, docs, old, r, global_batch // old) for r in range(old)]
    steps = min(len(b) for b, _, _ in first_run)
    if steps == 0:
        return
    stop = data.draw(st.integers(1, steps))
    first, entries = hand_over(first_run, stop)
    before = [t for b, _, _ in first_run for t in all_tokens(b[:stop])]
    after = []
    for r in range(new):
        tail, _, _ = run(
            packing, batch_rows, docs, new, r, global_batch // new, first, (entries, (old, old)), (new, new)
        )
        after += all_tokens(tail)
    every = Counter(int(t) for d in docs for t in d)
    got = Counter(before + after)
    assert not [t for t, n in got.items() if n > 1], "a token was trained twice"
    assert got == every, f"lost {sum((every - got).values())} tokens"


@settings(max_examples=60, deadline=None)
@given(lengths, seq_lens, st.sampled_from([(2, 1, 4), (4, 2, 1), (1, 4, 2), (2, 2, 2)]), st.data())
def test_two_resumes_in_a_row_train_every_token_once(lens, seq_len, dps, data):
    """Interrupted, resumed on another DP degree, interrupted again before every leader has passed
    what the first hand-over named, resumed again: the shared entries carry over."""
    global_batch, batch_rows = 4, 1
    docs = numbered_documents(lens * 4, STRIDE)
    docs += [np.zeros(0, np.int64)] * (-len(docs) % global_batch)
    packing = Packing(seq_len, "pad", BOUNDARIES)
    trained: list[int] = []
    entries, world, first = None, None, 0
    for i, dp in enumerate(dps):
        runs = [
            run(
                packing,
                batch_rows,
                docs,
                dp,
                r,
                global_batch // dp,
                first,
                None if entries is None else (entries, world),
                (dp, dp),
            )
            for r in range(dp)
        ]
        steps = min(len(b) for b, _, _ in runs)
        if i == len(dps) - 1 or steps == 0:
            trained += [t for b, _, _ in runs for t in all_tokens(b)]
            break
        stop = data.draw(st.integers(1, steps))
        trained += [t for b, _, _ in runs for t in all_tokens(b[:stop])]
        first, entries = hand_over(runs, stop)
        world = (dp, dp)
    got, every = Counter(trained), Counter(int(t) for d in docs for t in d)
    assert not [t for t, n in got.items() if n > 1], "a token was trained twice"
    assert got == every, f"lost {sum((every - got).values())} tokens"


def test_cursor_names_the_first_document_with_tokens_left():
    rows = PackedRows(Packing(seq_len=3), batch_rows=1, dp_rank=0, world=(1, 1))
    docs = numbered_documents([2, 0, 5, 1], STRIDE)
    batches = rows.rows(leader_documents(docs, 1, 0, 2), lambda: 0)
    next(batches)  # 2 tokens of doc 0, the empty doc 1, 2 of doc 2
    assert rows.cursor() == Cursor(1, 0, 2)
    next(batches)  # doc 2's last 3, doc 3's one: both batches done
    assert rows.cursor() == Cursor(1, 2, 0)
    assert rows.log.hand_over(0, rows.cursor(), 0)[0].tolist() == [
        [0, 0, 0, -1],
        [0, 0, 1, -1],
        [0, 1, 2, -1],
        [0, 1, 3, -1],
    ]


def test_packer_rows_are_cut_only_when_asked():
    packer = Packer(seq_len=2)
    packer.add("a", np.arange(10))
    assert packer.cursor() == ("a", 0)
    assert isinstance(packer.next_row(), Row) and packer.cursor() == ("a", 3)
