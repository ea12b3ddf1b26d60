"""Several MDS datasets mixed on a schedule, on the data-parallel leaders only.

:class:`MixtureSource` builds one packing :class:`~collective_loader.streaming.StreamingSource`
per source (build it on every rank, like them); on a leader it makes a :class:`MixtureStream`.
Every source packs its own documents into rows of ``seq_len + 1`` tokens cut from their
concatenation, so a row holds ``seq_len`` real tokens whatever its documents' lengths, and
mixing rows mixes tokens. Which source each row of a step comes from is decided by a
:class:`~collective_loader.text.mixture.RowAllocator` from the schedule and the training progress
alone: every leader decides the same, with no collective, and the decision does not depend on the
DP degree. Each source keeps its own cursor (its packing stream's state), saved in the loader's
state, so a resume continues each source where it was, also after the schedule's future was
edited (other weights, a source added or dropped: logged at INFO)::

    schedule = MixtureSchedule((Phase(0, {"web": 0.7, "code": 0.3}), Phase(8e6, {"web": 0.2, "math": 0.8}, ramp=1e6)))
    source = MixtureSource(mesh, {"web": {"local": "/data/web"}, "code": {"local": "/data/code"},
                                  "math": {"local": "/data/math"}},
                           schedule, batch_size=8, packing=Packing(seq_len=2048))
    loader = CollectiveLoader(source, mesh, inputs=("input_ids",), labels=("labels", "source_id"))

Every batch carries ``source_id`` ``(R,)`` int64: each row's source, its index in
``MixtureSource.names`` (a trainer logs the loss per source from it). A source that runs out
ends the epoch, on every rank at the same step (the loader's end of data).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from collective_loader.plan.mesh import DEFAULT_PLACEMENT, Placement, StageStyle
from collective_loader.streaming.source import StreamingSource
from collective_loader.streaming.streams import PackedStream
from collective_loader.text.layouts import ColumnLayout
from collective_loader.text.mixture import MixtureSchedule, RowAllocator
from collective_loader.text.packing import Packing, Row, batch_of

log = logging.getLogger(__name__)


class MixtureSource:
    """One packing ``StreamingSource`` per source, mixed by ``schedule``; pass it to
    ``CollectiveLoader`` as the source.

    Args:
        mesh: the loader's mesh. Construct on **every** rank.
        sources: per source name, the ``StreamingDataset`` arguments of that source (``local``,
            ``remote``, ``shuffle``, ``shuffle_seed``, ...). Every name the schedule weighs must
            be here; one it does not weigh is read only if a resumed state's schedule did.
        schedule: the weights over training progress.
        batch_size: rows per replica and step.
        packing: how each source's documents become rows (balancing over replicas is not
            supported with mixtures yet).
        layout: where a sample's tokens are, the same for every source.
        documents_per_batch, num_workers, placement, stage_style, clean_stale, timeout,
        dataloader_kwargs: as for ``StreamingSource``, for every source.
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        sources: Mapping[str, Mapping[str, Any]],
        schedule: MixtureSchedule,
        *,
        batch_size: int,
        packing: Packing,
        layout: ColumnLayout | None = None,
        documents_per_batch: int | None = None,
        num_workers: int = 0,
        placement: Placement = DEFAULT_PLACEMENT,
        stage_style: StageStyle = "loop",
        clean_stale: bool = False,
        timeout: float = 600.0,
        dataloader_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        missing = sorted(set(schedule.sources) - set(sources))
        if missing:
            raise ValueError(f"the schedule weighs sources {missing} that sources= does not describe")
        if packing.balance is not None:
            raise ValueError("mixtures do not balance rows over replicas yet: leave Packing(balance=None)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 row per replica and step, got {batch_size}")
        self.names: tuple[str, ...] = tuple(sorted(sources))
        self.schedule, self.batch_size, self.packing = schedule, batch_size, packing
        self._sources = {
            name: StreamingSource(
                mesh,
                batch_size=1,  # one row per pull: the mixture draws each row from its own source
                packing=packing,
                layout=layout,
                documents_per_batch=documents_per_batch or batch_size,
                num_workers=num_workers,
                placement=placement,
                stage_style=stage_style,
                clean_stale=clean_stale and name == self.names[0],  # once per node is enough
                timeout=timeout,
                dataloader_kwargs=dataloader_kwargs,
                **dict(sources[name]),
            )
            for name in self.names
        }
        first = self._sources[self.names[0]]
        self.place = first.place
        self.leaders = first.leaders

    def __call__(self) -> MixtureStream:
        """Build every source's dataset and DataLoader (leaders only; ``CollectiveLoader`` calls this)."""
        streams: dict[str, PackedStream] = {}
        for name in self.names:
            stream = self._sources[name]()
            assert isinstance(stream, PackedStream)
            streams[name] = stream
        return MixtureStream(streams, self.schedule, self.batch_size, self.packing, self.place.dp_size)


