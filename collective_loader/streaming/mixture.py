"""Several MDS datasets mixed on a schedule, on the data-parallel leaders only (``docs/mixtures.md``).

:class:`MixtureSource` makes one packing :class:`~collective_loader.streaming.StreamingSource` per
source over one leaders' group; on a leader its :class:`MixtureStream` draws each row of a step
from the source an :class:`~collective_loader.text.mixture.Allocation` names. A row holds
``seq_len`` real tokens, but a source's last row of an epoch, padded, counts its real tokens (the
leaders tell each other theirs), so mixing rows mixes tokens. A source that runs out follows its
``when_exhausted`` on every leader at the same step; with a ``"repeat"`` or ``"stop"`` source the
leaders agree on it before every step (one small gather, over a group of their own).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from collective_loader.delivery.leader_group import LeaderGroup
from collective_loader.streaming.mixture_file import read_mixture, when_exhausted_of
from collective_loader.streaming.source import StreamingSource
from collective_loader.streaming.streams import PackedStream
from collective_loader.text.mixture import Allocation, MixtureSchedule
from collective_loader.text.packing import Packing, Row, batch_of
from collective_loader.text.resume import Cursor

log = logging.getLogger(__name__)


class MixtureSource:
    """One packing ``StreamingSource`` per source, mixed by ``schedule``; pass it to
    ``CollectiveLoader`` as the source. Construct on **every** rank.

    Args:
        mesh: the loader's mesh.
        sources: per source name, its ``StreamingDataset`` arguments (``local``, ...) and, optionally,
            ``when_exhausted``: ``"end"`` (the epoch), ``"repeat"`` (a new epoch of it) or ``"stop"`` (it;
            the others share its weight). A source the schedule does not weigh keeps its cursor.
        schedule: the weights over training progress.
        batch_size: rows per replica and step.
        packing: how each source's documents become rows (no ``balance`` with mixtures yet).
        source_key: the batch key of each row's source (its index in ``names``); ``None``: none.
        allow_edit: resume a state saved under another schedule (each change logged at INFO).
        **options: ``StreamingSource``'s other options (``layout``, ``documents_per_batch``, by default
            ``batch_size``, ``num_workers``, ``roles``, ...) and ``StreamingDataset`` arguments for every
            source, which a source's own table overrides.
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        sources: Mapping[str, Mapping[str, Any]],
        schedule: MixtureSchedule,
        *,
        batch_size: int,
        packing: Packing,
        source_key: str | None = "source_id",
        allow_edit: bool = False,
        **options: Any,
    ) -> None:
        missing = sorted(set(schedule.sources) - set(sources))
        if missing:
            raise ValueError(f"the schedule weighs sources {missing} that sources= does not describe")
        if packing.balance is not None:
            raise ValueError("mixtures do not balance rows over replicas yet: leave Packing(balance=None)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 row per replica and step, got {batch_size}")
        self.when_exhausted = when_exhausted_of(sources, "MixtureSource")
        self.names: tuple[str, ...] = tuple(sorted(sources))
        self.schedule, self.batch_size, self.packing = schedule, batch_size, packing
        self.source_key, self.allow_edit = source_key, allow_edit
        options["documents_per_batch"] = options.get("documents_per_batch") or batch_size
        # one row per pull: the mixture draws each row from its own source
        shared = StreamingSource(mesh, batch_size=1, packing=packing, **options)
        tables = {name: {k: v for k, v in sources[name].items() if k != "when_exhausted"} for name in self.names}
        self._sources = {name: shared.over(**tables[name]) for name in self.names}
        self.place, self.leaders = shared.place, shared.leaders
        # the per-step agreement runs on the transfer thread: a group of its own, apart from checkpoint_state's
        agree = any(policy != "end" for policy in self.when_exhausted.values())
        self._agreement = LeaderGroup.build(self.leaders, shared.timeout, "mixture") if agree else None

    @classmethod
    def from_file(
        cls, mesh: DeviceMesh, path: str | Path, *, batch_size: int, packing: Packing, **options: Any
    ) -> MixtureSource:
        """The mixture of one ``.json`` or ``.toml`` file: its ``sources`` tables and its schedule
        (``docs/mixtures.md``; an error names the file). ``options`` as for the constructor: they
        apply to every source, whose own table overrides them.

        Example (every rank)::

            source = MixtureSource.from_file(mesh, "mix.toml", batch_size=4, packing=Packing(2048))
        """
        sources, schedule = read_mixture(path)
        return cls(mesh, sources, schedule, batch_size=batch_size, packing=packing, **options)

    def saved_global_batches(self, state: Mapping[str, Any]) -> list[int] | None:
        """The global batches (samples of all leaders per step) each source of a saved state counts
        in (a source not read yet: none); ``None`` for a state a ``MixtureSource`` did not save.
        Every rank can ask, before a resume: the format stays this class's."""
        if "mixture" not in state:
            return None
        return [source["global_batch"] for source in state["sources"].values() if source is not None]

    def __call__(self) -> MixtureStream:
        """Build every source's dataset and DataLoader (leaders only; ``CollectiveLoader`` calls this)."""
        streams: dict[str, PackedStream] = {}
        for name in self.names:
            stream = self._sources[name]()
            assert isinstance(stream, PackedStream)
            streams[name] = stream
        agreement = self._agreement if self._agreement is not None and self._agreement.group is not None else None
        return MixtureStream(streams, self, agreement)


