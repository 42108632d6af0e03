"""Reading a restore's arrays batch by batch and building its values (`read_arrays`, called by
`restoring.read_item`): each batch of `read_jobs.schedule` read into one of two reused batch buffers
(`core.buffers.Carved`) or, in a restore in place, straight into the target's memory, the next batch's reads
overlapping this one's building, one transfer to the devices running while the next tensor is copied, and under a
host budget the freed memory returned to the OS between batches. With single-replica reads, each batch is settled
with the other processes first (`replica_reads.Exchange`). What the reads did is counted by path (`PATHS`). Blocks.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .. import arrays, storage, targets
from ..core import buffers, dtypes, host_memory, layout, tree
from ..core.errors import CheckpointError, CorruptCheckpointError
from ..core.events import RESTORE_BATCH_ISSUED, RESTORE_BATCH_SETTLED, RESTORE_BUILT, Emitter
from ..options import RestoreOptions
from . import read_jobs, replica_reads
from .read_jobs import ReadJob

# What `read_arrays` counts of the paths its reads take (``restore_finished``'s ``paths``, with the local reads').
PATHS = ("batches", "read_ahead", "batch_buffer_bytes", "batch_buffer_allocations", "batch_buffer_frees",
         "own_buffer_bytes", "into_target_bytes", "memory_returns")


def read_arrays(loc: storage.Location, reader: arrays.ArrayReader, jobs: Sequence[ReadJob], options: RestoreOptions,
                take: Callable[[dict], None] | None = None, *, release_targets: bool = False,
                exchange: replica_reads.Exchange | None = None,
                into: Mapping[layout.KeyPath, torch.Tensor] | None = None, events: Emitter | None = None,
                paths: Counter[str] | None = None) -> dict:
    """Read every job's regions and build its tensor, batch by batch as `read_jobs.schedule` plans them: the
    reads of the next batch overlap building this one (unless both exceed `options.max_host_bytes`), one
    transfer to the devices runs while the next tensor is copied, and under a budget the freed host memory is
    returned to the OS after a batch unless the next batch fits beside it (`host_memory`). Every array is opened
    by `reader`. The tensors are returned, or with `take` handed to it one by one (see `read_item`, also for
    `release_targets`). On error, outstanding reads are waited for before the error propagates. With an
    `exchange` (single-replica reads), the batches are the ones every process agreed on, and each is settled
    with the others (`replica_reads.Exchange`) before it is built. `into`: target tensors by key path that the
    reads may fill directly (`read_item`'s restores in place). `events` hears of each batch's reads and each
    value built and, under a budget, of each batch settled (`events.RESTORE_BATCH_ISSUED`, `RESTORE_BUILT`,
    `RESTORE_BATCH_SETTLED`); `paths` counts which paths they took."""
    _check_sizes(loc, jobs)
    events = events or Emitter()
    paths = Counter() if paths is None else paths
    schedule = read_jobs.schedule(list(jobs), options, exchange and exchange.batches)
    batches = _Batches(loc, schedule, {job.key_path: reader.open(job.meta) for job in jobs}, exchange, into,
                       events, paths)
    transfers = _Transfers()
    resident_at_start = host_memory.resident_bytes() if schedule.budget is not None else None
    results: dict[layout.KeyPath, torch.Tensor] = {}
    restored: set[layout.KeyPath] = set()
    try:
        for k, group in enumerate(schedule.groups):
            batches.issue(k)  # unless it was read ahead
            if schedule.reads_ahead(k):
                batches.issue(k + 1)
                paths["read_ahead"] += 1
            if exchange is not None:
                exchange.settle(k)
            for i, job in enumerate(group):
                value = _build(job, batches.take(k, i), release=release_targets)
                if events.listeners:
                    events.emit(RESTORE_BUILT, nbytes=job.read_bytes, details={
                        "key": tree.format_key_path(job.key_path), "batch": k, "target": job.target.NAME})
                if job.target.DEVICE_BOUND:
                    transfers.started(job.target, value)
                if take is None:
                    results[job.key_path] = value
                else:
                    take({job.key_path: value})
                restored.add(job.key_path)
            if schedule.budget is not None:
                transfers.settle()
                returned = batches.trim(k, resident_at_start)
                paths["memory_returns"] += returned
                events.emit(RESTORE_BATCH_SETTLED, details={"batch": k, "returned_memory": returned})
        if exchange is not None:
            exchange.finish()
    except BaseException as exc:
        batches.drain()
        if exchange is not None:
            exchange.abandon(exc)
        if take is not None and (restored or batches.written_into) and isinstance(exc, CheckpointError):
            unrestored = [job.key_path for job in jobs if job.key_path not in restored]
            _name_unrestored(exc, [k for k in unrestored if k not in batches.written_into],
                             [k for k in unrestored if k in batches.written_into])
        raise
    return results


def _name_unrestored(error: CheckpointError, kept: Sequence[layout.KeyPath],
                     overwritten: Sequence[layout.KeyPath]) -> None:
    """Say in `error` which targets restored in place kept their old values and which a read had started to
    write into (the others are restored)."""
    def names(keys: Sequence[layout.KeyPath]) -> str:
        return ", ".join(tree.format_key_path(k) for k in keys[:5]) + (f" and {len(keys) - 5} more"
                                                                       if len(keys) > 5 else "")

    if kept:
        error.args = (f"{error} [not restored, left as they were: {names(kept)}]", *error.args[1:])
    if overwritten:
        error.args = (f"{error} [not restored, partly overwritten by the failed reads: {names(overwritten)}]",
                      *error.args[1:])


def _check_sizes(loc: storage.Location, jobs: Sequence[ReadJob]) -> None:
    limit = _memory_limit()
    for job in jobs:
        if job.read_bytes > limit:
            raise CorruptCheckpointError(
                f"restoring {tree.format_key_path(job.key_path)} from {loc.child(job.meta.path)} would read "
                f"{job.read_bytes / 2**30:.1f} GiB at once, more than this machine's memory; a damaged checkpoint?")


class _Batches:
    """The reads of a schedule's batches: batch k is read into batch buffer ``k % 2`` (or, alone under a budget, into
    buffers of its own); a region's buffer is dropped once its tensor is built."""

    def __init__(self, loc: storage.Location, schedule: read_jobs.ReadSchedule, opened: dict,
                 exchange: replica_reads.Exchange | None, into: Mapping[layout.KeyPath, torch.Tensor] | None,
                 events: Emitter, paths: Counter[str]):
        self._loc, self._schedule, self._opened, self._exchange = loc, schedule, opened, exchange
        self._events, self._paths = events, paths
        self._buffers = (buffers.Carved(schedule.batch_bytes, paths), buffers.Carved(schedule.batch_bytes, paths))
        self._issued: dict[int, list[dict]] = {}
        self._into = into or {}
        self.written_into: set[layout.KeyPath] = set()  # targets whose own memory a read was started into

    def issue(self, k: int) -> None:
        """Start the reads of batch k, if not yet started (batch k - 2, read into the same buffer, is built)."""
        if k in self._issued:
            return
        batch = self._buffers[k % 2]
        if self._schedule.alone(k):
            batch.release()
            batch = None
        else:
            batch.reset()
        group = self._schedule.groups[k]
        into_before = set(self.written_into)
        self._issued[k] = _issue_reads(self._loc, group, self._opened, batch, self._exchange, self._into,
                                       self.written_into, self._paths)
        self._paths["batches"] += 1
        if self._events.listeners:
            into = [tree.format_key_path(job.key_path) for job in group if job.key_path in self.written_into
                    and job.key_path not in into_before]
            self._events.emit(RESTORE_BATCH_ISSUED, nbytes=self._schedule.sizes[k], details={
                "batch": k, "keys": [tree.format_key_path(job.key_path) for job in group],
                "buffers": "own" if batch is None else "batch", "into_targets": into})

    def take(self, k: int, i: int) -> dict:
        """The read regions of job i of batch k (blocks until they are read); the batch no longer holds them."""
        regions = {index: read.result() for index, read in self._issued[k][i].items()}
        self._issued[k][i] = {}
        if i == len(self._schedule.groups[k]) - 1:
            del self._issued[k]
        return regions

    def trim(self, k: int, resident_at_start: int | None) -> bool:
        """After batch k under a budget: give the freed host memory back unless the next batch fits beside it;
        whether it was given back."""
        schedule = self._schedule
        upcoming = 0
        if k + 1 < len(schedule.groups):
            if schedule.alone(k + 1):
                self._buffers[k % 2].release()  # unused until after the large tensor is placed
            upcoming = schedule.staged(k + 1) + schedule.placing(k + 1)
        return host_memory.keep_within(resident_at_start, schedule.budget - upcoming)

    def drain(self) -> None:
        """Wait for every array opening and read still in flight (after an error)."""
        outstanding = [read for reads in self._issued.values() for batch in reads for read in batch.values()]
        arrays.drain([*self._opened.values(), *outstanding])
        if self._exchange is not None:
            self._exchange.drain()


