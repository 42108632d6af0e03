"""Reusable host buffers: made, sized, kept and handed out here and nowhere else. A buffer is memory the library
writes again and again (read windows, delta frames, batches of restored data, rounds of peer copies) rather than
memory that becomes a result; making it fresh each time costs a page fault per 4 KiB (2-8 us each on the
development VM), so it is kept.

One rule for every buffer:

* **made** as an anonymous private mapping (`new`): aligned to the page, as ``O_DIRECT`` reads need, zero-filled,
  outside glibc's heap (so freeing it returns it to the OS, and no trim is needed), a forked child's copy never
  reaching the parent's; advised to use huge pages (a direct read from 2 MiB pages goes to the disk in requests
  as large as the device allows: `arrays.local_reads`);
* **sized** to the next power of two of at least a page (`size_for`): a buffer grown chunk after chunk is remade
  O(log n) times, and the rounding costs address space only (pages never touched are never faulted in);
* **kept** up to ``kept_buffer_bytes`` (`core.tunables`) each, larger ones freed once unused; the free list
  (`take` / `give`) holds at most `KEPT_BUFFERS` of them at a time.

Two ways to hold one: a thread's own buffer by name (`of_thread`: valid until the thread's next `of_thread` of that
name, for work that finishes before the thread's next item), or one checked out (`take`, then `give`: for
buffers that outlive a call or cross threads); `Carved` cuts slices one after another out of one of them (a
restore's batch, a peer copy's round). Used by `arrays.local_reads` and `arrays.direct_ocdbt` (windows),
`incremental.deltas` and `incremental.saving` (delta frames, the anchor's chunk), `views.sketch` (binning),
`restores.read_batches` (batches) and `checkpoint_manager.peer_copies.file_transfer` (rounds). A thread's own
small structures for system calls, made once (`of_thread_made`), live here too: `arrays.page_cache`'s.
"""

from __future__ import annotations

import math
import mmap
import threading
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from . import tunables

T = TypeVar("T")

PAGE = 4096  # a multiple of every logical block size O_DIRECT asks for (and of no page size smaller)
KEPT_BUFFERS = 4  # free buffers kept at most: two rounds of a peer copy in flight, a direct save's writers
_SLICE_ALIGN = 64  # a cache line: what numpy's own allocations give, kept for the slices `Carved` cuts

_free: list[np.ndarray] = []
_free_lock = threading.Lock()


class _Held(threading.local):
    def __init__(self) -> None:
        self.buffers: dict[str, np.ndarray] = {}
        self.made: dict[str, object] = {}


_held = _Held()


def size_for(nbytes: int) -> int:
    """The size of the buffer made for `nbytes`: the next power of two, at least a page. Never blocks."""
    return PAGE if nbytes <= PAGE else 1 << (nbytes - 1).bit_length()


def new(nbytes: int) -> np.ndarray:
    """A new buffer of `size_for(nbytes)` bytes (uint8, page-aligned, zero-filled, huge pages advised), kept by
    no one. Called on any thread; blocks only to map memory; raises OSError (ENOMEM) where none is left."""
    size = size_for(nbytes)
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no MADV_HUGEPAGE here, or transparent huge pages disabled: small pages
        pass
    return np.frombuffer(mapping, np.uint8)


def take(nbytes: int) -> np.ndarray:
    """A buffer of at least `nbytes` (uint8, page-aligned, its whole length; not zeroed) checked out to the
    caller: a kept one if one is large enough, else a new one. Give it back with `give` once nothing refers to
    it (or drop it: it is freed like any array). Called on any thread; never blocks but on the lock of the free
    list and to map memory; raises OSError (ENOMEM) where none is left."""
    with _free_lock:
        fits = [i for i, buffer in enumerate(_free) if len(buffer) >= nbytes]
        if fits:
            return _free.pop(min(fits, key=lambda i: len(_free[i])))
    return new(nbytes)


def give(buffer: np.ndarray) -> None:
    """Give back a buffer `take` handed out (whole, not a slice), which nothing refers to any more: kept for the
    next `take` if at most ``kept_buffer_bytes`` and fewer than `KEPT_BUFFERS` are kept, else freed. Called on
    any thread; never blocks but on the lock of the free list."""
    if len(buffer) <= tunables.get("kept_buffer_bytes"):
        with _free_lock:
            if len(_free) < KEPT_BUFFERS:
                _free.append(buffer)


