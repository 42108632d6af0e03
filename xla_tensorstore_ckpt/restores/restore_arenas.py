"""Host buffers that restores read into before the data goes to the devices, carved from one allocation per
batch slot and reused batch after batch.

A restore onto XLA devices reads each region into a host buffer, hands it to torch_xla (which copies it on its
way to the device) and drops it. Allocating these buffers afresh per region made them fresh memory again and
again: freed to glibc between the long-lived device buffers (host memory too on CPU devices), trimmed away under
a host budget (`host_memory`), then faulted in anew: on the benchmark VM a budgeted Hugging Face load took
4.3-4.6 s from the page cache that way, 2.0-2.9 s with arenas (benchmarks/bench_hf_import.py's files). An arena
is faulted in once and stays out of glibc's heap.

Only for regions whose data no result keeps: XLA placements, whose host data torch_xla copies before
`targets.xla.build` returns. Used by `restoring` on its own thread; not thread-safe.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

_ALIGN = 64  # a cache line: what numpy's own allocations give


class Arena:
    """Buffers for one batch of reads: `empty` hands out slices of one buffer of `capacity` bytes (allocated on
    first use) until it is full, then ordinary arrays; `reset` makes the whole buffer free again. The caller
    resets only once nothing refers to the slices handed out (the batch is built, or its reads are abandoned).
    `paths` (a restore's, told in ``restore_finished``) counts the buffers allocated (``arena_allocations``)
    and freed (``arena_frees``)."""

    def __init__(self, capacity: int, paths: Counter[str] | None = None):
        self.capacity = capacity
        self._buffer: np.ndarray | None = None
        self._used = 0
        self._paths = Counter() if paths is None else paths

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialised array of `shape` and `dtype`, in the arena if it fits. Never raises for lack of
        space (then it is allocated as usual)."""
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        start = -(-self._used // _ALIGN) * _ALIGN
        if nbytes == 0 or start + nbytes > self.capacity:
            return np.empty(shape, dtype=dtype)
        if self._buffer is None:
            self._buffer = np.empty(self.capacity, dtype=np.uint8)
            self._paths["arena_allocations"] += 1
        self._used = start + nbytes
        return self._buffer[start:start + nbytes].view(dtype).reshape(shape)

    def reset(self) -> None:
        self._used = 0

    def release(self) -> None:
        """Free the buffer (reset, and the memory goes back to the OS); the next `empty` allocates it anew."""
        if self._buffer is not None:
            self._paths["arena_frees"] += 1
        self._buffer = None
        self._used = 0
