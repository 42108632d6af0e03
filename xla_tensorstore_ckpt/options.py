"""Frozen, keyword-only option records. They validate in ``__post_init__`` and never rewrite their fields."""

from __future__ import annotations

from dataclasses import dataclass

_MiB = 1 << 20


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How an item is written.

    fsync: sync every chunk file, metadata file and directory to stable storage before the save returns
        (local disk; object stores are durable once a write returns). Off trades crash durability for speed.
    host_batch_bytes: device bytes fetched to host per torch_xla call; writes of one batch overlap the fetch
        of the next. Bounds the replicas held at once when a tensor is partially replicated.
    """

    fsync: bool = True
    host_batch_bytes: int = 256 * _MiB

    def __post_init__(self) -> None:
        if not isinstance(self.fsync, bool):
            raise ValueError(f"fsync must be a bool, got {self.fsync!r}")
        _positive("host_batch_bytes", self.host_batch_bytes)


@dataclass(frozen=True, kw_only=True)
class RestoreOptions:
    """How an item is read.

    read_batch_bytes: bytes read per batch; the reads of one batch overlap placing the previous one on the
        devices, so host memory holds about two batches beyond the restored tensors.
    """

    read_batch_bytes: int = 256 * _MiB

    def __post_init__(self) -> None:
        _positive("read_batch_bytes", self.read_batch_bytes)
