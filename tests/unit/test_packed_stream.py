"""A packing leader's checkpoint (:class:`~collective_loader.streaming.streams.PackedStream`), in one
process, over a stand-in dataset: the leader's documents, numbered, a few sample-batches an epoch.

The loader's transfer thread takes a snapshot right after each batch; the training thread turns it
into the state later (``checkpoint_state``, a collective over the leaders). A mixture's ``"repeat"``
source begins its next epoch on the transfer thread, so that can happen while the training thread
is inside ``checkpoint_state`` (here the leaders' gather begins it: the interleaving that made a
resume across a repeating source's new epoch train that source's last rows again, 1 run in 3-4 of
``tests/distributed/test_mixture_source.py``'s resume across credited short rows), or before it
(which raised ``RuntimeError``). Either way the state is the snapshot's epoch's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from collective_loader.delivery.leader_group import LeaderGroup
from collective_loader.streaming.streams import LeaderDataset, PackedStream
from collective_loader.text.layouts import TokenizedBatch
from collective_loader.text.packing import Packing
from collective_loader.text.resume import FULL
from collective_loader.text.rows import PackedRows

GLOBAL_BATCH = 2  # samples per step: one leader, two documents a sample-batch
# each epoch: steps 0 and 1, documents of 3 tokens (rows of seq_len + 1 = 4 tokens)
EPOCH = [
    (np.array([10, 11]), [np.arange(3), np.arange(3, 6)]),
    (np.array([12, 13]), [np.arange(6, 9), np.arange(9, 12)]),
]


class Dataset:
    """What a leader asks of its ``StreamingDataset`` here: streaming's state at an epoch's start."""

    def __init__(self) -> None:
        self.epochs = 0

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict[str, Any]:
        return {"epoch": self.epochs - 1, "sample_in_epoch": num_samples}


class Epochs:
    """The leader's DataLoader: each iteration an epoch of :data:`EPOCH`, counted by ``dataset``."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[TokenizedBatch]:
        self.dataset.epochs += 1
        return iter([TokenizedBatch(samples, tokens) for samples, tokens in EPOCH])


class Alone(LeaderGroup):
    """One leader's group, whose first gather runs ``meanwhile`` first: what the transfer thread
    did while the training thread waited in it."""

    def __init__(self) -> None:
        super().__init__(None)
        self.meanwhile: Callable[[], Any] | None = None

    def gather(self, value: Any) -> list[Any]:
        work, self.meanwhile = self.meanwhile, None
        if work is not None:
            work()
        return super().gather(value)


def stream() -> tuple[PackedStream, Alone]:
    dataset, leaders = Dataset(), Alone()
    data = LeaderDataset(dataset, Epochs(dataset), GLOBAL_BATCH, leaders)  # type: ignore[arg-type]
    return PackedStream(data, PackedRows(Packing(seq_len=3), batch_rows=1, dp_rank=0, world=(1, 1))), leaders


@pytest.mark.parametrize("begins", ["during the checkpoint", "before the checkpoint"])
def test_a_checkpoint_of_the_last_epoch_hands_over_that_epoch_s_documents_while_the_next_begins(begins):
    alone, _ = stream()
    assert len(list(alone.row_lists())) == 3  # 12 tokens: 3 rows of 4
    expected = alone.checkpoint_state(alone.state_dict())  # the end of epoch 0, nothing else happening

    packed, leaders = stream()
    assert len(list(packed.row_lists())) == 3
    snapshot = packed.state_dict()  # the transfer thread, right after the epoch's last batch
    epoch_1 = packed.row_lists()
    begin = lambda: next(epoch_1)  # noqa: E731 (the transfer thread begins epoch 1: a mixture's "repeat")
    if begins == "before the checkpoint":
        begin()
    else:
        leaders.meanwhile = begin
    state = packed.checkpoint_state(snapshot)  # the training thread

    # epoch 0 resumes at step 1 and passes over both of its documents: its rows are trained
    assert (state["epoch"], state["sample_in_epoch"]) == (0, 1 * GLOBAL_BATCH)
    assert state["packing"]["entries"].tolist() == [[0, 1, 12, FULL], [0, 1, 13, FULL]]
    assert state["packing"]["entries"].tolist() == expected["packing"]["entries"].tolist()
    # a checkpoint of epoch 1 at its first row (3 tokens of document 10, 1 of 11): the one above
    # pruned epoch 0's log, not this one's
    state = packed.checkpoint_state(packed.state_dict())
    assert state["epoch"] == 1 and state["packing"]["entries"].tolist() == [[0, 0, 10, FULL], [0, 0, 11, 1]]
