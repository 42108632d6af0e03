"""The storage protocol: a `Backend` holds files under string paths; a `Location` is a directory of one backend.

Every backend offers the same small-file operations (read, write, exclusive create, delete, list) and a
tensorstore kvstore spec for array data, which never passes through Python. What differs between backends is
said by their `Capabilities`, and the callers (the root lock, the commit protocol, the readers) act on those
flags, never on scheme names. Adding a backend is one module with one `Backend` subclass, one line in the
registry (`storage.register_backend`) and one subclass of the contract tests (tests/backend_contract.py).

Paths are backend-relative, ``/``-separated, without a trailing slash. Every operation blocks until done, is
thread-safe and raises `StorageError` naming the object.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar, Protocol

from ..core import threads
from ..core.errors import StorageError


class Counts:
    """Thread-safe counters named by `FIELDS`: `add` from any thread; a caller takes a `snapshot` before some
    work and `since` it after, to tell what that work did (restores report theirs in ``restore_finished``)."""

    FIELDS: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._counts = dict.fromkeys(self.FIELDS, 0)
        self._lock = threading.Lock()

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def since(self, before: dict[str, int]) -> dict[str, int]:
        """The counts added since `before` (a `snapshot`)."""
        now = self.snapshot()
        return {name: now[name] - before[name] for name in self.FIELDS}


class CallCounts(Counts):
    """What this process read through `Location`s, per call: whole-file reads (`Location.read`) and ranged
    reads (`Location.read_range`), and their bytes (a ranged read's as asked). `storage.CALLS` counts them since
    the process started."""

    FIELDS = ("whole_reads", "whole_read_bytes", "ranged_reads", "ranged_read_bytes")


CALLS = CallCounts()


class RangeNotSatisfiableError(StorageError):
    """A ranged read asked for bytes past the end of a file; `size` is the file's size where the store said."""

    def __init__(self, message: str, *, size: int | None = None):
        super().__init__(message)
        self.size = size


class PendingBytes(Protocol):
    """A ranged read in flight: `result()` blocks and returns the bytes, None if the file does not exist, or
    raises `StorageError` (`RangeNotSatisfiableError` if the file ends before the range does)."""

    def result(self) -> bytes | None: ...


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a backend guarantees.

    atomic_create: `create_exclusive` has exactly one winner among concurrent creators (the root lock relies
        on it; without it the lock is best effort).
    durable_writes: a completed write is durable; nothing is left to sync (object stores, memory).
    cheap_refetch: reading the same bytes again costs about a memory copy (page cache, memory), so a restore may
        fetch a chunk once per shard it feeds instead of once overall.
    zero_copy_writes: tensorstore may write straight from the caller's buffers (memory stores must copy: they
        would keep referencing the buffers).
    renames: a directory can be renamed atomically (local file systems), so a step can be written under a
        temporary name and renamed into place; elsewhere its commit marker is written last.
    """

    atomic_create: bool
    durable_writes: bool
    cheap_refetch: bool
    zero_copy_writes: bool
    renames: bool


class Backend(ABC):
    """One storage system (a local file system, a bucket, a memory namespace). Instances are immutable and
    compare equal when they address the same storage."""

    scheme: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    @classmethod
    @abstractmethod
    def parse(cls, rest: str) -> tuple[Backend, str]:
        """(backend, path) of a URL of this scheme without its ``scheme://``; `ValueError` if malformed."""

    @abstractmethod
    def url(self, path: str) -> str:
        """The user-facing URL of `path`."""

    @abstractmethod
    def kvstore_spec(self, path: str) -> dict:
        """A tensorstore kvstore spec of the directory `path` (trailing slash included)."""

    @abstractmethod
    def read(self, path: str) -> bytes | None:
        """The bytes of file `path`, or None if it does not exist."""

    @abstractmethod
    def write(self, path: str, data: bytes, *, fsync: bool) -> None:
        """Replace file `path` atomically: readers see the old content or the new, never a part. With `fsync`
        (where writes are not durable anyway) the file is durable on return, with its directory's entries (its
        own, and the directory's in its parent)."""

    @abstractmethod
    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create file `path` with `data` unless it exists; True if this call created it. Never visible without
        its content."""

    @abstractmethod
    def delete(self, path: str) -> None:
        """Delete file `path`; nothing happens if it is absent."""

    @abstractmethod
    def delete_tree(self, path: str) -> None:
        """Delete the directory `path` and everything below it; nothing happens if it is absent."""

    @abstractmethod
    def list_dir(self, path: str) -> list[str]:
        """Sorted names of the files and directories directly inside `path` (empty if it does not exist)."""

    @abstractmethod
    def read_range(self, path: str, start: int, stop: int) -> PendingBytes:
        """Start reading bytes [`start`, `stop`) of file `path`; many may be in flight at once."""

    def local_file(self, path: str) -> str | None:
        """The operating-system path of file `path`, for memory-mapping, where the backend is a local file
        system; None elsewhere."""
        return None

    def exists_dir(self, path: str) -> bool:
        """True if the directory `path` exists (on object stores: if anything is stored below it)."""
        return bool(self.list_dir(path))

    def sync_files(self, directory: str, names: Iterable[str],  # noqa: B027 - optional, no-op by default
                   trees: Iterable[str] = ()) -> None:
        """Make the files `names` and every file below the directories `trees` (all relative to `directory`)
        durable, with every directory entry leading to them, up to `directory` and its parent. Nothing to do
        where writes are durable."""

    def remove_stale_temporaries(self, path: str) -> list[str]:
        """Remove the temporary files directly in directory `path` that writers on this host left when they died
        mid-write (killed between writing and renaming into place); their names. Nothing to do where writes
        need no temporary file."""
        return []

    def file_written(self, path: str) -> None:  # noqa: B027 - optional, no-op by default
        """A hint that a large file at `path` is complete and will be synced: start writing it to stable
        storage now. Best effort, silent; called from a background thread."""

    def rename_dir(self, source: str, target: str) -> None:
        """Rename directory `source` to `target` (which must not exist), durably. Only where
        `capabilities.renames`."""
        raise NotImplementedError(f"{self.scheme} storage cannot rename directories")

    def resolve(self, path: str) -> str:
        """`path` with every symbolic link in it resolved (local file systems); `path` itself elsewhere."""
        return path

    def is_link(self, path: str) -> bool:
        """True if `path` itself is a symbolic link (only local file systems have them)."""
        return False

    def is_file(self, path: str) -> bool:
        """True if `path` is a file (a directory, or nothing, is not)."""
        return self.read_range(path, 0, 0).result() is not None

    def list_files(self, path: str) -> list[str]:
        """Every file below the directory `path`, as paths relative to it, sorted."""
        out = []
        for name in self.list_dir(path):
            below = self.list_files(_join(path, name))
            if below:  # a directory (object stores have no empty ones)
                out.extend(_join(name, f) for f in below)
            else:
                out.append(name)
        return sorted(out)

    def copy_file(self, source: str, target: str) -> None:
        """Copy file `source` to `target` (replacing it). Object stores copy on the server."""
        data = self.read(source)
        if data is None:
            raise StorageError(f"cannot copy {self.url(source)}: it does not exist")
        self.write(target, data, fsync=False)

    def replace_dir(self, source: str, target: str, *, commit_files: Sequence[str] = ()) -> None:
        """Put the complete directory `source` in place of `target` (which may hold an older version, or
        nothing); `source` is gone afterwards. Where the storage renames, by renaming (the local backend swaps
        the two atomically). Elsewhere by copying, in the order that keeps readers safe: `commit_files` are the
        commit markers (relative to the directory) in the order a commit writes them; the old `target`'s are
        deleted first, in reverse order, then the rest of it; `source`'s files are copied, its `commit_files`
        last, in order; then `source` is deleted. A crash in between leaves `target` uncommitted and `source`
        whole. Blocks."""
        for name in reversed(commit_files):
            self.delete(_join(target, name))
        self.delete_tree(target)
        files = self.list_files(source)
        last = [name for name in commit_files if name in files]
        with ThreadPoolExecutor(threads.count("storage_requests")) as pool:
            list(pool.map(lambda name: self.copy_file(_join(source, name), _join(target, name)),
                          [name for name in files if name not in last]))
        for name in last:
            self.copy_file(_join(source, name), _join(target, name))
        self.delete_tree(source)


@dataclass(frozen=True)
class Location:
    """A directory in some storage: a backend and a path on it. Small-file operations take names relative
    to it (which may contain ``/``)."""

    backend: Backend
    path: str

    def child(self, *names: str) -> Location:
        """The location of a sub-directory (names may contain ``/``)."""
        path = self.path
        for name in names:
            path = _join(path, name)
        return Location(self.backend, path)

    def _file(self, name: str) -> str:
        return _join(self.path, name)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> Location:
        head = self.path.rsplit("/", 1)[0] if "/" in self.path.strip("/") else ""
        if self.path.startswith("/") and not head:
            head = "/"
        return Location(self.backend, head)

    @property
    def capabilities(self) -> Capabilities:
        return self.backend.capabilities

    def kvstore_spec(self) -> dict:
        return self.backend.kvstore_spec(self.path)

    def read(self, name: str) -> bytes | None:
        data = self.backend.read(self._file(name))
        CALLS.add(whole_reads=1, whole_read_bytes=0 if data is None else len(data))
        return data

    def write(self, name: str, data: bytes, *, fsync: bool = True) -> None:
        self.backend.write(self._file(name), data, fsync=fsync)

    def read_range(self, name: str, start: int, stop: int) -> PendingBytes:
        CALLS.add(ranged_reads=1, ranged_read_bytes=stop - start)
        return self.backend.read_range(self._file(name), start, stop)

    def local_file(self, name: str) -> str | None:
        return self.backend.local_file(self._file(name))

    def create_exclusive(self, name: str, data: bytes) -> bool:
        return self.backend.create_exclusive(self._file(name), data)

    def delete(self, name: str) -> None:
        self.backend.delete(self._file(name))

    def delete_tree(self) -> None:
        self.backend.delete_tree(self.path)

    def list(self) -> list[str]:
        return self.backend.list_dir(self.path)

    def exists(self) -> bool:
        return self.backend.exists_dir(self.path)

    def is_empty(self) -> bool:
        return not self.backend.list_dir(self.path)

    def sync_files(self, names: Iterable[str], trees: Iterable[str] = ()) -> None:
        self.backend.sync_files(self.path, names, trees)

    def file_written(self, name: str) -> None:
        self.backend.file_written(self._file(name))

    def remove_stale_temporaries(self) -> list[str]:
        return self.backend.remove_stale_temporaries(self.path)

    def rename_to(self, target: Location) -> None:
        self.backend.rename_dir(self.path, target.path)

    def replace(self, target: Location, *, commit_files: Sequence[str] = ()) -> None:
        """Put this complete directory in place of `target` (`Backend.replace_dir`)."""
        self.backend.replace_dir(self.path, target.path, commit_files=commit_files)

    def resolved(self) -> Location:
        """This location with its symbolic links resolved (`Backend.resolve`)."""
        return Location(self.backend, self.backend.resolve(self.path))

    def is_link(self) -> bool:
        return self.backend.is_link(self.path)

    def is_file(self) -> bool:
        return self.backend.is_file(self.path)

    def overlaps(self, other: Location) -> bool:
        """True if `other` is this location, lies inside it, or holds it, after resolving symbolic links: a
        write to one may then change the other."""
        if self.backend != other.backend:
            return False
        a, b = self.backend.resolve(self.path).rstrip("/"), other.backend.resolve(other.path).rstrip("/")
        return a == b or not a or not b or b.startswith(a + "/") or a.startswith(b + "/")

    def __str__(self) -> str:
        return self.backend.url(self.path)


def _join(path: str, name: str) -> str:
    """`name` (which may contain ``/``) below `path`; an absolute path stays absolute."""
    name = name.strip("/")
    if not name:
        return path
    head = path.rstrip("/")
    return f"{head}/{name}" if head or path.startswith("/") else name
