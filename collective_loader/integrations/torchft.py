"""Live elasticity under torchft: replica groups leave and join a running job, and over the
committed steps every sample, or every token of packed rows, is trained exactly once, with a
constant global batch.

:class:`QuorumData` holds the job's whole data state, one **cursor** into a fixed global order
(:mod:`collective_loader.plan.quorum`), and registers it with torchft's ``Manager`` so that a
group that heals takes it from a live peer. A position of that order is a sample of the dataset,
or, with ``packing=``, a packed row of ``seq_len + 1`` tokens cut from the documents of the
order concatenated (:class:`~collective_loader.plan.quorum.DocumentStarts`). Each step it reads
the step's quorum (``participating_rank()``, ``num_participants()``), computes this replica's
share of the window ``[cursor, cursor + global_batch)``, and has the replica's leader read those
positions and deliver them as micro-batches with a :class:`~collective_loader.CollectiveLoader`
over the group's own ``DeviceMesh``. The cursor moves only when the step commits, so a step that
does not commit is served again to the next quorum, re-divided over whoever is there. See
docs/fault-tolerance.md.

The training loop, on every rank of a replica group::

    data = QuorumData(dataset, mesh, manager, global_batch=G, micro_batch=m, inputs=..., labels=...)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # a group outside the step all-reduces zeros
    while manager.current_step() < steps:
        manager.start_quorum()
        for batch in data.step():  # this replica's micro-batches (none outside the step)
            loss = loss_fn(model(batch["x"]), batch["y"], reduction="sum") / data.global_samples
            loss.backward()
        for p in model.parameters():
            manager.allreduce(p.grad, reduce_op=ReduceOp.SUM).wait()  # SUM: the loss is global already
        committed = manager.should_commit()
        if committed:
            optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        data.end_step(committed)

torchft is imported by nothing here: ``manager`` is any object with torchft's ``Manager``
methods used above, so importing this module never needs torchft.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import default_collate

from collective_loader.delivery.agreement import run_phase
from collective_loader.integrations.quorum_positions import Positions, RowPositions, SamplePositions
from collective_loader.loader import CollectiveLoader
from collective_loader.plan.quorum import GlobalOrder, StepShare, step_share
from collective_loader.text.layouts import TokenLayout
from collective_loader.text.packing import Packing
from collective_loader.types import Batch

if TYPE_CHECKING:
    from torchft import Manager

__all__ = ["QuorumData"]

_FORMAT = 2  # 2: the kind of positions (samples or packed rows) and the rows' anchor


@runtime_checkable
class MapDataset(Protocol):
    """What :class:`QuorumData` reads: a length, and one sample by index (a list, a map-style
    ``Dataset``, a :class:`~collective_loader.streaming.leader_dataset.StreamingByIndex`)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


@runtime_checkable
class ClosingDataset(MapDataset, Protocol):
    """A dataset that holds something until closed (a leader's ``StreamingDataset``: shared
    memory). :class:`QuorumData` closes one that its ``dataset`` callable built."""

    def close(self) -> None: ...


