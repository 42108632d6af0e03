"""Local file systems (``/path`` or ``file:///path``): POSIX calls for small files, tensorstore's ``file``
kvstore for arrays. Writes are made durable by fsync, of exactly the files a save wrote."""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import StorageError
from .base import Backend, Capabilities, RangeNotSatisfiableError


@dataclass(frozen=True)
class LocalBackend(Backend):
    """The machine's file system; paths are absolute."""

    scheme = "file"
    capabilities = Capabilities(atomic_create=True, durable_writes=False, cheap_refetch=True,
                                zero_copy_writes=True, renames=True)

    @classmethod
    def parse(cls, rest: str) -> tuple[Backend, str]:
        return cls(), absolute("/" + rest.lstrip("/"))

    def url(self, path: str) -> str:
        return path or "/"

    def kvstore_spec(self, path: str) -> dict:
        return {"driver": "file", "path": path.rstrip("/") + "/"}

    def read(self, path: str) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):  # a directory is no file
            return None
        except OSError as exc:
            raise StorageError(f"cannot read {path}: {exc}") from exc

    def read_range(self, path: str, start: int, stop: int) -> Future:
        # Synchronous: local readers of bulk data memory-map the file (`local_file`); this serves headers.
        done: Future = Future()
        try:
            with open(path, "rb") as f:
                data = os.pread(f.fileno(), stop - start, start)
                size = os.fstat(f.fileno()).st_size
            if len(data) < stop - start:
                raise RangeNotSatisfiableError(f"cannot read bytes {start}-{stop} of {path}: it ends before",
                                               size=size)
            done.set_result(data)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            done.set_result(None)
        except RangeNotSatisfiableError as exc:
            done.set_exception(exc)
        except OSError as exc:
            done.set_exception(StorageError(f"cannot read {path}: {exc}"))
        return done

    def local_file(self, path: str) -> str | None:
        return path

    def write(self, path: str, data: bytes, *, fsync: bool) -> None:
        directory = os.path.dirname(path)
        try:
            tmp = _temporary_copy(path, data, fsync=fsync)
            try:
                os.replace(tmp, path)
            except BaseException:
                _remove_quietly(tmp)
                raise
            if fsync:  # the file's directory entry, and that directory's own entry in its parent
                _fsync(directory)
                _fsync(os.path.dirname(directory))
        except OSError as exc:
            raise StorageError(f"cannot write {path}: {exc}") from exc

    def create_exclusive(self, path: str, data: bytes) -> bool:
        # Written under a temporary name and hard-linked into place: the link fails if the name exists, and a
        # reader never sees the file before its content.
        try:
            tmp = _temporary_copy(path, data, fsync=False)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                _remove_quietly(tmp)
        except OSError as exc:
            raise StorageError(f"cannot create {path}: {exc}") from exc
        return True

    def delete(self, path: str) -> None:
        try:
            os.remove(path)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            raise StorageError(f"cannot delete {path}: {exc}") from exc

    def delete_tree(self, path: str) -> None:
        try:
            shutil.rmtree(path)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            raise StorageError(f"cannot delete {path}: {exc}") from exc

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(entry.name for entry in os.scandir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise StorageError(f"cannot list {path}: {exc}") from exc

    def exists_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def sync_files(self, directory: str, names: Iterable[str], trees: Iterable[str] = ()) -> None:
        """fsync each file, each directory between them and `directory`, `directory` itself and its parent,
        many at a time. Exactly what the save wrote: a commit never waits for other writers' dirty data on the
        same file system (``syncfs`` did: a small save took 0.58 s instead of 0.02 s beside a process writing
        files, benchmarks/bench_commit_latency.py)."""
        files = [os.path.join(directory, name) for name in names]
        for tree in trees:
            files.extend(os.path.join(root, f) for root, _, found in os.walk(os.path.join(directory, tree))
                         for f in found)
        directories = {directory, os.path.dirname(directory)}
        for path in files:
            parent = os.path.dirname(path)
            while len(parent) > len(directory):
                directories.add(parent)
                parent = os.path.dirname(parent)
        directories = {d for d in directories if os.path.isdir(d)}  # none: nothing was written there
        errors = [e for e in _FSYNC_POOL.map(_fsync_reporting, [*files, *sorted(directories)]) if e is not None]
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise StorageError(f"cannot sync {errors[0]}{more}")

    def rename_dir(self, source: str, target: str) -> None:
        try:
            os.rename(source, target)
            _fsync(os.path.dirname(target))
        except OSError as exc:
            raise StorageError(f"cannot rename {source} to {target}: {exc}") from exc

    def file_written(self, path: str) -> None:
        """Start writing the file's dirty pages (Linux ``sync_file_range``) without waiting, so that disk writes
        overlap the rest of a save and the final `sync_files` finds little left."""
        if _SYNC_FILE_RANGE is None:
            return
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return  # e.g. removed by a concurrent cleanup; `sync_files` decides the outcome
        try:
            _SYNC_FILE_RANGE(fd, ctypes.c_int64(0), ctypes.c_int64(0), _SYNC_FILE_RANGE_WRITE)
        finally:
            os.close(fd)


def absolute(path: str) -> str:
    """A normalized absolute path without a trailing slash (``/`` for the root)."""
    return os.path.abspath(path).rstrip("/") or "/"


def _temporary_copy(path: str, data: bytes, *, fsync: bool) -> str:
    """`data` in a new temporary file beside `path` (its directory created if needed); the file's path."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        _remove_quietly(tmp)
        raise
    return tmp


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_reporting(path: str) -> str | None:
    """`_fsync`, returning the error text instead of raising (so that every path is tried)."""
    try:
        _fsync(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    return None


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


# fsyncs of many files at once let the file system commit its journal once for all of them.
_FSYNC_POOL = ThreadPoolExecutor(16, thread_name_prefix="xtc-fsync")
_SYNC_FILE_RANGE = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
_SYNC_FILE_RANGE_WRITE = 2
