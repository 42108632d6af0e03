"""Local file systems (``/path`` or ``file:///path``): POSIX calls for small files, tensorstore's ``file``
kvstore for arrays. Writes are made durable by fsync, of exactly the files a save wrote."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from ..core import threads
from ..core.errors import StorageError
from ..core.processes import host_tag, pid_alive
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
            fd = _open_regular(path)
            if fd is None:
                return None
            with os.fdopen(fd, "rb") as f:
                return f.read()
        except OSError as exc:
            raise StorageError(f"cannot read {path}: {exc}") from exc

    def read_range(self, path: str, start: int, stop: int) -> Future:
        # Synchronous: local readers of bulk data memory-map the file (`local_file`); this serves headers.
        done: Future = Future()
        try:
            fd = _open_regular(path)
            if fd is None:
                done.set_result(None)
                return done
            try:
                # No readahead past the range: headers read here must not fill the page cache with the data
                # after them (bulk reads bypass it where it is cold: arrays/local_reads.py).
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                size = os.fstat(fd).st_size
                if stop > size:
                    raise RangeNotSatisfiableError(f"cannot read bytes {start}-{stop} of {path}: it ends before",
                                                   size=size)
                data = os.pread(fd, stop - start, start) if stop > start else b""
            finally:
                os.close(fd)
            if len(data) < stop - start:
                raise RangeNotSatisfiableError(f"cannot read bytes {start}-{stop} of {path}: it ends before",
                                               size=size)
            done.set_result(data)
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
                fsync_path(directory)
                fsync_path(os.path.dirname(directory))
        except OSError as exc:
            raise StorageError(f"cannot write {path}: {exc}") from exc

    def remove_stale_temporaries(self, path: str) -> list[str]:
        here = host_tag()
        removed = []
        for name in self.list_dir(path):
            writer = _TEMPORARY.fullmatch(name)
            if writer is not None and writer["host"] == here and not pid_alive(int(writer["pid"])):
                _remove_quietly(os.path.join(path, name))
                removed.append(name)
        return removed

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
        """Also removes a symbolic link at `path` (only the link: nothing is ever deleted through one)."""
        try:
            _remove(path)
        except FileNotFoundError:
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
            fsync_path(os.path.dirname(target))
        except OSError as exc:
            raise StorageError(f"cannot rename {source} to {target}: {exc}") from exc

    def replace_dir(self, source: str, target: str, *, commit_files: Sequence[str] = ()) -> None:
        """Swap `source` and `target` atomically (Linux ``renameat2(RENAME_EXCHANGE)``; two renames where the
        file system cannot), then delete the old `target` from its temporary name. A symbolic link at `target`
        is replaced by the directory, never written through."""
        try:
            if not os.path.lexists(target):
                os.rename(source, target)
            elif _exchange(source, target):
                _remove(source)
            else:
                old = f"{source}.old"
                os.rename(target, old)
                os.rename(source, target)
                _remove(old)
            fsync_path(os.path.dirname(target))
        except OSError as exc:
            raise StorageError(f"cannot put {source} in place of {target}: {exc}") from exc

    def resolve(self, path: str) -> str:
        return os.path.realpath(path)

    def is_link(self, path: str) -> bool:
        return os.path.islink(path)

    def is_file(self, path: str) -> bool:
        return os.path.lexists(path) and not os.path.isdir(path)

    def list_files(self, path: str) -> list[str]:
        return sorted(os.path.relpath(os.path.join(root, f), path) for root, _, files in os.walk(path) for f in files)

    def copy_file(self, source: str, target: str) -> None:
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(source, target)
        except OSError as exc:
            raise StorageError(f"cannot copy {source} to {target}: {exc}") from exc

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


_TEMPORARY = re.compile(r"\..+\.(?P<host>[0-9a-f]{8})-(?P<pid>[0-9]+)\.[^.]+\.tmp")


def _temporary_copy(path: str, data: bytes, *, fsync: bool) -> str:
    """`data` in a new temporary file beside `path` (its directory created if needed); the file's path."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = _create_temporary(path)
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


def is_regular(path: str) -> bool:
    """True if `path` is a regular file (a symbolic link to one too), False if nothing or a directory is there.
    Anything else (a FIFO, a socket, a device) raises OSError(EINVAL): opening a FIFO blocks until a writer
    comes, reading a device may never end, and tensorstore opens the files it reads itself. Checked with `stat`
    alone, which never opens `path`. Every reader of local files it did not just write asks this first (this
    module's reads, `arrays.local_reads`, `check_tree` before tensorstore opens a directory's files)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    if stat.S_ISREG(mode):
        return True
    if stat.S_ISDIR(mode):
        return False
    raise OSError(errno.EINVAL, f"{path} is {_special_kind(mode)}, not a regular file")


def check_tree(directory: str) -> None:
    """OSError(EINVAL) naming the first entry under `directory` (symbolic links followed to what they name) that
    is neither a regular file nor a directory: called before tensorstore opens files there (an OCDBT store's data
    files, zarr chunk files), which it would block on. A listing (the entries' types come with it) and a `stat`
    per symbolic link; never opens a file. Nothing there: nothing to refuse."""
    pending = [directory]
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                pending.append(entry.path)
            elif not entry.is_file(follow_symlinks=False):  # a link, or a special file
                is_regular(entry.path)


def _special_kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), f"a special file (mode {mode:o})")


def _create_temporary(path: str) -> tuple[int, str]:
    """A new empty file beside `path` under a temporary name, and its descriptor (write-only). Created with mode
    0666, which the kernel narrows by the process's umask as for any file a user creates (``mkstemp``'s 0600
    would leave checkpoint metadata unreadable by the other users of a shared directory). The writer is in the
    name: a later manager removes what a writer that died (SIGKILL) left behind (`remove_stale_temporaries`)."""
    prefix = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{host_tag()}-{os.getpid()}.")
    while True:
        tmp = f"{prefix}{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue


def _open_regular(path: str) -> int | None:
    """A read-only descriptor of the regular file `path`; None if nothing or a directory is there. Anything
    else (a FIFO, a device, a socket) is an error (`is_regular`), checked before it is opened; the descriptor
    is checked again, for a file replaced in between."""
    if not is_regular(path):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode):
        os.set_blocking(fd, True)
        return fd
    os.close(fd)
    if stat.S_ISDIR(mode):
        return None
    raise OSError(errno.EINVAL, f"{path} is {_special_kind(mode)}, not a regular file")


def _remove(path: str) -> None:
    """Delete the directory tree, file or symbolic link (the link only) at `path`."""
    if os.path.islink(path) or not os.path.isdir(path):
        os.remove(path)
    else:
        shutil.rmtree(path)


def _exchange(a: str, b: str) -> bool:
    """Swap the entries `a` and `b` atomically; False where the file system or the C library cannot."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def fsync_path(path: str) -> None:
    """Flush a file or directory of the local file system to disk (for a directory: the names in it). Blocks;
    raises OSError."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_reporting(path: str) -> str | None:
    """`fsync_path`, returning the error text instead of raising (so that every path is tried)."""
    try:
        fsync_path(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    return None


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


# fsyncs of many files at once let the file system commit its journal once for all of them.
_FSYNC_POOL = threads.pool("storage_requests", "xtc-fsync")
_LIBC = ctypes.CDLL(None, use_errno=True)
_SYNC_FILE_RANGE = getattr(_LIBC, "sync_file_range", None)
_RENAMEAT2 = getattr(_LIBC, "renameat2", None)
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_SYNC_FILE_RANGE_WRITE = 2
