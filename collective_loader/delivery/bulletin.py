"""What a replica's leader tells the ranks of its replica that are outside delivery.

A middle pipeline stage without ``every_stage`` keys receives nothing, so it is in no delivery
group: no leader ever waits for it, and its training loop may iterate the loader or never touch
it (Megatron's middle stages never call their data iterator; TorchTitan's call ``next()`` on every
rank). So that one which iterates sees the same steps, the same end and the same errors as the
rest of its replica, and one which does not still learns of a failure at ``close()``, the leader
posts on a :class:`Bulletin` in the key-value store that ``torch.distributed`` was initialized
with (a ``TCPStore`` under torchrun): per epoch a counter of the steps delivered (one ``add`` per
step, on the transfer thread) and the epoch's last outcome (its end, or the error); per
checkpoint the loader's state; once, its configuration's digest. A reader only reads or waits
for keys: no collective, and it waits for nothing but its own leader.

Keys live under ``collective_loader/<loader id>/<dp_rank>/``. The loader id is the name torch gave
the loader's control group, the same on every rank and new for every loader.

The store must outlive every read. Under torchrun its agent hosts it, and the agents wait for one
another before they exit; in a plain ``env://`` (or ``tcp://``) world, rank 0 hosts it, and a
rank 0 that exits ends every read. So there, rank 0's ``close()`` (also the one that runs at
interpreter exit) waits until every rank outside delivery has closed its loader
(:class:`Readers`), at most ``timeout`` seconds. A store that is gone all the same (its host was
killed) is a :class:`~collective_loader.DeliveryError` that names it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from collective_loader.errors import DeliveryError
from collective_loader.plan import wire
from collective_loader.plan.wire import Kind

POLL_FIRST, POLL_MOST = 0.0005, 0.02  # seconds between reads while a step is not posted yet
T = TypeVar("T")


def job_store() -> dist.Store:
    """The store ``init_process_group`` rendezvoused through: every rank of the job reaches it.
    torch has no public accessor for it; ``_get_default_store`` is what its own groups use."""
    return dist.distributed_c10d._get_default_store()


def hosts_job_store() -> bool:
    """Whether the job's store lives in this process: rank 0's, unless torchrun's agent hosts it
    (torch's own rule, ``torch.distributed.rendezvous._create_c10d_store``)."""
    return dist.get_rank() == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


@contextlib.contextmanager
def reaching_store(what: str) -> Iterator[None]:
    """Inside, a store that cannot be reached raises :class:`~collective_loader.DeliveryError`
    naming it and what this rank was doing (``what``), instead of torch's network error."""
    try:
        yield
    except dist.DistNetworkError as e:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise DeliveryError(
            f"rank {dist.get_rank()} lost the job's key-value store ({where}) while it {what}: {e}. The store is "
            "hosted by torchrun's agent or, in a plain env:// world, by rank 0: that process has ended"
        ) from e


@dataclass
class Bulletin:
    """One replica's bulletin. ``prefix`` ends in ``/``; ``timeout``: seconds a reader waits.

    Example (a leader and a reader of the same replica)::

        leader = Bulletin.open(loader_id, dp_rank=0, timeout=600.0)
        leader.post_step(epoch=1)                   # step 0 of epoch 1 delivered
        leader.post_last(1, Kind.END, step=1)       # ... and the epoch ends at step 1
        reader.wait_step(1, 0)                      # Kind.DATA
        reader.wait_step(1, 1)                      # Kind.END
    """

    store: dist.Store
    prefix: str
    timeout: float
    _posted: int = 0  # reader: steps of the epoch being read known to be delivered
    _epoch: int = -1
    reported: bool = False  # reader: whether the leader's error was raised on this rank already

    @classmethod
    def open(cls, loader_id: str, dp_rank: int, timeout: float) -> Bulletin:
        return cls(job_store(), f"collective_loader/{loader_id}/{dp_rank}/", timeout)

    # --- the leader ----------------------------------------------------------------------------

    def post_step(self, epoch: int) -> None:
        """One more step of ``epoch`` delivered."""
        with reaching_store("posted a delivered step for the ranks outside delivery"):
            self.store.add(f"{self.prefix}{epoch}/steps", 1)

    def post_last(self, epoch: int, kind: Kind, step: int, text: str = "") -> None:
        """``epoch``'s last outcome, at ``step``: its end, or an error (which also stays posted for
        :meth:`error`)."""
        value = _bytes(wire.message({"message": text}, kind, step))
        with reaching_store(f"posted its epoch's end at step {step} for the ranks outside delivery"):
            if kind != Kind.END:
                self.store.set(f"{self.prefix}error", value)
            self.store.set(f"{self.prefix}{epoch}/last", value)

    def post_state(self, index: int, state: Mapping[str, Any]) -> None:
        """The loader's state at its ``index``-th checkpoint (in the wire format, no pickle)."""
        buf = _bytes(wire.message(state, Kind.DATA, index))
        with reaching_store(f"posted its loader state (checkpoint {index}) for the ranks outside delivery"):
            self.store.set(f"{self.prefix}state/{index}", buf)
            if index >= 2:  # every reader has read it: a checkpoint is taken at one step on every rank
                self.store.delete_key(f"{self.prefix}state/{index - 2}")

    def post_config(self, digest: str) -> None:
        with reaching_store("posted its configuration for the ranks outside delivery"):
            self.store.set(f"{self.prefix}config", digest)

    # --- a rank outside delivery ---------------------------------------------------------------

    def wait_step(self, epoch: int, step: int) -> tuple[Kind, str]:
        """``(kind, text)`` of ``step`` of ``epoch``: DATA once the leader delivered it, else the
        epoch's last outcome at that step. Waits at most ``timeout`` seconds
        (:class:`~collective_loader.DeliveryError` then)."""
        if epoch != self._epoch:
            self._epoch, self._posted = epoch, 0
        last = f"{self.prefix}{epoch}/last"

        def outcome() -> tuple[Kind, str] | None:
            if step < self._posted:
                return Kind.DATA, ""
            self._posted = self.store.add(f"{self.prefix}{epoch}/steps", 0)
            if step < self._posted:
                return Kind.DATA, ""
            if self.store.check([last]):
                kind, at, text = _parse(self.store.get(last))
                if at == step:
                    return kind, text
            return None

        return self._poll(outcome, f"deliver step {step}")

    def error(self) -> tuple[Kind, str] | None:
        """The error the leader posted, if any (does not wait)."""
        key = f"{self.prefix}error"
        with reaching_store("read whether its leader failed"):
            if not self.store.check([key]):
                return None
            kind, _, text = _parse(self.store.get(key))
        return kind, text

    def read_state(self, index: int) -> dict[str, Any]:
        """The loader state the leader posted at its ``index``-th checkpoint (waits for it; raises
        the leader's error instead if it posts one meanwhile)."""
        key = f"{self.prefix}state/{index}"

        def posted() -> bool | None:
            if self.store.check([key]):
                return True
            failed = self.error()
            if failed is not None:
                kind, text = failed
                self.reported = True
                raise kind.error(f"rank {dist.get_rank()} (outside delivery) waited for its loader state: {text}")
            return None

        what = f"post its loader state (checkpoint {index})"
        self._poll(posted, what)
        with reaching_store(f"waited for its leader to {what}"):
            raw = self.store.get(key)
        return wire.read_message(_tensor(raw), len(raw))[1]

    def _poll(self, ready: Callable[[], T | None], what: str) -> T:
        def timed_out() -> DeliveryError:
            return DeliveryError(
                f"rank {dist.get_rank()} (outside delivery) waited {self.timeout:.0f}s for its leader to {what} "
                f"(timeout={self.timeout}s)"
            )

        return _poll(ready, self.timeout, f"waited for its leader to {what}", timed_out)

    def read_config(self) -> str:
        """The leader's configuration digest (waits for it: posted at construction)."""
        key = f"{self.prefix}config"
        with reaching_store("waited for its leader to post its configuration"):
            try:
                self.store.wait([key], datetime.timedelta(seconds=self.timeout))
            except dist.DistStoreError as e:  # a timeout
                raise DeliveryError(
                    f"rank {dist.get_rank()} (outside delivery) waited {self.timeout:.0f}s for its leader to post "
                    f"its configuration (timeout={self.timeout}s): {e}"
                ) from e
            return self.store.get(key).decode()


@dataclass
class Readers:
    """The ranks outside delivery, as the job's store host sees them: it must not exit before
    they are done reading their bulletins.

    Example (a loader whose ranks 2 and 3 are outside delivery)::

        readers = Readers.open(loader_id, (2, 3), timeout=600.0)
        readers.closed(2)      # on rank 2, at its close()
        readers.wait_closed()  # on the store's host, at its close(): waits for rank 3 too
    """

    store: dist.Store
    prefix: str
    ranks: tuple[int, ...]
    timeout: float

    @classmethod
    def open(cls, loader_id: str, ranks: Sequence[int], timeout: float) -> Readers:
        return cls(job_store(), f"collective_loader/{loader_id}/closed/", tuple(ranks), timeout)

    def closed(self, rank: int) -> None:
        """``rank`` has read all it will read."""
        with reaching_store("closed its loader"):
            self.store.set(f"{self.prefix}{rank}", "")

    def wait_closed(self) -> None:
        """Wait until every rank outside delivery has closed its loader (or exited: the loader
        closes at interpreter exit); :class:`~collective_loader.DeliveryError` naming the others
        after ``timeout`` seconds."""
        waiting = list(self.ranks)

        def all_closed() -> bool | None:
            waiting[:] = [r for r in waiting if not self.store.check([f"{self.prefix}{r}"])]
            return True if not waiting else None

        def timed_out() -> DeliveryError:
            return DeliveryError(
                f"rank {dist.get_rank()} hosts the job's key-value store, which ranks {waiting} (outside delivery) "
                f"read their leader's steps from, and waited {self.timeout:.0f}s for them to close their loader "
                f"(timeout={self.timeout}s): they are stuck or dead; exiting now ends their reads"
            )

        _poll(all_closed, self.timeout, "waited for the ranks outside delivery to close their loader", timed_out)


def _poll(ready: Callable[[], T | None], timeout: float, doing: str, timed_out: Callable[[], Exception]) -> T:
    """``ready()``'s first answer that is not None, asked with a growing pause (usually the first
    ask answers); ``timed_out()`` raised after ``timeout`` seconds. ``doing``: what this rank is
    doing, for the error if the store is gone."""
    deadline = time.monotonic() + timeout
    pause = POLL_FIRST
    while True:
        with reaching_store(doing):
            answer = ready()
        if answer is not None:
            return answer
        if time.monotonic() > deadline:
            raise timed_out()
        time.sleep(pause)
        pause = min(2 * pause, POLL_MOST)


def _parse(value: bytes) -> tuple[Kind, int, str]:
    """An entry :meth:`Bulletin.post_last` wrote: ``(kind, step, text)``."""
    header, text = wire.read_text(_tensor(value))
    return header.kind, header.step, text


def _bytes(message: torch.Tensor) -> Any:
    """A message as the store takes it (torch's stub says ``str``; ``bytes`` work)."""
    return message.numpy().tobytes()


def _tensor(value: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(value), dtype=torch.uint8)
