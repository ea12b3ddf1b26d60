"""The leaders place each step's packed rows over the replicas together (``Packing(balance=...)``).

Each leader packs its rows as without balancing (:class:`~collective_loader.text.rows.PackedRows`),
then, per step: one gather of every leader's piece lengths (a few hundred bytes), the same
:func:`~collective_loader.text.balance.place`-ment computed on every leader, and one all-to-all
that moves the token ids of the pieces that change leader. It runs where the source runs, on the
transfer thread, over a gloo group of its own (never NCCL, and never the group the packing state
is gathered over on the training thread).

Every leader takes part in every step's gather, also to say that its data ended (the epoch ends on
every leader at that step, as without balancing) or that its source raised (every leader raises,
naming it), so no leader is left waiting in the all-to-all.

With ``Balance(replicas=k)`` each block of ``k`` consecutive replicas does all of this among its
own leaders, over a group of its own: a step's collectives cost what they cost at dp = ``k``. A
block whose data ends, or whose source raises, stops at that step while the others have loaded
theirs; the loader's per-step agreement of every leader's outcome then ends every rank at that
same step, as when one leader's data ends without balancing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import torch

from collective_loader.delivery.leader_group import LeaderGroup
from collective_loader.text.balance import Piece, place_in_blocks, replica_costs
from collective_loader.text.packing import Packing, Row, batch_of

log = logging.getLogger(__name__)


class BalancedRows:
    """A packing leader's steps of rows, placed over the replicas with the other leaders.

    ``dp_rank``: this leader's replica (for the log); ``leaders``: the group of the leaders placed
    together (every replica's, or those of this replica's block of ``Balance(replicas=k)``).
    Placements are indexed by the leaders' order in that group: the leader of rank ``g`` there
    delivers ``placed[g]`` to its replica. :attr:`stats` holds the figures of the steps so far:
    ``steps``, and the sums over steps of max/mean cost over the group's replicas as packed
    (``cost_ratio_packed``) and as placed (``cost_ratio_placed``).
    """

    def __init__(self, packing: Packing, batch_rows: int, dp_rank: int, leaders: LeaderGroup) -> None:
        assert packing.balance is not None
        self.packing, self.balance = packing, packing.balance
        self.batch_rows, self.dp_rank, self.leaders = batch_rows, dp_rank, leaders
        self.stats: dict[str, float] = {"steps": 0, "cost_ratio_packed": 0.0, "cost_ratio_placed": 0.0}

    def batches(self, steps: Iterator[list[Row]]) -> Iterator[dict[str, torch.Tensor]]:
        """Each step's batch of this replica's rows: ``steps`` yields this leader's rows as packed."""
        self.stats = {"steps": 0, "cost_ratio_packed": 0.0, "cost_ratio_placed": 0.0}
        while True:
            rows, heard = self.leaders.agree(lambda: _next_rows(steps), "balanced a step")
            if rows is None or any(pieces is None for pieces in heard):
                return  # every leader stops at this step
            yield self._step(rows, heard)

    def _step(self, rows: list[Row], pieces: list[list[list[int]]]) -> dict[str, torch.Tensor]:
        capacity = self.packing.seq_len + 1
        placed = place_in_blocks(pieces, self.batch_rows, capacity, self.balance.linear_cost, self.balance.rows)
        mine = self._move(rows, placed)
        batch = batch_of(mine, self.packing, self.batch_rows)
        if self.balance.valid_tokens is not None:
            # a row of n real tokens has n - 1 real labels (its last token is a label only)
            valid = sum(max(sum(p.length for p in row) - 1, 0) for replica in placed for row in replica)
            batch[self.balance.valid_tokens] = torch.tensor(valid, dtype=torch.int64)
        self._count(pieces, placed)
        return batch

    def _move(self, rows: list[Row], placed: list[list[list[Piece]]]) -> list[Row]:
        """This replica's rows: the pieces placed here, their tokens sent by the leaders that packed them."""
        me = self.leaders.rank
        send: list[np.ndarray] = []
        send_counts = []
        for replica in placed:  # in each receiver's row order: the order it reads them back in
            n = 0
            for row in replica:
                for p in row:
                    if p.leader == me:
                        send.append(rows[p.row].tokens[p.start : p.start + p.length])
                        n += p.length
            send_counts.append(n)
        recv_counts = [sum(p.length for row in placed[me] for p in row if p.leader == j) for j in range(len(placed))]
        flat = np.concatenate(send) if send else np.zeros(0, np.int64)
        received = self.leaders.exchange(torch.from_numpy(flat.astype(np.int64)), send_counts, recv_counts).numpy()
        starts = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]).astype(int).tolist()
        out = []
        for row in placed[me]:
            parts = []
            for p in row:
                parts.append(received[starts[p.leader] : starts[p.leader] + p.length])
                starts[p.leader] += p.length
            tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
            out.append(Row(tokens, [p.length for p in row]))
        return out

    def _count(self, packed: list[list[list[int]]], placed: list[list[list[Piece]]]) -> None:
        c = self.balance.linear_cost
        before = replica_costs(packed, c)
        after = replica_costs([[[p.length for p in row] for row in replica] for replica in placed], c)
        ratios = [max(costs) / (sum(costs) / len(costs)) if sum(costs) else 1.0 for costs in (before, after)]
        self.stats["steps"] += 1
        self.stats["cost_ratio_packed"] += ratios[0]
        self.stats["cost_ratio_placed"] += ratios[1]
        log.debug(
            "balance step %d (replica %d): replica cost max/mean %.3f as packed, %.3f placed",
            self.stats["steps"] - 1,
            self.dp_rank,
            ratios[0],
            ratios[1],
        )


def _next_rows(steps: Iterator[list[Row]]) -> tuple[list[Row] | None, list[list[int]] | None]:
    """This leader's next rows, and what the others need of them (their pieces; ``None`` at the end)."""
    rows = next(steps, None)
    return rows, None if rows is None else [r.pieces for r in rows]
