"""A storage backend that wraps another and runs a hook before each of its operations: to fail, block or kill the
process at a named point of a save, through the storage protocol rather than the library's private functions.

Operations are named as the `Backend` methods are, with array opening as ``open_array`` (the kvstore spec is
asked for once per array opened or created). Hooks get the operation, the path and how many times the operation
has been called so far (1 for the first call).
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from xla_tensorstore_ckpt import storage
from xla_tensorstore_ckpt.storage import Backend

Hook = Callable[[str, str, int], None]


@dataclass(frozen=True, eq=False)
class HookedBackend(Backend):
    inner: Backend
    hook: Hook
    calls: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    scheme = "hooked"

    @property
    def capabilities(self):  # type: ignore[override]
        return self.inner.capabilities

    @classmethod
    def parse(cls, rest):
        raise ValueError("hooked backends are built in code, not from URLs")

    def _before(self, operation: str, path: str) -> None:
        with self.lock:
            self.calls[operation] += 1
            count = self.calls[operation]
        self.hook(operation, path, count)

    def url(self, path):
        return self.inner.url(path)

    def kvstore_spec(self, path):
        self._before("open_array", path)
        return self.inner.kvstore_spec(path)

    def read(self, path):
        self._before("read", path)
        return self.inner.read(path)

    def read_range(self, path, start, stop):
        self._before("read_range", path)
        return self.inner.read_range(path, start, stop)

    def local_file(self, path):
        return self.inner.local_file(path)

    def write(self, path, data, *, fsync):
        self._before("write", path)
        self.inner.write(path, data, fsync=fsync)

    def create_exclusive(self, path, data):
        self._before("create_exclusive", path)
        return self.inner.create_exclusive(path, data)

    def delete(self, path):
        self._before("delete", path)
        self.inner.delete(path)

    def delete_tree(self, path):
        self._before("delete_tree", path)
        self.inner.delete_tree(path)

    def list_dir(self, path):
        self._before("list_dir", path)
        return self.inner.list_dir(path)

    def exists_dir(self, path):
        self._before("exists_dir", path)
        return self.inner.exists_dir(path)

    def sync_files(self, directory, names: Iterable[str], trees: Iterable[str] = ()):
        self._before("sync_files", directory)
        self.inner.sync_files(directory, names, trees)

    def file_written(self, path):
        self._before("file_written", path)
        self.inner.file_written(path)

    def rename_dir(self, source, target):
        self._before("rename_dir", source)
        self.inner.rename_dir(source, target)


def hooked(path, hook: Hook) -> storage.Location:
    """The location `path` (any URL) seen through a `HookedBackend` running `hook`."""
    loc = storage.location(path)
    return storage.Location(HookedBackend(loc.backend, hook), loc.path)


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
