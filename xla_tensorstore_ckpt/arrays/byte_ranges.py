"""Arrays stored as raw C-order bytes at an offset of a file (the tensors of safetensors files), read region by
region: a reader gets the bytes of its region and no others, never the whole tensor or the whole file.

Local files are read on a small thread pool straight into each region's buffer: a region of a few contiguous
runs (a row-sharded region is one) with one positioned read per run (large requests: faster than page faults
on a cold file), others (column-sharded: a run per row) copied out of a memory map of the page cache. Elsewhere
(object stores, memory) a region is a set of byte ranges, one per contiguous run (a row-sharded region is one
run, a column-sharded one a run per row): runs closer than ``merge_gap_bytes`` (`tunables`) are fetched in one
ranged request (the gap is read and dropped: requests, not bytes, are what remote reads pay for) of at most
`MAX_REQUEST_BYTES`, all in flight at once. Results are pending reads (`base.PendingRead`): `.result()` blocks and
returns the numpy array, or raises `CheckpointError` naming the file and the key. No tensorstore here (ranged reads go
through `storage`); no torch_xla.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np

from .. import storage
from ..core import dtypes, threads, tunables
from ..core.errors import CheckpointError, CorruptCheckpointError, StorageError
from ..core.records import ArrayMetadata, RawArrayMetadata
from .base import ArrayReader, ByteCounter, Empty, Index, Picked, Ready, index_box
from .local_reads import read_runs

MAX_POSITIONED_READS = 16  # runs per region read with pread; more are copied out of a memory map
MAX_REQUEST_BYTES = 16 << 20

_COPIES = threads.pool("local_reads", "xtc-raw-read")


class ByteRangeReader(ArrayReader):
    """Reads the tensors of one Hugging Face item (`RawArrayMetadata` entries): each region reads exactly its
    bytes, never the whole tensor or file."""

    fetches_once = True

    def __init__(self, item: storage.Location):
        self.item = item
        self._fetched = ByteCounter()

    def open(self, meta: ArrayMetadata) -> Ready:
        if not isinstance(meta, RawArrayMetadata):
            raise TypeError(f"{meta.path}: a byte-range tensor is opened from its RawArrayMetadata")
        return Ready(ByteRangeArray(self.item, meta, self._fetched))

    def fetched_bytes(self) -> int:
        """The bytes of the regions read from local files (a memory-mapped region: its own bytes), and of the
        ranged requests elsewhere (merged gaps included)."""
        return self._fetched.total


class ByteRangeArray:
    """One tensor of a file, open for reading regions (`base.StoredArray`)."""

    reads_whole_chunks = False

    def __init__(self, item: storage.Location, meta: RawArrayMetadata, fetched: ByteCounter):
        self.file = item.child(meta.file) if meta.file else item
        self._fetched = fetched  # the reader's
        self.location = self.file
        self.key = meta.path
        self.shape = meta.shape
        self.dtype_name = meta.dtype
        self.chunk_shape = meta.chunk_shape
        self.offset = meta.offset
        self._row = dtypes.by_name(meta.dtype)
        self._local = self.file.parent.local_file(self.file.name)

    @property
    def where(self) -> str:
        return f"{self.file} [{self.key}]"

    def read(self, regions: Sequence[Index], empty: Empty = np.empty) -> dict[Index, RawRead]:
        """Start reading each region into a buffer from `empty`."""
        return {region: self._read(region, empty) for region in regions}

    def _read(self, region: Index, empty: Empty) -> RawRead:
        out = empty(tuple(b - a for a, b in region), self._row.copy_dtype)
        if out.size == 0:
            return RawRead(self, out, [], None)
        if self._local is not None:
            self._fetched.add(out.nbytes)
            return RawRead(self, out, [], _COPIES.submit(self._copy_mapped, region, out))
        requests = requests_of(_runs(self.shape, region, self._row.itemsize, self.offset))
        self._fetched.add(sum(stop - start for start, stop, _ in requests))
        pending = [self.file.parent.read_range(self.file.name, start, stop) for start, stop, _ in requests]
        return RawRead(self, out, list(zip(requests, pending)), None)

    def read_index(self, index: tuple[slice | int, ...]) -> Picked:
        """Start reading `index` (normalized integers and slices, strides allowed): the bounding box is read,
        then indexed."""
        box, within = index_box(index, self.shape)
        return Picked(self._read(box, np.empty), within)

    def _copy_mapped(self, region: Index, out: np.ndarray) -> None:
        runs = _runs(self.shape, region, self._row.itemsize, self.offset)
        if len(runs) <= MAX_POSITIONED_READS:
            read_runs(self._local, into(runs, out), self.where)
            return
        try:
            mapped = np.memmap(self._local, dtype=out.dtype, mode="r", offset=self.offset,
                               shape=max(1, math.prod(self.shape))).reshape(self.shape)
        except (OSError, ValueError) as exc:
            raise StorageError(f"cannot map {self.where}: {exc}") from exc
        np.copyto(out, mapped[tuple(slice(a, b) for a, b in region)])


def into(runs: list[tuple[int, int, int]], out: np.ndarray) -> list[tuple[int, memoryview]]:
    """Runs of `runs_between` as `read_runs` takes them: each with the part of `out` it fills."""
    flat = memoryview(out.reshape(-1).view(np.uint8))
    return [(source, flat[target:target + length]) for source, length, target in runs]


class RawRead:
    """A region read in flight."""

    def __init__(self, array: ByteRangeArray, out: np.ndarray, requests: list, copy: Future | None):
        self.array, self.out, self.requests, self.copy = array, out, requests, copy

    def result(self) -> np.ndarray:
        try:
            if self.copy is not None:
                self.copy.result()
            flat = self.out.reshape(-1).view(np.uint8)
            for (start, _, runs), pending in self.requests:
                data = pending.result()
                if data is None:
                    raise CorruptCheckpointError(f"{self.array.where}: the file disappeared")
                buffer = np.frombuffer(data, dtype=np.uint8)
                for source, length, target in runs:
                    flat[target:target + length] = buffer[source - start:source - start + length]
        except storage.RangeNotSatisfiableError as exc:
            raise CorruptCheckpointError(f"{self.array.where}: the file ends before the tensor's data") from exc
        except CheckpointError:
            raise
        except OSError as exc:
            raise StorageError(f"cannot read {self.array.where}: {exc}") from exc
        return self.out.view(self.array._row.numpy)


def _runs(shape: Sequence[int], region: Index, itemsize: int, offset: int) -> list[tuple[int, int, int]]:
    """(file offset, length, offset in the region's buffer) of each contiguous run of `region`, in order."""
    return runs_between(shape, region, itemsize, offset, tuple(b - a for a, b in region), (0,) * len(region))


def runs_between(shape: Sequence[int], box: Index, itemsize: int, offset: int, out_shape: Sequence[int],
                 out_start: Sequence[int]) -> list[tuple[int, int, int]]:
    """(file offset, length, offset in the output buffer) of each contiguous run that copies `box` of a C-order
    tensor of `shape` stored at `offset` into a C-order buffer of `out_shape` at `out_start`, in order."""
    rank = len(shape)
    if rank == 0:
        return [(offset, itemsize, 0)]
    extents = [b - a for a, b in box]
    # Runs span the trailing dimensions the box covers whole in both, and a range of the one before.
    split = rank - 1
    while split > 0 and box[split] == (0, shape[split]) and out_shape[split] == extents[split]:
        split -= 1
    strides = [math.prod(shape[d + 1:]) * itemsize for d in range(rank)]
    out_strides = [math.prod(out_shape[d + 1:]) * itemsize for d in range(rank)]
    length = extents[split] * strides[split]
    starts = np.full(1, offset + box[split][0] * strides[split], dtype=np.int64)
    targets = np.full(1, out_start[split] * out_strides[split], dtype=np.int64)
    for d in range(split - 1, -1, -1):
        along = np.arange(extents[d], dtype=np.int64)
        starts = (((along + box[d][0]) * strides[d])[:, None] + starts[None, :]).reshape(-1)
        targets = (((along + out_start[d]) * out_strides[d])[:, None] + targets[None, :]).reshape(-1)
    return [(int(s), length, int(t)) for s, t in zip(starts, targets)]


def requests_of(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """Runs grouped into ranged requests: (start, stop, runs) with gaps of at most ``merge_gap_bytes``
    (`tunables`) and spans of at most `MAX_REQUEST_BYTES` (a longer run is split)."""
    merge_gap = tunables.get("merge_gap_bytes")
    pieces = []
    for source, length, target in runs:
        for at in range(0, length, MAX_REQUEST_BYTES):
            size = min(MAX_REQUEST_BYTES, length - at)
            pieces.append((source + at, size, target + at))
    requests: list[tuple[int, int, list]] = []
    for source, length, target in pieces:
        if requests:
            start, stop, members = requests[-1]
            if source - stop <= merge_gap and source >= stop and source + length - start <= MAX_REQUEST_BYTES:
                members.append((source, length, target))
                requests[-1] = (start, source + length, members)
                continue
        requests.append((source, source + length, [(source, length, target)]))
    return requests
