"""A storage backend that wraps another and runs a hook before each of its operations: to fail, block or kill the
process at a named point of a save, through the storage protocol rather than the library's private functions.

Operations are named as the `Backend` methods are, with array opening as ``open_array`` (the kvstore spec is
asked for once per array opened or created). Hooks get the operation, the path and how many times the operation
has been called so far (1 for the first call). `hook` runs before each operation; `after`, if given, once it has
returned (not for ``open_array``, whose work happens later, in tensorstore).
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from xla_tensorstore_ckpt import storage
from xla_tensorstore_ckpt.storage import Backend

Hook = Callable[[str, str, int], None]
T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class HookedBackend(Backend):
    inner: Backend
    hook: Hook
    after: Hook | None = None
    calls: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    scheme = "hooked"

    @property
    def capabilities(self):  # type: ignore[override]
        return self.inner.capabilities

    @classmethod
    def parse(cls, rest):
        raise ValueError("hooked backends are built in code, not from URLs")

    def _before(self, operation: str, path: str) -> int:
        with self.lock:
            self.calls[operation] += 1
            count = self.calls[operation]
        self.hook(operation, path, count)
        return count

    def _around(self, operation: str, path: str, run: Callable[[], T]) -> T:
        count = self._before(operation, path)
        result = run()
        if self.after is not None:
            self.after(operation, path, count)
        return result

    def url(self, path):
        return self.inner.url(path)

    def kvstore_spec(self, path):
        self._before("open_array", path)
        return self.inner.kvstore_spec(path)

    def read(self, path):
        return self._around("read", path, lambda: self.inner.read(path))

    def read_range(self, path, start, stop):
        return self._around("read_range", path, lambda: self.inner.read_range(path, start, stop))

    def local_file(self, path):
        return self.inner.local_file(path)

    def write(self, path, data, *, fsync):
        self._around("write", path, lambda: self.inner.write(path, data, fsync=fsync))

    def create_exclusive(self, path, data):
        return self._around("create_exclusive", path, lambda: self.inner.create_exclusive(path, data))

    def delete(self, path):
        self._around("delete", path, lambda: self.inner.delete(path))

    def delete_tree(self, path):
        self._around("delete_tree", path, lambda: self.inner.delete_tree(path))

    def list_dir(self, path):
        return self._around("list_dir", path, lambda: self.inner.list_dir(path))

    def exists_dir(self, path):
        return self._around("exists_dir", path, lambda: self.inner.exists_dir(path))

    def sync_files(self, directory, names: Iterable[str], trees: Iterable[str] = ()):
        self._around("sync_files", directory, lambda: self.inner.sync_files(directory, names, trees))

    def file_written(self, path):
        self._around("file_written", path, lambda: self.inner.file_written(path))

    def rename_dir(self, source, target):
        self._around("rename_dir", source, lambda: self.inner.rename_dir(source, target))

    def replace_dir(self, source, target, *, commit_files=()):
        self._around("replace_dir", source, lambda: self.inner.replace_dir(source, target, commit_files=commit_files))

    def resolve(self, path):
        return self.inner.resolve(path)

    def is_link(self, path):
        return self.inner.is_link(path)

    def is_file(self, path):
        return self._around("is_file", path, lambda: self.inner.is_file(path))

    def list_files(self, path):
        return self._around("list_files", path, lambda: self.inner.list_files(path))

    def copy_file(self, source, target):
        self._around("copy_file", source, lambda: self.inner.copy_file(source, target))


def hooked(path, hook: Hook, after: Hook | None = None) -> storage.Location:
    """The location `path` (any URL) seen through a `HookedBackend` running `hook` (and `after`)."""
    loc = storage.location(path)
    return storage.Location(HookedBackend(loc.backend, hook, after), loc.path)


def fail_on(operation: str, error: BaseException, *, when: Callable[[str], bool] = lambda path: True) -> Hook:
    """A hook raising `error` at every call of `operation` whose path `when` accepts."""
    def hook(op: str, path: str, count: int) -> None:
        if op == operation and when(path):
            raise error
    return hook


def kill_at(point: str) -> Hook:
    """A hook that SIGKILLs the process before the N-th call of an operation: ``"write:2"``."""
    operation, count = point.rsplit(":", 1)

    def hook(op: str, path: str, n: int) -> None:
        if op == operation and n == int(count):
            os.kill(os.getpid(), signal.SIGKILL)
    return hook


def wait_for(operation: str, event: threading.Event) -> Hook:
    """A hook that blocks every call of `operation` until `event` is set."""
    def hook(op: str, path: str, count: int) -> None:
        if op == operation:
            event.wait()
    return hook
