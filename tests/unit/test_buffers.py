"""BufferPool hands a buffer out again only when no tensor outside the pool uses it."""

from __future__ import annotations

import pytest
import torch

from collective_loader.delivery.buffers import BufferPool


def test_held_buffer_is_never_handed_out_again():
    pool = BufferPool(capacity=4)
    held = [pool.take(64) for _ in range(4)]
    for i, t in enumerate(held):
        t.fill_(i)
    more = [pool.take(64) for _ in range(8)]  # pool full of held buffers: fresh ones
    for t in more:
        t.fill_(99)
    assert [int(t[0]) for t in held] == [0, 1, 2, 3]
    assert len({t.data_ptr() for t in held + more}) == 12
    assert pool.allocations == 12


def test_a_view_keeps_its_buffer_out_of_the_pool():
    pool = BufferPool(capacity=1)
    buf = pool.take(64)
    view = buf[8:16].view(torch.int64)  # what a delivered batch holds
    ptr = buf.data_ptr()
    del buf
    assert pool.take(64).data_ptr() != ptr
    del view
    assert pool.take(64).data_ptr() == ptr


def test_steady_loop_stops_allocating():
    pool = BufferPool(capacity=3)
    in_flight = []
    for _ in range(100):
        in_flight.append(pool.take(1000))
        if len(in_flight) > 2:
            in_flight.pop(0)
    assert pool.allocations == 3


def test_smallest_fitting_buffer_and_replacement_of_small_ones():
    pool = BufferPool(capacity=2)
    small, big = pool.take(10), pool.take(1000)
    small_ptr = small.data_ptr()
    del small, big
    assert pool.take(5).data_ptr() == small_ptr  # smallest that fits
    grown = pool.take(5000)  # both free but too small: one is replaced
    assert grown.numel() == 5000 and pool.allocations == 3
    del grown
    assert pool.take(4000).numel() == 4000 and pool.allocations == 3


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        BufferPool(0)
