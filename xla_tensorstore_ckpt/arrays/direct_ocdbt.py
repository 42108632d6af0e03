"""OCDBT stores a saving process writes by itself, around the page cache: its chunk values appended to data files
with ``O_DIRECT``, then one B-tree leaf node that lists them and the store's manifest. Local file systems only.

Through tensorstore every saved byte is copied into the page cache first, and on a VM that hands fresh memory to
its hypervisor and back, that copy is most of a save: 1 GiB written and fsynced took 1.1-4.0 s buffered here, 0.6 s
direct (`benchmarks/bench_direct_writes.py`). The store is an ordinary OCDBT store, as tensorstore would write it
(Orbax, tensorstore and the item's merge read it the same way): values in data files ``d/<32 hex digits>``, the
B-tree node after them in the last file, and ``manifest.ocdbt`` (encoded by tensorstore, `ocdbt.manifest_bytes`).
Each chunk value is what tensorstore's zarr codecs make of it (`encode_chunk`): the chunk's little-endian bytes,
padded to the whole chunk at the array's edge, then their CRC32C.

A `DirectStore` is written by one thread at a time (a lane of `writing.ChunkWriter`); its methods block and raise
`StorageError` naming the file. File systems without ``O_DIRECT`` (tmpfs) are written buffered, the same way.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import struct
import threading
from collections.abc import Sequence

import crc32c
import numpy as np

from ..errors import StorageError
from . import ocdbt

ALIGN = 4096  # a multiple of every logical block size O_DIRECT asks for
WINDOW_BYTES = 8 << 20  # each store's aligned window: values are copied into it and written a window at a time
_BTREE_MAGIC = 0x0CDB20DE
_INDIRECT = 1  # value kind: stored in a data file
# Windows of finished stores, kept for the next save's: each would otherwise be 8 MiB of fresh memory per save.
_free_windows: list[memoryview] = []
_free_windows_lock = threading.Lock()


def encode_chunk(data: np.ndarray, chunk_shape: Sequence[int]) -> list[memoryview]:
    """The stored value of one zarr chunk under this library's codecs (``bytes`` little endian, ``crc32c``), as
    the parts to write: the chunk's bytes (`data` padded with zeros, the fill value, to `chunk_shape` where it
    lies at the array's edge) and their checksum. Copies only to pad or to make `data` contiguous."""
    if data.shape != tuple(chunk_shape):
        full = np.zeros(tuple(chunk_shape), data.dtype)
        full[tuple(slice(0, n) for n in data.shape)] = data
        data = full
    raw = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))  # bytes of any dtype (bfloat16 too)
    return [raw, memoryview(struct.pack("<I", crc32c.crc32c(raw)))]


class DirectStore:
    """One OCDBT store (the directory `path`) written by this process alone: `put` appends values, `finish`
    writes the B-tree node and the manifest, after which tensorstore can open it. Values go into data files of
    about `data_file_bytes` each (a value is never split)."""

    def __init__(self, path: str, *, data_file_bytes: int):
        self.path = path
        self.data_file_bytes = data_file_bytes
        self.files: list[str] = []  # relative to `path`: d/<hex>
        self.entries: list[tuple[bytes, int, int, int]] = []  # key, file index, offset, length
        self._file: _DataFile | None = None
        self._window: memoryview | None = None
        self.failed: StorageError | None = None

    def put(self, key: str, parts: Sequence[memoryview]) -> None:
        """Append the value of `key` (the concatenation of `parts`)."""
        self._check()
        length = sum(len(p) for p in parts)
        try:
            if self._file is None or self._file.size >= self.data_file_bytes:
                self._next_file()
            offset = self._file.size
            for part in parts:
                self._file.append(part)
        except OSError as exc:
            self.failed = StorageError(f"cannot write {key} to {self._where()}: {exc}")
            raise self.failed from exc
        self.entries.append((key.encode(), len(self.files) - 1, offset, length))

    def finish(self) -> None:
        """Append the B-tree leaf node to the last data file, close it and write the manifest."""
        self._check()
        try:
            location, node_bytes = None, 0
            if self.entries:  # an empty store has no B-tree node at all (an empty node is invalid)
                node = encode_leaf(sorted(self.entries), self.files)
                offset, node_bytes = self._file.size, len(node)
                self._file.append(memoryview(node))
                self._close_file()
                location = f"btreenode::{self.files[-1]}:{offset}:{node_bytes}"
            statistics = {"num_keys": len(self.entries), "num_tree_bytes": node_bytes,
                          "num_indirect_value_bytes": sum(e[3] for e in self.entries)}
            os.makedirs(self.path, exist_ok=True)
            _write_file(os.path.join(self.path, ocdbt.MANIFEST), ocdbt.manifest_bytes(location, statistics))
        except OSError as exc:
            self.failed = StorageError(f"cannot finish the array store {self.path}: {exc}")
            raise self.failed from exc

    def abort(self) -> None:
        """Close the open data file, if any (a failed save); the store stays unfinished: no manifest."""
        if self._file is not None:
            self._file.abandon()
            self._file = None
        self._give_back_window()

    def _close_file(self) -> None:
        self._file.close()
        self._file = None
        self._give_back_window()

    def _give_back_window(self) -> None:
        if self._window is not None:
            with _free_windows_lock:
                _free_windows.append(self._window)
            self._window = None

    def _check(self) -> None:
        if self.failed is not None:
            raise self.failed

    def _where(self) -> str:
        return os.path.join(self.path, self.files[-1]) if self.files else self.path

    def _next_file(self) -> None:
        if self._file is not None:
            self._file.close()
        name = f"d/{secrets.token_hex(16)}"
        os.makedirs(os.path.join(self.path, "d"), exist_ok=True)
        if self._window is None:
            with _free_windows_lock:
                self._window = _free_windows.pop() if _free_windows else None
            if self._window is None:
                self._window = memoryview(mmap.mmap(-1, WINDOW_BYTES))
        self.files.append(name)
        self._file = _DataFile(os.path.join(self.path, name), self._window)


