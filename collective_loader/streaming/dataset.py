"""``StreamingDataset``, except that a failed shard download ends its iteration with the error.

Streaming (0.13) downloads shards on background threads of each process that iterates the
dataset. When a download fails for good (the object store went away, a shard was deleted, the
retries ran out), the thread's exception goes to a future's done-callback, which logs it and
sets an event; the sample loop then *stops*: the epoch ends early, with no exception, in the
iterating process (seen: 16 of 64 batches). Under ``CollectiveLoader`` that would be a short
epoch that every rank takes for a clean one. Here the first failure is kept, named by its shard
(boto3's own message may not name it: "Max Retries Exceeded"), and raised where the parent's
iteration stopped, so the leader's source raises and every rank gets ``LeaderError`` with it.

Streaming also leaves the failed shard marked "being prepared" in the node's shared state, and
its ready thread, stopping, marks the next sample ready anyway: the iterating thread then asks
for that shard and would wait for it for ever. Here a process that has seen a download fail
raises that failure instead of waiting. Another process (a DataLoader worker, another leader on
the node) that needs the same shard still waits: in a worker the error reaches the leader when
the DataLoader comes to that worker's next batch, and if another worker's batch comes first, the
loader's stall report ends the wait on every rank (after ``0.75 x timeout``).

With ``cache_limit``, streaming's ready thread can wait for ever as well: it asks for a shard only
if the shard is missing when it comes to it, then waits for the shard to become local; when the
download thread, working ahead, evicts that shard to make room for another (the shards that
``predownload`` samples need do not fit the cache), nobody downloads it again and the epoch stops
(seen here: an epoch that never ended, with 4 shards' worth of cache for 7 shards). The ready
thread here downloads a shard again whenever it finds it evicted while waiting for it.

And the end of an epoch waits until two of streaming's three loops (download, ready, sample)
have counted themselves out, which a thread does only when it returns: when both download
threads raise (both met the failing store), the epoch's end waits for ever and the failure is
never raised. Here both threads count themselves out however they end.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from streaming import StreamingDataset
from streaming.base.dataset import TICK, _ShardState

from collective_loader.errors import ShardDownloadError


class DownloadFailureRaisingDataset(StreamingDataset):
    """``StreamingDataset`` whose iteration raises its first failed shard download."""

    def _raise_if_failed(self) -> None:
        error = getattr(self, "_download_error", None)
        if error is not None:
            raise error

    def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
        self._raise_if_failed()  # do not wait for a shard whose download failed here
        if not self.cache_limit and self._shard_states[shard_id] == _ShardState.LOCAL:
            # streaming's download thread calls this for every sample; for a local shard it takes
            # the node's cache file lock only to note the access time, which only eviction reads,
            # and without a cache limit nothing is evicted (and a local shard stays local)
            return
        if blocking:  # streaming's own wait (when another thread prepares it) would never end if that fails
            while self._shard_states[shard_id] == _ShardState.PREPARING:
                time.sleep(TICK)
                self._raise_if_failed()
        try:
            super().prepare_shard(shard_id, blocking)
        except Exception as e:
            stream = self.streams[self.stream_per_shard[shard_id]]
            name = self.shards[shard_id].file_pairs[0][0].basename
            where = os.path.join(stream.remote or stream.local, stream.split or "", name)
            last = getattr(e, "last_exception", None)  # boto3's RetriesExceededError: what the retries met
            why = f"{type(e).__name__}: {e}" + (f" (the last attempt: {type(last).__name__}: {last})" if last else "")
            raise ShardDownloadError(f"could not download shard {where}: {why}") from e

    def on_exception(self, future: Future) -> None:
        error = None if future.cancelled() else future.exception()
        if error is not None and getattr(self, "_download_error", None) is None:
            self._download_error = error
        super().on_exception(future)  # streaming's own handling: sets its event, logs the error

    def _prepare_thread(self, it: Any) -> None:
        try:
            super()._prepare_thread(it)
        except BaseException:
            it.on_exit()  # see _ready_thread
            raise

    def _ready_thread(self, it: Any) -> None:
        """Mark samples ready, in order, once their shard is local (streaming's ready thread,
        except that a shard evicted while being waited for is downloaded again)."""
        try:
            while not (it.should_exit() or it.ready_index == it.total or self._event.is_set()):
                if self.predownload is not None and it.ready_index - it.yield_index > self.predownload:
                    time.sleep(TICK)
                    continue
                sample_id = it.sample_ids[it.ready_index]
                if sample_id != -1:  # -1: padding, nothing to wait for
                    shard_id, _ = self.spanner[sample_id]
                    while self._shard_states[shard_id] != _ShardState.LOCAL and not self._event.is_set():
                        if self._shard_states[shard_id] == _ShardState.REMOTE:
                            self.prepare_shard(shard_id, blocking=False)
                        else:
                            time.sleep(TICK)
                it.ready_index += 1
        finally:
            # streaming counts a thread out only when it returns, and the epoch's end waits until
            # two of its three loops have: when both download threads raise, it would wait for ever
            it.on_exit()

    _download_error: BaseException | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._download_error = None
        yield from super().__iter__()
        self._raise_if_failed()
