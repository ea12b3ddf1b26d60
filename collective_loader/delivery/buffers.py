"""Reusable host byte buffers, so a step does not page-fault a fresh allocation.

Delivered tensors are views into the buffer a payload was received into (or, on the leader,
packed into). A buffer is therefore handed out again only when no tensor outside the pool still
uses its storage: a training loop that drops its batch frees the buffer for a later step, and a
loop that keeps a batch keeps its buffer out of the pool, so nothing it holds is overwritten.

Example::

    >>> pool = BufferPool(capacity=2)
    >>> a = pool.take(100)
    >>> b = pool.take(100)               # `a` is still in use: another buffer
    >>> a.data_ptr() == b.data_ptr()
    False
    >>> ptr = a.data_ptr(); del a
    >>> pool.take(80).data_ptr() == ptr  # `a` was dropped: its buffer comes back
    True
"""

from __future__ import annotations

import torch

_use_count = torch._C._storage_Use_Count  # references to a storage: tensors, views, numpy arrays


class _Kept:
    """A buffer of the pool, with what its in-use test needs, read once."""

    __slots__ = ("tensor", "nbytes", "storage", "idle")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.nbytes = tensor.numel()
        self.storage = tensor.untyped_storage()._cdata
        # the references while only the pool holds it; torch's cudagraph trees use the same count
        # to tell whether an output is still alive
        self.idle = _use_count(self.storage)

    def in_use(self) -> bool:
        """Whether any tensor but the pool's own uses the buffer (views included)."""
        return _use_count(self.storage) > self.idle


class BufferPool:
    """At most ``capacity`` host uint8 buffers, each reused once nothing else holds it.

    ``pin``: allocate page-locked memory (on CUDA meshes, so copies to the GPU are asynchronous);
    pinning is slow, which is one more reason to reuse.

    ``take(n)`` returns an ``n``-byte view of the smallest free buffer that fits; when none
    fits it allocates, keeping the new buffer in place of a free one that is too small (or of
    nothing, when the pool has room). When every kept buffer is in use, the allocation is
    returned but not kept, so a loop that holds all its batches costs what it would without
    a pool.
    """

    def __init__(self, capacity: int, pin: bool = False) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.pin = pin
        self._kept: list[_Kept] = []  # by size, smallest first
        self.allocations = 0  # buffers allocated so far (a steady loop stops allocating)

    def take(self, nbytes: int) -> torch.Tensor:
        for kept in self._kept:  # smallest first; once per step: one torch call per buffer looked at
            if kept.nbytes >= nbytes and not kept.in_use():
                return kept.tensor[:nbytes]
        new = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        self.allocations += 1
        if len(self._kept) < self.capacity:
            self._kept.append(_Kept(new))
        else:  # every free one is too small: replace one
            free = next((i for i, kept in enumerate(self._kept) if not kept.in_use()), None)
            if free is not None:
                self._kept[free] = _Kept(new)
        self._kept.sort(key=lambda kept: kept.nbytes)
        return new[:nbytes]
