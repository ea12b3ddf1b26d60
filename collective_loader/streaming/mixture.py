"""Several MDS datasets mixed on a schedule, on the data-parallel leaders only.

:class:`MixtureSource` builds one packing :class:`~collective_loader.streaming.StreamingSource`
per source (build it on every rank, like them); on a leader it makes a :class:`MixtureStream`.
Every source packs its own documents into rows of ``seq_len + 1`` tokens cut from their
concatenation, so a row holds ``seq_len`` real tokens whatever its documents' lengths, and
mixing rows mixes tokens; an epoch's last, padded row counts its real tokens (the allocator
credits it, and the progress counts real tokens). Which source each row of every replica comes
from is decided by a :class:`~collective_loader.text.mixture.ReplicaAllocator` from the schedule
and the training progress alone (and the padded rows the leaders tell each other in their
agreement, below): every leader computes the same allocation. Over all replicas
each source stays within a row of its target; each replica's own rows stay near it too, so each
consumes its part of every source at about the scheduled rate and the leaders' parts (as many
documents each) run out together; a replica's rows do not depend on how its steps are cut into
micro-batches. Each source keeps its own cursor (its
packing stream's state), saved in the loader's state, so a resume continues each source where
it was, also at another DP degree and, with ``allow_edit=True``, after the schedule's future was
edited (other weights, a source added or dropped: logged at INFO)::

    schedule = MixtureSchedule((Phase(0, {"web": 0.7, "code": 0.3}), Phase(8e6, {"web": 0.2, "math": 0.8}, ramp=1e6)))
    source = MixtureSource(mesh, {"web": {"local": "/data/web"},
                                  "code": {"local": "/data/code", "when_exhausted": "repeat"},
                                  "math": {"local": "/data/math"}},
                           schedule, batch_size=8, packing=Packing(seq_len=2048))
    loader = CollectiveLoader(source, mesh, inputs=("input_ids",), labels=("labels", "source_id"))

Every batch carries ``source_id`` ``(R,)`` int64 (``source_key=``; ``None``: no such key): each
row's source, its index in ``MixtureSource.names`` (a trainer logs the loss per source from it).

**When a source runs out** on some leader (each leader reads its own part of every source), its
``when_exhausted`` policy applies on every leader at the same step: ``"end"`` (the default) ends
the epoch, ``"repeat"`` begins a new shuffled epoch of that source, ``"stop"`` takes it out and
shares its weight among the others. What the other leaders had left of that source's epoch is
not trained (as at streaming's own epoch end: each leader's part holds as many documents, so
that is a few rows; ``stats()`` counts the queued ones as ``dropped_rows``). With a "repeat" or
"stop" source the leaders agree on it every step (one small gather among them, on the loader's
transfer thread, which also tells every leader which of the others' next rows are padded); with
"end" alone the loader's own end of data does (and at dp > 1 the last padded rows before it count
as full: no leader knows the others').
"""

from __future__ import annotations

import copy
import logging
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from itertools import islice
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from collective_loader.delivery.leaders import LeaderGroup
from collective_loader.plan.mesh import DEFAULT_PLACEMENT, Placement, StageStyle
from collective_loader.streaming.source import StreamingSource
from collective_loader.streaming.streams import PackedStream
from collective_loader.text.layouts import ColumnLayout
from collective_loader.text.mixture import MixtureSchedule, ReplicaAllocator, WhenExhausted, when_exhausted_of
from collective_loader.text.packing import Packing, Row, batch_of
from collective_loader.text.resume import Cursor

log = logging.getLogger(__name__)


