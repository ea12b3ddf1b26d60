"""Agreements: every member of a group decides one outcome together, the first failure by rank winning.

A step's outcome among the leaders (:func:`agree_outcome`), a construction phase on every rank
(:func:`run_phase`), the same configuration everywhere (:func:`first_difference`). Each costs one
small all-reduce, plus one broadcast of the failing rank's message when there is one, so an
error raised on some ranks reaches all of them instead of leaving the others in the next collective.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from collective_loader.delivery.config import usable_timeout
from collective_loader.delivery.transport import Groups, new_group
from collective_loader.errors import BatchError
from collective_loader.plan import wire
from collective_loader.plan.wire import Kind

T = TypeVar("T")
MESSAGE_BYTES = 4096  # fixed size of an agreement message (a wire message, zero-padded)


def control_group(timeout: Any) -> dist.ProcessGroup:
    """The gloo group of the whole world that construction agrees over; built before any
    argument is checked, so with ``timeout`` only when it is a usable number (else torch's
    default: the arguments check then refuses it on every rank)."""
    group = new_group(
        range(dist.get_world_size()),
        "gloo",
        float(timeout) if usable_timeout(timeout) else None,
        "collective_loader:control",
    )
    assert group is not None
    return group


def encode_message(kind: Kind, text: str) -> torch.Tensor:
    """``text`` as a wire message of ``kind`` in ``MESSAGE_BYTES`` (cut to fit), the fixed size a
    receiver allocates before it knows the text."""
    while True:
        try:
            return wire.message({"message": text}, kind, nbytes=MESSAGE_BYTES)
        except BatchError:
            text = text[: len(text) * 3 // 4]


def decode_message(buf: torch.Tensor) -> tuple[Kind, str]:
    """The kind and text of an :func:`encode_message` received as ``buf``; :class:`WireError` for
    anything else (nothing received is evaluated)."""
    header, text = wire.read_text(buf)
    return header.kind, text


def agree_outcome(group: dist.ProcessGroup, kind: Kind, message: str) -> tuple[Kind, str, int]:
    """All members decide one outcome for a step: the first error by rank wins, then END.

    Each member passes its own ``kind`` (DATA, END or an error) and error ``message``; returns
    ``(kind, message, origin_rank)`` agreed by everyone. Costs one small all-reduce; one more
    broadcast only when someone failed.
    """
    me = dist.get_rank()
    failed = kind.is_error
    # MAX-reduce: [any END, any failure, -(lowest failing rank)]
    flags = torch.tensor([int(kind == Kind.END), int(failed), -me if failed else -(1 << 40)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    any_end, any_failed, lowest = flags.tolist()
    if not any_failed:
        return (Kind.END if any_end else Kind.DATA), "", -1
    origin = -lowest
    buf = encode_message(kind, message) if me == origin else torch.empty(MESSAGE_BYTES, dtype=torch.uint8)
    dist.broadcast(buf, src=origin, group=group)
    kind, text = decode_message(buf)
    return kind, text, origin


def run_phase(group: dist.ProcessGroup, fn: Callable[[], T], error: Callable[[int, str], Exception]) -> T:
    """Run one construction phase, ``fn``, on every member, then agree on how it went.

    When ``fn`` raised on any member, every member raises ``error(rank, text)`` for the first
    failing rank and its exception's text (that rank chains its own exception), so a check that
    fails on some ranks only ends construction everywhere instead of leaving the others in the
    next collective. One small all-reduce; one broadcast more on a failure.

    Example (every rank)::

        source = run_phase(control, build_source, lambda rank, text: LeaderError(f"rank {rank}: {text}"))
    """
    kind, message, cause, result = Kind.DATA, "", None, None
    try:
        result = fn()
    except Exception as e:  # raised on every rank below
        kind, message, cause = Kind.PHASE_ERROR, f"{type(e).__name__}: {e}", e
    kind, message, origin = agree_outcome(group, kind, message)
    if kind != Kind.DATA:
        raise error(origin, message) from (cause if origin == dist.get_rank() else None)
    return result  # type: ignore[return-value]


def digest(text: str) -> torch.Tensor:
    """A fixed-size fingerprint of ``text`` (SHA-256, as 4 int64 words): equal texts, equal digests.

    >>> bool(torch.equal(digest("a"), digest("a"))), bool(torch.equal(digest("a"), digest("b")))
    (True, False)
    """
    return torch.frombuffer(bytearray(hashlib.sha256(text.encode()).digest()), dtype=torch.int64).clone()


def first_difference(groups: Groups, reference: int, text: str) -> tuple[int, str, str] | None:
    """Whether every rank has the same ``text``; every member of ``groups`` calls it.

    Checked hierarchically by digest: each replica's leader sends its digest to its replica
    (its ranks in delivery; it posts it on the bulletin for the others), the ``reference`` leader
    sends its digest to the other leaders, and one agreement over the control group says whether
    anyone differed. The bytes per rank do not grow with the world and
    no part of a text is cut off. Only on a mismatch do texts travel: returns ``(lowest
    differing rank, reference's text, that rank's text)``, or ``None`` when all are the same.
    """
    mine = digest(text)
    if groups.replica is None:  # outside delivery
        assert groups.bulletin is not None
        differs = groups.bulletin.read_config() != mine.numpy().tobytes().hex()
    else:
        theirs = mine.clone()
        dist.broadcast(theirs, src=groups.replica.leader, group=groups.replica.group)
        differs = not torch.equal(theirs, mine)
        if groups.bulletin is not None and groups.replica.leader == dist.get_rank():
            groups.bulletin.post_config(mine.numpy().tobytes().hex())
    if groups.leaders is not None:  # this rank leads a replica, and there are several
        theirs = mine.clone()
        dist.broadcast(theirs, src=reference, group=groups.leaders)
        differs = differs or not torch.equal(theirs, mine)
    kind, other, origin = agree_outcome(groups.control, Kind.PHASE_ERROR if differs else Kind.DATA, text)
    if kind == Kind.DATA:
        return None
    ref = (
        encode_message(Kind.DATA, text)
        if dist.get_rank() == reference
        else torch.empty(MESSAGE_BYTES, dtype=torch.uint8)
    )
    dist.broadcast(ref, src=reference, group=groups.control)
    return origin, decode_message(ref)[1], other
