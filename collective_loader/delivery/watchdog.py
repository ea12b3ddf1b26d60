"""A leader's watchdog: reports a call into the data source that has not returned in time."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

JOIN_WAIT = 5.0  # seconds to wait for the watchdog thread at close


class StallWatch:
    """Reports a source call that has not returned within ``after`` seconds.

    The transfer thread marks each call into the source with :meth:`loading`; the watchdog
    thread looks every ``after / 16`` seconds (nothing is signalled per step) and, once a call
    has taken longer than ``after``, sets ``stalled`` and calls ``report(step)``. Both happen
    under one lock, so either the call returned first or ``stalled`` is set: from then on the
    transfer thread delivers nothing and the collectives are the watchdog's.

    Example::

        >>> reported = []
        >>> watch = StallWatch(0.05, reported.append, "watch")
        >>> with watch.loading(3):
        ...     time.sleep(0.3)
        >>> watch.close(); watch.stalled, reported
        (True, [3])
    """

    def __init__(self, after: float, report: Callable[[int], None], name: str) -> None:
        self.after = after
        self.stalled = False
        self._report = report
        self._lock = threading.Lock()
        self._step: int | None = None  # the step being loaded, None between calls
        self._since = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def loading(self, step: int) -> Iterator[None]:
        with self._lock:
            self._step, self._since = step, time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._step = None

    def _run(self) -> None:
        while not self._stop.wait(self.after / 16):
            with self._lock:
                step = self._step
                if step is None or time.monotonic() - self._since < self.after:
                    continue
                self.stalled = True
            self._report(step)
            return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(JOIN_WAIT)
