"""The tensorstore side of storage: the shared context (one per process) and a `Backend` base whose small-file
operations go through tensorstore's kvstore API. Memory and object-store backends build on it; the only module
of `storage` that imports tensorstore.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import tensorstore as ts

from ..core.errors import StorageError
from .base import Backend, Capabilities, RangeNotSatisfiableError

OBJECT_STORE_MAX_RETRIES = 10


@cache
def context() -> ts.Context:
    """The tensorstore context for array and kvstore I/O (one per process, so ``memory://`` stores are shared).

    The file kvstore does not sync each file as it writes it: `Location.sync_files` syncs a save's files
    together at its end, many at a time, while chunk files are already being written back. Local chunk files
    are read through memory maps of the page cache rather than copied into fresh buffers first (a restore from
    local disk took 1.2-1.9x as long that way); checkpoint files are never truncated in place (tensorstore
    writes a new file and renames it), so a mapping cannot lose its pages under a reader. GCS and S3 requests
    are retried with exponential backoff on transient errors (429, 503 SlowDown, 5xx, dropped connections), a
    bounded number of times; the error that finally escapes names the object."""
    return ts.Context({
        "file_io_sync": False,
        "file_io_mode": {"mode": "memmap"},
        "cache_pool": {"total_bytes_limit": 0},
        "cache_pool#ocdbt": {"total_bytes_limit": 100_000_000},  # OCDBT B-tree nodes, shared by every array
        "gcs_request_retries": {"max_retries": OBJECT_STORE_MAX_RETRIES, "initial_delay": "50ms", "max_delay": "5s"},
        "s3_request_retries": {"max_retries": OBJECT_STORE_MAX_RETRIES, "initial_delay": "50ms", "max_delay": "5s"},
    })


def operation_context() -> ts.Context:
    """A context for one save, restore or inspection: the process's shared resources (`context`: thread pools,
    file I/O settings, memory stores) with a cache of OCDBT B-tree nodes of its own. An OCDBT store cached beyond
    one operation would outlive a deletion of its directory and serve a stale manifest to the next save there."""
    return ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": 100_000_000}}, parent=context())


def without_spec(text: str) -> str:
    """A tensorstore error message without the spec dump it ends with (the status, file and OS error stay)."""
    return _SPEC_DUMP.sub("", text)


_SPEC_DUMP = re.compile(r"\s*\[tensorstore_spec='.*'\]", re.S)


class KvstoreBackend(Backend):
    """Small files through a tensorstore kvstore: atomic single-key writes, conditional creates, range
    deletes, recursive listings. Subclasses give the spec and the URL."""

    def _run(self, what: str, path: str, operation: Callable[[ts.KvStore], ts.Future]) -> Any:
        try:
            return operation(_open(self)).result()
        except ValueError as exc:
            raise StorageError(f"cannot {what} {self.url(path)}: {exc}") from exc

    def read(self, path: str) -> bytes | None:
        result = self._run("read", path, lambda kv: kv.read(path))
        return result.value if result.state == "value" else None

    def write(self, path: str, data: bytes, *, fsync: bool) -> None:
        self._run("write", path, lambda kv: kv.write(path, data))

    def read_range(self, path: str, start: int, stop: int) -> _RangeRead:
        try:
            future = _open(self).read(path, byte_range=slice(start, stop))
        except ValueError as exc:
            raise StorageError(f"cannot read {self.url(path)}: {exc}") from exc
        return _RangeRead(future, self.url(path), start, stop)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        current = self._run("read", path, lambda kv: kv.read(path))
        if current.state != "missing":
            return False
        stamp = self._run("create", path, lambda kv: kv.write(path, data, if_equal=current.stamp.generation))
        return bool(stamp.generation)  # empty: the precondition failed, someone else created it

    def delete(self, path: str) -> None:
        self._run("delete", path, lambda kv: kv.delete_range(ts.KvStore.KeyRange(path, path + "\x00")))

    def delete_tree(self, path: str) -> None:
        prefix = f"{path}/" if path else ""
        self._run("delete", path, lambda kv: kv.delete_range(
            ts.KvStore.KeyRange(prefix, prefix[:-1] + "0") if prefix else ts.KvStore.KeyRange()))

    def list_dir(self, path: str) -> list[str]:
        prefix = f"{path}/" if path else ""
        keys = self._run("list", path, lambda kv: kv.list(
            ts.KvStore.KeyRange(prefix, prefix[:-1] + "0") if prefix else ts.KvStore.KeyRange()))
        return sorted({key.decode("utf-8")[len(prefix):].split("/", 1)[0] for key in keys})

    def list_files(self, path: str) -> list[str]:
        prefix = f"{path}/" if path else ""
        keys = self._run("list", path, lambda kv: kv.list(
            ts.KvStore.KeyRange(prefix, prefix[:-1] + "0") if prefix else ts.KvStore.KeyRange()))
        return sorted(key.decode("utf-8")[len(prefix):] for key in keys)


@dataclass(frozen=True)
class BucketBackend(KvstoreBackend):
    """One bucket of an object store (``<scheme>://<bucket>/<prefix>``); paths are object names (prefixes for
    directories). Objects are written whole and never renamed; reads go over the network."""

    bucket: str
    capabilities = Capabilities(atomic_create=True, durable_writes=True, cheap_refetch=False,
                                zero_copy_writes=True, renames=False)

    @classmethod
    def parse(cls, rest: str) -> tuple[Backend, str]:
        bucket, _, prefix = rest.strip("/").partition("/")
        if not bucket:
            raise ValueError(f"{cls.scheme}://{rest} names no bucket")
        return cls(bucket), prefix.strip("/")

    def url(self, path: str) -> str:
        return f"{self.scheme}://{self.bucket}/{path}".rstrip("/")


class _RangeRead:
    """A ranged kvstore read in flight (`base.PendingBytes`)."""

    __slots__ = ("future", "url", "start", "stop")

    def __init__(self, future: ts.Future, url: str, start: int, stop: int):
        self.future, self.url, self.start, self.stop = future, url, start, stop

    def result(self) -> bytes | None:
        try:
            result = self.future.result()
        except ValueError as exc:
            text = str(exc)
            if text.startswith("OUT_OF_RANGE"):
                size = _VALUE_SIZE.search(text)
                raise RangeNotSatisfiableError(
                    f"cannot read bytes {self.start}-{self.stop} of {self.url}: it ends before",
                    size=int(size.group(1)) if size else None) from exc
            raise StorageError(f"cannot read bytes {self.start}-{self.stop} of {self.url}: {exc}") from exc
        return result.value if result.state == "value" else None


_VALUE_SIZE = re.compile(r"value of size (\d+)")


@cache
def _open(backend: KvstoreBackend) -> ts.KvStore:
    """The kvstore at the root of a backend, opened once."""
    try:
        return ts.KvStore.open(backend.kvstore_spec(""), context=context()).result()
    except ValueError as exc:
        raise StorageError(f"cannot open storage at {backend.url('')}: {exc}") from exc
