"""A chunk's stored bytes in a local file, for `local_chunks`: where they are (`ChunkSource`: a byte range of a
file, the whole file, or inline in an OCDBT B-tree), positioned reads of them through a descriptor held open for
the chunk (`ChunkReads`: into the caller's buffers with their CRC32C computed on the way, or as a view of the
reading thread's window), and the data files one operation keeps open across chunks (`OpenFiles`). A missing or
short file is a `CorruptCheckpointError` naming the array, the chunk and the file. Called by
`local_chunks.LocalChunkReader` (locating) and `local_chunks.LocalChunkArray` (reading); blocks on the reads.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from dataclasses import dataclass
from typing import Any

import crc32c

from ..core.errors import CorruptCheckpointError
from . import page_cache
from .local_reads import COUNTS, open_for_runs, read_runs, read_window


@dataclass(frozen=True)
class ChunkSource:
    """Where one chunk's stored bytes are: `length` bytes at `offset` of the local file `file` (the whole file,
    with `whole_file`), or `inline`."""

    file: str
    offset: int
    length: int
    whole_file: bool = False
    inline: bytes | None = None
    files: OpenFiles | None = None  # keeps `file` open for the chunks after this one (a shared data file)

    @property
    def where(self) -> str:
        if self.inline is not None:
            return "inline in the array store"
        return f"{self.file} at byte {self.offset}" if self.offset else self.file


class ChunkReads:
    """Positioned reads of one chunk's stored bytes (a context manager holding the file open)."""

    def __init__(self, source: ChunkSource, array: Any, key: str):  # array: a LocalChunkArray
        self.source = source
        self._what = f"array {array.location}: chunk {key}"
        self._fd: int | None = None

    def __enter__(self) -> ChunkReads:
        source = self.source
        if source.inline is not None:
            return self
        try:
            self._fd, size = source.files.get(source.file) if source.files is not None else open_sized(source.file)
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"{self._what} is missing ({source.file})") from exc
        if size != source.length if source.whole_file else size < source.offset + source.length:
            self.__exit__()
            raise CorruptCheckpointError(f"{self._what} should be {source.length} bytes at byte "
                                         f"{source.offset} of {source.file}, which holds {size}")
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._fd is not None and self.source.files is None:
            os.close(self._fd)
            COUNTS.add(files_closed=1)
        self._fd = None

    def read_into(self, buffers: list, at: int, *, checksummed: int = 0) -> int:
        """Fill `buffers` (writable buffers, in order) from `at` bytes into the chunk; return the CRC32C of the
        first `checksummed` buffers' bytes (0 if none), computed as they are read."""
        views = [memoryview(b).cast("B") for b in buffers]
        if self.source.inline is not None:
            checksum = 0
            for i, view in enumerate(views):
                view[:] = self.source.inline[at:at + len(view)]
                at += len(view)
                if i < checksummed:
                    checksum = crc32c.crc32c(view, checksum)
            return checksum
        runs, position = [], self.source.offset + at
        for view in views:
            runs.append((position, view))
            position += len(view)
        return read_runs(self.source.file, runs, f"{self._what} ({self.source.where})", fd=self._fd,
                         checksummed=checksummed)

    def view(self, at: int, nbytes: int) -> memoryview:
        """`nbytes` of the chunk from `at`, as a view valid until this thread's next read (`read_window`)."""
        if self.source.inline is not None:
            return memoryview(self.source.inline)[at:at + nbytes]
        start = self.source.offset + at
        return read_window(self._fd, start, start + nbytes, f"{self._what} ({self.source.where})")


class OpenFiles:
    """The data files one restore has open, with their sizes; shared by its reading threads. Their descriptors
    are pinned (`page_cache.pin`) while open: the probe before each of the thousands of reads from them asks
    their file system once, not each time."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def get(self, path: str) -> tuple[int, int]:
        """The descriptor and size of `path`, opened the first time. Raises OSError."""
        found = self._open.get(path)
        if found is not None:
            return found
        with self._lock:
            if path not in self._open:
                fd, size = open_sized(path)
                page_cache.pin(fd)
                self._open[path] = fd, size
            return self._open[path]

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._open.values():
                page_cache.unpin(fd)  # before its number can name another file
                os.close(fd)
            COUNTS.add(files_closed=len(self._open))
            self._open.clear()


def open_sized(path: str) -> tuple[int, int]:
    """A read-only descriptor of the regular file `path` and its size. Raises OSError (also for a FIFO or a
    device, which a read would block on or never finish)."""
    fd = open_for_runs(path, os.O_NONBLOCK)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a regular file")
    os.set_blocking(fd, True)
    COUNTS.add(files_opened=1)
    return fd, info.st_size