class MixtureSource:
    """One packing ``StreamingSource`` per source, mixed by ``schedule``; pass it to
    ``CollectiveLoader`` as the source.

    Args:
        mesh: the loader's mesh. Construct on **every** rank.
        sources: per source name, the ``StreamingDataset`` arguments of that source (``local``,
            ``remote``, ``shuffle``, ``shuffle_seed``, ...) and, optionally, ``when_exhausted``:
            ``"end"``, ``"repeat"`` or ``"stop"`` (see the module). Every name the schedule weighs
            must be here; one it does not weigh is kept with its cursor, and read only when the
            schedule weighs it.
        schedule: the weights over training progress.
        batch_size: rows per replica and step.
        packing: how each source's documents become rows (balancing over replicas is not
            supported with mixtures yet).
        layout: where a sample's tokens are, the same for every source.
        documents_per_batch, num_workers, placement, stage_style, clean_stale, timeout,
        dataloader_kwargs: as for ``StreamingSource``, for every source.
        source_key: the batch key of each row's source (its index in ``names``), ``(R,)`` int64;
            ``None``: no such key.
        allow_edit: resume a state saved under another schedule (its future edited: other weights,
            a source added or dropped; each change logged at INFO). Without it such a state is
            refused, naming what changed.
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
        source_key: str | None = "source_id",
        allow_edit: bool = False,
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
                **{k: v for k, v in sources[name].items() if k != "when_exhausted"},
            )
            for name in self.names
        }
        first = self._sources[self.names[0]]
        self.place = first.place
        self.leaders = first.leaders
        # the per-step agreement runs on the transfer thread: a group of its own, apart from checkpoint_state's
        agree = any(policy != "end" for policy in self.when_exhausted.values())
        self._agreement = LeaderGroup.build(self.leaders, timeout, "mixture") if agree else None

    def __call__(self) -> MixtureStream:
        """Build every source's dataset and DataLoader (leaders only; ``CollectiveLoader`` calls this)."""
        streams: dict[str, PackedStream] = {}
        for name in self.names:
            stream = self._sources[name]()
            assert isinstance(stream, PackedStream)
            streams[name] = stream
        return MixtureStream(
            streams,
            self.schedule,
            self.batch_size,
            self.packing,
            (self.place.dp_rank, self.place.dp_size),
            self.when_exhausted,
            self.source_key,
            self.allow_edit,
            self._agreement if self._agreement is not None and self._agreement.group is not None else None,
        )


class _SourceRows:
    """One source on a leader: its packing stream, read a row at a time into a queue of rows
    taken from it but not trained yet, each with the packer's cursor from before it (so a
    checkpoint saves the queued rows as not trained)."""

    def __init__(self, stream: PackedStream) -> None:
        self.stream = stream
        self.start: Any = None  # the snapshot before the epoch's first row, until one is taken (a resume's state)
        self.queue: deque[tuple[Row, Cursor]] = deque()
        self.epochs = 0  # epochs begun
        self.dropped = 0  # rows taken and never trained: what was queued when an epoch ended early
        self._rows: Iterator[list[Row]] | None = None
        self._taken = 0  # rows taken in this epoch
        self._ended = False

    def begin(self) -> None:
        """A new epoch, and its first row in the queue. Every leader does it at the same step:
        streaming starts an epoch once every leader on the node has asked for it."""
        if self._rows is not None:
            self.drop()
            self.stream.stop()  # the last epoch's DataLoader workers
            self.start = None
        stream = self.stream
        self._rows = stream.rows.row_lists(stream.data.batches(), stream.data.first_step)
        self._taken, self._ended = 0, False
        self.epochs += 1
        self.fill(1)

    def fill(self, rows: int) -> bool:
        """Take rows from the stream until ``rows`` are queued; ``False`` if its epoch ends first."""
        assert self._rows is not None, "begin() first"
        while len(self.queue) < rows and not self._ended:
            before = self.stream.rows.cursor() if self._taken else None
            pulled = next(self._rows, None)
            if not pulled:
                self._ended = True
                break
            self._taken += 1
            self.queue.append((pulled[0], before if before is not None else self.stream.epoch_start()))
        return len(self.queue) >= rows

    def take(self) -> Row:
        return self.queue.popleft()[0]

    def drop(self) -> int:
        """Forget the queued rows (the epoch ends before they are trained); how many."""
        n = len(self.queue)
        self.queue.clear()
        self.dropped += n
        return n

    def snapshot(self) -> Any:
        """The stream's snapshot before its first queued row (after its last trained one)."""
        if self.queue:
            return self.stream.snapshot_at(self.queue[0][1])
        return self.stream.state_dict() if self._taken else self.start


