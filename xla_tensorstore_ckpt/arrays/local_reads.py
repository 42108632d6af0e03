"""Positioned reads of a local file into many buffers: through the page cache where it holds the bytes,
around it (``O_DIRECT``) where it does not.

A cold restore through the page cache fills it with bytes it never reads again, and on a VM that hands fresh memory
to its hypervisor and back, filling it is most of the cost: a buffered cold read of a 2.48 GB file into fresh memory
took 5.8-6.6 s here, a direct one 2.2-2.4 s. Direct reads need aligned offsets, lengths and buffers, and a tensor's
bytes lie anywhere in a file, so they go through one aligned window per thread and are copied out, but for a run
whose offset and destination are both page-aligned, read straight in (`views.histogram`'s buffers). Whether the bytes
are cached is asked of the kernel (``cachestat``, `page_cache`): warm ones are read buffered. File systems without
``O_DIRECT`` (tmpfs) are read buffered. Used by the readers of DCP pieces, safetensors regions and this library's
chunks (`local_chunks`); no torch, no tensorstore.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
from collections.abc import Iterator, Sequence

import crc32c
import numpy as np

from ..core import buffers, tunables
from ..core.errors import CorruptCheckpointError, StorageError
from ..storage.local import is_regular
from . import page_cache
from .base import PathCounts

ALIGN = buffers.PAGE  # a multiple of every logical block size O_DIRECT asks for
_IOV_MAX = os.sysconf("SC_IOV_MAX")  # buffers per preadv
_NUMPY_COPY_BYTES = 64 << 10  # smaller copies out of a window are cheaper as memoryview copies (no arrays made)
STRAIGHT_BYTES = 256 << 10  # a shorter aligned run is read through the window with its neighbours (one request)


COUNTS = PathCounts()  # what this process's local reads did, by path


def read_runs(path: str, runs: list[tuple[int, memoryview]], where: str, *, fd: int | None = None,
              checksummed: int = 0) -> int:
    """Read each run (file offset, the buffer its bytes go to) of the local file `path`, and return the CRC32C
    of the bytes of the first `checksummed` runs as given, taken in file order (0 if none). Runs that follow
    one another in the file are read by one call (buffered) or one window (direct); a direct read checksums
    each window while it is in the cache, before copying out of it, rather than the whole buffer again once it
    is read (on 4 processes restoring 1 GiB here, that separate pass cost 30-50 ms of a 0.45 s restore).
    `fd`: a descriptor of `path` the caller keeps open (opened by `open_for_runs`), else one is opened for the
    call. Called on reading threads; blocks; raises `CorruptCheckpointError` where the file ends before a run,
    `StorageError` for other OS errors (both naming `where`)."""
    order = sorted(range(len(runs)), key=lambda i: runs[i][0])
    tagged = [(*runs[i], i < checksummed) for i in order]
    if not tagged:
        return 0
    own = fd is None
    if own:
        try:
            fd = open_for_runs(path)
        except OSError as exc:
            raise StorageError(f"cannot open {where}: {exc}") from exc
    try:
        direct_path = path if own else f"/proc/self/fd/{fd}"
        end = nbytes = 0
        for at, view, _ in tagged:
            end, nbytes = max(end, at + len(view)), nbytes + len(view)
        checksum = None if _cached(fd, tagged[0][0], end) else _read_direct(direct_path, tagged, where)
        if checksum is None:
            checksum = _read_buffered(fd, tagged, where)
            COUNTS.add(buffered_reads=1, buffered_bytes=nbytes)
        else:
            COUNTS.add(direct_reads=1, direct_bytes=nbytes)
    except OSError as exc:
        raise StorageError(f"cannot read {where}: {exc}") from exc
    finally:
        if own:
            os.close(fd)
    return checksum


def read_window(fd: int, start: int, stop: int, where: str) -> memoryview:
    """The bytes of the local file open as `fd` (`open_for_runs`) from `start` to `stop`, read into this
    thread's window and returned as a view of it, valid until this thread's next read here: no copy beyond the
    read itself, which goes around the page cache where it does not hold the bytes. A span larger than a window
    is read into a larger window (kept by the thread up to ``kept_buffer_bytes``, `buffers`). Called on reading
    threads; blocks; raises
    `CorruptCheckpointError` where the file ends before `stop`, `StorageError` for other OS errors (both naming
    `where`)."""
    try:
        with _source(fd, start, stop) as source:
            view, at = source.window(start, stop)
    except OSError as exc:
        raise StorageError(f"cannot read {where}: {exc}") from exc
    if len(view) - at < stop - start:
        raise CorruptCheckpointError(f"{where}: the file ends before the tensor's data")
    return view[at:at + stop - start]


def read_boxes(path: str, offset: int, shape: Sequence[int], boxes: list[tuple[Sequence[tuple[int, int]], np.ndarray]],
               where: str) -> None:
    """Copy boxes of the C-order array of `shape` stored at `offset` of the local file `path` into their
    destinations: each (box: a (start, stop) per dimension, an array of the box's shape and of the stored dtype).
    The rows (indices of the first dimension) the boxes need are read a window at a time, once for all boxes,
    and each box takes its part of a window with one strided numpy copy (which lets go of the GIL), not a copy
    per contiguous run: a piece saved row-sharded and read column-sharded has thousands of short runs. Rows too
    large for a window are read dimension by dimension. Called on reading threads; blocks; raises
    `CorruptCheckpointError` where the file ends before the array, `StorageError` for other OS errors (both
    naming `where`)."""
    boxes = [(box, dest) for box, dest in boxes if dest.size]
    if not boxes:
        return
    if not shape:  # a 0-d array is a row of one element
        shape, boxes = (1,), [(((0, 1),), dest.reshape(1)) for _, dest in boxes]
    try:
        fd = open_for_runs(path)
    except OSError as exc:
        raise StorageError(f"cannot open {where}: {exc}") from exc
    try:
        spans = _row_spans(boxes)
        row_bytes = _row_bytes(shape, boxes)
        with _source(fd, offset + spans[0][0] * row_bytes, offset + spans[-1][1] * row_bytes) as source:
            if source.direct is None:  # from the page cache, a box of whole rows is read straight into its destination
                rows_only = [(0, n) for n in shape[1:]]
                whole = [list(box[1:]) == rows_only and dest.flags.c_contiguous for box, dest in boxes]
                for (box, dest), read in zip(boxes, whole):
                    if read:
                        _read_fully(fd, [memoryview(dest.reshape(-1).view(np.uint8))],
                                    offset + box[0][0] * row_bytes, where)
                boxes = [pair for pair, read in zip(boxes, whole) if not read]
            _copy_rows(source, offset, tuple(shape), boxes, where)
    except OSError as exc:
        raise StorageError(f"cannot read {where}: {exc}") from exc
    finally:
        os.close(fd)


@contextlib.contextmanager
def _source(fd: int, start: int, stop: int) -> Iterator[_Source]:
    """`fd` open for reading windows of its bytes from `start` to `stop`: around the page cache unless it holds
    most of them (`_cached`); the O_DIRECT descriptor is closed at the end. Raises OSError."""
    direct = None if _cached(fd, start, stop) else _open_direct(f"/proc/self/fd/{fd}")
    try:
        yield _Source(fd, direct)
    finally:
        if direct is not None:
            os.close(direct)


class _Source:
    """A file open for reading windows: around the page cache while `direct` (an O_DIRECT descriptor) is set and
    the file system takes it, through it (`fd`) otherwise."""

    def __init__(self, fd: int, direct: int | None):
        self.fd, self.direct = fd, direct

    def window(self, start: int, stop: int) -> tuple[memoryview, int]:
        """This thread's window holding the file's bytes from `start` to at most `stop` (fewer where the file
        ends), and where in it `start` is."""
        window = _window(stop - start + 2 * ALIGN)
        if self.direct is not None:
            at = start // ALIGN * ALIGN
            try:
                return window[:_fill(self.direct, window[:-(-stop // ALIGN) * ALIGN - at], at)], start - at
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = None  # closed by the caller, which still holds it
        return window[:_fill(self.fd, window[:stop - start], start)], 0


def _row_bytes(shape: Sequence[int], boxes: list) -> int:
    return math.prod(shape[1:]) * boxes[0][1].dtype.itemsize


def _copy_rows(source: _Source, offset: int, shape: tuple[int, ...], boxes: list, where: str) -> None:
    if not boxes:
        return
    row_bytes = _row_bytes(shape, boxes)
    per_window = (tunables.get("read_window_bytes") - 2 * ALIGN) // row_bytes if row_bytes else 0
    for lo, hi in _row_spans(boxes):
        if per_window == 0:  # a row larger than a window: each row is an array of one dimension less
            for r in range(lo, hi):
                inner = [(box[1:], dest[r - box[0][0]]) for box, dest in boxes if box[0][0] <= r < box[0][1]]
                _copy_rows(source, offset + r * row_bytes, shape[1:], inner, where)
            continue
        for r in range(lo, hi, per_window):
            k = min(per_window, hi - r)
            start = offset + r * row_bytes
            window, at = source.window(start, start + k * row_bytes)
            if len(window) - at < k * row_bytes:
                raise CorruptCheckpointError(f"{where}: the file ends before the tensor's data")
            dtype = boxes[0][1].dtype
            rows = np.frombuffer(window, dtype, k * row_bytes // dtype.itemsize, at).reshape((k, *shape[1:]))
            for box, dest in boxes:
                a, b = max(box[0][0], r), min(box[0][1], r + k)
                if a < b:
                    np.copyto(dest[a - box[0][0]:b - box[0][0]],
                              rows[(slice(a - r, b - r), *(slice(x, y) for x, y in box[1:]))])


def _row_spans(boxes: list) -> list[tuple[int, int]]:
    """The rows the boxes need, as sorted, disjoint (start, stop) ranges."""
    spans: list[list[int]] = []
    for a, b in sorted(box[0] for box, _ in boxes):
        if spans and a <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], b)
        else:
            spans.append([a, b])
    return [(a, b) for a, b in spans]


def _open_direct(path: str) -> int | None:
    """An O_DIRECT descriptor of `path`, or None where the file system refuses O_DIRECT. Raises OSError."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise


def open_for_runs(path: str, flags: int = 0) -> int:
    """A read-only descriptor of `path` for `read_runs` (`flags` added). Raises OSError (EINVAL for a FIFO, a
    socket or a device, refused before it is opened: `storage.local.is_regular`)."""
    if not is_regular(path) and os.path.isdir(path):
        raise OSError(errno.EISDIR, f"{path} is a directory")
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        # No readahead: it would cache the pieces after these, and the probe would then take them as warm.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except OSError:
        os.close(fd)
        raise
    return fd


def _cached(fd: int, start: int, stop: int) -> bool:
    """Whether the page cache holds most of the file's bytes from `start` to `stop`: counted with ``cachestat``
    (`page_cache.cached_pages`), which reads nothing; where it cannot count, a ``RWF_NOWAIT`` read of one byte in the
    middle (which fails rather than wait for the disk, but makes the kernel read that page: a restore that reads
    the same bytes again then finds it cached and reads them buffered). Not the first or last page alone: the
    reads next to these bytes may have cached them (a chunk's checksum and the next chunk's first bytes share a
    page). Where the kernel cannot say, True: read through the page cache."""
    cached, counted = page_cache.probe(fd, start, stop)
    COUNTS.add(cache_probes=1, cached_probes=int(cached), nowait_probes=int(not counted))
    return cached


def _read_buffered(fd: int, runs: list[tuple[int, memoryview, bool]], where: str) -> int:
    """Read the runs (sorted) through the page cache; the CRC32C of the checksummed ones'."""
    i = 0
    while i < len(runs):
        start, first, _ = runs[i]
        views, end = [first], start + len(first)
        i += 1
        while i < len(runs) and runs[i][0] == end and len(views) < _IOV_MAX:
            views.append(runs[i][1])
            end += len(runs[i][1])
            i += 1
        _read_fully(fd, views, start, where)
    checksum = 0
    for _, view, checksummed in runs:
        if checksummed:
            checksum = crc32c.crc32c(view, checksum)
    return checksum


def _read_fully(fd: int, views: list[memoryview], at: int, where: str) -> None:
    """Fill `views` (at most `_IOV_MAX`) from the file bytes that follow one another from `at`."""
    first = 0
    while first < len(views):
        n = os.preadv(fd, views[first:], at)
        if n == 0:
            raise CorruptCheckpointError(f"{where}: the file ends before the tensor's data")
        at += n
        while first < len(views) and n >= len(views[first]):
            n -= len(views[first])
            first += 1
        if n:
            views[first] = views[first][n:]


def _read_direct(path: str, runs: list[tuple[int, memoryview, bool]], where: str) -> int | None:
    """Read the runs (sorted) window by window with O_DIRECT; the CRC32C of the checksummed ones', or None
    (nothing to rely on having been read) where the file system refuses O_DIRECT. `path` may be a
    descriptor's ``/proc/self/fd`` link: the file the caller holds open is read even if its name was removed or
    replaced meanwhile."""
    fd = _open_direct(path)
    if fd is None:
        return None
    checksum = 0
    try:
        window = _window()
        for straight, group in _straight_runs(runs):
            # (where the read starts, what it fills, the runs it holds): a straight run fills its destination,
            # the others a window each, copied out of it
            reads = [(group[0][0], group[0][1], group)] if straight else [
                (at, window[:-(-max(source + len(dest) for source, dest, _ in parts) // ALIGN) * ALIGN - at], parts)
                for at, parts in _by_window(group, len(window))]
            for start, into, parts in reads:
                try:
                    got = _fill(fd, into, start)
                except OSError as exc:
                    if exc.errno == errno.EINVAL:
                        return None
                    raise
                for source, dest, checksummed in parts:
                    if source + len(dest) > start + got:
                        raise CorruptCheckpointError(f"{where}: the file ends before the tensor's data")
                    read = dest if dest is into else into[source - start:source - start + len(dest)]
                    if checksummed:
                        checksum = crc32c.crc32c(read, checksum)
                    if read is not dest:
                        copy_bytes(dest, read)
    finally:
        os.close(fd)
    return checksum


def _straight_runs(runs: list[tuple[int, memoryview, bool]]) -> list[tuple[bool, list[tuple[int, memoryview, bool]]]]:
    """The runs (sorted) in file order, as (True, [the whole pages of a run of at least `STRAIGHT_BYTES` whose file
    offset and destination are page-aligned]), read into the destination with no copy out of a window (~0.3 CPU-s
    of `stats` over the 2.42 GiB model), or (False, the runs and remainders between), read through the window."""
    out: list[tuple[bool, list[tuple[int, memoryview, bool]]]] = []
    pending: list[tuple[int, memoryview, bool]] = []
    for source, dest, checksummed in runs:
        body = len(dest) // ALIGN * ALIGN
        if body < STRAIGHT_BYTES or source % ALIGN or np.frombuffer(dest, np.uint8).ctypes.data % ALIGN:
            pending.append((source, dest, checksummed))
            continue
        if pending:
            out.append((False, pending))
            pending = []
        out.append((True, [(source, dest[:body], checksummed)]))
        if body < len(dest):
            pending.append((source + body, dest[body:], checksummed))
    if pending:
        out.append((False, pending))
    return out


def copy_bytes(dest: memoryview, source: memoryview) -> None:
    """`dest[:] = source`; a large copy through numpy, which lets go of the GIL while it copies (the reading
    threads' copies out of their windows, and the writing threads' into theirs, then overlap each other and the
    calling thread)."""
    if len(dest) < _NUMPY_COPY_BYTES:
        dest[:] = source
    else:
        np.copyto(np.frombuffer(dest, np.uint8), np.frombuffer(source, np.uint8))


def _by_window(runs: list[tuple[int, memoryview, bool]],
               window_bytes: int) -> list[tuple[int, list[tuple[int, memoryview, bool]]]]:
    """The runs (sorted) cut at the boundaries of windows of `window_bytes` (``tunables`` ``read_window_bytes``)
    aligned in the file, grouped by window, in file order: (the aligned offset the window's read starts at, its
    parts)."""
    end = 0
    for source, dest, _ in runs:
        end = max(end, source + len(dest))
    first = runs[0][0] if runs else 0
    if end > first and first // window_bytes == (end - 1) // window_bytes:
        return [(first // ALIGN * ALIGN, runs)]  # all in one window, nothing to cut: a chunk's read, mostly
    groups: dict[int, list[tuple[int, memoryview, bool]]] = {}
    for source, dest, checksummed in runs:
        while len(dest):
            base = source // window_bytes * window_bytes
            take = min(len(dest), base + window_bytes - source)
            groups.setdefault(base, []).append((source, dest[:take], checksummed))
            source, dest = source + take, dest[take:]
    return [(parts[0][0] // ALIGN * ALIGN, parts) for _, parts in sorted(groups.items())]  # parts in file order


def _fill(fd: int, view: memoryview, at: int) -> int:
    """Read into `view` from `at` until it is full or the file ends; the bytes read."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], at + got)
        if n == 0:
            break
        got += n
    return got


def _window(nbytes: int = 0) -> memoryview:
    """This thread's window (`buffers.of_thread`, page-aligned as direct reads need) of ``read_window_bytes``
    (`tunables`), or for more (a row larger than a window) a larger one kept beside it: the two are never
    overwritten by each other's reads. Windows live as long as their thread, so their pages are faulted in
    once. Why huge pages (`buffers.new`): a direct request is built from the buffer's pages, as segments of
    physically contiguous memory of which a disk takes a limited number, so a window of 4 KiB pages went to the
    disk here in requests of 512 KiB (the block layer's count: 512 requests for 256 MiB), where 2 MiB pages make
    requests as large as the device allows (4 MiB: 64 requests). Measured on this VM (4 processes reading 256
    MiB each, freshly written, cold cache): 0.51-0.57 s with huge-page windows, 0.61-0.73 s with 4 KiB ones,
    0.47-0.55 s buffered."""
    window_bytes = tunables.get("read_window_bytes")
    if nbytes > window_bytes:
        return buffers.view_of_thread("large_read_window", nbytes)
    return buffers.view_of_thread("read_window", window_bytes)
