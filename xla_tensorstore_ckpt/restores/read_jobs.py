"""What a restore reads and when: one `ReadJob` per array (the regions each target shard needs, read whole or as one
covering box), grouped into batches by `schedule`, with the host memory that schedule needs. Computed from metadata
alone, so the restore (`read_batches.read_arrays`) and its dry run (`restore_plan`) share it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from .. import targets
from ..core import dtypes, grid, layout
from ..core.records import ArrayMetadata
from ..core.tensor_layout import Index, TensorLayout
from ..options import RestoreOptions

# Reading each target shard into its own buffer avoids cutting shards out of one large read (an extra copy, and
# large allocations that must be faulted in afresh every time); fetching a chunk twice from the page cache costs
# less than that, up to about this factor. Over a network, each chunk is fetched once.
MAX_READ_AMPLIFICATION = 2.0
SMALL_READ_BYTES = 4 << 20
# Host memory a restore holds per array while it runs besides the data (its records, reads and futures): a CPU
# restore of the benchmarks' 2,000 small arrays peaked 10.9 MiB above its result (benchmarks/bench_restore_memory.py).
BOOKKEEPING_BYTES_PER_ARRAY = 5 << 10


@dataclass(frozen=True)
class RestoreAs:
    """A restore-target leaf that is not a tensor yet: restore the array with the placement (sharding and
    device) of `reference`, as `dtype`. Used to rebuild optimizer state on the sharding of its parameter."""

    reference: torch.Tensor
    dtype: torch.dtype


@dataclass(frozen=True)
class ReadJob:
    """The reads of one array, and where its data goes."""

    key_path: layout.KeyPath
    meta: ArrayMetadata
    reference: Any  # the target leaf the value is placed like (a tensor, DTensor, ShardedArray), or None
    dtype: torch.dtype
    layout: TensorLayout  # where the data goes: the reference's local shards, or one whole-array CPU shard
    max_amplification: float = MAX_READ_AMPLIFICATION  # stored bytes fetched per byte, at most, to read by shard

    @cached_property
    def reads(self) -> tuple[Index, ...]:
        """The regions to read (`read_regions` of the distinct local shards)."""
        return read_regions(tuple(s.index for s in self.layout.distinct_shards()), self.meta, self.max_amplification)

    @cached_property
    def chunks_touched(self) -> int:
        """Stored chunks the reads touch (a chunk touched by two reads counts twice)."""
        total = 0
        for region in self.reads:
            count = 1
            for (a, b), chunk in zip(region, self.meta.chunk_shape):
                count *= -(-b // chunk) - a // chunk if b > a else 0
            total += count
        return total

    @cached_property
    def read_bytes(self) -> int:
        itemsize = dtypes.by_name(self.meta.dtype).itemsize
        return sum(math.prod(b - a for a, b in r) for r in self.reads) * itemsize

    @cached_property
    def copied_bytes(self) -> int:
        """Host bytes torch_xla's copy of this tensor's data holds on its way to the devices: a padded shard per
        local device (a replicated tensor's data once per device), or the whole tensor for an unsharded one;
        none for data that stays on the host (`Target.placing_elements`)."""
        return self.target.placing_elements(self.layout) * dtypes.by_torch(self.dtype).itemsize

    @cached_property
    def target(self) -> targets.Target:
        """The target (tensor kind) that builds this array's value (asked several times per array)."""
        return targets.of_layout(self.layout)


def read_regions(indices: tuple[Index, ...], meta: ArrayMetadata, amplification: float) -> tuple[Index, ...]:
    """The regions a process whose distinct shards are `indices` (sorted) reads of the array `meta`. Each
    shard is read on its own, into its own buffer that goes to the device as it is, unless the shards tile a
    box (always on a single host) and the box is small (one read beats many) or reading shard by shard would
    fetch more than `amplification` times the stored bytes (a chunk feeding several shards is fetched once per
    shard): then the box is read once and the shards are cut from it. Pure: single-replica reads compute it for
    every process (`replica_plans`)."""
    if len(indices) <= 1:
        return indices
    # Loops, not generators: a restore of thousands of small sharded arrays computes this for each.
    starts, stops, shard_elements = [a for a, _ in indices[0]], [b for _, b in indices[0]], 0
    for index in indices:
        elements = 1
        for d, (a, b) in enumerate(index):
            starts[d], stops[d], elements = min(starts[d], a), max(stops[d], b), elements * (b - a)
        shard_elements += elements
    box = tuple(zip(starts, stops))
    box_elements = math.prod(b - a for a, b in box)
    tiled = shard_elements == box_elements
    small = box_elements * dtypes.by_name(meta.dtype).itemsize <= SMALL_READ_BYTES
    if tiled and (small or sum(_fetched(meta, i) for i in indices) > amplification * _fetched(meta, box)):
        return (box,)
    return indices


def _fetched(meta: ArrayMetadata, region: Index) -> int:
    """Elements of the stored chunks a read of `region` fetches (whole chunks: checksums cover a chunk)."""
    total = 1
    for (a, b), chunk, n in zip(region, meta.chunk_shape, meta.shape):
        if b <= a:
            return 0
        total *= min(n, -(-b // chunk) * chunk) - (a // chunk) * chunk
    return total


def max_amplification(fetches_once: bool, cheap_refetch: bool) -> float:
    """How many stored bytes a restore may fetch per byte it needs to read shard by shard: any number for a
    reader that fetches each chunk once (a box costs no more than its shards), `MAX_READ_AMPLIFICATION` where
    fetching again is cheap (local files, the page cache), else 1 (object stores)."""
    return math.inf if fetches_once else MAX_READ_AMPLIFICATION if cheap_refetch else 1.0


def jobs(saved: dict, wanted: dict, max_amplification: float) -> list[ReadJob]:
    """The reads of every array `wanted` asks for (target leaves by key path, as `restoring` matches them): what the
    restore reads, and what `restore_plan` reports."""
    references: dict[layout.KeyPath, tuple[Any, torch.dtype]] = {}
    owners = []  # the target of each reference, asked once
    for p, t in wanted.items():
        ref = t.reference if isinstance(t, RestoreAs) else t
        owner = targets.of(ref)
        if owner is not None or isinstance(t, RestoreAs):  # `is_array_target`
            references[p] = ref, t.dtype
            owners.append(owner)
    layouts = dict(zip(references, targets.layouts([r for r, _ in references.values()], owners)))
    out = []
    for path in wanted:
        meta = saved[path]
        if not isinstance(meta, ArrayMetadata):
            continue
        reference, dtype = references.get(path, (None, meta.torch_dtype))
        out.append(ReadJob(path, meta, reference, dtype, layouts.get(path) or targets.cpu.layout(meta.shape),
                           max_amplification))
    return out


def is_array_target(value: Any) -> bool:
    """Whether a restore target's leaf asks for an array: a value some target claims, or a `RestoreAs`."""
    return isinstance(value, RestoreAs) or targets.of(value) is not None




@dataclass(frozen=True)
class ReadSchedule:
    """The batches a restore reads in, in order, and what each holds in host memory. Batch k reads into batch
    buffer ``k % 2`` (`core.buffers`) while batch k - 1 is built and placed; under a host budget (`budget`), a batch
    larger than `batch_bytes` (one large tensor) reads into buffers of its own instead, and the next batch is
    read ahead only if it fits beside the current one."""

    groups: tuple[tuple[ReadJob, ...], ...]
    batch_bytes: int
    budget: int | None

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sum(job.read_bytes for job in group) for group in self.groups)

    def alone(self, k: int) -> bool:
        """Whether batch k reads into buffers of its own (the batch buffers are given up meanwhile)."""
        return self.budget is not None and self.sizes[k] > self.batch_bytes

    def staged(self, k: int) -> int:
        """Host bytes batch k holds while it is read and built."""
        return self.sizes[k] if self.alone(k) else self.batch_bytes

    def placing(self, k: int) -> int:
        """Host bytes torch_xla's copies of batch k hold at once: a tensor's data is copied on its way to the
        devices and the copy lives until the transfer ends; the restore lets one transfer run while the next
        tensor is copied (`restoring`), so at most the copies of two tensors: the group's largest two, or with
        the previous group's last, whose transfer is waited for at the end of a batch only under a budget."""
        copies = [job.copied_bytes for job in self.groups[k]]
        if self.budget is None and k > 0 and self.groups[k - 1]:
            copies.append(self.groups[k - 1][-1].copied_bytes)
        return sum(sorted(copies)[-2:])

    def reads_ahead(self, k: int) -> bool:
        """Whether batch k + 1 is read while batch k is built (always, unless that would exceed the budget)."""
        return k + 1 < len(self.groups) and (
            self.budget is None or self.staged(k) + self.placing(k) + self.staged(k + 1) <= self.budget)

    @cached_property
    def peak_host_bytes(self) -> int:
        """Host memory the restore holds at most beyond the restored tensors' own: the batch buffers' touched bytes
        (each keeps the most any of its batches wrote into it), the reads of a batch that did not fit its buffer,
        and torch_xla's copies in flight, for the batch being built and the one read ahead. Data that stays on
        the host (CPU tensors, `ShardedArray`s) is the result itself."""
        touched = [0, 0]
        peak = 0
        for k in range(len(self.groups)):
            ahead = (k + 1,) if self.reads_ahead(k) else ()
            held = self.placing(k)
            for j in (k, *ahead):
                xla = self._xla_bytes(j)
                if self.alone(j):
                    touched[j % 2] = 0  # released for it
                    held += xla
                else:
                    touched[j % 2] = max(touched[j % 2], min(xla, self.batch_bytes))
                    held += max(0, xla - self.batch_bytes)
            peak = max(peak, sum(touched) + held)
        return peak + BOOKKEEPING_BYTES_PER_ARRAY * sum(map(len, self.groups))

    def _xla_bytes(self, k: int) -> int:
        """Bytes batch k reads into host buffers bound for devices (`Target.DEVICE_BOUND`)."""
        return sum(job.read_bytes for job in self.groups[k] if job.target.DEVICE_BOUND)


def batch_bytes(options: RestoreOptions) -> int:
    """The most bytes a batch reads under `options`: `read_batch_bytes`, a quarter of a `max_host_bytes` budget
    (which holds two batches, torch_xla's copies of the one being placed, and glibc's slack), and with
    single-replica reads `broadcast_max_bytes`."""
    limit = options.read_batch_bytes
    if options.max_host_bytes is not None:
        limit = min(limit, max(1, options.max_host_bytes // 4))
    if options.single_replica_reads:
        limit = min(limit, options.broadcast_max_bytes)
    return limit


def schedule(jobs: list[ReadJob], options: RestoreOptions,
             batches: Sequence[Sequence[layout.KeyPath]] | None = None) -> ReadSchedule:
    """The batches of `jobs` under `options` (of at most `batch_bytes`), or with `batches` (the key paths of each
    batch, agreed with other processes: `replica_reads`) this process's jobs of each, possibly none."""
    limit = batch_bytes(options)
    if batches is None:
        groups = tuple(tuple(g) for g in grid.batches(jobs, lambda job: job.read_bytes, limit))
    else:
        by_key = {job.key_path: job for job in jobs}
        groups = tuple(tuple(by_key[key] for key in keys if key in by_key) for keys in batches)
    return ReadSchedule(groups, limit, options.max_host_bytes)
