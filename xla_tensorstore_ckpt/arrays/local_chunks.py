"""This library's zarr v3 arrays on local disk, read chunk by chunk straight from their files, without tensorstore.

A chunk of ours is its elements in C order, little-endian, followed by their CRC32C (the ``bytes`` and ``crc32c``
codecs), in a file of its own or at a byte range of an OCDBT data file (`ocdbt.ocdbt_index` says where). A
compressed one (``bytes``, ``zstd``, ``crc32c``: `SaveOptions.compression`, Orbax's chain) is one zstd frame then
the frame's CRC32C: it is read whole, checked, and decompressed straight into the destination where the chunk is one
contiguous block of it, else into a buffer of its own and copied out (`LocalChunkArray._read_compressed`). A read of
some regions of an array reads each chunk they touch once, however many regions share it, with positioned reads
(`chunk_files`, over `local_reads`: around the page cache where it does not hold the chunk): straight into the
destination where the chunk is one contiguous block of it (a restore onto the sharding it was saved with), else in
pieces of at most ``chunk_piece_bytes`` (`tunables`), each read into the reading thread's window
(`local_reads.read_window`) and copied out of it once, to each region that needs it. The checksum is computed with
the processor's CRC32C instruction (the `crc32c` package) as the pieces pass, and a chunk that fails it, is missing
or has the wrong size is an error naming the array and the chunk.

Why not tensorstore here: it maps the files into memory and takes a page fault per 4 KiB on every restore, warm or
cold (a quarter of a million per GiB, at several microseconds each on a busy VM); its CRC32C is the portable one
(about 3 GB/s per core, against 15 here); and a chunk feeding two target shards is decoded twice. Arrays this does
not cover (object stores, other codecs, zarr v2, Orbax's arrays, single-file arrays) are read by `arrays` through
tensorstore: `covers` and `LocalChunkReader.open` say which. No tensorstore is used here, and no torch_xla.
"""

from __future__ import annotations

import itertools
import math
import os
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import crc32c
import numpy as np

from .. import storage
from ..core import bounds, dtypes, layout, threads, tunables
from ..core.errors import CorruptCheckpointError, StorageError
from ..core.records import ArrayMetadata, ArrayStore
from . import zstd
from .base import ArrayReader, ByteCounter, Empty, Index, Opening, Picked, Ready, index_box
from .chunk_files import ChunkReads, ChunkSource, OpenFiles
from .local_reads import COUNTS
from .ocdbt import StoredValue, ocdbt_index
from .tensorstore_reads import TensorstoreReader

# Smaller chunks are read at once on the restoring thread. Each chunk costs some microseconds of Python: on worker
# threads, thousands of small ones held the GIL against the restoring thread's own work and slowed it 4-7x (2,000
# small tensors: 1.5-2.0 s); through tensorstore, its threads slowed that work too (0.3 s of no-op dtype casts
# and copies, 0.06 s without them). Measured on that workload: median 1.07 s read here inline against 1.35 s
# for format 1 (tensorstore, a directory per array). Larger chunks are mostly data, read with the GIL released.
_CHECKSUM_BYTES = 4
_WORKERS = threads.pool("local_reads", "xtc-chunk-read")


def covers(item: storage.Location, store: ArrayStore) -> bool:
    """True if the arrays of `item` may be read here: local files, this library's checksummed zarr v3 arrays, in
    directories or one OCDBT store, no missing chunks allowed."""
    return (store.kind in ("directories", "ocdbt") and store.zarr_format == 3 and store.checksums
            and not store.fill_missing and item.local_file("") is not None)


