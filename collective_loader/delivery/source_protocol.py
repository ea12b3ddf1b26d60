"""What a leader's loader asks of its source: the :class:`Source` protocol, and the one adapter
that makes any iterable (a ``DataLoader``, a ``StatefulDataLoader``, a generator, a list) one.

Only leaders hold a source. :class:`~collective_loader.CollectiveLoader` calls these methods and
nothing else; :func:`as_source` is the one place that looks at what a plain iterable offers.

A new kind of source is one class with these methods, e.g. one that yields ``n`` numbered
batches and resumes from the number of the last one trained::

    >>> class Numbers:
    ...     elastic = False  # its state is this replica's own position
    ...     def __init__(self, n): self.n, self.next = n, 0
    ...     def __iter__(self):
    ...         while self.next < self.n:
    ...             self.next += 1
    ...             yield {"x": self.next - 1}
    ...         self.next = 0
    ...     def state_dict(self): return {"next": self.next}
    ...     def resume(self, state, steps): self.next = state["next"]
    ...     def checkpoint_state(self, snapshot): return snapshot
    ...     def stop(self): self.next = 0
    ...     def stats(self): return {}
    ...     def close(self): pass
    >>> source = as_source(Numbers(4))
    >>> source.resume({"next": 1}, steps=1)
    >>> isinstance(source, Source), [b["x"] for b in source]
    (True, [1, 2, 3])
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from collective_loader.delivery.workers import stop_dataloader_workers, stop_workers


@runtime_checkable
class Source(Protocol):
    """A leader's source of batches, one epoch per ``iter()``.

    The loader's transfer thread iterates it and takes :meth:`state_dict` right after each batch;
    the training thread calls :meth:`checkpoint_state` (inside ``CollectiveLoader.state_dict``),
    :meth:`stats` and :meth:`close`. :meth:`resume` and :meth:`stop` are called on the transfer
    thread or, for ``stop``, when no thread is inside the source.

    Attributes:
        elastic: whether a state it saved resumes over another number of data-parallel replicas
            (its state then is the same on every leader: see :meth:`checkpoint_state`).
    """

    elastic: bool

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        """One epoch's batches (mappings of str to tensors, nested mappings and plain values)."""
        ...

    def state_dict(self) -> Any:
        """A snapshot right after the last batch the current epoch yielded; ``None`` if it has none.

        It must not change when later batches are taken (the loader prefetches)."""
        ...

    def resume(self, state: Any, steps: int) -> None:
        """Before the next ``iter()``: continue an epoch after ``steps`` batches, from ``state``
        (what :meth:`checkpoint_state` returned then, through a checkpoint; ``None`` if it had none)."""
        ...

    def checkpoint_state(self, snapshot: Any) -> Any:
        """What a checkpoint saves for ``snapshot`` (a :meth:`state_dict` of the consumed step).

        Called on every leader at the same step; it may be collective over the leaders (a
        packing stream merges what each leader trained into one state every rank saves)."""
        ...

    def stop(self) -> None:
        """End the current epoch's iteration now (its DataLoader workers exit); the next
        ``iter()`` starts afresh."""
        ...

    def stats(self) -> dict[str, float]:
        """Its own figures (e.g. packing's documents, rows and padding); ``{}`` if none."""
        ...

    def close(self) -> None:
        """Release what it holds (workers, files); called once, when the loader closes."""
        ...


@runtime_checkable
class PlacesLeaders(Protocol):
    """A source callable, built on every rank, that fixed where the replicas' leaders sit (a
    ``StreamingSource``: its leaders form streaming's world at construction). The loader refuses
    one whose leaders are not its own, on every rank, before any leader calls it: the two
    disagreeing would leave some leaders waiting for others that never come."""

    @property
    def leaders(self) -> tuple[int, ...]:
        """The leader ranks, ordered by dp_rank."""
        ...