class QuorumData:
    """One replica group's data under torchft: each step, this replica's share of a constant
    global batch, split by the step's quorum; a committed cursor torchft hands to healing groups.

    Build it on every rank of the replica group (a collective, like the
    :class:`~collective_loader.CollectiveLoader` it builds), after the ``Manager`` and before
    the first ``start_quorum()``.

    Args:
        dataset: a :class:`MapDataset`: anything with ``__len__`` and ``__getitem__(index)``
            returning one sample (a list, a map-style ``Dataset``), taken as it is (it stays the
            caller's to close); or else a zero-argument callable returning one, called on the
            replicas' leaders only (a :class:`~collective_loader.streaming.LeaderStreamingDataset`:
            an MDS dataset), whose product is QuorumData's: :meth:`close` closes it when it has
            ``close()`` (:class:`ClosingDataset`). Anything else is a ``TypeError`` on every rank;
            a callable that returns no ``MapDataset``, a ``LeaderError`` on every rank. Only
            leaders read it, by index, in this class's own order.
        mesh: the replica group's own ``DeviceMesh`` (every rank of the group's
            ``torch.distributed`` world); its data dims (``dp_shard``, ``dp``, ...) split the
            group's share again, its ``tp`` peers get copies, as in any ``CollectiveLoader``.
        manager: the group's ``torchft.Manager``. Its ``participating_rank()`` and
            ``num_participants()`` choose the share; the state is registered with its
            ``register_state_dict_fn(state_key, ...)``.
        global_batch: samples (or packed rows) per step over the whole job, whatever the quorum (``G``).
        micro_batch: the most samples (rows) one micro-batch holds; a replica delivers its share as
            ``ceil(share / micro_batch)`` micro-batches (the same count on every replica of the group).
        packing: a :class:`~collective_loader.text.Packing`: the positions of the order are rows
            of ``seq_len + 1`` tokens packed from the samples' documents (batches of
            ``input_ids``, ``labels`` and ``packing.boundaries``), every token of every document
            in one row; ``None``: the positions are the samples.
        layout: with ``packing``, where a sample's tokens are: a ``TokenColumn`` (default
            ``TokenColumn("tokens")``), a ``TextColumn``, or any :class:`~collective_loader.text.layouts.TokenLayout`.
        document_lengths: with ``packing``, optionally each sample's token count, by dataset index
            (a list, an array, ``numpy.load(path, mmap_mode="r")``: only the leaders read it).
            Without it a leader learns the lengths by reading the documents: every leader reads
            about every document of every window; with it, only those of its own rows.
        collate: without ``packing``, samples -> one batch (default
            ``torch.utils.data.default_collate``); an empty micro-batch is the collate of one
            sample with every tensor cut to 0 rows.
        shuffle, seed: the global order: a permutation of the dataset per pass, from ``seed``
            and the pass (or the identity without ``shuffle``), the same on every process.
        state_key: the key of the state registered with the manager.
        **loader_options: the :class:`~collective_loader.LoaderConfig` fields (``inputs=``,
            ``labels=``, ``every_stage=``, ``seq_dims=``, ``timeout=``, ...).
    """

    def __init__(
        self,
        dataset: MapDataset | Callable[[], MapDataset],
        mesh: DeviceMesh,
        manager: Manager,
        *,
        global_batch: int,
        micro_batch: int,
        packing: Packing | None = None,
        layout: TokenLayout | None = None,
        document_lengths: Any = None,
        collate: Callable[[list[Any]], Batch] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        state_key: str = "collective_loader",
        **loader_options: Any,
    ) -> None:
        if global_batch < 1 or micro_batch < 1:
            raise ValueError(f"global_batch and micro_batch must be >= 1, got {global_batch} and {micro_batch}")
        if not isinstance(dataset, MapDataset) and not callable(dataset):
            raise TypeError(
                "dataset must be a map-style dataset (__len__ and __getitem__) or a zero-argument callable "
                f"returning one, got {type(dataset).__qualname__}"
            )
        self.positions: Positions = (
            SamplePositions(collate or default_collate, layout=layout, document_lengths=document_lengths)
            if packing is None
            else RowPositions(packing, layout=layout, document_lengths=document_lengths, collate=collate)
        )
        self.manager = manager
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.shuffle, self.seed = shuffle, seed
        self.cursor = 0  # positions of the global order the committed steps trained
        self.share: StepShare | None = None  # the current (or last) step's share for this replica
        self._step_number: int | None = None  # the manager's step while a step is open
        self._before_first_commit = True  # no step committed through this QuorumData yet (every rank alike)
        positions = self.positions
        self.loader = CollectiveLoader(lambda: _step_source(dataset, positions, seed, shuffle), mesh, **loader_options)
        manager.register_state_dict_fn(state_key, self._load_live_state, self.state_dict)

    @property
    def global_samples(self) -> int:
        """The loss normaliser: the samples (rows) of the whole step over every participant (the
        global batch). Divide a summed loss by it and all-reduce gradients with ``SUM``; with
        ``packing`` every row is full, so a step holds ``global_samples * seq_len`` label tokens."""
        return self.global_batch

    def step(self) -> Iterator[Batch]:
        """This rank's micro-batches of the current step, after ``manager.start_quorum()``.

        Blocks on the quorum (``participating_rank()``), computes this replica's share
        (:attr:`share`), and returns an iterator of its micro-batches, each delivered by the
        replica's leader (none when the group takes no part in the step: a healing group in
        torchft's asynchronous mode). Iterate it to the end before :meth:`end_step`.

        Until the first step commits it is collective over the group (call it on every rank, as
        the loop does): a ``RuntimeError`` on every rank of the group when some rank of it heals
        while it is given a share (torchft's asynchronous quorum with ``init_sync=True``)."""
        if self._step_number is not None:
            raise RuntimeError("QuorumData.step() again before end_step(committed) of the step before")
        participant = self.manager.participating_rank()  # blocks until the quorum is known
        participants = self.manager.num_participants()
        if self._before_first_commit:
            self._refuse_partial_heal(participant, participants)
        self._step_number = self.manager.current_step()
        loader = self.loader
        share = step_share(
            self.cursor, self.global_batch, participant, participants, loader.dp_rank, loader.dp_size, self.micro_batch
        )
        self.share = share
        if not share.micro_batches:  # the whole group agrees: it saw the same quorum
            return iter(())
        source = loader.source
        if source is not None:  # a leader: read only this step's share, nothing ahead
            assert isinstance(source, _StepSource)
            source.request = share.micro_batches
        return iter(loader)

    def end_step(self, committed: bool) -> None:
        """After ``manager.should_commit()``: pass what it returned. The cursor moves by the
        global batch only on ``True``; otherwise the same window is served to the next quorum."""
        if self._step_number is None:
            raise RuntimeError("QuorumData.end_step() without a step()")
        expected = self._step_number + (1 if committed else 0)
        self._step_number = None
        if self.manager.current_step() != expected:
            raise RuntimeError(
                f"end_step(committed={committed}) but the manager is at step {self.manager.current_step()}, "
                f"expected {expected}: pass what manager.should_commit() returned, once per step"
            )
        if committed:
            self._before_first_commit = False
            self.cursor += self.global_batch
            self.positions.committed(self.cursor)

    def _refuse_partial_heal(self, participant: int | None, participants: int) -> None:
        """Raise on every rank of the group when any of its ranks is given a share of the step
        (``participating_rank()`` not ``None``) but does not take part (``is_participating()``
        false: it heals in torchft's asynchronous quorum, so its gradient is zeroed).

        torchft 0.2 does that with ``init_sync=True``, which heals a group's ranks at step 0 rank
        by rank from different groups: the ranks that heal would drop their gradients while
        their share of the data counts as trained. Only some ranks of the group are in that
        state, and they share one loader, so a rank that raised alone would leave the others
        waiting for it in the loader's next collective: the group agrees on it instead, with one
        small all-reduce on this (the training) thread over the loader's control group (gloo,
        every rank of the group; nothing else uses it after construction). It is needed only
        before the group's first commit: that is the only time a rank can heal while given a
        share (a group behind the others' step heals as a whole and is given none), and from
        the first commit on every rank has passed step 0. "Before the first commit" is the same
        on every rank of the group (``end_step`` takes ``should_commit()``, the group's vote),
        so every rank runs the collective at the same steps."""

        def check() -> None:
            if participant is not None and not self.manager.is_participating():
                raise RuntimeError(
                    f"torchft gave it participant {participant} of {participants} but is_participating() is False: "
                    "it heals in the asynchronous quorum (torchft's init_sync=True heals a group's ranks at step 0 "
                    "rank by rank), so its gradient would be dropped while its share of the data is counted; use "
                    "Manager(..., init_sync=False) with the same initial weights on every group (e.g. one seed)"
                )

        run_phase(
            self.loader.settings.groups.control,
            check,
            lambda rank, text: RuntimeError(
                f"QuorumData.step(), on every rank of the replica group: its rank {rank} (the lowest in that state): {text}"
            ),
        )

    # --- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The data state (the committed cursor and what fixes the order): what the manager sends a
        healing group, and what a checkpoint saves beside ``manager.state_dict()``."""
        # the positions' part first: end_step moves the cursor before the anchor, so an anchor
        # read before the cursor is never after it, whichever thread asks when
        positions = self.positions.state()
        return {
            "format": _FORMAT,
            "cursor": self.cursor,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            **positions,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (a checkpoint's). ``ValueError`` for a state of another
        global batch, order or kind of positions (samples, or rows of another ``seq_len``)."""
        if not isinstance(state, Mapping) or state.get("format") != _FORMAT:
            raise ValueError(f"not a QuorumData state (format {_FORMAT}): {str(state)[:200]}")
        mine = self.state_dict()
        differ = [k for k in ("global_batch", "seed", "shuffle") if state[k] != mine[k]]
        if differ:
            raise ValueError(
                "the state was saved with "
                + ", ".join(f"{k}={state[k]!r}" for k in differ)
                + ", this QuorumData has "
                + ", ".join(f"{k}={mine[k]!r}" for k in differ)
            )
        cursor = int(state["cursor"])
        if cursor < 0 or cursor % self.global_batch:
            raise ValueError(f"the state's cursor {cursor} is no whole number of steps of {self.global_batch}")
        self.positions.load(state, cursor)
        self.cursor = cursor

    def _load_live_state(self, state: Mapping[str, Any]) -> None:
        # torchft calls this on a healing group: in synchronous mode inside start_quorum (before
        # step()), in asynchronous mode inside should_commit, when this group trained nothing
        self.load_state_dict(state)

    def close(self) -> None:
        """Close the loader (its threads and groups); on every rank of the group."""
        self.loader.close()

    def __enter__(self) -> QuorumData:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _StepSource:
    """A leader's source: one ``iter()`` yields the micro-batches of one step's request (position
    ranges of the global order) and ends, so the loader's transfer thread never reads ahead of
    the step the training loop asked for."""

    elastic = True  # nothing of its own to resume: the state is QuorumData's cursor

    def __init__(
        self, dataset: MapDataset, positions: Positions, seed: int, shuffle: bool, owned: ClosingDataset | None = None
    ) -> None:
        self.dataset = dataset
        self.owned = owned  # what close() closes: a dataset QuorumData's callable built
        self.reader = positions.reader(dataset, GlobalOrder(len(dataset), seed, shuffle))
        self.request: Sequence[tuple[int, int]] = ()

    def __iter__(self) -> Iterator[Batch]:
        request, self.request = self.request, ()
        for lo, hi in request:
            yield self.reader.read(lo, hi) if hi > lo else self.reader.empty()

    def state_dict(self) -> Any:
        return None

    def resume(self, state: Any, steps: int) -> None:
        pass

    def checkpoint_state(self, snapshot: Any) -> Any:
        return snapshot

    def stop(self) -> None:
        self.request = ()

    def stats(self) -> dict[str, float]:
        return self.reader.stats()

    def close(self) -> None:
        if self.owned is not None:
            self.owned.close()


def _step_source(
    dataset: MapDataset | Callable[[], MapDataset], positions: Positions, seed: int, shuffle: bool
) -> _StepSource:
    """A leader's source (the loader's source-building phase: an error reaches every rank as a
    ``LeaderError``). A dataset given as it is stays the caller's; one that ``dataset()`` builds
    is closed with the source when it has ``close()``."""
    if isinstance(dataset, MapDataset):
        return _StepSource(dataset, positions, seed, shuffle)
    built = dataset()
    if not isinstance(built, MapDataset):
        raise TypeError(
            f"dataset() returned a {type(built).__qualname__}, not a map-style dataset (__len__ and __getitem__)"
        )
    return _StepSource(built, positions, seed, shuffle, built if isinstance(built, ClosingDataset) else None)