class LocalChunkReader(ArrayReader):
    """Reads the arrays of one item (`covers`) chunk by chunk from their files; each chunk a call of
    `LocalChunkArray.read` touches is read once. An array whose ``zarr.json`` is not exactly what this module
    reads (another codec, a single-file array) is read by tensorstore instead, which reports what is wrong with
    it. Used by one operation; `close` (or garbage collection) closes the OCDBT data files the reads opened."""

    fetches_once = True

    def __init__(self, item: storage.Location, store: ArrayStore, tensorstore: TensorstoreReader):
        self.item = item
        self.store = store
        self._tensorstore = tensorstore
        self._index: dict[str, StoredValue] | None = None
        self._files = OpenFiles()
        self._fetched = ByteCounter()
        self._fell_back = False  # an array read by tensorstore instead
        weakref.finalize(self, self._files.close)

    def close(self) -> None:
        self._files.close()

    def fetched_bytes(self) -> int | None:
        """Every chunk read from a file counts its stored bytes once (inline chunks came with the OCDBT index);
        arrays read by tensorstore instead count as `TensorstoreReader.fetched_bytes` does."""
        if not self._fell_back:
            return self._fetched.total
        other = self._tensorstore.fetched_bytes()
        return None if other is None else self._fetched.total + other

    def open(self, meta: ArrayMetadata) -> Opening:
        """Reads the array's metadata (and, the first time, the item's OCDBT index) at once; raises
        `CorruptCheckpointError` for an unreadable index."""
        if self.store.kind == "directories":
            where = self.item.child(meta.path)
            try:
                raw = where.read(layout.ZARR_METADATA)
            except StorageError:
                raw = None  # tensorstore's reader reports it
            locate = self._chunk_file
        else:
            if self._index is None:
                self._index = ocdbt_index(self.item)
            value = self._index.get(f"{meta.path}/{layout.ZARR_METADATA}")
            raw, where, locate = value.inline if value is not None else None, self.item.child(meta.path), \
                self._ocdbt_chunk
        kind = _layout(raw, meta)
        if kind is None:
            self._fell_back = True
            return self._tensorstore.open(meta)
        return Ready(LocalChunkArray(where, meta, locate, compressed=kind == "zstd"))

    def _chunk_file(self, array: LocalChunkArray, key: str) -> ChunkSource | None:
        """A chunk of an array stored in a directory: a file of its own, holding exactly the chunk."""
        path = array.location.local_file(key)
        if path is None:
            return None
        length = array.stored_bytes
        if array.compressed:  # as long as its frame: the file's size (checked again once it is open)
            try:
                length = os.stat(path).st_size
            except FileNotFoundError:
                return None
        self._fetched.add(length)  # a chunk is located to be read, whole, once
        return ChunkSource(path, 0, length, whole_file=True)

    def _ocdbt_chunk(self, array: LocalChunkArray, key: str) -> ChunkSource | None:
        """A chunk of an array in the OCDBT store: inline in its B-tree, or a byte range of a data file."""
        assert self._index is not None  # built when the array was opened
        value = self._index.get(f"{array.meta.path}/{key}")
        if value is None:
            return None
        if value.inline is not None:
            return ChunkSource("", 0, len(value.inline), inline=value.inline)
        path = self.item.local_file(value.file)
        if path is None:
            return None
        self._fetched.add(value.length)  # a chunk is located to be read, whole, once
        return ChunkSource(path, value.offset, value.length, files=self._files)


def _layout(raw: bytes | None, meta: ArrayMetadata) -> str | None:
    """``"raw"`` or ``"zstd"`` if ``zarr.json`` `raw` describes `meta`'s array in a layout read here: a regular
    chunk grid of `meta.chunk_shape`, default chunk keys, little-endian elements, perhaps one zstd frame of them,
    then a CRC32C, nothing else; None otherwise."""
    if raw is None:
        return None
    try:  # a malformed one is reported by the tensorstore reader, which checks it the same way
        doc = bounds.load_json(raw, where=layout.ZARR_METADATA, max_bytes=bounds.MAX_ARRAY_JSON_BYTES)
    except CorruptCheckpointError:
        return None
    elements = [{"configuration": {"endian": "little"}, "name": "bytes"}]
    if dtypes.by_name(meta.dtype).itemsize == 1:
        elements.append({"name": "bytes"})
    if not (doc.get("zarr_format") == 3 and doc.get("node_type") == "array" and doc.get("shape") == list(meta.shape)
            and doc.get("data_type") == meta.dtype
            and doc.get("chunk_grid") == {"name": "regular", "configuration": {"chunk_shape": list(meta.chunk_shape)}}
            and doc.get("chunk_key_encoding") in ({"name": "default"},
                                                  {"name": "default", "configuration": {"separator": "/"}})
            and not doc.get("storage_transformers")):
        return None
    codecs = doc.get("codecs")
    if not isinstance(codecs, list) or not codecs or codecs[0] not in elements or codecs[-1] != {"name": "crc32c"}:
        return None
    if len(codecs) == 2:
        return "raw"
    return "zstd" if len(codecs) == 3 and _is_zstd(codecs[1]) else None


def _is_zstd(codec: object) -> bool:
    """A zstd codec entry as Orbax and this library write it (any level; a frame checksum is checked by the
    decoder)."""
    if not isinstance(codec, dict) or codec.get("name") != zstd.NAME:
        return False
    config = codec.get("configuration", {})
    return isinstance(config, dict) and set(config) <= {"level", "checksum"}