def of_thread(name: str, count: int, dtype: np.dtype | type = np.uint8) -> np.ndarray:
    """This thread's buffer `name` as `count` elements of `dtype`, page-aligned, valid until this thread's next
    `of_thread(name, ...)` (so for work the thread finishes first). Made on first use and anew when a larger one is
    needed (zero-filled then: `new`); one larger than ``kept_buffer_bytes`` is made for this call alone. Called
    on any thread; blocks only to map memory; raises OSError (ENOMEM) where none is left."""
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    buffers = _held.buffers
    held = buffers.get(name)
    if held is None or len(held) < nbytes:
        held = new(nbytes)
        if len(held) <= tunables.get("kept_buffer_bytes"):
            buffers[name] = held
    return held[:nbytes].view(dtype)


def view_of_thread(name: str, nbytes: int) -> memoryview:
    """`of_thread` of `nbytes` bytes as a memoryview: a direct read's window, asked before each of a restore's
    thousands of reads, so without `of_thread`'s dtype handling where the buffer is large enough already."""
    held = _held.buffers.get(name)
    if held is None or len(held) < nbytes:
        return memoryview(of_thread(name, nbytes))
    return memoryview(held)[:nbytes]


def of_thread_made(name: str, make: Callable[[], T]) -> T:
    """This thread's own `name`, made by `make()` on first use and kept for the thread's life: small fixed
    structures passed to system calls again and again (a ``cachestat`` range and its answer), where making them
    anew would cost more than the call. Called on any thread; never blocks; raises what `make` raises."""
    made = _held.made
    try:
        return made[name]  # type: ignore[return-value]
    except KeyError:
        made[name] = value = make()
        return value


class Carved:
    """Slices cut one after another out of one buffer (`cut`), all free again at once (`reset`): the arrays one
    batch or round of work writes, every one of them dropped before the next batch in the same buffer. Not thread-safe:
    one thread cuts and resets. Each slice starts at a multiple of `align` bytes (a cache line, as numpy's own
    allocations; 1 for slices laid end to end). `counts` (a restore's paths, told in ``restore_finished``), if given,
    counts the buffers made (``batch_buffer_allocations``) and released (``batch_buffer_frees``)."""

    def __init__(self, capacity: int = 0, counts: Counter[str] | None = None, *, align: int = _SLICE_ALIGN):
        self.capacity, self.align = capacity, align
        self._buffer: np.ndarray | None = None
        self._used = 0
        self._counts = counts

    def cut(self, shape: tuple[int, ...], dtype: np.dtype | type = np.uint8) -> np.ndarray | None:
        """An uninitialised array of `shape` and `dtype` out of the buffer (made, from `take`, at the first
        cut), or None if it no longer fits in `capacity` (nor does an empty one). Raises OSError (ENOMEM) where
        no memory is left."""
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        start = -(-self._used // self.align) * self.align
        if nbytes == 0 or start + nbytes > self.capacity:
            return None
        if self._buffer is None:
            self._buffer = take(self.capacity)
            if self._counts is not None:
                self._counts["batch_buffer_allocations"] += 1
        self._used = start + nbytes
        return self._buffer[start:start + nbytes].view(dtype).reshape(shape)

    def reset(self, capacity: int | None = None) -> None:
        """Make the whole buffer free again (every slice cut is dropped by then), with room for `capacity` bytes
        if given (a smaller buffer is given back and a larger one taken at the next cut)."""
        self._used = 0
        if capacity is not None:
            if self._buffer is not None and len(self._buffer) < capacity:
                self.give_back()
            self.capacity = capacity

    def give_back(self) -> None:
        """Give the buffer back to the pool (`give`: kept for reuse if small enough) once nothing refers to its
        slices; the next `cut` takes one anew."""
        buffer, self._buffer, self._used = self._buffer, None, 0
        if buffer is not None:
            give(buffer)

    def release(self) -> None:
        """Free the buffer (to the OS, not the pool: the caller wants the memory back, as a restore under a host
        budget does); the next `cut` makes one anew."""
        if self._buffer is not None and self._counts is not None:
            self._counts["batch_buffer_frees"] += 1
        self._buffer, self._used = None, 0
