"""Arrays stored as pieces that tile them, each piece a ``torch.save`` blob of one region in some file (the tensors
of a DCP checkpoint, `records.PiecesArrayMetadata`): a region reads, from each piece it overlaps, the bytes of the
overlap as raw bytes at the blob's storage record, never through ``torch.load``.

Opening an array locates every piece's storage record (`torch_zip.locate`: a few small reads per piece,
all pieces at once). A C-order piece of a local file is read once for all the regions of one `read` call that
overlap it, a window of whole rows at a time, each region taking its box out of the window
(`local_reads.read_boxes`; the rows' other columns are read too, a box of whole rows from a warm page cache
straight into its buffer). Elsewhere a piece is read as runs of bytes with ranged requests (runs merged as
`byte_ranges` merges them), straight into the region's buffer. A piece saved with other strides (a transposed
tensor) is read whole and copied out. No tensorstore; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np

from .. import storage
from ..core import dtypes, threads
from ..core.errors import CheckpointError, CorruptCheckpointError, StorageError
from ..core.records import ArrayMetadata, PiecesArrayMetadata
from . import torch_zip
from .base import ArrayReader, ByteCounter, Empty, Index, Picked, index_box
from .byte_ranges import requests_of, runs_between
from .local_reads import read_boxes

_POOL = threads.pool("dcp_pieces", "xtc-pieces")


class PiecesReader(ArrayReader):
    """Reads the tensors of one DCP item: each region reads only the bytes of the pieces it overlaps."""

    fetches_once = True

    def __init__(self, item: storage.Location):
        self.item = item
        self._fetched = ByteCounter()

    def open(self, meta: ArrayMetadata) -> Opening:
        if not isinstance(meta, PiecesArrayMetadata):
            raise TypeError(f"{meta.path}: a DCP tensor is opened from its PiecesArrayMetadata")
        return Opening(self.item, meta, self._fetched)

    def fetched_bytes(self) -> int:
        """The bytes of the pieces' regions read (not the blobs' small records)."""
        return self._fetched.total


class Opening:
    """The pieces of one array being located (`base.Opening`)."""

    def __init__(self, item: storage.Location, meta: PiecesArrayMetadata, fetched: ByteCounter):
        self.item, self.meta, self.fetched = item, meta, fetched
        self.pending = [_POOL.submit(_locate, item, meta, piece) for piece in meta.pieces]

    def result(self) -> PiecesArray:
        located = []
        errors = []
        for future in self.pending:
            try:
                located.append(future.result())
            except CheckpointError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return PiecesArray(self.item, self.meta, located, self.fetched)


def _locate(item: storage.Location, meta: PiecesArrayMetadata, piece) -> torch_zip.TensorBytes:  # noqa: ANN001
    where = f"{item.child(piece.file)} [{meta.path} chunk at {list(piece.offsets)}]"
    return torch_zip.locate(item, piece.file, piece.start, piece.length, meta.dtype, piece.sizes, where)


class PiecesArray:
    """One DCP tensor, open for reading regions (`base.StoredArray`)."""

    reads_whole_chunks = False

    def __init__(self, item: storage.Location, meta: PiecesArrayMetadata, located: list[torch_zip.TensorBytes],
                 fetched: ByteCounter):
        self.item = item
        self.location = item
        self.key = meta.path
        self.shape = meta.shape
        self.dtype_name = meta.dtype
        self.chunk_shape = meta.chunk_shape
        self._row = dtypes.by_name(meta.dtype)
        self._pieces = list(zip(meta.pieces, located))
        self._local = {p.file: item.local_file(p.file) for p in meta.pieces}
        self._fetched = fetched

    def read(self, regions: Sequence[Index], empty: Empty = np.empty) -> dict[Index, PiecesRead]:
        """Start reading each region into a buffer from `empty`. The boxes every region needs of one local piece
        are read by one task, which reads each of the piece's bytes once."""
        local: dict[int, tuple[list, list[PiecesRead]]] = {}  # piece -> its boxes, the reads that need them
        reads = {region: self._read(region, empty, local) for region in regions}
        for i, (boxes, users) in local.items():
            piece, data = self._pieces[i]
            future = _POOL.submit(read_boxes, self._local[piece.file], self._start(data), piece.sizes, boxes,
                                  self._where(piece))
            for read in users:
                read.copies.append(future)
        return reads

    def read_index(self, index: tuple[slice | int, ...]) -> Picked:
        """Start reading `index` (normalized integers and slices, strides allowed): its bounding box, indexed."""
        box, within = index_box(index, self.shape)
        return Picked(self.read([box])[box], within)

    def _start(self, data: torch_zip.TensorBytes) -> int:
        """Where the piece's first element is in its file."""
        return data.offset + data.storage_offset * self._row.itemsize

    def _where(self, piece) -> str:  # noqa: ANN001
        return f"{self.item.child(piece.file)} [{self.key} chunk at {list(piece.offsets)}]"

    def _read(self, region: Index, empty: Empty, local: dict[int, tuple[list, list[PiecesRead]]]) -> PiecesRead:
        out_shape = tuple(b - a for a, b in region)
        out = empty(out_shape, self._row.copy_dtype)
        read = PiecesRead(self, out)
        if out.size == 0:
            return read
        itemsize = self._row.itemsize
        for i, (piece, data) in enumerate(self._pieces):
            overlap = tuple((max(a, o), min(b, o + n)) for (a, b), o, n in zip(region, piece.offsets, piece.sizes))
            if any(a >= b for a, b in overlap):
                continue
            box = tuple((a - o, b - o) for (a, b), o in zip(overlap, piece.offsets))
            out_start = tuple(a - r for (a, _), (r, _) in zip(overlap, region))
            where = self._where(piece)
            if not data.contiguous:
                self._fetched.add(data.storage_bytes)
                read.copies.append(_POOL.submit(self._copy_strided, piece.file, data, box, out, out_start, where))
                continue
            if self._local[piece.file] is not None:
                self._fetched.add(math.prod(b - a for a, b in box) * itemsize)
                boxes, users = local.setdefault(i, ([], []))
                target = (*(slice(s, s + b - a) for s, (a, b) in zip(out_start, box)), ...)  # a view, 0-d too
                boxes.append((box, out[target]))
                users.append(read)
            else:
                runs = runs_between(piece.sizes, box, itemsize, self._start(data), out_shape, out_start)
                requests = requests_of(runs)
                self._fetched.add(sum(stop - start for start, stop, _ in requests))
                read.requests += [(request, self.item.read_range(piece.file, request[0], request[1]), where)
                                  for request in requests]
        return read

    def _copy_strided(self, file: str, data: torch_zip.TensorBytes, box: Index, out: np.ndarray,
                      out_start: tuple[int, ...], where: str) -> None:
        try:
            raw = self.item.read_range(file, data.offset, data.offset + data.storage_bytes).result()
        except storage.RangeNotSatisfiableError:
            raise CorruptCheckpointError(f"{where}: the file ends before the tensor's data") from None
        if raw is None or len(raw) != data.storage_bytes:
            raise CorruptCheckpointError(f"{where}: the file ends before the tensor's data")
        flat = np.frombuffer(raw, dtype=out.dtype)
        itemsize = out.dtype.itemsize
        view = np.lib.stride_tricks.as_strided(flat[data.storage_offset:], shape=data.size,
                                               strides=tuple(s * itemsize for s in data.stride), writeable=False)
        target = tuple(slice(s, s + b - a) for s, (a, b) in zip(out_start, box))
        out[target] = view[tuple(slice(a, b) for a, b in box)]


