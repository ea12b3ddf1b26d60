"""Running figures a leader counts as it delivers: the work of the micro-batches it split.

The plan says what one micro-batch costs each shard rank
(:meth:`~collective_loader.plan.split.Split.work`, a pure function of the batch); this module
counts those over the steps, for the loader's ``stats()``.
"""

from __future__ import annotations

from collective_loader.plan.split import ShardWork


class ShardWorkTally:
    """Running figures over the micro-batches a leader split (its loader's ``stats()``).

    >>> tally = ShardWorkTally()
    >>> tally.add(ShardWork((3.0, 1.0), 4, 6)); tally.add(ShardWork((1.0, 1.0), 3, 6))
    >>> tally.figures()
    {'cp_micro_batches': 2, 'cp_cost_max_over_mean': 1.25, 'cp_cost_max_over_mean_worst': 1.5, 'cp_padding': 0.1667}
    """

    def __init__(self) -> None:
        self.batches, self.balance_sum, self.worst, self.slots, self.tokens = 0, 0.0, 1.0, 0, 0

    def add(self, work: ShardWork) -> None:
        self.batches += 1
        self.balance_sum += work.max_over_mean
        self.worst = max(self.worst, work.max_over_mean)
        self.slots += len(work.costs) * work.slots
        self.tokens += work.tokens

    def figures(self) -> dict[str, float]:
        """``cp_cost_max_over_mean``: the mean over micro-batches of max / mean cost over the shard
        ranks (``_worst``: the largest); ``cp_padding``: all slots over all real tokens, minus 1.
        Empty before the first split micro-batch."""
        if not self.batches:
            return {}
        return {
            "cp_micro_batches": self.batches,
            "cp_cost_max_over_mean": round(self.balance_sum / self.batches, 4),
            "cp_cost_max_over_mean_worst": round(self.worst, 4),
            "cp_padding": round(self.slots / self.tokens - 1, 4) if self.tokens else 0.0,
        }
