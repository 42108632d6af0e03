"""The restore half of an item: match the saved tree against a target, read for each local shard of each target
exactly its region (a box covering several shards is read once), and place the data: on the target's devices
with its sharding (XLA), as CPU tensors, or as the shards a `ShardedArray` target asks for.

Restoring needs no coordination between processes: each reads its own regions. Everything blocks.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from . import arrays, dtypes, formats, grid, host_memory, layout, restore_arenas, storage, tree
from .errors import (
    CorruptCheckpointError,
    KeyMismatchError,
    ShapeMismatchError,
    UnsupportedValueError,
    UsageError,
)
from .events import RESTORE_FINISHED, RESTORE_PLANNED, Emitter
from .gc_pause import paused_gc
from .options import RestoreOptions
from .plan import Index, LocalShard, Placement, TensorLayout, cpu_layout, host_layout
from .records import ArrayMetadata, ItemManifest
from .sharded_array import ShardedArray

PathLike = str | storage.Location

# Reading each target shard into its own buffer avoids cutting shards out of one large read (an extra copy, and
# large allocations that must be faulted in afresh every time); fetching a chunk twice from the page cache costs
# less than that, up to about this factor. Over a network, each chunk is fetched once.
MAX_READ_AMPLIFICATION = 2.0
SMALL_READ_BYTES = 4 << 20
XLA_PLACEMENTS = (Placement.TILED, Placement.REPLICATED, Placement.UNSHARDED)


@dataclass(frozen=True)
class RestoreAs:
    """A restore-target leaf that is not a tensor yet: restore the array with the placement (sharding and
    device) of `reference`, as `dtype`. Used to rebuild optimizer state on the sharding of its parameter."""

    reference: torch.Tensor
    dtype: torch.dtype


@dataclass(frozen=True)
class _ReadJob:
    key_path: layout.KeyPath
    meta: ArrayMetadata
    reference: torch.Tensor | ShardedArray | None  # gives sharding and device; None: a CPU tensor
    dtype: torch.dtype
    layout: TensorLayout  # where the data goes: the reference's local shards, or one whole-array shard
    max_amplification: float = MAX_READ_AMPLIFICATION  # stored bytes fetched per byte, at most, to read by shard

    @cached_property
    def reads(self) -> tuple[Index, ...]:
        """The regions to read. Each local shard is read on its own, into its own buffer that goes to the device
        as it is, unless the shards tile a box (always on a single host) and the box is small (one read beats
        many) or reading shard by shard would fetch more than `max_amplification` times the stored bytes
        (a chunk feeding several shards is fetched once per shard): then the box is read once and the shards
        are cut from it."""
        shards = self.layout.distinct_shards()
        if len(shards) <= 1:
            return tuple(s.index for s in shards)
        indices = tuple(s.index for s in shards)
        box = tuple((min(s.index[d][0] for s in shards), max(s.index[d][1] for s in shards))
                    for d in range(len(self.meta.shape)))
        box_elements = math.prod(b - a for a, b in box)
        tiled = sum(s.size for s in shards) == box_elements
        small = box_elements * dtypes.by_name(self.meta.dtype).itemsize <= SMALL_READ_BYTES
        if tiled and (small or sum(map(self._fetched, indices)) > self.max_amplification * self._fetched(box)):
            return (box,)
        return indices

    def _fetched(self, region: Index) -> int:
        """Elements of the stored chunks a read of `region` fetches (whole chunks: checksums cover a chunk)."""
        total = 1
        for (a, b), chunk, n in zip(region, self.meta.chunk_shape, self.meta.shape):
            if b <= a:
                return 0
            total *= min(n, -(-b // chunk) * chunk) - (a // chunk) * chunk
        return total

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


KeyMap = Mapping[str, str | None] | Callable[[str], str | None]


def read_item(path: PathLike, target: Any = None, *, strict: bool = True, options: RestoreOptions | None = None,
              manifest: ItemManifest | None = None, key_map: KeyMap | None = None,
              take: Callable[[dict[layout.KeyPath, Any]], None] | None = None, release_targets: bool = False,
              events: Emitter | None = None) -> dict[layout.KeyPath, Any]:
    """The restored value of every key path `restore` would fill: tensors placed like their target leaf
    (a tensor or a `RestoreAs`; CPU tensors for other leaves) and saved JSON values. Same errors as
    `restore`; callers that restore in place (the manager) assign the values themselves. With `key_map`, the
    checkpoint's keys are renamed first (see `renamed`); without a target the result is then keyed by
    1-tuples of the new names.

    With `take`, each restored tensor is handed to it as soon as it is placed, and not returned (the result
    holds the JSON values only): a caller that swaps them into the target at once frees the target's old
    device buffers tensor by tensor, so a restore in place needs the state plus about one tensor of device
    memory, not twice the state. With `release_targets` too (the caller replaces every target tensor with the
    value it is handed), each XLA target's device data is released once its regions are read and checked,
    right before its new value is placed: no device memory beyond the state; if placing then fails, that
    tensor is left without values. Keys and shapes are checked before anything is read; if reading fails
    later (damaged data), the tensors already handed over stay restored.

    `events` (by default `options.listeners` with the item's path) is told when the reads are planned and when
    they are done (`events.RESTORE_PLANNED`, `RESTORE_FINISHED`: the bytes this process reads)."""
    options = options or RestoreOptions()
    if release_targets and take is None:
        raise TypeError("release_targets needs take: the caller must put the new values in place")
    loc = storage.location(path)
    if isinstance(target, ShardedArray):
        raise UnsupportedValueError("the restore target must be a tree (dict, list or tuple), not a ShardedArray")
    with paused_gc():  # many small records (layouts, read plans) live until the item is read
        manifest = manifest or formats.read_item(loc)
        saved = manifest.leaves()
        if key_map is not None:
            saved = renamed(saved, key_map, dict(tree.flatten(target)) if target is not None else {}, loc)
        wanted = ({p: None for p in saved} if target is None
                  else _match(loc, saved, dict(tree.flatten(target)), strict))
        reader = arrays.reader(loc, manifest.store)
        # A reader that fetches each chunk once reads a box as cheaply as its shards one by one.
        amplification = (math.inf if reader.fetches_once
                         else MAX_READ_AMPLIFICATION if loc.capabilities.cheap_refetch else 1.0)
        jobs = read_jobs(saved, wanted, amplification)
        events = (events or Emitter(options.listeners)).bound(path=str(loc))
        planned_bytes = sum(job.read_bytes for job in jobs)
        events.emit(RESTORE_PLANNED, nbytes=planned_bytes,
                    details={"arrays": len(jobs), "chunks": sum(job.chunks_touched for job in jobs)})
        begun = time.perf_counter()
        try:
            values = read_arrays(loc, reader, jobs, options, take, release_targets=release_targets)
        finally:
            reader.close()  # every read has finished: read_arrays waits for them, also on errors
        events.emit(RESTORE_FINISHED, seconds=time.perf_counter() - begun, nbytes=planned_bytes,
                    details={"arrays": len(jobs)})
    values.update((p, saved[p]) for p in wanted if not isinstance(saved[p], ArrayMetadata))
    return values


def renamed(saved: dict, key_map: KeyMap, target: dict, loc: storage.Location) -> dict:
    """The checkpoint's leaves under the names `key_map` gives them, keyed by the target's key path of that name
    (a 1-tuple of the name where the target has none). Names are key paths joined by ``.`` (``layers.0.w``), as
    Orbax and torch ``state_dict`` keys spell them; `key_map` is a dict (names it lacks stay as they are) or a
    function; None drops a leaf. Raises `UsageError` if two checkpoint keys get the same name."""
    by_name = {layout.key_name(p): p for p in target}
    out: dict[layout.KeyPath, Any] = {}
    origin: dict[layout.KeyPath, str] = {}
    for path, leaf in saved.items():
        name = layout.key_name(path)
        new = key_map(name) if callable(key_map) else key_map.get(name, name)
        if new is None:
            continue
        if not isinstance(new, str):
            raise UsageError(f"key_map gave {new!r} for {name!r}: not a name (str) or None")
        key = by_name.get(new, (new,))
        if key in out:
            raise UsageError(f"key_map gives {origin[key]!r} and {name!r} of {loc} the same name {new!r}")
        out[key], origin[key] = leaf, name
    return out


def _match(loc: storage.Location, saved: dict, target: dict, strict: bool) -> dict:
    """Target leaves by key path, checked against the checkpoint (keys, tensor shapes)."""
    missing = tuple(tree.format_key_path(p) for p in target if p not in saved)
    unexpected = tuple(tree.format_key_path(p) for p in saved if p not in target)
    if missing or unexpected:
        message = f"checkpoint {loc} and the restore target differ: " + "; ".join(
            part for part in (
                f"missing from the checkpoint: {', '.join(missing)}" if missing else "",
                f"not in the target: {', '.join(unexpected)}" if unexpected else "") if part)
        if strict:
            raise KeyMismatchError(message + " (pass strict=False to restore the common keys)",
                                   missing=missing, unexpected=unexpected)
        warnings.warn(message + "; restoring the common keys", stacklevel=4)
    wanted = {}
    for path, value in target.items():
        if path not in saved:
            continue
        stored = saved[path]
        reference = value.reference if isinstance(value, RestoreAs) else value
        if isinstance(reference, (torch.Tensor, ShardedArray)):
            if not isinstance(stored, ArrayMetadata):
                raise UnsupportedValueError(
                    f"cannot restore {tree.format_key_path(path)} from {loc}: the checkpoint holds the value "
                    f"{stored!r}, the target an array")
            if tuple(reference.shape) != stored.shape:
                raise ShapeMismatchError(
                    f"cannot restore {tree.format_key_path(path)}: checkpoint shape {stored.shape} at "
                    f"{loc.child(stored.path)} does not match target shape {tuple(reference.shape)}",
                    key=tree.format_key_path(path), saved_shape=stored.shape, target_shape=tuple(reference.shape))
        wanted[path] = value if isinstance(value, (torch.Tensor, RestoreAs, ShardedArray)) else None
    return wanted


def read_jobs(saved: dict, wanted: dict, max_amplification: float) -> list[_ReadJob]:
    """The reads of every array `wanted` asks for (target leaves by key path, as `_match` returns them): what the
    restore reads, and what `restore_plan` reports."""
    targets = {p: (t.reference, t.dtype) if isinstance(t, RestoreAs) else (t, t.dtype)
               for p, t in wanted.items() if isinstance(t, (torch.Tensor, RestoreAs, ShardedArray))}
    xla = [(p, ref) for p, (ref, _) in targets.items() if isinstance(ref, torch.Tensor) and ref.device.type == "xla"]
    layouts: dict[layout.KeyPath, TensorLayout] = {
        p: host_layout(ref) for p, (ref, _) in targets.items() if isinstance(ref, ShardedArray)}
    if xla:
        from . import sharding

        layouts.update(zip([p for p, _ in xla], sharding.layouts([t for _, t in xla])))
    jobs = []
    for path in wanted:
        meta = saved[path]
        if not isinstance(meta, ArrayMetadata):
            continue
        reference, dtype = targets.get(path, (None, meta.torch_dtype))
        if path not in layouts:
            reference = None  # a CPU tensor
        jobs.append(_ReadJob(path, meta, reference, dtype, layouts.get(path) or cpu_layout(meta.shape),
                             max_amplification))
    return jobs


def read_arrays(loc: storage.Location, reader: arrays.ArrayReader, jobs: Sequence[_ReadJob], options: RestoreOptions,
                take: Callable[[dict], None] | None = None, *, release_targets: bool = False) -> dict:
    """Read every job's regions and build its tensor; the reads of the next batch overlap building this one
    (unless both batches together exceed `options.max_host_bytes`; with a budget, each tensor's transfer to
    its devices is waited for before the one after the next is placed, and after a batch the freed host memory
    is returned to the OS unless the next batch fits beside it: see `host_memory`), every array opened by
    `reader`. The tensors are returned, or with `take` handed to
    it one by one (see `read_item`, also for `release_targets`). On error, outstanding reads are waited for
    before the error propagates."""
    limit = _memory_limit()
    for job in jobs:
        if job.read_bytes > limit:
            raise CorruptCheckpointError(
                f"restoring {tree.format_key_path(job.key_path)} from {loc.child(job.meta.path)} would read "
                f"{job.read_bytes / 2**30:.1f} GiB at once, more than this machine's memory; a damaged checkpoint?")
    opened = {job.key_path: reader.open(job.meta) for job in jobs}
    budget = options.max_host_bytes
    # Under a budget: two batches of reads in flight, torch_xla's copy of the one being placed, and glibc's slack.
    batch_bytes = min(options.read_batch_bytes, math.inf if budget is None else max(1, budget // 4))
    groups = list(grid.batches(jobs, lambda job: job.read_bytes, batch_bytes))
    sizes = [sum(job.read_bytes for job in group) for group in groups]
    # A tensor larger than a batch (a group of its own) is read into buffers of its own (not an arena); under a
    # budget the arenas not in use are given up while it is read and placed.
    alone = [budget is not None and size > batch_bytes for size in sizes]
    staged = [size if big else batch_bytes for size, big in zip(sizes, alone)]  # host bytes a batch holds
    # torch_xla copies a tensor's data on its way to the devices and holds the copy until the transfer ends;
    # under a budget one transfer runs while the next tensor is copied: its two largest tensors' bytes more.
    placing = [sum(sorted(job.read_bytes for job in group)[-2:]) for group in groups]
    arenas = (restore_arenas.Arena(batch_bytes), restore_arenas.Arena(batch_bytes))  # batch k reads into arenas[k % 2]
    resident_at_start = host_memory.resident_bytes() if budget is not None else None

    def issue(k: int) -> list[dict]:
        arena = arenas[k % 2]  # batch k - 2 read into it and is placed (or abandoned after an error)
        if alone[k]:
            arena.release()
            return _issue_reads(loc, groups[k], opened, None)
        arena.reset()
        return _issue_reads(loc, groups[k], opened, arena)

    results: dict[layout.KeyPath, torch.Tensor] = {}
    current: list[dict] = []
    following: list[dict] = []
    transferring: list[torch.Tensor] = []  # under a budget: the placed tensor whose transfer may still run

    def settle() -> None:
        if transferring:
            from . import sharding

            sharding.wait_transferred(transferring.pop())

    try:
        current = issue(0) if groups else []
        for k, group in enumerate(groups):
            ahead = k + 1 < len(groups) and (budget is None or staged[k] + placing[k] + staged[k + 1] <= budget)
            following = issue(k + 1) if ahead else []
            for i, job in enumerate(group):
                value = _build(job, {index: r.result() for index, r in current[i].items()},
                               release=release_targets)
                current[i] = {}  # its host buffers are not needed any more
                if budget is not None and job.layout.placement in XLA_PLACEMENTS:
                    settle()  # the previous tensor's: its host copy is freed
                    transferring.append(value)
                if take is None:
                    results[job.key_path] = value
                else:
                    take({job.key_path: value})
            if budget is not None:
                settle()
                upcoming = 0
                if k + 1 < len(groups):
                    if alone[k + 1]:
                        arenas[k % 2].release()  # unused until after the large tensor is placed
                    upcoming = staged[k + 1] + placing[k + 1]
                # This batch's staging copies are free: give them back unless the next batch fits beside them.
                host_memory.keep_within(resident_at_start, budget - upcoming)
            if k + 1 < len(groups) and not ahead:
                following = issue(k + 1)
            current, following = following, []
    except BaseException:
        arrays.drain([*opened.values(), *(r for reads in current + following for r in reads.values())])
        raise
    return results


def _issue_reads(loc: storage.Location, group: Sequence[_ReadJob], opened: dict,
                 arena: restore_arenas.Arena | None) -> list[dict]:
    """Start the reads of `group`. Data bound for XLA devices is read into `arena` if given (torch_xla copies
    it before `_build` returns, so the arena is free again once the group is built); CPU and host results own
    theirs."""
    issued = []
    for job in group:
        stored = opened[job.key_path].result()
        _check_stored(loc, job, stored)
        empty = arena.empty if arena is not None and job.layout.placement in XLA_PLACEMENTS else np.empty
        issued.append(stored.read(job.reads, empty))
    return issued


def _check_stored(loc: storage.Location, job: _ReadJob, stored: arrays.StoredArray) -> None:
    """The stored array must be the one the manifest describes (a hostile ``zarr.json`` could otherwise make
    tensorstore allocate absurd chunks)."""
    shape, dtype, chunks = stored.shape, stored.dtype_name, stored.chunk_shape
    if shape != job.meta.shape or dtype != job.meta.dtype or chunks != job.meta.chunk_shape:
        raise CorruptCheckpointError(
            f"array {loc.child(job.meta.path)} holds {dtype}{list(shape)} in chunks {list(chunks)} but "
            f"{layout.ITEM_METADATA} records {job.meta.dtype}{list(job.meta.shape)} in chunks "
            f"{list(job.meta.chunk_shape)}")


def _region(index: Index, reads: dict) -> Any:
    """The data of `index` (a numpy view into the read that contains it), or None for an empty shard."""
    if math.prod(b - a for a, b in index) == 0:
        return None
    for read, data in reads.items():
        if index == read:
            return data
        if all(ra <= a and b <= rb for (a, b), (ra, rb) in zip(index, read)):
            return data[tuple(slice(a - ra, b - ra) for (a, b), (ra, _) in zip(index, read))]
    raise AssertionError(f"no read covers {index}")  # the reads are planned to cover every shard


def _build(job: _ReadJob, regions: dict, *, release: bool = False) -> torch.Tensor | ShardedArray:
    """The tensor of `job` from its read `regions`; with `release`, an XLA reference's device data is released
    first (see `read_item`)."""
    saved_dtype = dtypes.by_name(job.meta.dtype).torch
    lay = job.layout
    if lay.placement is Placement.HOST:
        shards = []
        for shard in lay.shards:
            region = _region(shard.index, regions)
            data = dtypes.numpy_to_tensor(region) if region is not None else torch.empty(shard.extent,
                                                                                          dtype=saved_dtype)
            shards.append((shard.index, data.to(job.dtype).contiguous()))
        return ShardedArray(lay.shape, job.dtype, lay.shard_shape, tuple(shards))
    if lay.placement in (Placement.CPU, Placement.UNSHARDED):
        region = _region(lay.shards[0].index, regions)
        data = dtypes.numpy_to_tensor(region) if region is not None else torch.empty(lay.shape, dtype=saved_dtype)
        data = data.to(job.dtype)
        if lay.placement is Placement.CPU:
            return data
        from . import sharding

        return sharding.build(job.reference, lay, [data], release_target=release)
    padded: dict[Any, torch.Tensor] = {}
    shards = []
    for shard in lay.shards:
        if shard.index not in padded:
            padded[shard.index] = _pad(_region(shard.index, regions), shard, lay.shard_shape, saved_dtype,
                                       job.dtype)
        shards.append(padded[shard.index])
    from . import sharding

    return sharding.build(job.reference, lay, shards, release_target=release)


def _pad(region: Any, shard: LocalShard, shard_shape: tuple[int, ...], saved_dtype: torch.dtype,
         dtype: torch.dtype) -> torch.Tensor:
    """The shard's data in a buffer of the padded shard shape (XLA wants padding; its value is irrelevant)."""
    data = dtypes.numpy_to_tensor(region) if region is not None else torch.empty(shard.extent, dtype=saved_dtype)
    data = data.to(dtype)
    if tuple(data.shape) == shard_shape:
        return data
    out = torch.zeros(shard_shape, dtype=dtype)
    out[tuple(slice(0, e) for e in shard.extent)] = data
    return out


def _memory_limit() -> int:
    """Physical memory of this machine: no single read may need more."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62