class _Transfers:
    """The placed value whose transfer to the devices may still run, and its target: torch_xla holds a host copy
    of its data until the transfer ends, so the restore waits for it before the value after the next is copied."""

    def __init__(self) -> None:
        self._running: tuple[targets.Target, Any] | None = None

    def started(self, target: targets.Target, value: Any) -> None:
        self.settle()
        self._running = (target, value)

    def settle(self) -> None:
        if self._running is not None:
            target, value = self._running
            target.settle(value)
            self._running = None


def _issue_reads(loc: storage.Location, group: Sequence[ReadJob], opened: dict,
                 batch: buffers.Carved | None, exchange: replica_reads.Exchange | None,
                 into: Mapping[layout.KeyPath, torch.Tensor], written_into: set[layout.KeyPath],
                 paths: Counter[str]) -> list[dict]:
    """Start the reads of `group` (through `exchange`, if given). Data bound for XLA devices is read into
    `batch` if given (torch_xla copies it before `_build` returns, so the buffer is free again once the group is
    built); a host target restored in place (`into`) is read into directly where it can be (`_target_memory`;
    its key is added to `written_into`); other CPU and host results own theirs. `paths` counts the bytes read
    into each kind of buffer."""
    issued = []
    for job in group:
        stored = opened[job.key_path].result()
        _check_stored(loc, job, stored)
        in_batch = batch is not None and job.target.DEVICE_BOUND
        empty = _carved_or_own(batch) if in_batch else host_memory.empty
        memory = _target_memory(job, into.get(job.key_path))
        if memory is not None:
            empty = _into(memory)
            written_into.add(job.key_path)
        paths["into_target_bytes" if memory is not None else "batch_buffer_bytes" if in_batch
              else "own_buffer_bytes"] += job.read_bytes
        issued.append(stored.read(job.reads, empty) if exchange is None else exchange.read(job, stored, empty))
    return issued


