"""The loader's state, shared from each replica's leader with the rest of its replica.

Only the leader knows its source's state; a checkpoint saves it on every rank. One message over
the replica's group carries it, in the wire format (no pickle): the same dict on every rank of
the replica, or, when the leader cannot encode it, its error on all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from collective_loader.delivery.settings import Settings
from collective_loader.errors import BatchError
from collective_loader.plan import wire
from collective_loader.plan.wire import Kind


def share_state(settings: Settings, state: Mapping[str, Any], index: int) -> dict[str, Any]:
    """Every rank of a replica in delivery, at the same step: the leader's ``state`` on each of them.

    ``state`` holds at least ``epoch`` and ``steps``; a rank whose own differ from its leader's
    was called at another step and raises ``RuntimeError`` saying so. A state the wire cannot
    carry raises :class:`~collective_loader.BatchError` on the leader and on every rank of its replica.
    ``index`` numbers the loader's checkpoints: a leader whose replica has ranks outside delivery
    posts the state on its bulletin under it, and those ranks read it there (whatever their own
    steps: they need not iterate).
    """
    place, channel, bulletin = settings.place, settings.groups.replica, settings.groups.bulletin
    if channel is None:  # outside delivery
        assert bulletin is not None
        return bulletin.read_state(index)
    if place.is_leader:
        try:
            encoded = wire.encode(state)
        except BatchError as e:  # the replica waits for this message: send it the error instead
            text = f"leader rank {place.rank} cannot send its loader state to its replica: {e}"
            channel.send_encoded(Kind.BATCH_ERROR, state["steps"], wire.encode({"message": text}))
            raise BatchError(text) from e
        channel.send_encoded(Kind.DATA, state["steps"], encoded)
        if bulletin is not None:
            bulletin.post_state(index, state)
        return dict(state)
    header, payload = channel.recv(settings.config.max_batch_bytes)
    leader_state = wire.decode(payload, header.meta_nbytes).batch(payload)
    if header.kind != Kind.DATA:
        raise header.kind.error(str(leader_state.get("message")))
    if leader_state["steps"] != state["steps"] or leader_state["epoch"] != state["epoch"]:
        raise RuntimeError(
            f"rank {place.rank} asked for the loader state at epoch {state['epoch']} step {state['steps']}, "
            f"but its leader rank {place.leader} at epoch {leader_state['epoch']} step "
            f"{leader_state['steps']}: call state_dict() on every rank after the same step"
        )
    return leader_state
