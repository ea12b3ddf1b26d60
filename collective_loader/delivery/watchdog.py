"""A leader's watchdog: reports a call into the data source that has not returned in time."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

JOIN_WAIT = 5.0  # seconds to wait for the watchdog thread at close
SLOW_AFTER = 0.5  # share of ``after``: a call still running then is logged as slow (WARNING)
log = logging.getLogger(__name__)


class StallWatch:
    """Reports a source call that has not returned within ``after`` seconds.

    The transfer thread marks each call into the source with :meth:`loading`; the watchdog
    thread looks every ``after / 16`` seconds (nothing is signalled per step) and, once a call
    has taken longer than ``after``, sets ``stalled`` and calls ``report(step)``. Both happen
    under one lock, so either the call returned first or ``stalled`` is set: from then on the
    transfer thread delivers nothing and the collectives are the watchdog's. A call still
    running after ``SLOW_AFTER * after`` is logged once as a WARNING first, so a slow source
    shows in the log before it becomes an error.

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
        self._warned: int | None = None  # the step a slow call was logged for
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def loading(self, step: int) -> StallWatch:
        """Mark a call into the source for ``step``, as ``with watch.loading(step): ...``: one lock
        and a clock read on each side, nothing signalled."""
        with self._lock:
            self._step, self._since = step, time.monotonic()
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._step = None

    def _run(self) -> None:
        while not self._stop.wait(self.after / 16):
            with self._lock:
                step = self._step
                took = time.monotonic() - self._since
                if step is not None and took >= SLOW_AFTER * self.after and self._warned != step:
                    self._warned = step
                    log.warning(
                        "%s: the source has not returned step %d after %.0fs; reported as stalled after %.0fs",
                        self._thread.name,
                        step,
                        took,
                        self.after,
                    )
                if step is None or took < self.after:
                    continue
                self.stalled = True
            self._report(step)
            return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(JOIN_WAIT)
