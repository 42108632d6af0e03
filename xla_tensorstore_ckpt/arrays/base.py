"""The array-reading protocol: what every reader of stored arrays offers, whatever stores them.

An `ArrayReader` reads the arrays of one item for one operation (a restore, a scan, a conversion): `open(meta)`
starts opening the array an `ArrayMetadata` describes and returns an `Opening`, whose `result()` is a
`StoredArray`. A stored array tells its shape, zarr dtype name and chunk shape, and reads regions: `read(regions,
empty)` starts reading each region (``((start, stop), ...)`` per dimension, within the shape) into a buffer from
`empty`, and returns a `PendingRead` per region, whose `result()` blocks and gives the numpy array (or raises a
`CheckpointError` naming the array and the chunk). Callers start many reads, then wait, so I/O runs
concurrently. Readers differ in how they fetch, and say so: `ArrayReader.fetches_once` (each stored chunk a call
of `read` touches is fetched once, however many regions share it) and `StoredArray.reads_whole_chunks` (a chunk
is fetched and decoded whole, whatever part of it is asked for).

Adding a reader (a store tensorstore cannot open, a new format's arrays) is one module with an `ArrayReader`
subclass and a line in the picker (`arrays.reader`); callers never change. No tensorstore here.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from .. import storage
from ..core.errors import CheckpointError
from ..core.grid import Index
from ..core.records import ArrayMetadata

Empty = Callable[[tuple[int, ...], np.dtype], np.ndarray]  # np.empty or a restore batch buffer's: where reads put data


class PendingRead(Protocol):
    """A read in flight: `result()` blocks, then returns the data or raises a `CheckpointError`."""

    def result(self) -> np.ndarray: ...


class StoredArray(Protocol):
    """One array open for reading (see the module)."""

    location: storage.Location  # where it is stored, for messages
    shape: tuple[int, ...]
    dtype_name: str
    chunk_shape: tuple[int, ...]
    reads_whole_chunks: bool

    def read(self, regions: Sequence[Index], empty: Empty = np.empty) -> dict[Index, PendingRead]:
        """Start reading `regions` into buffers from `empty`; one pending read per region."""

    def read_index(self, index: tuple[slice | int, ...]) -> PendingRead:
        """Start reading `index` (normalized integers and slices, strides allowed; () is everything)."""


class Opening(Protocol):
    """An array being opened: `result()` blocks, then returns the `StoredArray` or raises a `CheckpointError`
    (missing or malformed metadata, naming the file)."""

    def result(self) -> StoredArray: ...


class ArrayReader(ABC):
    """Opens the arrays of one item for one operation; `close` when every read has finished (it may hold
    files open until then; garbage collection closes them too)."""

    fetches_once: bool = False

    @abstractmethod
    def open(self, meta: ArrayMetadata) -> Opening:
        """Start opening the array `meta` describes (its entry in the item's manifest)."""

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release what the reads held (open files). Call it once no read is in flight any more."""

    def fetched_bytes(self) -> int | None:
        """Bytes of array data this reader has fetched from storage so far (chunks with their checksums, or a
        raw tensor's bytes; not the item's metadata), or None if it cannot tell. Exact once every read it
        started has finished. Never raises."""
        return None


class ByteCounter:
    """A count of bytes that reading threads add to (readers' `fetched_bytes`)."""

    def __init__(self) -> None:
        self._total = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self._total += n

    @property
    def total(self) -> int:
        return self._total


class PathCounts(storage.Counts):
    """What array reads did, by path: cache probes (how many found the bytes cached, and how many asked with a
    one-byte ``RWF_NOWAIT`` read where ``cachestat`` could not count, ``nowait_probes``), the local reads and
    bytes that went around the page cache (direct) or through it (buffered), the chunks `local_chunks` read
    itself (on the restoring thread, ``chunks_inline``, or on its worker threads, ``chunks_on_workers``) and the
    regions read through tensorstore (``tensorstore_regions``), and the data files `local_chunks` opened and
    closed (``files_opened``, ``files_closed``: equal once a restore ends). `local_reads.COUNTS` counts this
    process's since it started; restores report the difference over their reads (``restore_finished``'s
    ``paths``); tests read it to see which path ran. Thread-safe."""

    FIELDS = ("cache_probes", "cached_probes", "nowait_probes", "direct_reads", "direct_bytes", "buffered_reads",
              "buffered_bytes", "chunks_inline", "chunks_on_workers", "tensorstore_regions", "files_opened",
              "files_closed")


class Ready:
    """An operation that finished at once, shaped like a pending one."""

    __slots__ = ("value",)

    def __init__(self, value: object):
        self.value = value

    def result(self) -> object:
        return self.value


def index_box(index: tuple[slice | int, ...], shape: tuple[int, ...]) -> tuple[Index, tuple]:
    """The smallest region holding `index` (normalized integers and slices, strides allowed, trailing dimensions
    whole), and the index that picks `index` out of that region's data: for readers that read regions only."""
    box, within = [], []
    for i in index:
        if isinstance(i, int):
            box.append((i, i + 1))
            within.append(0)
        else:
            step = i.step or 1
            count = max(0, -(-(i.stop - i.start) // step))
            stop = i.start + (count - 1) * step + 1 if count else i.start
            box.append((i.start, stop))
            within.append(slice(0, stop - i.start, step))
    box += [(0, n) for n in shape[len(index):]]
    return tuple(box), tuple(within)


class Picked:
    """A read of a region's box, then `within` of it (`index_box`)."""

    __slots__ = ("read", "within")

    def __init__(self, read: PendingRead, within: tuple):
        self.read, self.within = read, within

    def result(self) -> np.ndarray:
        return self.read.result()[self.within]


def wait_all(pending: Sequence) -> list[object]:
    """Wait for every pending operation (even after one fails) and raise the first `CheckpointError`, noting
    how many failed."""
    results: list[object] = []
    errors: list[CheckpointError] = []
    for item in pending:
        try:
            results.append(item.result())
        except CheckpointError as exc:
            errors.append(exc)
            results.append(None)
    if errors:
        first = errors[0]
        if len(errors) > 1:
            first.args = (f"{first} (and {len(errors) - 1} more failed operations)",)
        raise first
    return results


def drain(pending: Sequence) -> None:
    """Wait for operations whose results no longer matter (an error is already on its way)."""
    for item in pending:
        try:
            item.result()
        except CheckpointError:
            pass