class _SourceRows:
    """One source on a leader: the rows taken from its stream and not trained yet, each with the
    packer's cursor before it (a checkpoint saves them as not trained), and what it delivered."""

    def __init__(self, stream: PackedStream) -> None:
        self.stream = stream
        self.start: Any = None  # the state this epoch resumed from, until a row is taken
        self.queue: deque[tuple[Row, Cursor]] = deque()
        self.counts = dict.fromkeys(("rows", "tokens", "documents", "epochs", "dropped_rows"), 0)
        self._rows: Iterator[tuple[list[Row], Cursor]] = iter(())
        self._taken = False  # a row of this epoch

    def begin(self) -> None:
        """A new epoch, its first row queued. Every leader does it at the same step: streaming
        starts an epoch once every leader on the node has asked for it."""
        if self.counts["epochs"]:
            self.drop()
            self.stream.stop()  # the last epoch's DataLoader workers
            self.start = None
        self._rows, self._taken = self.stream.row_lists(), False
        self.counts["epochs"] += 1
        self.fill(1)

    def fill(self, rows: int) -> bool:
        """Take rows from the stream until ``rows`` are queued; ``False`` if its epoch ends first."""
        while len(self.queue) < rows and (pulled := next(self._rows, None)) is not None:
            self._taken = True
            self.queue.append((pulled[0][0], pulled[1]))
        return len(self.queue) >= rows

    def take(self) -> Row:
        row = self.queue.popleft()[0]
        self.counts["rows"] += 1
        self.counts["tokens"] += max(len(row.tokens) - 1, 0)  # real tokens: a row holds seq_len + 1
        self.counts["documents"] += row.documents
        return row

    def drop(self) -> int:
        """Forget the queued rows (the epoch ends before they are trained); how many."""
        n = len(self.queue)
        self.queue.clear()
        self.counts["dropped_rows"] += n
        return n

    def snapshot(self) -> Any:
        """The stream's snapshot before its first queued row (after its last trained one)."""
        if self.queue:
            return self.stream.snapshot_at(self.queue[0][1])
        return self.stream.state_dict() if self._taken else self.start


