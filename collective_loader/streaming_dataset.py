"""``StreamingDataset``, except that a failed shard download ends its iteration with the error.

Streaming (0.13) downloads shards on a background thread of each process that iterates the
dataset. When a download fails for good (the object store went away, a shard was deleted, the
retries ran out), the thread's exception goes to a future's done-callback, which logs it and
sets an event; the sample loop then *stops*: the epoch ends early, with no exception, in the
iterating process. Under ``CollectiveLoader`` that would be a short epoch that every rank takes
for a clean one. This subclass keeps the first such exception and raises it where the parent's
iteration stopped, so the leader's source raises and every rank gets ``LeaderError`` with
streaming's own message (which names the shard).

Streaming also leaves the failed shard marked "being prepared" in the node's shared state, and
its ready thread, stopping, marks the next sample ready anyway: the iterating thread then asks
for that shard and would wait for it for ever. Here a process that has seen a download fail
raises that failure instead of waiting. Another process (a DataLoader worker, another leader on
the node) that needs the same shard still waits: in a worker the error reaches the leader when
the DataLoader comes to that worker's next batch, and if another worker's batch comes first, the
loader's stall report ends the wait on every rank (after ``0.75 x timeout``).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Iterator

from streaming import StreamingDataset


class DownloadFailureRaisingDataset(StreamingDataset):
    """``StreamingDataset`` whose iteration raises its background threads' first exception."""

    def on_exception(self, future: Future) -> None:
        error = None if future.cancelled() else future.exception()
        if error is not None and getattr(self, "_download_error", None) is None:
            self._download_error = error
        super().on_exception(future)  # streaming's own handling: sets its event, logs the error

    def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
        error = getattr(self, "_download_error", None)
        if error is not None:  # do not wait for a shard whose download failed here
            raise error
        super().prepare_shard(shard_id, blocking)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._download_error: BaseException | None = None
        yield from super().__iter__()
        if self._download_error is not None:
            raise self._download_error
