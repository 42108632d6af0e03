"""The process's host memory as glibc's allocator holds it, for the streaming parts that promise a host-memory
budget. Linux with glibc only (through ctypes and /proc); elsewhere nothing is returned to the OS and the
resident memory is unknown.

glibc keeps memory that was freed in its heaps for reuse instead of returning it. A restore frees a stream of
staging buffers of varying sizes (our read buffers, torch_xla's copy of each shard on its way to the device)
between long-lived allocations (the new device buffers, on CPU devices host memory too), so the free space
fragments and the process's resident memory grew by ~900 MiB while loading a 2.4 GiB model whose reads in
flight were bounded (benchmarks/bench_hf_import.py). Returning free pages keeps resident memory within the
budget, at the price of page faults when the memory is used again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import sys

import numpy as np
import torch

_M_MMAP_THRESHOLD = -3
_TORCH_BYTES = 4 << 20  # where numpy starts advising huge pages
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c") if sys.platform == "linux" else None
    if not name:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


_LIBC = _glibc()


def empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array of `shape` and `dtype` for data read from storage that becomes a result (a new
    CPU tensor or DTensor shard), in memory not advised to use huge pages: from torch's allocator from 4 MiB
    up (glibc's malloc, as for any tensor), numpy's below.

    Why not `np.empty` for all: from 4 MiB it advises ``MADV_HUGEPAGE``. On a VM that hands free memory back
    to its hypervisor (free page reporting reports free blocks of 2 MiB and up), a new huge page tends to be
    such a block, and its first touch costs the host's faults for all of it: a cold 1 GiB restore into new
    tensors in a fresh process took 1.8-3.0 s of system time that way against 0.6-0.9 s in 4 KiB pages, with
    no compaction (504 huge page faults). torch's allocator advises nothing unless asked
    (``THP_MEM_ALLOC_ENABLE``), and its buffers go back to glibc's heaps when freed, so the next restore in the
    process reuses them (fresh mappings of our own would be faulted in again every time). Buffers a restore
    reuses (`buffers`) are mappings of their own. Called by restores; raises MemoryError (numpy) or RuntimeError
    (torch) when memory runs out."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes < _TORCH_BYTES:
        return np.empty(shape, dtype)
    # A bare storage: `torch.empty` would fill it under `torch.use_deterministic_algorithms`, and honour a
    # default device other than the CPU.
    memory = torch.empty(0, dtype=torch.uint8, device="cpu").set_(torch.UntypedStorage(nbytes, device="cpu"))
    return memory.numpy().view(dtype).reshape(shape)


def resident_bytes() -> int | None:
    """The process's resident memory (Linux: ``/proc/self/statm``), or None where it cannot be read. Never
    raises."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


def keep_within(start: int | None, limit: int) -> bool:
    """Return the free memory to the OS (`return_free_memory`) if the process has grown by more than `limit`
    bytes since it held `start` (a `resident_bytes` value), or if either is unknown (`past_limit`); whether it
    did. Returned pages cost a page fault each when they are used again (3-5 us on the benchmark VM), so a
    restore under a budget trims only when the next batch would not fit otherwise. Called by restores under a
    budget after each batch; never raises."""
    if not past_limit(start, resident_bytes(), limit):
        return False
    return_free_memory()
    return True


def past_limit(start: int | None, now: int | None, limit: int) -> bool:
    """Whether resident memory `now` exceeds `start` by more than `limit` bytes, or either is unknown (None):
    `keep_within`'s decision, apart from the process's memory."""
    return start is None or now is None or now - start > limit


def return_free_memory() -> None:
    """Give the free pages of glibc's heaps back to the operating system (``malloc_trim(0)``); blocks for a few
    milliseconds; never raises."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def release_large_buffers_at_once() -> None:
    """Have glibc give every allocation of 1 MiB or more back to the OS when it is freed. Its default keeps
    freed buffers of up to 32 MiB in per-thread arenas, so a streaming copy whose chunk buffers are allocated on
    several threads grew 2-3x beyond the data in flight (measured in tests/test_convert.py). A process-wide
    setting: called by the console script `xtckpt` (it owns its process), never by the library nor by `cli.main`
    run inside another program (a test, a notebook: their allocator is theirs). Never raises."""
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, 1 << 20)  # fixing it also stops glibc's dynamic raising of it