class LocalChunkArray:
    """One array open for chunk reads (`base.StoredArray`)."""

    reads_whole_chunks = True

    def __init__(self, location: storage.Location, meta: ArrayMetadata,
                 locate: Callable[[LocalChunkArray, str], ChunkSource | None], *, compressed: bool = False):
        self.location = location
        self.meta = meta
        self.shape = meta.shape
        self.dtype_name = meta.dtype
        self.chunk_shape = meta.chunk_shape
        self._row = dtypes.by_name(meta.dtype)
        self._locate = locate
        self.chunk_bytes = math.prod(meta.chunk_shape) * self._row.itemsize
        self.compressed = compressed  # each chunk a zstd frame (of any length) then its CRC32C
        self.stored_bytes = self.chunk_bytes + _CHECKSUM_BYTES  # uncompressed, or at most about that

    def read(self, regions: Sequence[Index], empty: Empty = np.empty) -> dict[Index, RegionRead]:
        """Start reading `regions` (each within the shape) into buffers from `empty`; each chunk they touch is
        read once. Chunks of ``inline_chunk_bytes`` (`tunables`) or more are read on a small thread pool and
        this returns at once; smaller ones are read before it returns. Errors are raised by the `RegionRead` that
        needs the chunk."""
        outs = {r: empty(tuple(b - a for a, b in r), self._row.copy_dtype) for r in regions}
        needed: dict[tuple[int, ...], list[Index]] = {}
        for region in regions:
            if any(b <= a for a, b in region):
                continue
            spans = [range(a // c, -(-b // c)) for (a, b), c in zip(region, self.chunk_shape)]
            for position in itertools.product(*spans):
                needed.setdefault(position, []).append(region)
        reads = {r: RegionRead(self, outs[r]) for r in regions}
        inline = self.stored_bytes < tunables.get("inline_chunk_bytes")
        COUNTS.add(**{"chunks_inline" if inline else "chunks_on_workers": len(needed)})
        for position, users in needed.items():
            targets = [(r, outs[r]) for r in users]
            future = _read_now(self._read_chunk, position, targets) if inline else \
                _WORKERS.submit(self._read_chunk, position, targets)
            for region in users:
                reads[region].futures.append(future)
        return reads

    def read_index(self, index: tuple[slice | int, ...]) -> Picked:
        """Start reading `index`: its bounding box is read, then indexed."""
        box, within = index_box(index, self.shape)
        return Picked(self.read([box])[box], within)

    def _read_chunk(self, position: tuple[int, ...], targets: list[tuple[Index, np.ndarray]]) -> None:
        key = layout.chunk_key(position)
        source = self._locate(self, key)
        if source is None:
            raise CorruptCheckpointError(f"array {self.location}: chunk {key} is missing")
        if self.compressed:
            self._read_compressed(key, position, targets, source)
            return
        if source.length != self.stored_bytes:
            raise CorruptCheckpointError(
                f"array {self.location}: chunk {key} holds {source.length} bytes, not the {self.stored_bytes} of "
                f"a chunk of {list(self.chunk_shape)} {self.dtype_name} ({source.where})")
        box = tuple((p * c, p * c + c) for p, c in zip(position, self.chunk_shape))
        try:
            with ChunkReads(source, self, key) as reader:
                block = _contiguous_block(box, *targets[0]) if len(targets) == 1 else None
                if block is not None:
                    stored = bytearray(_CHECKSUM_BYTES)
                    self._check(key, reader.read_into([block, stored], 0, checksummed=1), stored, source)
                else:
                    self._from_pieces(key, box, targets, reader, source)
        except OSError as exc:
            raise StorageError(f"cannot read chunk {key} of array {self.location} ({source.where}): {exc}") from exc

    def _read_compressed(self, key: str, position: tuple[int, ...], targets: list[tuple[Index, np.ndarray]],
                         source: ChunkSource) -> None:
        """Read a compressed chunk whole (its frame and CRC32C), check it, and decompress it into the one target
        it is a contiguous block of, else into a buffer of its own, copied to each target."""
        if source.length <= _CHECKSUM_BYTES:
            raise CorruptCheckpointError(f"array {self.location}: chunk {key} holds {source.length} bytes, too few "
                                         f"for a zstd frame and its CRC32C ({source.where})")
        box = tuple((p * c, p * c + c) for p, c in zip(position, self.chunk_shape))
        stored = bytearray(source.length)
        frame, checksum = memoryview(stored)[:-_CHECKSUM_BYTES], memoryview(stored)[-_CHECKSUM_BYTES:]
        try:
            with ChunkReads(source, self, key) as reader:
                computed = reader.read_into([frame, checksum], 0, checksummed=1)
        except OSError as exc:
            raise StorageError(f"cannot read chunk {key} of array {self.location} ({source.where}): {exc}") from exc
        self._check(key, computed, bytearray(checksum), source)
        block = _contiguous_block(box, *targets[0]) if len(targets) == 1 else None
        whole = block if block is not None else memoryview(np.empty(self.chunk_bytes, np.uint8))
        try:
            zstd.decompress_into(frame, whole)
        except ValueError as exc:
            raise CorruptCheckpointError(f"array {self.location}: chunk {key} does not decompress to the "
                                         f"{self.chunk_bytes} bytes of its elements: {exc} ({source.where})") from None
        if block is not None:
            return
        data = np.frombuffer(whole, self._row.copy_dtype).reshape(self.chunk_shape)
        for region, out in targets:
            overlap = tuple((max(a, ra), min(b, rb)) for (a, b), (ra, rb) in zip(box, region))
            if any(b <= a for a, b in overlap):
                continue
            out[tuple(slice(a - r[0], b - r[0]) for (a, b), r in zip(overlap, region))] = \
                data[tuple(slice(a - o[0], b - o[0]) for (a, b), o in zip(overlap, box))]

    def _from_pieces(self, key: str, box: Index, targets: list[tuple[Index, np.ndarray]], reader: ChunkReads,
                     source: ChunkSource) -> None:
        """Read the chunk in pieces of whole rows (of its first dimension), each into this thread's read window
        (`local_reads.read_window`: no copy on the way), copy each piece's part of each target, and check the
        checksum over all of it."""
        inner = self.chunk_shape[1:]
        row_bytes = math.prod(inner) * self._row.itemsize
        rows = self.chunk_shape[0]
        per_piece = max(1, tunables.get("chunk_piece_bytes") // max(1, row_bytes))
        checksum = 0
        for first in range(0, rows, per_piece):
            count = min(per_piece, rows - first)
            piece = reader.view(first * row_bytes, count * row_bytes)
            checksum = crc32c.crc32c(piece, checksum)
            data = np.frombuffer(piece, self._row.copy_dtype).reshape((count, *inner))
            start = box[0][0] + first
            for region, out in targets:
                overlap = ((max(start, region[0][0]), min(start + count, region[0][1])),
                           *((max(a, ra), min(b, rb)) for (a, b), (ra, rb) in zip(box[1:], region[1:])))
                if any(b <= a for a, b in overlap):
                    continue
                origin = (start, *(a for a, _ in box[1:]))
                out[tuple(slice(a - r[0], b - r[0]) for (a, b), r in zip(overlap, region))] = \
                    data[tuple(slice(a - o, b - o) for (a, b), o in zip(overlap, origin))]
        stored = bytearray(_CHECKSUM_BYTES)
        reader.read_into([stored], rows * row_bytes)
        self._check(key, checksum, stored, source)

    def _check(self, key: str, checksum: int, stored: bytearray, source: ChunkSource) -> None:
        expected = int.from_bytes(stored, "little")
        if checksum != expected:
            raise CorruptCheckpointError(f"array {self.location}: chunk {key} fails its CRC32C checksum "
                                         f"(computed {checksum:#010x}, stored {expected:#010x}; {source.where})")


class _Done:
    """A chunk read that ran at once, shaped like a `Future` for `RegionRead`."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None):
        self.error = error

    def result(self) -> None:
        if self.error is not None:
            raise self.error


_DONE = _Done(None)


def _read_now(read: Callable, position: tuple[int, ...], targets: list) -> _Done:
    try:
        read(position, targets)
    except (CorruptCheckpointError, StorageError) as exc:
        return _Done(exc)
    return _DONE


class RegionRead:
    """A region read in flight, a `base.PendingRead`: `result()` blocks and returns the numpy array or
    raises the `CheckpointError` of a chunk it needed."""

    __slots__ = ("dtype", "out", "futures")

    def __init__(self, array: LocalChunkArray, out: np.ndarray):
        self.dtype = array._row.numpy
        self.out = out
        self.futures: list[Future | _Done] = []

    def result(self) -> np.ndarray:
        for future in self.futures:
            future.result()
        return self.out.view(self.dtype)


def _contiguous_block(box: Index, region: Index, out: np.ndarray) -> memoryview | None:
    """The bytes of `out` (the buffer of `region`) that chunk `box` fills, if the chunk lies wholly inside the
    region and is one contiguous block of it (every dimension after its first of length > 1 spans the region);
    else None."""
    if any(a < ra or b > rb for (a, b), (ra, rb) in zip(box, region)):
        return None
    extent = [b - a for a, b in box]
    width = [b - a for a, b in region]
    first = next((d for d, n in enumerate(extent) if n > 1), len(extent))
    if any(extent[d] != width[d] for d in range(first + 1, len(extent))):
        return None
    offset = 0
    for (a, _), (ra, _), n in zip(box, region, width):
        offset = offset * n + a - ra
    flat = out.reshape(-1)
    return memoryview(flat[offset:offset + math.prod(extent)].view(np.uint8))
