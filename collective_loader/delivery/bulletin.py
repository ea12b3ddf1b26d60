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
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from collective_loader.errors import DeliveryError, WireError
from collective_loader.plan import wire
from collective_loader.plan.wire import Kind

POLL_FIRST, POLL_MOST = 0.0005, 0.02  # seconds between reads while a step is not posted yet
T = TypeVar("T")


def job_store() -> dist.Store:
    """The store ``init_process_group`` rendezvoused through: every rank of the job reaches it.
    torch has no public accessor for it; ``_get_default_store`` is what its own groups use."""
    return dist.distributed_c10d._get_default_store()


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
        self.store.add(f"{self.prefix}{epoch}/steps", 1)

    def post_last(self, epoch: int, kind: Kind, step: int, text: str = "") -> None:
        """``epoch``'s last outcome, at ``step``: its end, or an error (which also stays posted for
        :meth:`error`)."""
        value = f"{int(kind)} {step} {text}"
        if kind != Kind.END:
            self.store.set(f"{self.prefix}error", value)
        self.store.set(f"{self.prefix}{epoch}/last", value)

    def post_state(self, index: int, state: Mapping[str, Any]) -> None:
        """The loader's state at its ``index``-th checkpoint (in the wire format, no pickle)."""
        plan = wire.encode(state)
        buf = torch.empty(wire.HEADER_BYTES + plan.header(Kind.DATA, index).inline_nbytes, dtype=torch.uint8)
        plan.write(buf, Kind.DATA, index)
        self.store.set(f"{self.prefix}state/{index}", buf.numpy().tobytes())  # type: ignore[arg-type]  # bytes work
        if index >= 2:  # every reader has read it: a checkpoint is taken at one step on every rank
            self.store.delete_key(f"{self.prefix}state/{index - 2}")

    def post_config(self, digest: str) -> None:
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

        self._poll(posted, f"post its loader state (checkpoint {index})")
        raw = self.store.get(key)
        buf = torch.empty(len(raw), dtype=torch.uint8)
        buf.numpy()[:] = np.frombuffer(raw, dtype=np.uint8)
        header = wire.Header.read(buf, len(raw))
        payload = buf[wire.HEADER_BYTES : wire.HEADER_BYTES + header.payload_nbytes]
        return wire.decode(payload, header.meta_nbytes).batch(payload)

    def _poll(self, ready: Callable[[], T | None], what: str) -> T:
        """``ready()``'s first answer that is not None, asked with a growing pause (the leader is
        usually ahead: the first ask answers); DeliveryError after ``timeout`` seconds."""
        deadline = time.monotonic() + self.timeout
        pause = POLL_FIRST
        while (answer := ready()) is None:
            if time.monotonic() > deadline:
                raise DeliveryError(
                    f"rank {dist.get_rank()} (outside delivery) waited {self.timeout:.0f}s for its leader to "
                    f"{what} (timeout={self.timeout}s)"
                )
            time.sleep(pause)
            pause = min(2 * pause, POLL_MOST)
        return answer

    def read_config(self) -> str:
        """The leader's configuration digest (waits for it: posted at construction)."""
        key = f"{self.prefix}config"
        try:
            self.store.wait([key], datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:  # torch raises DistStoreError, a RuntimeError, on a timeout
            raise DeliveryError(
                f"rank {dist.get_rank()} (outside delivery) waited {self.timeout:.0f}s for its leader to post "
                f"its configuration (timeout={self.timeout}s): {e}"
            ) from e
        return self.store.get(key).decode()


def _parse(value: bytes) -> tuple[Kind, int, str]:
    try:
        kind, step, text = value.decode().split(" ", 2)
        return Kind(int(kind)), int(step), text
    except ValueError as e:
        raise WireError(f"a bulletin entry does not decode: {value[:100]!r}") from e