class MixtureStream:
    """A leader's mixture: per step, ``batch_size`` rows, each from the source the allocator names.

    Before a step's rows are used, each source has them queued; with a ``"repeat"`` or ``"stop"``
    source the leaders then agree over ``agreement`` (one gather) whether one of them lacks rows,
    so that every leader ends, restarts or stops that source at the same step, and which of their
    next ``batch_size`` rows of each active source (queued ahead) are padded: the allocator credits
    them, counting their real tokens.

    State: the allocator's counters, the progress, and each source's own packing state (from
    before its queued rows), so each source resumes at its own cursor. ``stats()``: per source,
    the rows, real tokens and documents this leader delivered, the share of them against the
    scheduled one, the current weight, epochs begun and rows dropped at early epoch ends.
    """

    elastic = True  # each source's packing state re-partitions; the allocation over all replicas goes on

    def __init__(
        self,
        streams: Mapping[str, PackedStream],
        schedule: MixtureSchedule,
        batch_size: int,
        packing: Packing,
        replica: tuple[int, int],
        when_exhausted: Mapping[str, WhenExhausted],
        source_key: str | None,
        allow_edit: bool,
        agreement: LeaderGroup | None,
    ) -> None:
        self.sources = {name: _SourceRows(streams[name]) for name in sorted(streams)}
        self.names = tuple(self.sources)
        self.schedule, self.batch_size, self.packing = schedule, batch_size, packing
        self.dp_rank, self.dp_size = replica
        self.when_exhausted, self.source_key, self.allow_edit = dict(when_exhausted), source_key, allow_edit
        self.agreement = agreement
        self.allocator = ReplicaAllocator(schedule, self.dp_size)
        self.progress = 0.0  # in the schedule's unit, over every replica
        self._counts = {name: dict.fromkeys(("rows", "tokens", "documents"), 0) for name in self.names}
        self._held: dict[str, Any] = {}  # the saved states of sources this run does not describe
        # the padded rows among every leader's next batch_size rows of each active source, when the
        # leaders know each other's (an agreement, or one leader): (replica, source, index) -> padding tokens
        self._ahead = batch_size if agreement is not None or self.dp_size == 1 else 0
        self._padded: dict[tuple[int, str, int], int] = {}

    # --- iteration -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        self._together(self._begin_every_source, "began an epoch")
        index = {name: i for i, name in enumerate(self.names)}
        while True:
            start = self.progress  # the step's weights are those at its start
            allocated = self._allocate()
            if allocated is None:
                return
            chosen, padding = allocated
            rows = [self.sources[name].take() for name in chosen]
            for name, row in zip(chosen, rows):
                counts = self._counts[name]
                counts["rows"] += 1
                counts["tokens"] += max(len(row.tokens) - 1, 0)
                counts["documents"] += row.documents
            self.progress += self._step_progress(padding)
            if log.isEnabledFor(logging.DEBUG):
                weights = self.allocator.rows.weights_at(start)
                log.debug("mixture step: rows %s, weights %s", {n: chosen.count(n) for n in self.names}, weights)
            batch: dict[str, Any] = batch_of(rows, self.packing, self.batch_size)
            if self.source_key is not None:
                batch[self.source_key] = torch.tensor([index[name] for name in chosen], dtype=torch.int64)
            yield batch

    def _begin_every_source(self) -> None:
        self._padded = {}
        for source in self.sources.values():
            source.begin()

    def _allocate(self) -> tuple[list[str], int] | None:
        """The sources of this replica's rows for the next step, each queued on every leader, and
        the padding tokens of every replica's rows; ``None`` when the epoch ends. A source some
        leader lacks rows of follows its policy. The allocator credits the padded rows among the
        leaders' next rows (allocating again when they are not the ones it was told of: each
        source's next ``batch_size`` rows are all it can take, so a resume is exact)."""
        restarted: set[str] = set()
        seq_len = self.packing.seq_len
        while True:
            trial = copy.deepcopy(self.allocator)  # kept only once every leader has its rows
            every = trial.allocate(self.progress, self.batch_size, {k: n / seq_len for k, n in self._padded.items()})
            short, heard = self._short(Counter(every[self.dp_rank]))
            if heard != self._padded:
                self._padded = heard
                continue
            if not short:
                self.allocator = trial
                taken = {(r, name): every[r].count(name) for r in range(self.dp_size) for name in self.names}
                padding = sum(n for (r, name, i), n in heard.items() if i < taken[r, name])
                self._padded = {
                    (r, name, i - taken[r, name]): n for (r, name, i), n in heard.items() if i >= taken[r, name]
                }
                return every[self.dp_rank], padding
            for name in short:
                policy = self.when_exhausted[name]
                where = f"mixture source {name!r} ran out at progress {self.progress:.0f} {self.schedule.unit}"
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
                self.allocator.rows.exclude(name)
                if not self.allocator.rows.weights_at(self.progress):
                    log.info("mixture: every source weighed now has stopped: the epoch ends")
                    return None

    def _short(self, need: Counter[str]) -> tuple[list[str], dict[tuple[int, str, int], int]]:
        """The sources some leader lacks rows of for this step (this leader's alone when every
        policy is "end": the loader's end of data then stops every rank at the same step), and
        the padded rows (fewer than ``seq_len`` real tokens) among every leader's next
        ``batch_size`` rows of each active source (queued to know them): (replica, source, index)
        -> padding tokens; none when every policy is "end" at dp > 1 (no leader knows the others':
        they count as full, and the epoch ends soon after them)."""
        seq_len, ahead = self.packing.seq_len, self._ahead

        def mine() -> tuple[list[str], list[Any]]:
            short = [name for name in sorted(need) if not self.sources[name].fill(need[name])]
            padded = []
            for name in self.allocator.rows.weights_at(self.progress) if ahead else ():
                self.sources[name].fill(ahead)
                for i, (row, _) in enumerate(islice(self.sources[name].queue, ahead)):
                    if len(row.tokens) <= seq_len:
                        padded.append([self.dp_rank, name, i, seq_len - max(len(row.tokens) - 1, 0)])
            return short, [short, padded]

        if self.agreement is None:
            short, heard = mine()
            heard = [heard]
        else:
            _, heard = self.agreement.agree(mine, "queued a mixture step's rows")
            short = sorted(set().union(*(s for s, _ in heard)))
        return short, {(r, name, i): n for _, padded in heard for r, name, i, n in padded}

    def _together(self, work: Callable[[], Any], what: str) -> None:
        """``work()`` on every leader; with an agreement group, one that raises tells the others,
        which raise too, rather than wait for it in the next step's gather."""
        if self.agreement is None:
            work()
        else:
            self.agreement.agree(lambda: (work(), None), what)

    def _step_progress(self, padding: int) -> float:
        """One step's progress over every replica, in the schedule's unit: its real tokens (its
        rows' tokens but ``padding``), or 1 step."""
        if self.schedule.unit == "steps":
            return 1.0
        return float(self.dp_size * self.batch_size * self.packing.seq_len - padding)

    # --- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This leader's snapshot right after a batch; :meth:`checkpoint_state` makes the state."""
        return {
            "mixture": self.allocator.state_dict(),
            "progress": self.progress,
            "sources": {name: source.snapshot() for name, source in self.sources.items()},
        }

    def checkpoint_state(self, snapshot: Any) -> Any:
        """Each source's state over every leader (its own collective over the leaders), with the
        allocator's counters and the progress; sources held from a resumed state kept as saved."""
        if snapshot is None:
            return None
        sources = {name: self.sources[name].stream.checkpoint_state(s) for name, s in snapshot["sources"].items()}
        return {**snapshot, "sources": {**self._held, **sources}}

    def resume(self, state: Mapping[str, Any] | None, steps: int) -> None:
        if state is None:
            return
        self.progress = float(state["progress"])  # where the next step starts
        changes = self.allocator.load_state_dict(state["mixture"], allow_edit=self.allow_edit, progress=self.progress)
        for line in changes:
            log.info("mixture resumed under an edited schedule: %s", line)
        saved = dict(state["sources"])
        self._held = {name: s for name, s in saved.items() if name not in self.sources}
        for name, source in self.sources.items():
            source.start = saved.get(name)
            source.stream.resume(saved.get(name), steps)

    # --- the rest of the Source protocol ------------------------------------------------------------

    def stop(self) -> None:
        for source in self.sources.values():
            source.stream.stop()

    def stats(self) -> dict[str, float]:
        """Per source ``name``: ``mixture/name/rows``, ``/tokens`` (real tokens), ``/documents``
        (begun) this leader delivered; ``/share`` (of this leader's real tokens) against
        ``/target`` (the scheduled share of every replica's real tokens so far) and ``/weight`` (now);
        ``/epochs`` begun, ``/dropped_rows`` (queued when an epoch ended early)."""
        total = sum(c["tokens"] for c in self._counts.values()) or 1
        targets = self.allocator.rows.targets
        slots = sum(targets.values()) or 1.0
        weights = self.allocator.rows.weights_at(self.progress)
        out: dict[str, float] = {}
        for name, counts in self._counts.items():
            source = self.sources[name]
            out[f"mixture/{name}/rows"] = counts["rows"]
            out[f"mixture/{name}/tokens"] = counts["tokens"]
            out[f"mixture/{name}/documents"] = counts["documents"]
            out[f"mixture/{name}/share"] = counts["tokens"] / total
            out[f"mixture/{name}/target"] = targets.get(name, 0.0) / slots
            out[f"mixture/{name}/weight"] = weights.get(name, 0.0)
            out[f"mixture/{name}/epochs"] = source.epochs
            out[f"mixture/{name}/dropped_rows"] = source.dropped
        return out

    def close(self) -> None:
        for source in self.sources.values():
            source.stream.close()
