"""The last hop of a batch on a GPU mesh: host memory to this rank's GPU, without a host sync.

Delivery over gloo leaves each rank's batch in pinned host memory. :func:`copy_to_device` starts
the copies on a side stream and records an event; :func:`hand_over` runs on the training thread
and makes its stream wait for that event, so neither thread ever blocks on the GPU. Nothing here
is a collective, so it may run on any thread.

Example (a CUDA machine)::

    side = torch.cuda.Stream()
    batch, event = copy_to_device({"ids": pinned_ids}, torch.device("cuda", 0), side)
    batch = hand_over(batch, event)   # on the training thread; kernels queued after it see the ids
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (mappings and lists are walked)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    return value


def copy_to_device(batch: Any, device: torch.device, stream: torch.cuda.Stream) -> tuple[Any, torch.cuda.Event]:
    """Start copying every tensor of a host ``batch`` to ``device`` on ``stream``; do not wait.

    Returns the device batch (same tree; its tensors are allocated on ``stream``) and an event
    recorded on ``stream`` after the last copy. The copies overlap compute only when the host
    tensors are pinned. The caller must keep the host tensors alive until the event has
    completed (``event.query()``), and must pass the batch through :func:`hand_over` before use.
    """
    with torch.cuda.stream(stream):
        out = map_tensors(batch, lambda t: t.to(device, non_blocking=True))
        event = torch.cuda.Event()
        event.record(stream)
    return out, event


def hand_over(batch: Any, event: torch.cuda.Event | None) -> Any:
    """Training thread: make the current stream wait for ``event`` (when there is one) and tell
    the caching allocator that the current stream uses the batch's tensors, so their memory is
    not handed to the side stream's next copy while this step still reads it."""
    if event is None:
        return batch
    stream = torch.cuda.current_stream()
    stream.wait_event(event)

    def record(t: torch.Tensor) -> torch.Tensor:
        t.record_stream(stream)
        return t

    return map_tensors(batch, record)