class _DataFile:
    """A new file written sequentially through an aligned window: full windows are written at aligned offsets
    (``O_DIRECT`` where the file system allows it); the last one padded, then the file cut to its size."""

    def __init__(self, path: str, window: memoryview):
        self.path, self.window = path, window
        self.size = 0  # bytes appended
        self.filled = 0  # bytes of the window not yet written
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.fd = os.open(path, flags, 0o644)

    def append(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), len(self.window) - self.filled)
            _copy(self.window[self.filled:self.filled + take], data[:take])
            self.filled += take
            self.size += take
            data = data[take:]
            if self.filled == len(self.window):
                self._flush(len(self.window))

    def close(self) -> None:
        try:
            if self.filled:
                self._flush(-(-self.filled // ALIGN) * ALIGN)
                os.ftruncate(self.fd, self.size)
        finally:
            os.close(self.fd)

    def abandon(self) -> None:
        os.close(self.fd)

    def _flush(self, nbytes: int) -> None:
        at = self.size - self.filled
        view = self.window[:nbytes]
        while len(view):
            n = os.pwrite(self.fd, view, at)
            view, at = view[n:], at + n
        self.filled = 0


def _copy(dest: memoryview, source: memoryview) -> None:
    """A large copy through numpy, which lets go of the GIL while it copies."""
    if len(dest) < (64 << 10):
        dest[:] = source
    else:
        np.copyto(np.frombuffer(dest, np.uint8), np.frombuffer(source, np.uint8))


def _write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while len(view):
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def encode_leaf(entries: Sequence[tuple[bytes, int, int, int]], files: Sequence[str]) -> bytes:
    """An uncompressed B-tree leaf node (OCDBT format) of `entries` (key, index into `files`, offset, length;
    sorted by key, every value in a data file); `files` are paths relative to the store (its data file table,
    base paths empty)."""
    keys = [e[0] for e in entries]
    prefixes = [_common_prefix(a, b) for a, b in zip(keys, keys[1:])]
    body = bytearray([0])  # height: a leaf
    body += _file_table([f.encode() for f in files])
    body += _varint(len(entries))
    for n in prefixes:
        body += _varint(n)
    suffixes = [k[p:] for k, p in zip(keys, [0, *prefixes])]
    for s in suffixes:
        body += _varint(len(s))
    for s in suffixes:
        body += s
    for e in entries:
        body += _varint(e[3])
    body += _varint(_INDIRECT) * len(entries)
    for e in entries:
        body += _varint(e[1])
    for e in entries:
        body += _varint(e[2])
    head = struct.pack(">I", _BTREE_MAGIC)
    tail = _varint(0) + _varint(0)  # format version 0, uncompressed
    length = len(head) + 8 + len(tail) + len(body) + 4
    node = head + struct.pack("<Q", length) + tail + bytes(body)
    return node + struct.pack("<I", crc32c.crc32c(node))


def _file_table(paths: Sequence[bytes]) -> bytes:
    prefixes = [_common_prefix(a, b) for a, b in zip(paths, paths[1:])]
    out = bytearray(_varint(len(paths)))
    for n in prefixes:
        out += _varint(n)
    suffixes = [p[n:] for p, n in zip(paths, [0, *prefixes])]
    for s in suffixes:
        out += _varint(len(s))
    out += _varint(0) * len(paths)  # base path lengths
    for s in suffixes:
        out += s
    return bytes(out)


def _common_prefix(a: bytes, b: bytes) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)