def build_source(source: Iterable[Mapping[str, Any]] | Callable[[], Iterable[Mapping[str, Any]]]) -> Source:
    """A leader's source: ``source``, or what calling it returns, as a :class:`Source`
    (:func:`as_source`). ``TypeError`` if it is neither iterable nor a callable returning one.

    >>> build_source(lambda: [{"x": 1}]).elastic
    False
    """
    if not isinstance(source, Iterable):
        if not callable(source):
            raise TypeError(f"source must be an iterable or a callable, got {type(source).__qualname__}")
        built = source()
        if not isinstance(built, Iterable):
            raise TypeError(f"source() returned a {type(built).__qualname__}, which is not iterable")
        source = built
    return as_source(source)


# The members only a Source has: an iterable with some of them was meant as one, and adapting
# it would silently ignore them (its resume, its elastic state).
_SOURCE_ONLY = ("elastic", "resume", "checkpoint_state", "stop", "stats")
_MEMBERS = ("__iter__", "state_dict", *_SOURCE_ONLY, "close")


def as_source(source: Iterable[Mapping[str, Any]]) -> Source:
    """``source`` itself if it is a :class:`Source`, else an :class:`IterableSource` around it.
    ``TypeError`` naming what it lacks for one that has only part of the protocol.

    >>> as_source([{"x": 1}]).state_dict() is None
    True
    """
    if isinstance(source, Source):
        return source
    if any(hasattr(source, name) for name in _SOURCE_ONLY):
        has = [name for name in _MEMBERS if hasattr(source, name)]
        missing = [name for name in _MEMBERS if name not in has]
        raise TypeError(
            f"{type(source).__qualname__} has {', '.join(has)} of the Source protocol but not {', '.join(missing)}: "
            "give it every member of collective_loader.Source, or none of its own (a plain iterable, adapted)"
        )
    return IterableSource(source)


class IterableSource:
    """Any iterable of batches as a :class:`Source`.

    Its state is the iterable's own ``state_dict()`` when it has one (torchdata's
    ``StatefulDataLoader``); a loaded state goes to its ``load_state_dict()``. An iterable
    without them resumes by skipping the batches consumed before (with a warning). The state is
    this replica's own, so it resumes only on the same number of replicas (``elastic`` is false).
    Stopping an epoch ends a DataLoader's workers at once, and ``close()`` calls the iterable's
    ``close()`` if it has one.

    >>> source = IterableSource([{"x": i} for i in range(4)])
    >>> source.resume(None, 2)
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     [b["x"] for b in source]
    [2, 3]
    """

    elastic = False

    def __init__(self, iterable: Iterable[Mapping[str, Any]]) -> None:
        self.iterable = iterable
        self._skip = 0  # batches to skip at the next iter(): a resume without a state
        self._batches: Iterator[Mapping[str, Any]] | None = None  # the current epoch's iterator

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        skip, self._skip = self._skip, 0
        batches = self._batches = iter(self.iterable)
        if skip:
            warnings.warn(
                f"the source has no state_dict/load_state_dict: resuming by skipping {skip} batches", stacklevel=2
            )
            for _ in range(skip):
                next(batches)
        return batches

    def state_dict(self) -> Any:
        state_dict = getattr(self.iterable, "state_dict", None)
        return state_dict() if callable(state_dict) else None

    def resume(self, state: Any, steps: int) -> None:
        load_state_dict = getattr(self.iterable, "load_state_dict", None)
        if state is not None and callable(load_state_dict):
            load_state_dict(state)
        else:
            self._skip = steps

    def checkpoint_state(self, snapshot: Any) -> Any:
        return snapshot

    def stop(self) -> None:
        batches, self._batches = self._batches, None
        if batches is None:
            return
        stop_workers(batches, self.iterable)
        close_generator = getattr(batches, "close", None)
        if callable(close_generator):
            close_generator()

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self.stop()
        stop_dataloader_workers(self.iterable)  # persistent_workers keep them after the last epoch
        close = getattr(self.iterable, "close", None)
        if callable(close):
            close()
