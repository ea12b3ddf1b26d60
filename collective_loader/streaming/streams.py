"""A leader's ``StreamingDataset`` as a :class:`~collective_loader.Source`: three kinds, one state
format each.

* :class:`SampleStream`: the DataLoader's batches as they are. Its state is streaming's own
  (``StreamingDataset.state_dict``) for the *global* number of samples consumed, ``batches taken
  x global batch``, plus the global batch, which a resume must keep: the DP degree may change
  with it (``elastic``).
* :class:`PackedStream`: documents packed into rows (:class:`~collective_loader.text.rows.PackedRows`).
  Leaders take different numbers of samples per step, so each snapshot holds this leader's
  packer cursor, and :meth:`PackedStream.checkpoint_state` (collective over the leaders) turns
  the leaders' snapshots into one state every rank saves: streaming's state at the lowest cursor
  step, and the hand-over of the documents trained since (:mod:`collective_loader.text.resume`).
* :class:`BalancedStream`: a :class:`PackedStream` whose rows the leaders place over the replicas
  together each step (:class:`~collective_loader.streaming.balanced_rows.BalancedRows`); the same state.

:class:`~collective_loader.streaming.source.StreamingSource` builds the right one on each leader.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from collective_loader.delivery.leader_group import LeaderGroup
from collective_loader.delivery.workers import stop_dataloader_workers, stop_workers
from collective_loader.streaming.balanced_rows import BalancedRows
from collective_loader.streaming.cleanup import release
from collective_loader.text.packing import Row
from collective_loader.text.resume import Cursor, combine
from collective_loader.text.rows import PackedRows

CLOSE_WAIT = 60.0  # seconds a leader waits for the others before releasing shared files


class LeaderDataset:
    """What every kind of stream holds: a leader's dataset, its DataLoader and the current epoch.

    ``global_batch``: samples all leaders take per step (streaming's unit of progress).
    Streaming's state is asked once per epoch (:meth:`epoch_state`): each call of streaming's
    ``state_dict`` after a resume maps one more shared-memory block until exit.
    """

    def __init__(self, dataset: Any, loader: DataLoader, global_batch: int, leaders: LeaderGroup) -> None:
        self.dataset: Any = dataset
        self.loader: DataLoader | None = loader
        self.global_batch = global_batch
        self.leaders = leaders  # held for it (released at close)
        self._epoch_state: dict[str, Any] | None = None
        self._batches: Any = None  # the DataLoader iterator of the current (or last) epoch

    def columns(self) -> dict[str, str]:
        """The dataset's columns, name -> encoding, as its first shard declares them."""
        shards = self.dataset.shards
        return dict(zip(shards[0].column_names, shards[0].column_encodings)) if shards else {}

    def batches(self) -> Iterator[Any]:
        """Start an epoch: the DataLoader's iterator."""
        assert self.loader is not None, "the stream was used after close()"
        self._epoch_state = None
        self._batches = iter(self.loader)
        return self._batches

    def epoch_state(self) -> dict[str, Any]:
        """Streaming's state at the start of this epoch (known once the epoch has started)."""
        if self._epoch_state is None:
            self._epoch_state = self.dataset.state_dict(num_samples=0, from_beginning=False)
        return self._epoch_state

    def first_step(self) -> int:
        """The step this epoch starts at (a resumed one: after the steps it had trained)."""
        offset = self.epoch_state()["sample_in_epoch"]
        if offset % self.global_batch:
            raise ValueError(
                f"the epoch resumed at sample {offset}, which is no whole number of steps of {self.global_batch} samples "
                "(documents_per_batch x dp_size): resume a packing source from its own state"
            )
        return offset // self.global_batch

    def check(self, state: Mapping[str, Any], unit: str, packed: bool) -> None:
        """Refuse a state this run cannot resume: another global batch (``unit`` x dp_size), or
        saved with packing by a source that does not pack, or the other way round."""
        if state.get("global_batch") != self.global_batch:
            raise ValueError(
                f"the state was saved with a global batch of {state.get('global_batch')} samples; this run's is "
                f"{self.global_batch} ({unit} x dp_size): streaming resumes exactly only with the same global batch"
            )
        if ("packing" in state) != packed:
            raise ValueError(
                f"the state was saved {'with' if 'packing' in state else 'without'} packing and this source "
                f"{'packs' if packed else 'does not pack'}: resume with the source that saved it"
            )

    def load(self, state: Mapping[str, Any]) -> None:
        """Streaming's part of ``state``."""
        self.dataset.load_state_dict({k: v for k, v in state.items() if k not in ("global_batch", "packing")})

    def stop(self) -> None:
        stop_workers(self._batches, self.loader)

    def close(self) -> None:
        """Release the dataset's shared memory and lock files now rather than at interpreter exit.

        Every leader calls it; it first waits, at most ``CLOSE_WAIT`` seconds, for the other
        leaders, which share the node's blocks and locks.
        """
        if self.dataset is None:
            return
        # the last epoch's workers (a packing leader's epoch can end at another leader's last
        # step, leaving its DataLoader iterator unfinished), and persistent_workers
        self.stop()
        stop_dataloader_workers(self.loader)
        dataset, self.dataset, self.loader = self.dataset, None, None
        try:
            release_together(dataset, self.leaders)
        finally:
            self.leaders.release()


def release_together(dataset: Any, leaders: LeaderGroup) -> None:
    """Release ``dataset``'s shared memory and lock files once every leader of ``leaders`` is
    here (they share the node's blocks and locks), waiting at most ``CLOSE_WAIT`` seconds; a
    leader missing leaves the files in place, with a warning naming it."""
    missing = leaders.wait_for_all(CLOSE_WAIT)
    if missing is not None:
        warnings.warn(
            f"not every leader closed its dataset; leaving streaming's files in place: {missing}", stacklevel=4
        )
        return
    release(dataset)


class SampleStream:
    """A leader's DataLoader batches, with streaming's own state (see the module's docstring)."""

    elastic = True

    def __init__(self, data: LeaderDataset) -> None:
        self.data = data
        self._taken = 0

    @property
    def dataset(self) -> Any:
        """The leader's ``StreamingDataset`` (``None`` after close)."""
        return self.data.dataset

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        self._taken = 0
        for batch in self.data.batches():
            self.data.epoch_state()  # the epoch has started: streaming knows its offset now
            self._taken += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        state = dict(self.data.epoch_state())
        state["sample_in_epoch"] += self._taken * self.data.global_batch
        return {**state, "global_batch": self.data.global_batch}

    def resume(self, state: Mapping[str, Any] | None, steps: int) -> None:
        if state is not None:
            self.data.check(state, "batch_size", packed=False)
            self.data.load(state)

    def checkpoint_state(self, snapshot: Any) -> Any:
        return snapshot

    def stop(self) -> None:
        self.data.stop()

    def stats(self) -> dict[str, float]:
        return {}

    def columns(self) -> dict[str, dict[str, str]]:
        """Its dataset's columns (name -> encoding), under the name ``""`` (one dataset)."""
        return {"": self.data.columns()}

    def close(self) -> None:
        self.data.close()


class PackedStream:
    """A leader's documents packed into rows of ``batch_size`` per step (see the module's docstring).

    :meth:`stats`: this leader's packing in the current (or last) epoch: ``documents`` taken,
    ``rows`` packed (padding rows included), ``tokens`` of documents in them, ``carried`` (tokens
    of a document begun in an earlier row), ``padding`` (token slots of padding), ``dropped``
    (tokens of the last partial rows and batch with ``at_end="drop"``).
    """

    elastic = True

    def __init__(self, data: LeaderDataset, rows: PackedRows) -> None:
        self.data = data
        self.rows = rows

    @property
    def dataset(self) -> Any:
        """The leader's ``StreamingDataset`` (``None`` after close)."""
        return self.data.dataset

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        return self.rows.rows(self.data.batches(), self.data.first_step)

    def row_lists(self) -> Iterator[tuple[list[Row], Cursor]]:
        """One epoch's rows before they become tensors, a step's (at most ``batch_size``) at a
        time, each with the packer's cursor before them: :meth:`snapshot_at` it is the state that
        resumes at them (for rows taken but not trained yet)."""
        before = None
        for rows in self.rows.row_lists(self.data.batches(), self.data.first_step):
            yield rows, before or Cursor(self.data.first_step(), 0, 0)  # the epoch's start is known once begun
            before = self.rows.cursor()

    def state_dict(self) -> dict[str, Any]:
        """This leader's snapshot right after a batch; :meth:`checkpoint_state` makes the state."""
        return self.snapshot_at(self.rows.cursor())

    def snapshot_at(self, cursor: Cursor) -> dict[str, Any]:
        """The snapshot :meth:`state_dict` gave when the packer was at ``cursor`` in this epoch:
        for rows taken from the stream but not trained yet.

        It holds this epoch's log and resumed hand-over themselves: :meth:`checkpoint_state` reads
        them on the training thread, and by then the transfer thread may have begun the stream's
        next epoch (a mixture's ``"repeat"`` source does, within the loader's epoch), which puts
        new ones in their place.
        """
        state = dict(self.data.epoch_state())
        state["sample_in_epoch"] = cursor.step * self.data.global_batch  # this leader's own: the lowest is saved
        at = [cursor.step, cursor.index, cursor.offset]
        packed = {"cursor": at, "log": self.rows.log, "resumed": self.rows.resumed}
        return {**state, "global_batch": self.data.global_batch, "packing": packed}

    def checkpoint_state(self, snapshot: Any) -> Any:
        """Every leader's snapshot of the same step in one state, returned on every leader:
        streaming's state at the lowest cursor step ``D`` over the leaders, and
        ``packing = {"world": [leaders, leaders per node], "entries": (n, 4) int64 tensor}``, the
        hand-over of the documents trained at steps ``>= D``. Collective over the leaders. A
        state that is no snapshot (``None``: nothing consumed yet; the state a resumed epoch
        started from, before its first step) is saved as it is.

        The hand-over is of the snapshot's epoch, from its own log, even if the stream is in a
        later one now (a ``"repeat"`` source of a mixture that began anew after the snapshot).
        """
        if snapshot is None or "cursor" not in snapshot["packing"]:
            return snapshot
        rows, packed = self.rows, snapshot["packing"]
        log, cursor = packed["log"], Cursor(*packed["cursor"])
        first = min(self.data.leaders.gather(cursor.step))
        passed, matched = log.hand_over(rows.dp_rank, cursor, first)
        heard = self.data.leaders.gather({"passed": torch.from_numpy(passed), "matched": torch.from_numpy(matched)})
        parts = [(part["passed"].numpy(), part["matched"].numpy()) for part in heard]
        entries = combine(parts, packed["resumed"], first)
        log.prune(first)
        out = {k: v for k, v in snapshot.items() if k != "packing"}
        out["sample_in_epoch"] = first * self.data.global_batch
        out["packing"] = {"world": list(rows.world), "entries": torch.from_numpy(entries)}
        return out

    def resume(self, state: Mapping[str, Any] | None, steps: int) -> None:
        if state is None:
            return
        self.data.check(state, "documents_per_batch", packed=True)
        packed = state["packing"]
        if "entries" not in packed:
            raise ValueError(
                "a packing leader's own snapshot cannot resume: pass the state checkpoint_state returns "
                "(CollectiveLoader.state_dict does)"
            )
        self.rows.resume(np.asarray(packed["entries"], dtype=np.int64).reshape(-1, 4), packed["world"])
        self.data.load(state)

    def stop(self) -> None:
        self.data.stop()

    def stats(self) -> dict[str, float]:
        return dict(self.rows.stats)

    def columns(self) -> dict[str, dict[str, str]]:
        """Its dataset's columns (name -> encoding), under the name ``""`` (one dataset)."""
        return {"": self.data.columns()}

    def close(self) -> None:
        self.data.close()


class BalancedStream(PackedStream):
    """A :class:`PackedStream` whose rows the leaders place over the replicas each step.

    :meth:`stats` adds ``balanced_steps`` and, averaged over them, the replicas' cost max/mean as
    the leaders packed the rows (``cost_max_over_mean_packed``) and as they were placed
    (``cost_max_over_mean``).
    """

    def __init__(self, data: LeaderDataset, rows: PackedRows, balanced: BalancedRows) -> None:
        super().__init__(data, rows)
        self.balanced = balanced
        balanced.leaders.hold()  # released at close

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        return self.balanced.batches(rows for rows, _ in self.row_lists())

    def stats(self) -> dict[str, float]:
        out = super().stats()
        figures = self.balanced.stats
        steps = int(figures["steps"])
        out["balanced_steps"] = steps
        out["cost_max_over_mean_packed"] = figures["cost_ratio_packed"] / steps if steps else 1.0
        out["cost_max_over_mean"] = figures["cost_ratio_placed"] / steps if steps else 1.0
        return out

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.balanced.leaders.release()