def _target_memory(job: ReadJob, target: torch.Tensor | None) -> np.ndarray | None:
    """The memory of a host target restored in place, as the buffer of its one read, or None where it cannot be
    one: another dtype than the saved one (a cast), a non-contiguous local tensor, more than one read."""
    local = None if target is None or len(job.reads) != 1 else job.target.local_memory(target)
    if local is None:
        return None
    extent = tuple(b - a for a, b in job.reads[0])
    if (local.device.type != "cpu" or local.dtype != job.dtype or job.dtype != job.meta.torch_dtype
            or not local.is_contiguous() or tuple(local.shape) != extent or local.numel() == 0
            or local.is_conj() or local.is_neg()):  # lazily conjugated or negated views: their memory is not the values
        return None
    return dtypes.tensor_to_numpy(local.detach())


def _carved_or_own(batch: buffers.Carved) -> arrays.Empty:
    """An `Empty` that cuts the regions out of `batch` while they fit, then gives arrays of their own."""
    def empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        out = batch.cut(shape, dtype)
        return np.empty(shape, dtype) if out is None else out

    return empty


def _into(memory: np.ndarray) -> arrays.Empty:
    """An `Empty` that gives `memory` for its one region (viewed as the reader's dtype of the same size)."""
    def empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if tuple(shape) == memory.shape and np.dtype(dtype).itemsize == memory.itemsize:
            return memory.view(dtype)
        return host_memory.empty(shape, dtype)

    return empty


def _check_stored(loc: storage.Location, job: ReadJob, stored: arrays.StoredArray) -> None:
    """The stored array must be the one the manifest describes (a hostile ``zarr.json`` could otherwise make
    tensorstore allocate absurd chunks)."""
    shape, dtype, chunks = stored.shape, stored.dtype_name, stored.chunk_shape
    if shape != job.meta.shape or dtype != job.meta.dtype or chunks != job.meta.chunk_shape:
        raise CorruptCheckpointError(
            f"array {loc.child(job.meta.path)} holds {dtype}{list(shape)} in chunks {list(chunks)} but "
            f"{layout.ITEM_METADATA} records {job.meta.dtype}{list(job.meta.shape)} in chunks "
            f"{list(job.meta.chunk_shape)}")


def _build(job: ReadJob, regions: dict, *, release: bool = False) -> Any:
    """The value of `job` from its read `regions`, built by its target; with `release`, a device reference's
    data is released first (see `read_item`)."""
    return job.target.build(job, regions, release=release)


def _memory_limit() -> int:
    """Physical memory of this machine: no single read may need more."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62
