"""The one pool of reusable host buffers (`core.buffers`): its size rule, what it keeps, per-thread buffers and
slices cut out of one buffer."""

from __future__ import annotations

import ctypes
import threading
from collections import Counter

import numpy as np
from memory_maps import vm_flags

from xla_tensorstore_ckpt.core import buffers, tunables


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_sizes_are_powers_of_two_of_at_least_a_page_and_aligned_to_it():
    assert [buffers.size_for(n) for n in (0, 1, 4096, 4097, 3 << 20, 8 << 20)] == [4096, 4096, 4096, 8192, 4 << 20,
                                                                                 8 << 20]
    made = buffers.new(5000)
    assert len(made) == 8192 and _address(made) % buffers.PAGE == 0 and not made.any()  # zero-filled
    assert "hg" in vm_flags(ctypes.addressof(ctypes.c_char.from_buffer(buffers.new(4 << 20))))


def test_the_free_list_keeps_up_to_the_kept_maximum_and_a_few_buffers():
    while buffers._free:  # other tests' buffers: the check starts from an empty list
        buffers.take(0)
    with tunables.overridden(kept_buffer_bytes=1 << 20):
        small, large = buffers.take(100_000), buffers.take(2 << 20)
        buffers.give(small)
        buffers.give(large)  # larger than kept: freed
        assert [len(kept) for kept in buffers._free] == [128 << 10]
        assert buffers.take(60_000) is small and _address(buffers.take(60_000)) != _address(small)
        for _ in range(buffers.KEPT_BUFFERS + 2):
            buffers.give(buffers.new(4096))
        assert len(buffers._free) == buffers.KEPT_BUFFERS
        assert len(buffers.take(3000)) == 4096  # the smallest that fits
    while buffers._free:
        buffers.take(0)


def test_each_thread_has_its_own_buffer_by_name_kept_up_to_the_maximum():
    first = buffers.of_thread("test", 1000, np.int32)
    assert first.dtype == np.int32 and len(first) == 1000 and _address(first) % buffers.PAGE == 0
    assert _address(buffers.of_thread("test", 500, np.uint8)) == _address(first)  # reused
    grown = buffers.of_thread("test", 5000, np.int32)  # 20,000 bytes: made anew, 32 KiB
    assert _address(grown) != _address(first) and _address(buffers.of_thread("test", 8192)) == _address(grown)
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(_address(buffers.of_thread("test", 10))))
    thread.start()
    thread.join()
    assert elsewhere[0] != _address(grown)
    with tunables.overridden(kept_buffer_bytes=4096):
        buffers.of_thread("test_large", 8192)  # made for the call alone
        assert "test_large" not in buffers._held.buffers and "test" in buffers._held.buffers


def test_carved_slices_fit_the_capacity_and_are_counted():
    counts: Counter[str] = Counter()
    batch = buffers.Carved(1000, counts)
    a = batch.cut((10,), np.float32)
    b = batch.cut((3, 3), np.uint8)
    assert a.shape == (10,) and b.shape == (3, 3) and _address(b) - _address(a) == 64  # a cache line apart
    assert batch.cut((1000,)) is None and batch.cut((0,)) is None  # no room; nothing to cut
    batch.reset()
    assert _address(batch.cut((4,), np.float64)) == _address(a)  # free again, the same buffer
    batch.release()
    batch.cut((1,))
    assert counts == {"batch_buffer_allocations": 2, "batch_buffer_frees": 1}
    ends = buffers.Carved(align=1)
    ends.reset(7)
    assert _address(ends.cut((3,))) + 3 == _address(ends.cut((4,)))  # end to end
    ends.reset(1 << 20)  # larger than the buffer: another is taken at the next cut
    assert len(ends.cut((1 << 20,))) == 1 << 20
    ends.give_back()


def test_a_view_of_a_threads_buffer_is_that_buffer_or_a_grown_one():
    held = buffers.of_thread("test_view", 8192)
    view = buffers.view_of_thread("test_view", 4096)
    assert len(view) == 4096 and _address(np.frombuffer(view, np.uint8)) == _address(held)
    grown = buffers.view_of_thread("test_view", 3 * 8192)
    assert len(grown) == 3 * 8192 and _address(np.frombuffer(grown, np.uint8)) != _address(held)
    assert _address(buffers.of_thread("test_view", 10)) == _address(np.frombuffer(grown, np.uint8))
