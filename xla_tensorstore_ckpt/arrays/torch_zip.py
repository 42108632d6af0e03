"""Where a tensor's bytes are inside a ``torch.save`` blob (a zip archive, its records stored uncompressed): DCP
writes each tensor entry of a ``.distcp`` file as one such blob, at a byte range the ``.metadata`` records.

`locate` reads only the blob's zip directory, its ``data.pkl`` (through `torch_pickle`, which runs nothing) and
``byteorder``, then names the byte range of the storage record in the file: the tensor is read from there as
raw bytes, with no unpickling and no copy through ``torch.load``. Every number is checked against the blob's
bounds and the tensor the ``.metadata`` describes before it is used. A few small ranged reads per blob, on any
backend; no torch.
"""

from __future__ import annotations

import io
import math
import struct
import zipfile
import zlib
from dataclasses import dataclass

from ..core import dtypes, torch_pickle
from ..core.errors import CorruptCheckpointError, UnsupportedValueError
from ..storage import Location, RangeNotSatisfiableError

# The blob's first and last bytes are fetched at once: its small records come first, its zip directory last.
_WINDOW = 8192
_MAX_RECORD_BYTES = 1 << 20  # data.pkl of one tensor is ~200 bytes
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")


@dataclass(frozen=True)
class TensorBytes:
    """A tensor's elements in a file: its storage starts at `offset`; element (i, j, ...) is at storage index
    ``storage_offset + i * stride[0] + j * stride[1] + ...``."""

    offset: int
    storage_bytes: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def contiguous(self) -> bool:
        """C order, no gaps: regions read as runs of bytes."""
        expected, step = [], 1
        for n in reversed(self.size):
            expected.append(step)
            step *= n
        return all(s == e or n == 1 for s, e, n in zip(self.stride, reversed(expected), self.size))


# What `zipfile` raises on a damaged archive besides BadZipFile: an unknown "version" or compression
# (NotImplementedError), an "encrypted" record (RuntimeError), names that are not UTF-8 (UnicodeDecodeError, a
# ValueError), fields that overflow, short reads, broken deflate streams.
ZIP_ERRORS = (zipfile.BadZipFile, NotImplementedError, RuntimeError, OSError, ValueError, EOFError, OverflowError,
              struct.error, zlib.error)

def locate(directory: Location, file: str, start: int, length: int, dtype: str, size: tuple[int, ...],
           where: str) -> TensorBytes:
    """The bytes of the tensor that the ``torch.save`` blob at [`start`, `start + length`) of `file` holds,
    checked to be a tensor of `dtype` and `size` lying inside the blob. Blocks on two or three small reads.
    Raises `CorruptCheckpointError` naming `where` (missing file, truncated blob, not a zip, wrong tensor)."""
    view = _BlobView(directory, file, start, length, where)
    try:
        archive = zipfile.ZipFile(view)
    except CorruptCheckpointError:
        raise
    except ZIP_ERRORS as exc:
        raise CorruptCheckpointError(f"{where}: not a torch.save blob ({exc!r})"[:500]) from None
    names = archive.namelist()
    pickles = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise CorruptCheckpointError(f"{where}: not a torch.save blob (no single data.pkl record)")
    prefix = pickles[0][:-len("data.pkl")]
    order = _record(archive, f"{prefix}byteorder", where, required=False)
    if order is not None and order != b"little":
        raise UnsupportedValueError(f"{where}: a tensor stored {order[:10]!r}-endian; this library reads "
                                    f"little-endian data")
    tensor = torch_pickle.load_tensor_record(_record(archive, pickles[0], where), f"{where} data.pkl")
    if tensor.dtype != dtype:
        raise CorruptCheckpointError(f"{where}: holds a {tensor.dtype} tensor, the metadata says {dtype}")
    if tensor.size != size:
        raise CorruptCheckpointError(f"{where}: holds a tensor of shape {tensor.size}, the metadata says {size}")
    try:
        info = archive.getinfo(f"{prefix}data/{tensor.storage.key}")
    except KeyError:
        raise CorruptCheckpointError(f"{where}: the storage record {tensor.storage.key!r} is missing") from None
    if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
        raise CorruptCheckpointError(f"{where}: the storage record is compressed (torch.save never does)")
    header = view.pread(info.header_offset, _LOCAL_HEADER.size)
    fields = _LOCAL_HEADER.unpack(header)
    if fields[0] != b"PK\x03\x04":
        raise CorruptCheckpointError(f"{where}: damaged zip record header of the storage")
    data_start = info.header_offset + _LOCAL_HEADER.size + fields[10] + fields[11]
    if data_start + info.file_size > length:
        raise CorruptCheckpointError(f"{where}: the storage record ends past the blob")
    itemsize = dtypes.by_name(dtype).itemsize
    storage_bytes = tensor.storage.numel * (itemsize if tensor.storage.dtype is not None else 1)
    if storage_bytes != info.file_size:
        raise CorruptCheckpointError(f"{where}: the storage holds {info.file_size} bytes, its record says "
                                     f"{storage_bytes}")
    _check_extent(tensor, itemsize, storage_bytes, where)
    return TensorBytes(start + data_start, storage_bytes, tensor.storage_offset, tensor.size, tensor.stride)