class PiecesRead:
    """A region read in flight: positioned reads and copies on the pool, ranged requests elsewhere."""

    def __init__(self, array: PiecesArray, out: np.ndarray):
        self.array, self.out = array, out
        self.copies: list[Future] = []
        self.requests: list[tuple[tuple, object, str]] = []

    def result(self) -> np.ndarray:
        where = f"{self.array.item} [{self.array.key}]"
        try:
            for copy in self.copies:
                copy.result()
            flat = self.out.reshape(-1).view(np.uint8)
            for (start, _, runs), pending, where in self.requests:
                data = pending.result()
                if data is None:
                    raise CorruptCheckpointError(f"{where}: the file disappeared")
                buffer = np.frombuffer(data, dtype=np.uint8)
                if buffer.size < runs[-1][0] + runs[-1][1] - start:
                    raise CorruptCheckpointError(f"{where}: the file ends before the tensor's data")
                for source, length, target in runs:
                    flat[target:target + length] = buffer[source - start:source - start + length]
        except storage.RangeNotSatisfiableError as exc:
            raise CorruptCheckpointError(f"{where}: the file ends before the tensor's data") from exc
        except CheckpointError:
            raise
        except OSError as exc:
            raise StorageError(f"cannot read {where}: {exc}") from exc
        return self.out.view(self.array._row.numpy)