class MixtureStream:
    """A leader's mixture: per step, ``batch_size`` rows, each from the source the allocator names.

    State: the allocator's counters, the progress, and each source's own packing state, so each
    source resumes at its own cursor. ``stats()``: per source, rows and real tokens delivered by
    this leader, the share of them against the scheduled weight, and the current weights.
    """

    elastic = True  # each source's packing state re-partitions; the allocation ignores dp

    def __init__(
        self,
        streams: Mapping[str, PackedStream],
        schedule: MixtureSchedule,
        batch_size: int,
        packing: Packing,
        dp_size: int,
    ) -> None:
        self.streams = dict(streams)
        self.names = tuple(sorted(streams))
        self.schedule, self.batch_size, self.packing, self.dp_size = schedule, batch_size, packing, dp_size
        self.allocator = RowAllocator(schedule)
        self.progress = 0.0  # in the schedule's unit, over every replica
        self._rows: dict[str, Iterator[list[Row]]] = {}
        self._counts = {name: {"rows": 0, "tokens": 0} for name in self.names}
        self._held: dict[str, Any] = {}  # the saved states of sources this schedule no longer weighs
        self._resumed: dict[str, Any] = {}  # the state each source resumed from, until it is pulled again

    # --- iteration -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        self._rows = {}
        index = {name: i for i, name in enumerate(self.names)}
        while True:
            start = self.progress  # the step's weights are those at its start
            chosen = self.allocator.allocate(start, self.batch_size)
            rows: list[Row] = []
            ids: list[int] = []
            for name in chosen:
                row = self._next_row(name)
                if row is None:  # this source ran out: the epoch ends here, on every rank
                    log.info("mixture source %r ran out at progress %.0f: the epoch ends", name, self.progress)
                    return
                rows.append(row)
                ids.append(index[name])
                self._counts[name]["rows"] += 1
                self._counts[name]["tokens"] += max(len(row.tokens) - 1, 0)
            self.progress += self._step_progress()
            if log.isEnabledFor(logging.DEBUG):
                weights = self.allocator.weights_at(start)
                log.debug("mixture step: rows %s, weights %s", {n: chosen.count(n) for n in self.names}, weights)
            batch: dict[str, Any] = batch_of(rows, self.packing, self.batch_size)
            batch["source_id"] = torch.tensor(ids, dtype=torch.int64)
            yield batch

    def _next_row(self, name: str) -> Row | None:
        rows = self._rows.get(name)
        if rows is None:
            stream = self.streams[name]
            rows = self._rows[name] = stream.rows.row_lists(stream.data.batches(), stream.data.first_step)
        pulled = next(rows, None)
        return pulled[0] if pulled else None

    def _step_progress(self) -> float:
        """One step's progress over every replica, in the schedule's unit."""
        if self.schedule.unit == "steps":
            return 1.0
        return float(self.dp_size * self.batch_size * self.packing.seq_len)

    # --- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This leader's snapshot right after a batch; :meth:`checkpoint_state` makes the state."""
        return {
            "mixture": self.allocator.state_dict(),
            "progress": self.progress,
            "sources": {name: self._source_snapshot(name) for name in self.names},
        }

    def _source_snapshot(self, name: str) -> Any:
        if name in self._rows:
            return self.streams[name].state_dict()
        return self._resumed.get(name)  # not pulled since the resume (or at all): as it was

    def checkpoint_state(self, snapshot: Any) -> Any:
        """Each source's state over every leader (its own collective over the leaders), with the
        allocator's counters and the progress; sources held from a resumed state kept as saved."""
        if snapshot is None:
            return None
        sources = {name: self.streams[name].checkpoint_state(s) for name, s in snapshot["sources"].items()}
        return {**snapshot, "sources": {**self._held, **sources}}

    def resume(self, state: Mapping[str, Any] | None, steps: int) -> None:
        if state is None:
            return
        self.progress = float(state["progress"])  # where the next step starts
        changes = self.allocator.load_state_dict(
            state["mixture"], self.schedule, allow_edit=True, progress=self.progress
        )
        for line in changes:
            log.info("mixture resumed under an edited schedule: %s", line)
        saved = dict(state["sources"])
        self._held = {name: s for name, s in saved.items() if name not in self.streams}
        self._resumed = {name: saved.get(name) for name in self.names}
        for name in self.names:
            self.streams[name].resume(saved.get(name), steps)

    # --- the rest of the Source protocol ------------------------------------------------------------

    def stop(self) -> None:
        for stream in self.streams.values():
            stream.stop()

    def stats(self) -> dict[str, float]:
        """Per source ``name``: ``mixture/name/rows``, ``/tokens`` (real tokens this leader
        delivered), ``/share`` (of this leader's real tokens) and ``/weight`` (now)."""
        total = sum(c["tokens"] for c in self._counts.values()) or 1
        weights = self.schedule.weights_at(self.progress)
        out: dict[str, float] = {}
        for name, counts in self._counts.items():
            out[f"mixture/{name}/rows"] = counts["rows"]
            out[f"mixture/{name}/tokens"] = counts["tokens"]
            out[f"mixture/{name}/share"] = counts["tokens"] / total
            out[f"mixture/{name}/weight"] = weights.get(name, 0.0)
        return out

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()