def _check_extent(tensor: torch_pickle.TensorRecord, itemsize: int, storage_bytes: int, where: str) -> None:
    counts = (*tensor.size, *tensor.stride, tensor.storage_offset)
    if len(tensor.stride) != len(tensor.size) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        raise CorruptCheckpointError(f"{where}: malformed tensor record (size {tensor.size}, stride "
                                     f"{tensor.stride}, offset {tensor.storage_offset})"[:300])
    if math.prod(tensor.size) == 0:
        return
    last = tensor.storage_offset + sum((n - 1) * s for n, s in zip(tensor.size, tensor.stride))
    if (last + 1) * itemsize > storage_bytes:
        raise CorruptCheckpointError(f"{where}: the tensor's elements reach past its storage")


def _record(archive: zipfile.ZipFile, name: str, where: str, *, required: bool = True) -> bytes | None:
    try:
        info = archive.getinfo(name)
    except KeyError:
        if required:
            raise CorruptCheckpointError(f"{where}: the record {name} is missing") from None
        return None
    if info.file_size > _MAX_RECORD_BYTES:
        raise CorruptCheckpointError(f"{where}: the record {name} of {info.file_size} bytes is too large")
    try:
        return archive.read(name)
    except CorruptCheckpointError:
        raise
    except ZIP_ERRORS as exc:
        raise CorruptCheckpointError(f"{where}: cannot read the record {name} ({exc!r})"[:500]) from None


class _BlobView(io.RawIOBase):
    """The blob as a seekable file for `zipfile`: its first and last `_WINDOW` bytes fetched in one or two
    ranged reads, anything else read on demand."""

    def __init__(self, directory: Location, file: str, start: int, length: int, where: str):
        super().__init__()
        self.directory, self.file, self.start, self.length, self.where = directory, file, start, length, where
        self.position = 0
        head = min(length, _WINDOW)
        self.windows = [(0, self._fetch(0, head))]
        if length > head:
            tail = max(head, length - _WINDOW)
            self.windows.append((tail, self._fetch(tail, length)))

    def _fetch(self, begin: int, end: int) -> bytes:
        try:
            data = self.directory.read_range(self.file, self.start + begin, self.start + end).result()
        except RangeNotSatisfiableError:
            raise CorruptCheckpointError(f"{self.where}: truncated: the entry ends past the end of "
                                         f"{self.file}") from None
        if data is None:
            raise CorruptCheckpointError(f"{self.where}: the file {self.file} is missing")
        if len(data) != end - begin:
            raise CorruptCheckpointError(f"{self.where}: truncated: the entry ends past the end of {self.file}")
        return data

    def pread(self, begin: int, size: int) -> bytes:
        end = min(self.length, begin + size)
        if begin < 0 or begin > end:
            raise CorruptCheckpointError(f"{self.where}: a zip offset outside the entry")
        for at, data in self.windows:
            if at <= begin and end <= at + len(data):
                return data[begin - at:end - at]
        return self._fetch(begin, end)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = max(0, base + offset)
        return self.position

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = self.length - self.position
        data = self.pread(self.position, size) if self.position < self.length else b""
        self.position += len(data)
        return data

    def readinto(self, buffer) -> int:  # noqa: ANN001 - io's buffer protocol
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)
