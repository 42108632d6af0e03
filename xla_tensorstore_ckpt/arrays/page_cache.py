"""Whether the page cache holds a local file's bytes (`probe`), asked before each positioned read
(`local_reads`): counted with ``cachestat`` (`cached_pages`), which reads nothing; where the kernel cannot count
them, a ``RWF_NOWAIT`` read of one byte in the middle, which fails rather than wait for the disk. Called by
`local_reads` alone; reads no file data.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os


def probe(fd: int, start: int, stop: int) -> tuple[bool, bool]:
    """Whether the page cache holds most of the file's bytes from `start` to `stop` (see the module), and whether
    ``cachestat`` counted them (else a one-byte ``RWF_NOWAIT`` read was asked). Blocks on a one-byte read at
    most."""
    pages = cached_pages(fd, start, stop)
    if pages is not None:
        return 2 * pages * mmap.PAGESIZE >= stop - start, True
    probe = bytearray(1)
    try:
        os.preadv(fd, [probe], (start + stop) // 2, os.RWF_NOWAIT)
    except BlockingIOError:
        return False, False
    except OSError:  # RWF_NOWAIT not supported here (overlayfs, for one)
        return True, False
    return True, False


def cached_pages(fd: int, start: int, stop: int) -> int | None:
    """How many pages of the file's bytes from `start` to `stop` the page cache holds (``cachestat``), or None
    where the kernel cannot count them: no ``cachestat`` (Linux before 6.5: asked no more), a file it refuses
    (``EPERM`` for one this process could not write, on kernels since 2025), or a file system whose cache it
    does not see (overlayfs keeps the pages under the file beneath, ZFS in a cache of its own)."""
    call = _cachestat  # once: another thread may give it up meanwhile
    if call is None or stop <= start or _cache_unseen(fd):
        return None
    span, counts = _CachestatRange(start, stop - start), _Cachestat()
    if call(_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(counts), 0) == 0:
        return counts.nr_cache
    if ctypes.get_errno() == errno.ENOSYS:
        _give_up_cachestat()
    return None


def _give_up_cachestat() -> None:
    global _cachestat
    _cachestat = None


def _cache_unseen(fd: int) -> bool:
    """Whether `fd`'s file system keeps its cached pages where ``cachestat`` does not look. Asked at every probe
    (one ``fstatfs``, as cheap as the ``fstat`` a memo by device would need): device numbers are reused by the
    next mount, so a memo could answer for a file system that is gone."""
    info = ctypes.create_string_buffer(256)  # struct statfs, whose first field is the file system's magic
    if _fstatfs is None or _fstatfs(fd, info) != 0:
        return False
    return ctypes.c_long.from_buffer(info).value & 0xFFFFFFFF in _CACHE_UNSEEN_MAGIC


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted",
                                                     "nr_recently_evicted")]


_CACHESTAT = 451  # the system call's number, the same on every architecture (added after the tables merged)
_CACHE_UNSEEN_MAGIC = {0x794C7630, 0x2FC12FC1}  # overlayfs, ZFS
_LIBC = ctypes.CDLL(None, use_errno=True)
_cachestat = getattr(_LIBC, "syscall", None)
_fstatfs = getattr(_LIBC, "fstatfs", None)
