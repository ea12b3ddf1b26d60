"""A background thread that runs numbered steps ahead of their consumer, by a bounded lead.

:class:`Prefetcher` calls ``step_fn(0)``, ``step_fn(1)``, ... on its own thread and queues the
results; it may run at most ``lead`` steps ahead of what :meth:`~Prefetcher.take` has handed
out (a credit per step taken). It knows nothing of collectives: the loader gives it one step of
the delivery protocol (:mod:`collective_loader.delivery.protocol`), which every rank runs in the same
order, so that every rank's thread has run the same steps when the consumers have taken the same
number of items.

Example::

    >>> p = Prefetcher(lambda step: step * step, lead=2, is_last=lambda item: item >= 9, on_error=repr, name="squares")
    >>> [p.take() for _ in range(4)]
    [0, 1, 4, 9]
    >>> p.close(wait=5.0)
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """Runs ``step_fn(step)`` for step = 0, 1, ... on a thread named ``name``, at most ``lead``
    steps ahead of :meth:`take`.

    The thread stops after a step whose item ``is_last`` says ends the sequence, or when
    ``step_fn`` raises; the exception then becomes the last item through ``on_error``.

    Items and credits travel through two :class:`queue.SimpleQueue` (C, no Python-level
    condition): :meth:`take` is one ``get`` and one ``put``, which matters because it runs on the
    training thread once per step, and the thread sleeps in a blocking ``get`` between steps.
    """

    def __init__(
        self,
        step_fn: Callable[[int], T],
        lead: int,
        is_last: Callable[[T], bool],
        on_error: Callable[[BaseException], T],
        name: str,
    ) -> None:
        if lead < 1:
            raise ValueError(f"lead must be >= 1, got {lead}")
        self._step_fn, self._is_last, self._on_error = step_fn, is_last, on_error
        self._lead = lead
        self._queue: queue.SimpleQueue[T] = queue.SimpleQueue()
        # one True per item taken: the thread may run one step further; False: close
        self._credits: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._lock = threading.Lock()  # a step's item and an interrupt are queued one at a time
        self._interrupted = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def take(self) -> T:
        """The next step's item; waits for it. Lets the thread run one step further."""
        item = self._queue.get()
        self._credits.put(True)
        return item

    def interrupt(self, item: T) -> None:
        """From another thread, while a step is stuck (a stalled source): queue ``item`` as the
        last item; whatever the stuck step returns later is dropped."""
        with self._lock:
            self._interrupted = True
            self._queue.put(item)

    def close(self, wait: float) -> None:
        """Let the thread finish the steps already granted (peers run them too), then stop it.

        Waits at most ``wait`` seconds; a thread stuck in its step (a stalled source) is left
        behind as a daemon: see :meth:`alive`.
        """
        self._credits.put(False)  # after every credit already given: those steps run first
        self._thread.join(wait)

    def alive(self) -> bool:
        """Whether the thread is still running (after :meth:`close`: stuck inside a step)."""
        return self._thread.is_alive()

    def _run(self) -> None:
        for step in itertools.count():
            if step >= self._lead and not self._credits.get():
                return
            try:
                item, last = self._step_fn(step), False
            except BaseException as e:  # handed to the consumer, raised there
                item, last = self._on_error(e), True
            with self._lock:
                if self._interrupted:
                    return
                self._queue.put(item)
            if last or self._is_last(item):
                return
