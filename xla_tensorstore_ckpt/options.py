"""Frozen, keyword-only option records. They validate in ``__post_init__`` and never rewrite their fields."""

from __future__ import annotations

from dataclasses import dataclass

_MiB = 1 << 20


def _check_int(name: str, value: object, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How an item is written.

    fsync: sync every chunk file, metadata file and directory to stable storage before the save returns
        (local disk; object stores are durable once a write returns). Off trades crash durability for speed.
    host_batch_bytes: device bytes fetched to host per torch_xla call; writes of one batch overlap the fetch
        of the next. Bounds the replicas held at once when a tensor is partially replicated.
    single_file_max_bytes: an array of at most this size whose chunks are all written by this process is
        stored as one file (zarr's sharding codec, a checksum per chunk still): thousands of small tensors
        then cost thousands of files, not tens of thousands. Larger arrays keep one file per chunk, which
        tensorstore writes without assembling the whole array in memory.
    split_bytes: in a job of several processes, a tensor of at least this size that every process holds whole
        (unsharded or replicated) is cut into one chunk per process along its first dimension, so that all
        processes share its writing instead of one writing it all.
    """

    fsync: bool = True
    host_batch_bytes: int = 64 * _MiB
    single_file_max_bytes: int = 4 * _MiB
    split_bytes: int = 16 * _MiB

    def __post_init__(self) -> None:
        if not isinstance(self.fsync, bool):
            raise ValueError(f"fsync must be a bool, got {self.fsync!r}")
        _check_int("host_batch_bytes", self.host_batch_bytes)
        _check_int("single_file_max_bytes", self.single_file_max_bytes, minimum=0)
        _check_int("split_bytes", self.split_bytes)


@dataclass(frozen=True, kw_only=True)
class RestoreOptions:
    """How an item is read.

    read_batch_bytes: bytes read per batch; the reads of one batch overlap placing the previous one on the
        devices, so host memory holds about two batches beyond the restored tensors.
    """

    read_batch_bytes: int = 256 * _MiB

    def __post_init__(self) -> None:
        _check_int("read_batch_bytes", self.read_batch_bytes)