class MixtureStream:
    """A leader's mixture: per step, ``batch_size`` rows, each from the source the allocation names.
    State: the allocation, the progress and each source's packing state from before its queued rows.
    """

    elastic = True  # each source's packing state re-partitions; the allocation over all replicas goes on

    def __init__(self, streams: Mapping[str, PackedStream], mix: MixtureSource, agreement: LeaderGroup | None) -> None:
        self.sources = {name: _SourceRows(streams[name]) for name in sorted(streams)}
        self.mix, self.agreement = mix, None if agreement is None else agreement.hold()
        self.dp_rank, self.dp_size = mix.place.dp_rank, mix.place.dp_size
        self.allocation = Allocation.start(mix.schedule, self.dp_size)
        self.progress = 0.0  # in the schedule's unit, over every replica
        self._held: dict[str, Any] = {}  # the saved states of sources this run does not describe
        # the padded rows among every leader's next batch_size rows of each active source, when the leaders
        # know each other's (an agreement, or one leader): (replica, source, index) -> padding tokens
        self._ahead = mix.batch_size if agreement is not None or self.dp_size == 1 else 0
        self._padded: dict[tuple[int, str, int], int] = {}

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        self._together(self._begin_every_source, "began an epoch")
        index = {name: i for i, name in enumerate(self.sources)}
        seq_len, rows = self.mix.packing.seq_len, self.mix.batch_size
        while (allocated := self._allocate()) is not None:
            chosen, padding = allocated
            if log.isEnabledFor(logging.DEBUG):
                weights = self.allocation.weights_at(self.progress)
                log.debug("mixture step: rows %s, weights %s", Counter(chosen), weights)
            self.progress += 1.0 if self.mix.schedule.unit == "steps" else self.dp_size * rows * seq_len - padding
            batch: dict[str, Any] = batch_of([self.sources[name].take() for name in chosen], self.mix.packing, rows)
            if self.mix.source_key is not None:
                batch[self.mix.source_key] = torch.tensor([index[name] for name in chosen], dtype=torch.int64)
            yield batch

    def _begin_every_source(self) -> None:
        self._padded = {}
        for source in self.sources.values():
            source.begin()

    def _allocate(self) -> tuple[list[str], int] | None:
        """This replica's sources for the next step, each queued on every leader, and the padding
        tokens of every replica's rows; ``None`` when the epoch ends. A source some leader lacks
        follows its policy. Tried again when the padded rows heard are not those it was told of."""
        restarted: set[str] = set()
        seq_len = self.mix.packing.seq_len
        while True:
            short_rows = {k: n / seq_len for k, n in self._padded.items()}
            every, after = self.allocation.allocate(self.progress, self.mix.batch_size, short_rows)
            short, heard = self._short(Counter(every[self.dp_rank]))
            if heard != self._padded:
                self._padded = heard
                continue
            if not short:
                self.allocation = after
                taken = [Counter(names) for names in every]
                padding = sum(n for (r, name, i), n in heard.items() if i < taken[r][name])
                self._padded = {(r, s, i - taken[r][s]): n for (r, s, i), n in heard.items() if i >= taken[r][s]}
                return every[self.dp_rank], padding
            for name in short:
                policy = self.mix.when_exhausted[name]
                where = f"mixture source {name!r} ran out at progress {self.progress:.0f} {self.mix.schedule.unit}"
                if policy == "end":
                    log.info("%s: the epoch ends", where)
                    return None
                if name in restarted:
                    raise RuntimeError(
                        f"{where} in the new epoch it began at this step: it has fewer rows than a step takes "
                        f"from it ({self.dp_size} replicas)"
                    )
                dropped = self.sources[name].drop()
                if policy == "repeat":
                    log.info("%s: a new epoch of it begins (%d rows queued here dropped)", where, dropped)
                    self._together(self.sources[name].begin, f"began a new epoch of {name!r}")
                    restarted.add(name)
                    continue
                log.info("%s: it stops, the others share its weight (%d rows queued here dropped)", where, dropped)
                self.allocation = self.allocation.exclude(name)
                if not self.allocation.weights_at(self.progress):
                    log.info("mixture: every source weighed now has stopped: the epoch ends")
                    return None

    def _short(self, need: Counter[str]) -> tuple[list[str], dict[tuple[int, str, int], int]]:
        """The sources some leader lacks rows of (this leader's alone without an agreement: the
        loader's end of data then stops every rank), and the padded rows among every leader's next
        ``batch_size`` rows of each active source, (replica, source, index) -> padding tokens (a
        step takes no more, so a resume is exact); none at dp > 1 without an agreement."""
        seq_len, ahead = self.mix.packing.seq_len, self._ahead

        def mine() -> tuple[list[str], list[Any]]:
            short = [name for name in sorted(need) if not self.sources[name].fill(need[name])]
            padded = []
            for name in self.allocation.weights_at(self.progress) if ahead else ():
                self.sources[name].fill(ahead)
                for i, (row, _) in enumerate(islice(self.sources[name].queue, ahead)):
                    if len(row.tokens) <= seq_len:
                        padded.append([self.dp_rank, name, i, seq_len - max(len(row.tokens) - 1, 0)])
            return short, [short, padded]

        if self.agreement is None:
            short, mine_heard = mine()
            heard = [mine_heard]
        else:
            _, heard = self.agreement.agree(mine, "queued a mixture step's rows")
            short = sorted(set().union(*(s for s, _ in heard)))
        return short, {(r, name, i): n for _, padded in heard for r, name, i, n in padded}

    def _together(self, work: Callable[[], Any], what: str) -> None:
        """``work()`` on every leader; one that raises tells the others (which raise too)."""
        if self.agreement is None:
            work()
        else:
            self.agreement.agree(lambda: (work(), None), what)

    def state_dict(self) -> dict[str, Any]:
        """This leader's snapshot right after a batch; :meth:`checkpoint_state` makes the state."""
        sources = {name: source.snapshot() for name, source in self.sources.items()}
        return {"mixture": self.allocation.state_dict(), "progress": self.progress, "sources": sources}

    def checkpoint_state(self, snapshot: Any) -> Any:
        """Each source's state over every leader (its own collective over the leaders), with the
        allocation and the progress; sources held from a resumed state kept as saved."""
        if snapshot is None:
            return None
        sources = {name: self.sources[name].stream.checkpoint_state(s) for name, s in snapshot["sources"].items()}
        return {**snapshot, "sources": {**self._held, **sources}}

    def resume(self, state: Mapping[str, Any] | None, steps: int) -> None:
        if state is None:
            return
        self.progress = float(state["progress"])  # where the next step starts
        self.allocation, changes = Allocation.resume(
            state["mixture"], self.mix.schedule, self.dp_size, allow_edit=self.mix.allow_edit, progress=self.progress
        )
        for line in changes:
            log.info("mixture resumed under an edited schedule: %s", line)
        self._held = {name: s for name, s in state["sources"].items() if name not in self.sources}
        for name, source in self.sources.items():
            source.start = state["sources"].get(name)
            source.stream.resume(source.start, steps)

    def stop(self) -> None:
        for source in self.sources.values():
            source.stream.stop()

    def stats(self) -> dict[str, float]:
        """Per source ``name``: ``mixture/name/rows``, ``/tokens`` (real tokens), ``/documents``
        (begun) this leader delivered; ``/share`` (of this leader's real tokens) against
        ``/target`` (the scheduled share of every replica's real tokens so far) and ``/weight`` (now);
        ``/epochs`` begun, ``/dropped_rows`` (queued when an epoch ended early)."""
        total = sum(source.counts["tokens"] for source in self.sources.values()) or 1
        targets, weights = self.allocation.targets, self.allocation.weights_at(self.progress)
        slots = sum(targets.values()) or 1.0
        out: dict[str, float] = {}
        for name, source in self.sources.items():
            share = {"share": source.counts["tokens"] / total, "target": targets.get(name, 0.0) / slots}
            out |= {
                f"mixture/{name}/{k}": v
                for k, v in {**source.counts, **share, "weight": weights.get(name, 0.0)}.items()
            }
        return out

    def columns(self) -> dict[str, dict[str, str]]:
        """Each source's dataset's columns (name -> encoding), by source name."""
        return {name: source.stream.columns()[""] for name, source in self.sources.items()}

    def close(self) -> None:
        try:
            for source in self.sources.values():
                source.stream.close()
        finally:
            if self.agreement is not None:
                self.agreement.release()
