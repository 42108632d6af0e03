"""Whether the page cache holds a local file's bytes (`probe`), asked before each positioned read
(`local_reads`): counted with ``cachestat`` (`cached_pages`), which reads nothing; where the kernel cannot count
them, a ``RWF_NOWAIT`` read of one byte in the middle, which fails rather than wait for the disk. Called by
`local_reads` alone, and by `chunk_files.OpenFiles` to `pin` the descriptors a restore keeps open; reads no file
data.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

from ..core import buffers


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
    # This thread's own structures, reused: a restore probes before each of its thousands of reads, and making
    # them anew cost more than the system call.
    span, counts, span_ref, counts_ref, _ = _buffers()
    span.off, span.len = start, stop - start
    if call(_CACHESTAT, fd, span_ref, counts_ref, 0) == 0:
        return counts.nr_cache
    if ctypes.get_errno() == errno.ENOSYS:
        _give_up_cachestat()
    return None


def _give_up_cachestat() -> None:
    global _cachestat
    _cachestat = None


def pin(fd: int) -> None:
    """Remember the answer of `_cache_unseen` for `fd`, which the caller keeps open until it calls `unpin`
    (`chunk_files.OpenFiles`, whose data files every chunk of a restore is read from): while it is open, the
    number names that file, whose file system cannot change. Called on any thread; one ``fstatfs``."""
    _pinned[fd] = _ask_unseen(fd)


def unpin(fd: int) -> None:
    """Forget `fd`'s pinned answer; called before the descriptor is closed (its number is then reused)."""
    _pinned.pop(fd, None)


def _cache_unseen(fd: int) -> bool:
    """Whether `fd`'s file system keeps its cached pages where ``cachestat`` does not look: the pinned answer
    (`pin`), else one ``fstatfs`` now. No memo by device: device numbers are reused by the next mount, so it
    could answer for a file system that is gone."""
    unseen = _pinned.get(fd)
    return _ask_unseen(fd) if unseen is None else unseen


def _ask_unseen(fd: int) -> bool:
    info = _buffers()[4]  # struct statfs, whose first field is the file system's magic
    if _fstatfs is None or _fstatfs(fd, info) != 0:
        return False
    return ctypes.c_long.from_buffer(info).value & 0xFFFFFFFF in _CACHE_UNSEEN_MAGIC


def _buffers() -> tuple:
    """This thread's ``cachestat`` range and counts (with references to pass them) and ``statfs`` buffer."""
    return buffers.of_thread_made("page_cache_calls", _make_buffers)


def _make_buffers() -> tuple:
    span, counts = _CachestatRange(), _Cachestat()
    return span, counts, ctypes.byref(span), ctypes.byref(counts), ctypes.create_string_buffer(256)


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
_pinned: dict[int, bool] = {}  # descriptors held open by their pinner: whether cachestat cannot see their cache
