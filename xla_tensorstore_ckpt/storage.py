"""Where checkpoints live: URLs to tensorstore kvstore specs, and small-file operations (read, write, list,
delete) that work the same on local disk (``/path`` or ``file://``), ``gs://bucket/prefix`` and ``memory://``.

Array data never passes through here; `arrays` opens zarr arrays on `Location.kvstore_spec()` with the shared
tensorstore context from `context()`. Functions block until done and raise `StorageError` naming the object.
They are thread-safe.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from typing import Any

import tensorstore as ts

from .errors import StorageError

_SCHEMES = ("file", "gs", "memory")


@dataclass(frozen=True)
class Location:
    """A directory in some storage: ``scheme`` is file, gs or memory; ``path`` has no trailing slash (for gs
    and memory it has no leading slash either; for file it is absolute)."""

    scheme: str
    path: str
    bucket: str = ""

    def child(self, *names: str) -> Location:
        """The location of a sub-directory (names may contain ``/``)."""
        parts = [self.path] if self.path else []
        parts.extend(n.strip("/") for n in names if n.strip("/"))
        joined = "/".join(parts)
        if self.scheme == "file" and not joined.startswith("/"):
            joined = "/" + joined
        return Location(self.scheme, joined, self.bucket)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> Location:
        head = self.path.rstrip("/").rsplit("/", 1)[0] if "/" in self.path.strip("/") else ""
        if self.scheme == "file" and not head:
            head = "/"
        return Location(self.scheme, head, self.bucket)

    @property
    def cheap_refetch(self) -> bool:
        """Whether fetching the same bytes again costs about a memory copy (local disk's page cache, memory)
        rather than a network transfer."""
        return self.scheme != "gs"

    def kvstore_spec(self) -> dict:
        """A tensorstore kvstore spec for this directory (trailing slash included)."""
        prefix = self.path.rstrip("/") + "/" if self.path.strip("/") else ""
        if self.scheme == "file":
            return {"driver": "file", "path": prefix or "/"}
        if self.scheme == "memory":
            return {"driver": "memory", "path": prefix}
        return {"driver": "gcs", "bucket": self.bucket, "path": prefix}

    def __str__(self) -> str:
        if self.scheme == "file":
            return self.path
        if self.scheme == "gs":
            return f"gs://{self.bucket}/{self.path}".rstrip("/")
        return f"memory://{self.path}"


def location(path: str | os.PathLike | Location) -> Location:
    """Parse a user path: a local path, ``file://``, ``gs://bucket/prefix`` or ``memory://prefix``."""
    if isinstance(path, Location):
        return path
    text = os.fspath(path)
    scheme, sep, rest = text.partition("://")
    if not sep:
        return Location("file", os.path.abspath(text).rstrip("/") or "/")
    if scheme not in _SCHEMES:
        raise ValueError(f"unsupported storage scheme {scheme!r} in {text!r}; use a local path, gs:// or memory://")
    if scheme == "file":
        return Location("file", os.path.abspath("/" + rest.lstrip("/")).rstrip("/") or "/")
    rest = rest.strip("/")
    if scheme == "memory":
        return Location("memory", rest)
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{text!r} names no bucket")
    return Location("gs", prefix.strip("/"), bucket)


@cache
def context() -> ts.Context:
    """The tensorstore context for array I/O (one per process, so ``memory://`` stores are shared). The file
    kvstore does not sync each file as it writes it: `sync_files` syncs a save's files together at its end,
    many at a time, while chunk files are already being written back (`start_writeback`). Local chunk files
    are read through memory maps of the page cache rather than copied into fresh buffers first (a restore from
    local disk took 1.2-1.9x as long that way); checkpoint files are never truncated in place (tensorstore
    writes a new file and renames it), so a mapping cannot lose its pages under a reader. GCS requests are
    retried with exponential backoff on transient errors (429, 5xx, dropped connections), a bounded number of
    times; the error that finally escapes names the object."""
    return ts.Context({
        "file_io_sync": False,
        "file_io_mode": {"mode": "memmap"},
        "cache_pool": {"total_bytes_limit": 0},
        "gcs_request_retries": {"max_retries": GCS_MAX_RETRIES, "initial_delay": "50ms", "max_delay": "5s"},
    })


GCS_MAX_RETRIES = 10


def sync_files(loc: Location, names: Iterable[str]) -> None:
    """Make the files `names` (relative to `loc`) durable, with every directory entry leading to them: each
    file, each directory between them and `loc`, `loc` itself and its parent are fsync'ed, many at a time.
    Exactly what the save wrote: a commit never waits for other writers' dirty data on the same file system
    (``syncfs`` did: a small save took 0.58 s instead of 0.02 s beside a process writing files, see
    benchmarks/bench_commit_latency.py). Object stores and memory: nothing to do, a completed write is durable.
    Blocks; raises `StorageError` naming the first file that could not be synced."""
    if loc.scheme != "file":
        return
    files = [os.path.join(loc.path, name) for name in names]
    directories = {loc.path, os.path.dirname(loc.path)}
    for path in files:
        parent = os.path.dirname(path)
        while len(parent) > len(loc.path):
            directories.add(parent)
            parent = os.path.dirname(parent)
    directories = {d for d in directories if os.path.isdir(d)}  # none: nothing was written there
    errors = [e for e in _FSYNC_POOL.map(_fsync_path, [*files, *sorted(directories)]) if e is not None]
    if errors:
        raise StorageError(f"cannot sync {errors[0]}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))


def _fsync_path(path: str) -> str | None:
    """fsync a file or directory; the error text instead of raising (so every path is tried)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    try:
        os.fsync(fd)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    finally:
        os.close(fd)
    return None


# fsyncs of many files at once let the file system commit its journal once for all of them.
_FSYNC_POOL = ThreadPoolExecutor(16, thread_name_prefix="xtc-fsync")


def start_writeback(loc: Location, name: str) -> None:
    """Start writing file `name`'s dirty pages to disk without waiting for them (Linux ``sync_file_range``), so
    that disk writes overlap the rest of a save and the final `sync_files` finds little left. Called from a
    background thread as each chunk file is completed. Best effort and silent by design: `sync_files` is what
    makes the data durable and reports any error. Does nothing for object stores and memory, or without the call."""
    if loc.scheme != "file" or _SYNC_FILE_RANGE is None:
        return
    try:
        fd = os.open(os.path.join(loc.path, name), os.O_RDONLY)
    except OSError:
        return  # e.g. removed by a concurrent cleanup; `sync` decides the outcome
    try:
        _SYNC_FILE_RANGE(fd, ctypes.c_int64(0), ctypes.c_int64(0), _SYNC_FILE_RANGE_WRITE)
    finally:
        os.close(fd)


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


_SYNC_FILE_RANGE = getattr(_libc(), "sync_file_range", None)
_SYNC_FILE_RANGE_WRITE = 2


def _kvstore(loc: Location) -> ts.KvStore:
    try:
        return ts.KvStore.open(loc.kvstore_spec(), context=context()).result()
    except ValueError as exc:
        raise StorageError(f"cannot open storage at {loc}: {exc}") from exc


def read(loc: Location, name: str) -> bytes | None:
    """The bytes of file `name` in directory `loc`, or None if it does not exist."""
    if loc.scheme == "file":
        try:
            with open(os.path.join(loc.path, name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageError(f"cannot read {loc.child(name)}: {exc}") from exc
    try:
        result = _kv(loc, lambda kv: kv.read(name))
    except ValueError as exc:
        raise StorageError(f"cannot read {loc.child(name)}: {exc}") from exc
    return result.value if result.state == "value" else None


def write(loc: Location, name: str, data: bytes, *, fsync: bool = True) -> None:
    """Write file `name` in `loc` atomically: readers see the old content or the new, never a part. With
    `fsync` the file is durable on return, with its directory's entries (its own, and the directory's)."""
    if loc.scheme == "file":
        target = os.path.join(loc.path, name)
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(name)}.", suffix=".tmp",
                                       dir=os.path.dirname(target))
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    if fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, target)
            except BaseException:
                _remove_quietly(tmp)
                raise
            if fsync:  # the file's directory entry, and that directory's own entry in its parent
                _fsync_dir(os.path.dirname(target))
                _fsync_dir(os.path.dirname(os.path.dirname(target)))
        except OSError as exc:
            raise StorageError(f"cannot write {target}: {exc}") from exc
        return
    try:
        _kv(loc, lambda kv: kv.write(name, data))
    except ValueError as exc:
        raise StorageError(f"cannot write {loc.child(name)}: {exc}") from exc


def create_exclusive(loc: Location, name: str, data: bytes) -> bool:
    """Create file `name` with `data` unless it exists; True if this call created it. Atomic everywhere, and
    the file is never seen without its content: a hard link on local disk, a create-if-absent precondition
    (``ifGenerationMatch=0``) on GCS, a conditional write in memory."""
    if loc.scheme == "file":
        # Written under a temporary name and hard-linked into place: the link fails if the name exists, and a
        # reader never sees the file before its content.
        target = os.path.join(loc.path, name)
        try:
            os.makedirs(loc.path, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=loc.path)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.link(tmp, target)
            except FileExistsError:
                return False
            finally:
                _remove_quietly(tmp)
        except OSError as exc:
            raise StorageError(f"cannot create {target}: {exc}") from exc
        return True
    if loc.scheme == "gs":
        # gcsfs sends the precondition with a multipart upload, which GCS and its emulator both honour
        # (the emulator ignores preconditions on tensorstore's single-part uploads).
        try:
            _gcsfs().pipe_file(f"{loc.bucket}/{loc.path}/{name}".replace("//", "/"), data, mode="create")
        except FileExistsError:
            return False
        except OSError as exc:
            raise StorageError(f"cannot create {loc.child(name)}: {exc}") from exc
        return True
    try:
        kv = _kvstore(loc)
        current = kv.read(name).result()
        if current.state != "missing":
            return False
        return bool(kv.write(name, data, if_equal=current.stamp.generation).result().generation)
    except ValueError as exc:
        raise StorageError(f"cannot create {loc.child(name)}: {exc}") from exc


def delete(loc: Location, name: str) -> None:
    """Delete file `name` in `loc` (no error if it is absent)."""
    if loc.scheme == "file":
        try:
            os.remove(os.path.join(loc.path, name))
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StorageError(f"cannot delete {loc.child(name)}: {exc}") from exc
        return
    try:
        _kv(loc, lambda kv: kv.delete_range(ts.KvStore.KeyRange(name, name + "\x00")))
    except ValueError as exc:
        raise StorageError(f"cannot delete {loc.child(name)}: {exc}") from exc


def delete_tree(loc: Location) -> None:
    """Delete the directory `loc` and everything below it (no error if it is absent)."""
    if loc.scheme == "file":
        try:
            shutil.rmtree(loc.path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StorageError(f"cannot delete {loc}: {exc}") from exc
        return
    try:
        _kv(loc, lambda kv: kv.delete_range(ts.KvStore.KeyRange()))
    except ValueError as exc:
        raise StorageError(f"cannot delete {loc}: {exc}") from exc


def _kv(loc: Location, operation: Callable[[ts.KvStore], ts.Future]) -> Any:
    """Run one kvstore operation on the directory `loc` and wait for it."""
    return operation(_kvstore(loc)).result()


def list_children(loc: Location) -> list[str]:
    """Sorted names of the files and directories directly inside `loc` (empty if `loc` does not exist). On GCS this
    is one delimited listing, not a walk over every object below."""
    if loc.scheme == "file":
        try:
            return sorted(entry.name for entry in os.scandir(loc.path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise StorageError(f"cannot list {loc}: {exc}") from exc
    if loc.scheme == "gs":
        prefix = f"{loc.bucket}/{loc.path}".rstrip("/")
        try:
            entries = _gcsfs().ls(prefix, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StorageError(f"cannot list {loc}: {exc}") from exc
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != prefix})
    try:
        keys = _kv(loc, lambda kv: kv.list())
    except ValueError as exc:
        raise StorageError(f"cannot list {loc}: {exc}") from exc
    return sorted({key.decode("utf-8").split("/", 1)[0] for key in keys})


@cache
def _gcsfs():  # noqa: ANN202 - gcsfs is imported lazily: only gs:// needs it
    """A gcsfs file system for delimited listings (tensorstore's kvstore lists recursively). Credentials are
    gcsfs's defaults (application default credentials on TPU VMs); against an emulator
    (STORAGE_EMULATOR_HOST) anonymous access."""
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # else every call waits on a gRPC probe
    import gcsfs

    token = "anon" if os.environ.get("STORAGE_EMULATOR_HOST") else None
    return gcsfs.GCSFileSystem(token=token)  # retries transient HTTP errors itself (6 attempts)


def is_empty(loc: Location) -> bool:
    """True if nothing is stored under `loc`."""
    return not list_children(loc)


def exists(loc: Location) -> bool:
    """True if the directory `loc` exists (object stores have no empty directories: something is below it)."""
    if loc.scheme == "file":
        return os.path.isdir(loc.path)
    return not is_empty(loc)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
