"""A checkpoint taken right after an epoch's last step, with packed documents, resumed on the same
and on another DP degree (docs/checkpoint-resume.md, "A checkpoint right after an epoch's last batch").

With packing, leaders take different numbers of documents per row, so an epoch at dp=2 ends for
both replicas at the step where the first leader runs out, while the other may still hold tokens
it never put in a row (the uninterrupted run does not train them that epoch). A real
StreamingDataset of numbered token documents (token ``k`` of document ``i`` is ``i * STRIDE + k``),
two ranks, ``at_end="pad"``:

* saved at dp=2, resumed at dp=2: the next epoch at once, the uninterrupted run's;
* saved at dp=2, resumed at dp=1: first the rest of the saved epoch, exactly the tokens the dp=2
  run never trained in it (so no token of the epoch twice, none lost), padded into whole steps;
  the next ``iter()`` starts the next epoch;
* saved at dp=1 (one leader: its epoch ends with every token trained), resumed at dp=2: the next
  epoch at once, the uninterrupted dp=2 run's.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import ranks
from text_rows import all_tokens

from collective_loader import CollectiveLoader
from collective_loader.streaming import StreamingSource
from collective_loader.testing.data import numbered_documents, write_token_documents
from collective_loader.text import Packing, TokenColumn

STRIDE, DOCS, SEQ_LEN, ROWS = 128, 96, 16, 2
GLOBAL_DOCS = 4  # documents per step over all leaders: kept when the DP degree changes


def lengths() -> list[int]:
    # uneven, so that the two leaders' documents hold different numbers of tokens
    return np.random.default_rng(5).integers(1, 100, size=DOCS).tolist()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("epoch_end") / "tokens")
    write_token_documents(path, numbered_documents(lengths(), STRIDE), "bytes", "uint16", shard_bytes=1 << 12)
    return path


def build(data: str, dp: int) -> CollectiveLoader:
    """dp replicas over the 2 ranks (at dp=1 the second rank is a tp peer of the leader)."""
    mesh = ranks.make_mesh(("dp", "tp"), (dp, 2 // dp))
    source = StreamingSource(
        mesh,
        local=data,
        batch_size=ROWS,
        shuffle=True,
        shuffle_seed=11,
        num_canonical_nodes=2,
        layout=TokenColumn(dtype="uint16"),
        packing=Packing(SEQ_LEN, "pad", ("position_ids", "sequence_id")),
        documents_per_batch=GLOBAL_DOCS // dp,
    )
    return CollectiveLoader(source, mesh, inputs=("input_ids", "position_ids", "sequence_id"), labels=("labels",))


def epoch_end_resume(data: str, saved_dp: int, resumed_dp: int) -> dict:
    """On every rank: two uninterrupted epochs at each degree, a run stopped right after the first
    epoch's last step at ``saved_dp``, and its resumption at ``resumed_dp`` (two ``iter()``).
    Returns what the leaders trained (tokens; None on the other ranks), with the epoch each
    resumed ``iter()`` was in."""
    out: dict = {}
    steps = 0
    for dp in sorted({saved_dp, resumed_dp}):
        loader = build(data, dp)
        first, second = list(loader), list(loader)
        out[f"epochs{dp}"] = (all_tokens(first), all_tokens(second)) if loader.is_leader else None
        steps = len(first) if dp == saved_dp else steps  # the same on every rank: all stop at the same step
        loader.close()
    interrupted = build(data, saved_dp)
    it = iter(interrupted)
    for _ in range(steps):
        next(it)  # the epoch's last step; the loop has not seen its end yet
    state = interrupted.state_dict()
    interrupted.close()
    resumed = build(data, resumed_dp)
    resumed.load_state_dict(state)
    rest = list(resumed)
    rest_epoch = resumed.epoch
    after = list(resumed)
    after_epoch = resumed.epoch
    leader = resumed.is_leader
    resumed.close()
    if not leader:
        return {**out, "rest": None, "after": None}
    return {**out, "rest": (all_tokens(rest), rest_epoch, len(rest)), "after": (all_tokens(after), after_epoch)}


def every_token() -> Counter:
    return Counter(int(t) for d in numbered_documents(lengths(), STRIDE) for t in d)


def trained(results: list[dict], dp: int, epoch: int) -> Counter:
    """The tokens the leaders at ``dp`` trained in uninterrupted epoch ``epoch`` (0 or 1)."""
    return Counter(t for r in results if r[f"epochs{dp}"] for t in r[f"epochs{dp}"][epoch])


def test_at_the_same_degree_the_next_epoch_follows_at_once(worlds, data):
    results = worlds.get(2).run(epoch_end_resume, data, 2, 2, timeout=240)
    assert every_token() - trained(results, 2, 0), "the case needs a leader that still held tokens at the epoch's end"
    for r in results:  # both ranks lead at dp=2
        rest, rest_epoch, _ = r["rest"]
        assert rest_epoch == 2 and rest == r["epochs2"][1], "not the uninterrupted run's next epoch"


def test_on_fewer_replicas_the_tokens_left_untrained_come_first_then_the_next_epoch(worlds, data):
    results = worlds.get(2).run(epoch_end_resume, data, 2, 1, timeout=240)
    (r,) = [r for r in results if r["rest"] is not None]  # dp=1: one leader
    untrained = every_token() - trained(results, 2, 0)
    rest, rest_epoch, rest_steps = r["rest"]
    assert untrained and Counter(rest) == untrained, "the rest of the saved epoch is not what the dp=2 run left"
    assert rest_epoch == 1 and rest_steps >= 1, (rest_epoch, rest_steps)
    after, after_epoch = r["after"]
    assert after_epoch == 2 and Counter(after) == every_token(), "the next iter() is not a whole new epoch"


def test_on_more_replicas_the_next_epoch_follows_at_once(worlds, data):
    results = worlds.get(2).run(epoch_end_resume, data, 1, 2, timeout=240)
    assert trained(results, 1, 0) == every_token()  # one leader: its epoch trains every token
    for r in results:  # both ranks lead at dp=2
        rest, rest_epoch, _ = r["rest"]
        assert rest_epoch == 2 and rest == r["epochs2"][1], "not the uninterrupted dp=2 run's second epoch"
