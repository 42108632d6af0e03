"""OCDBT stores a saving process writes by itself, around the page cache: its chunk values appended to data files
with ``O_DIRECT`` (a file under one 8 MiB window is written buffered), then one B-tree leaf node that lists them
and the store's manifest. Local file systems only.

Through tensorstore every saved byte is copied into the page cache first, and on a VM that hands fresh memory to
its hypervisor and back, that copy is most of a save: a save of the 1 GiB workload took 4.5 s that way here and
1.4 s direct (`benchmarks/bench_direct_writes.py`). The store is an ordinary OCDBT store, as tensorstore would
write it (Orbax, tensorstore and the item's merge read it the same way): values in data files
``d/<32 hex digits>``, the B-tree node after them in the last file, and ``manifest.ocdbt`` (encoded by
tensorstore, `ocdbt.manifest_bytes`). Each chunk value is what tensorstore's zarr codecs make of it
(`encode_chunk`): the chunk's little-endian bytes, padded to the whole chunk at the array's edge (compressed into
one zstd frame where the save asks for it, `zstd`), then their CRC32C.

A `DirectStore` is written by one thread at a time (a lane of `writing.ChunkWriter`); its methods block and raise
`StorageError` naming the file. File systems without ``O_DIRECT`` (ramfs; tmpfs before Linux 6.6) are written
buffered, the same way.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import crc32c
import numpy as np

from ..core import buffers, tunables
from ..core.errors import StorageError
from . import ocdbt, zstd
from .local_reads import ALIGN, copy_bytes

_BTREE_MAGIC = 0x0CDB20DE
_INLINE, _INDIRECT = 0, 1  # value kinds: in the B-tree node, in a data file


def encode_chunk(data: np.ndarray, chunk_shape: Sequence[int], zstd_level: int | None = None) -> list[memoryview]:
    """The stored value of one zarr chunk under this library's codecs (``bytes`` little endian, then ``zstd`` at
    `zstd_level` if given, then ``crc32c``), as the parts to write: the chunk's bytes (`data` padded with zeros,
    the fill value, to `chunk_shape` where it lies at the array's edge), compressed if asked, and the checksum of
    what is stored. Copies only to pad, to make `data` contiguous, or to compress."""
    if data.dtype.itemsize in (1, 2, 4, 8):  # as unsigned integers: numpy copies ml_dtypes (bfloat16) per element
        data = data.view(np.dtype(f"u{data.dtype.itemsize}"))
    if data.shape != tuple(chunk_shape):
        full = np.zeros(tuple(chunk_shape), data.dtype)
        full[tuple(slice(0, n) for n in data.shape)] = data
        data = full
    raw = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    if zstd_level is not None:
        raw = memoryview(zstd.compress(raw, zstd_level))
    return [raw, memoryview(struct.pack("<I", crc32c.crc32c(raw)))]


class DirectStore:
    """One OCDBT store (the directory `path`) written by this process alone: `put` adds values, `finish` writes
    the B-tree node and the manifest, after which tensorstore can open it. Values of at most
    `ocdbt.MAX_INLINE_VALUE_BYTES` are kept in the node, as tensorstore keeps them; larger ones are appended to
    data files of about `data_file_bytes` each (a value is never split). After any failure the store is closed
    and stays unfinished (no manifest); every later call raises the same `StorageError`."""

    def __init__(self, path: str, *, data_file_bytes: int, buffered: bool = False):
        self.path = path
        self.buffered = buffered  # every file written through the page cache (`SaveOptions.page_cache`)
        self.data_file_bytes = data_file_bytes
        self.files: list[str] = []  # relative to `path`: d/<hex>
        self.entries: list[_Entry] = []
        self._file: _DataFile | None = None
        self._buffer: np.ndarray | None = None  # the data files' window (`buffers.take`), given back when done
        self.failed: StorageError | None = None

    def put(self, key: str, parts: Sequence[memoryview]) -> None:
        """Add the value of `key` (the concatenation of `parts`)."""
        self._check()
        length = sum(len(p) for p in parts)
        if length <= ocdbt.MAX_INLINE_VALUE_BYTES:
            self.entries.append(_Entry(key.encode(), -1, 0, length, b"".join(parts)))
            return
        try:
            if self._file is None or self._file.size >= self.data_file_bytes:
                self._next_file()
            offset = self._file.size
            for part in parts:
                self._file.append(part)
        except BaseException as exc:  # noqa: BLE001 - closed, then re-raised as a StorageError
            self.fail(f"cannot write {key} (or the values before it) to {self._where()}", exc)
        self.entries.append(_Entry(key.encode(), len(self.files) - 1, offset, length, None))

    def finish(self) -> None:
        """Append the B-tree leaf node to the last data file, close it and write the manifest."""
        self._check()
        try:
            location, node_bytes = None, 0
            if self.entries:  # an empty store has no B-tree node at all (an empty node is invalid)
                if self._file is None:  # every value inline
                    self._next_file()
                node = encode_leaf(sorted(self.entries), self.files)
                offset, node_bytes = self._file.size, len(node)
                self._file.append(memoryview(node))
                self._close_file()
                location = f"btreenode::{self.files[-1]}:{offset}:{node_bytes}"
            statistics = {"num_keys": len(self.entries), "num_tree_bytes": node_bytes,
                          "num_indirect_value_bytes": sum(e.length for e in self.entries if e.inline is None)}
            os.makedirs(self.path, exist_ok=True)
            _write_file(os.path.join(self.path, ocdbt.MANIFEST), ocdbt.manifest_bytes(location, statistics))
        except BaseException as exc:  # noqa: BLE001 - closed, then re-raised as a StorageError
            self.fail(f"cannot finish the array store {self.path}", exc)

    def abort(self) -> None:
        """Close the open data file, if any (a failed save); the store stays unfinished: no manifest."""
        file, self._file = self._file, None
        try:
            if file is not None:
                file.abandon()
        finally:
            self._give_back_window()

    def fail(self, what: str, exc: BaseException) -> NoReturn:
        """Give the store up after `exc` (closed, never finished) and raise it as a `StorageError` (`what`)."""
        try:
            self.abort()
        except OSError:
            pass  # the store is given up; `exc` is what the caller needs to know
        self.failed = exc if isinstance(exc, StorageError) else StorageError(f"{what}: {exc}")
        raise self.failed from exc

    def _close_file(self) -> None:
        file, self._file = self._file, None
        try:
            file.close()
        finally:
            self._give_back_window()

    def _give_back_window(self) -> None:
        """Give the window back to the pool for the next save's store (8 MiB of fresh memory per save else)."""
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            buffers.give(buffer)

    def _check(self) -> None:
        if self.failed is not None:
            raise self.failed

    def _where(self) -> str:
        return os.path.join(self.path, self.files[-1]) if self.files else self.path

    def _next_file(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.close()
        name = f"d/{secrets.token_hex(16)}"
        os.makedirs(os.path.join(self.path, "d"), exist_ok=True)
        window_bytes = tunables.get("read_window_bytes")
        if self._buffer is None:
            self._buffer = buffers.take(window_bytes)
        self.files.append(name)
        self._file = _DataFile(os.path.join(self.path, name), memoryview(self._buffer[:window_bytes]),
                               buffered=self.buffered)


@dataclass(frozen=True, order=True)
class _Entry:
    """One key of a store: its value `inline` (bytes) or `length` bytes at `offset` of data file `file`."""

    key: bytes
    file: int
    offset: int
    length: int
    inline: bytes | None


class _DataFile:
    """A new file written sequentially through an aligned window: full windows are written at aligned offsets
    (``O_DIRECT`` where the file system allows it); the last one padded, then the file cut to its size."""

    def __init__(self, path: str, window: memoryview, *, buffered: bool = False):
        self.window = window
        self.size = 0  # bytes appended
        self.filled = 0  # bytes of the window not yet written
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)  # less the umask
        # Buffered until the first full window: a file smaller than one stays in the page cache, where reading
        # it back right away costs no disk read (small saves, metadata-sized stores); larger ones go around it.
        # O_DIRECT is set on the open file: a file system that refuses it (EINVAL) has the file written buffered.
        self.direct = False
        self.may_go_direct = not buffered

    def append(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), len(self.window) - self.filled)
            copy_bytes(self.window[self.filled:self.filled + take], data[:take])
            self.filled += take
            self.size += take
            data = data[take:]
            if self.filled == len(self.window):
                if self.may_go_direct:
                    self.may_go_direct = False
                    self.direct = self._set_direct(True)
                self._flush(len(self.window))

    def close(self) -> None:
        """Write what is left and close; closes the file even if the write fails. Once only."""
        try:
            if self.filled and self.direct:
                self._flush(-(-self.filled // ALIGN) * ALIGN)
                os.ftruncate(self.fd, self.size)
            elif self.filled:
                self._flush(self.filled)
        finally:
            self.abandon()

    def abandon(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def _set_direct(self, on: bool) -> bool:
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                self.abandon()
                raise
            return False
        return on

    def _flush(self, nbytes: int) -> None:
        at = self.size - self.filled
        view = self.window[:nbytes]
        while len(view):
            try:
                n = os.pwrite(self.fd, view, at)
            except OSError as exc:
                # Near a file size limit the kernel cuts a direct write to an unaligned length and refuses it:
                # write buffered from here on, which stores the data or reports the real error.
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                self.direct = self._set_direct(False)
                continue
            view, at = view[n:], at + n
            if len(view) and self.direct and at % ALIGN:  # a short write (a full disk) left an unaligned offset
                self.direct = self._set_direct(False)
        self.filled = 0


def _write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)  # less the umask
    try:
        view = memoryview(data)
        while len(view):
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def encode_leaf(entries: Sequence[_Entry], files: Sequence[str]) -> bytes:
    """An uncompressed B-tree leaf node (OCDBT format) of `entries` (sorted by key; values inline or in a data
    file, `files` being their paths relative to the store: its data file table, base paths empty)."""
    keys = [e.key for e in entries]
    prefixes = [_common_prefix(a, b) for a, b in zip(keys, keys[1:])]
    indirect = [e for e in entries if e.inline is None]
    body = bytearray([0])  # height: a leaf
    body += _file_table([f.encode() for f in files])
    body += _varint(len(entries))
    for n in prefixes:
        body += _varint(n)
    suffixes = [k[p:] for k, p in zip(keys, [0, *prefixes])]
    for suffix in suffixes:
        body += _varint(len(suffix))
    for suffix in suffixes:
        body += suffix
    for e in entries:
        body += _varint(e.length)
    for e in entries:
        body += _varint(_INLINE if e.inline is not None else _INDIRECT)
    for e in indirect:
        body += _varint(e.file)
    for e in indirect:
        body += _varint(e.offset)
    for e in entries:
        if e.inline is not None:
            body += e.inline
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
