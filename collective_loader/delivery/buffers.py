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


def _in_use(buf: torch.Tensor) -> bool:
    """Whether any tensor but ``buf`` itself uses ``buf``'s storage (views included)."""
    # the count is the tensors on the storage, plus one for the storage object made to ask;
    # torch's cudagraph trees use the same count to tell whether an output is still alive
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata) > 2


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
        self._bufs: list[torch.Tensor] = []  # by size, smallest first
        self.allocations = 0  # buffers allocated so far (a steady loop stops allocating)

    def take(self, nbytes: int) -> torch.Tensor:
        for buf in self._bufs:  # smallest first
            if buf.numel() >= nbytes and not _in_use(buf):
                return buf[:nbytes]
        new = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        self.allocations += 1
        if len(self._bufs) < self.capacity:
            self._bufs.append(new)
        else:  # every free one is too small: replace one
            free = next((i for i, buf in enumerate(self._bufs) if not _in_use(buf)), None)
            if free is not None:
                self._bufs[free] = new
        self._bufs.sort(key=torch.Tensor.numel)
        return new[:nbytes]
