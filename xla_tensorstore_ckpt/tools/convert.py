"""Conversion between checkpoint formats, streaming under a host-memory budget, without torch_xla.

Sources: a Hugging Face safetensors file or directory, an item of this library (any format version), an item
Orbax wrote, or one item of a step. Destinations: an item of this library in the current format (which Orbax
restores: so this is also how an older item becomes Orbax-readable), a committed step holding it, or
Hugging Face safetensors files (`export`). Arrays are copied chunk by chunk: at most `max_host_bytes` of chunk
data is read or being written at any time, and no tensor is ever held whole unless it is one chunk. Called by
``xtckpt convert``; blocks.

A zarr chunk (of our items and Orbax's) is read and decoded whole whatever part of it is asked for, so such a
source is copied stored chunk by stored chunk: each is read once, and written as the destination chunks it
holds (or several stored chunks as one destination chunk). Where the destination's chunks do not line up with
the source's, the smallest region that both grids cut exactly is read at once. A stored chunk (or such a region)
that does not fit the budget is refused before anything is written, naming the array and the budget it needs.
A safetensors tensor is raw bytes, read exactly by region: its destination chunks are any shape.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import arrays, formats, incremental, storage
from ..core import dtypes, grid, host_memory, layout, tree
from ..core.errors import UsageError
from ..core.records import ArrayMetadata, ItemManifest, StepMetadata
from ..core.sharded_array import ShardedArray
from ..multihost.distributed import Coordinator
from ..options import SaveOptions
from ..saves import commit, save_plan, writing
from ..storage import outputs
from .inspection import Progress

DEFAULT_MAX_HOST_BYTES = 2 << 30
COPIES_IN_FLIGHT = 4  # host bytes per byte of chunk data in flight, at most (measured: tests/test_convert.py)


@dataclass(frozen=True)
class ConvertOptions:
    """How `convert_item` writes.

    max_host_bytes: how much the process's resident memory may grow. A chunk in flight takes up to
        `COPIES_IN_FLIGHT` times its size (the mapped or fetched source bytes, the read buffer, the encoded
        copy, and room for the reader's and writer's own buffers), so at most a quarter of the budget is chunk
        data in flight, and a chunk may be at most that large.
    chunk_shape: the stored chunk shape, for the trailing dimensions (leading ones get 1; an array of lower
        rank takes the last entries); None: see `mesh`. From a zarr source, a shape that divides the source's
        chunks (or is a multiple of them) copies each source chunk as one unit; others need larger units.
    mesh: the stored chunk grid as the shards of a mesh: dimension i of every array is cut into ``mesh[i]``
        chunks (dimensions beyond the mesh are whole), which is how FSDP (first axis) and tensor parallelism
        (second) shard weight matrices; a restore onto that mesh reads one chunk per shard. None with no
        `chunk_shape`: the source's chunks (a safetensors tensor's are cut along the first dimension to fit
        the budget; a zarr source's are kept, and refused if they do not fit).
    use_ocdbt, fsync, compression, compression_level: as in `SaveOptions` (a compressed source is read whatever
        these say).
    """

    max_host_bytes: int = DEFAULT_MAX_HOST_BYTES
    chunk_shape: tuple[int, ...] | None = None
    mesh: tuple[int, ...] | None = None
    use_ocdbt: bool = True
    fsync: bool = True
    compression: str | None = None
    compression_level: int = SaveOptions.compression_level

    def __post_init__(self) -> None:
        try:
            SaveOptions(compression=self.compression, compression_level=self.compression_level)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        if self.max_host_bytes < COPIES_IN_FLIGHT:
            raise UsageError(f"max_host_bytes must be positive, got {self.max_host_bytes}")
        if self.chunk_shape is not None and self.mesh is not None:
            raise UsageError("give a chunk shape or a mesh, not both")
        for name in ("chunk_shape", "mesh"):
            value = getattr(self, name)
            if value is not None and (not value or any(not isinstance(n, int) or n < 1 for n in value)):
                raise UsageError(f"{name} must be positive integers, got {value!r}")

    @property
    def chunk_budget(self) -> int:
        return self.max_host_bytes // COPIES_IN_FLIGHT


def convert_item(source: storage.Location, destination: storage.Location, *, options: ConvertOptions | None = None,
                 overwrite: bool = False, progress: Progress | None = None) -> ItemManifest:
    """Copy the item at `source` (see the module) to a new item at `destination`; return its manifest.
    `progress(bytes_done, bytes_total)` is called as chunks are written. The item is written beside
    `destination` and put in its place once complete (`outputs.staged_directory`): an existing destination is
    untouched until then, and untouched if anything fails. Raises `UsageError` if `destination` is, holds or
    lies inside `source`, `CheckpointExistsError` if `destination` holds anything and not `overwrite`,
    `UsageError` (naming the array, its chunks and the budget needed) if a chunk or a unit of the copy would not
    fit the budget, all before anything is written, and what reading the source raises
    (`CorruptCheckpointError` naming file and key)."""
    options = options or ConvertOptions()
    outputs.check_separate(source, destination)
    outputs.check_vacant(destination, overwrite=overwrite)
    sources, plan, units = _prepare(source, options)
    commit_files = formats.writer(plan.manifest.format).ITEM_COMMIT_FILES
    with outputs.staged_directory(destination, overwrite=overwrite, commit_files=commit_files) as staged:
        _copy(source, sources, staged, plan, units, options, progress)
        commit.commit(Coordinator.single(), staged, {"": plan}, [], fsync=options.fsync, what=str(destination))
    return plan.manifest


def convert_to_step(source: storage.Location, step_dir: storage.Location, *, item: str = "model",
                    options: ConvertOptions | None = None, overwrite: bool = False,
                    progress: Progress | None = None) -> StepMetadata:
    """`convert_item` into item `item` of a new committed step at `step_dir` (``<root>/<step>``), which a
    `CheckpointManager` on ``<root>`` then lists and restores. The step is committed by the protocol a
    manager's steps are (`commit.commit`: the item's files, then the step's marker and Orbax's completion mark),
    under a temporary step name that a manager treats as partial, and put in place once committed. Raises as
    `convert_item` does, and `UsageError` if `step_dir` is not named by a step number."""
    return _write_step({item: source}, step_dir, None, {"converted_from": str(source)}, options, overwrite,
                       progress)


def convert_step(source: storage.Location, step_dir: storage.Location, *, items: tuple[str, ...] | None = None,
                 options: ConvertOptions | None = None, overwrite: bool = False,
                 progress: Progress | None = None) -> StepMetadata:
    """Copy the committed step at `source` (every item, or `items`) into a new standalone step at `step_dir`,
    as `convert_to_step` writes one: an incremental or delta step becomes a step holding every chunk itself,
    which Orbax restores and which no longer needs its bases. Its metrics and custom metadata are kept.
    Raises as `convert_to_step` does, and `UsageError` if `source` is not a committed step or lacks an item of
    `items`."""
    marker = formats.read_step(source, None)
    if marker is None:
        raise UsageError(f"{source} is not a committed step (it has no step marker)")
    chosen = marker.items if items is None else items
    missing = [name for name in chosen if name not in marker.items]
    if missing:
        raise UsageError(f"{source} has no item {missing[0]!r} (it holds {', '.join(marker.items)})")
    custom = {**(marker.custom or {}), "converted_from": str(source)}
    return _write_step({name: source.child(name) for name in chosen}, step_dir, marker.metrics, custom, options,
                       overwrite, progress)


def _write_step(sources: dict[str, storage.Location], step_dir: storage.Location, metrics: dict | None,
                custom: dict, options: ConvertOptions | None, overwrite: bool,
                progress: Progress | None) -> StepMetadata:
    """Each item of `sources` (name -> item) copied into a new committed step at `step_dir` (`convert_to_step`)."""
    options = options or ConvertOptions()
    step = layout.parse_step_name(step_dir.name, None, any_prefix=False)
    if step is None:
        raise UsageError(f"{step_dir}: a step directory is named by its step number (e.g. <root>/0)")
    for item, source in sources.items():
        if not layout.is_safe_relative_path(item, single=True):
            raise UsageError(f"{item!r} is not an item name (one path segment)")
        outputs.check_separate(source, step_dir)
    outputs.check_vacant(step_dir, overwrite=overwrite)
    created = time.time()
    prepared = {item: _prepare(source, options) for item, source in sources.items()}
    sizes = {item: _total(plan, units) for item, (_, plan, units) in prepared.items()}
    total = sum(sizes.values())
    fmt = formats.writer(next(iter(prepared.values()))[1].manifest.format)  # every item's: the current one
    with outputs.staged_directory(step_dir, overwrite=overwrite, step=True,
                                  commit_files=fmt.STEP_COMMIT_FILES) as staged:
        done = 0
        for item, (arrays_open, plan, units) in prepared.items():
            counted = (lambda d, _t, before=done: progress(before + d, total)) if progress else None
            _copy(sources[item], arrays_open, staged.child(item), plan, units, options, counted)
            done += sizes[item]
        marker = StepMetadata(step=step, items=tuple(sources), created_at=created, committed_at=time.time(),
                              metrics=metrics, custom=custom, versions=formats.writer_versions(),
                              format_version=fmt.VERSION)
        commit.commit(Coordinator.single(), staged, {item: plan for item, (_, plan, _) in prepared.items()},
                      formats.step_files(marker), fsync=options.fsync, what=f"step {step_dir}")
    return marker


def _prepare(source: storage.Location, options: ConvertOptions
             ) -> tuple[dict[layout.KeyPath, Any], save_plan.SavePlan, dict[layout.KeyPath, tuple[int, ...]]]:
    """The source's arrays, open, and the plan of the copy (`_plan`). Reads only metadata."""
    manifest = formats.read_item(source)
    sources = _open_sources(source, manifest)
    plan, units = _plan(manifest, sources, options)
    return sources, plan, units


def _open_sources(source: storage.Location, manifest: ItemManifest) -> dict[layout.KeyPath, arrays.StoredArray]:
    """Every array of the source, open for reading (all opened at once; blocks). The reader closes when the
    arrays are garbage (the conversion is done with them)."""
    reader = incremental.reader(source, manifest.store)
    pending = {path: reader.open(meta) for path, meta in manifest.arrays()}
    return {path: opening.result() for path, opening in pending.items()}


def _plan(manifest: ItemManifest, sources: dict[layout.KeyPath, Any], options: ConvertOptions
          ) -> tuple[save_plan.SavePlan, dict[layout.KeyPath, tuple[int, ...]]]:
    """The save plan of the converted item (every array on its new chunk grid, as the shards of a
    `ShardedArray` this process holds whole, so every chunk is written here) and the shape of the region each
    array is read in at a time (`_unit_shape`). `UsageError` for a chunk or a unit beyond the budget."""
    units: dict[layout.KeyPath, tuple[int, ...]] = {}

    def leaf(path: layout.KeyPath, value: Any) -> Any:
        if not isinstance(value, ArrayMetadata):
            return value
        stored = _stored_chunk(value, sources[path])
        chunk = _chunk_shape(value, stored, options)
        units[path] = _unit_shape(value.shape, chunk, stored)
        if 0 not in value.shape:
            _check_budget(path, value, stored, chunk, units[path], options)
        return ShardedArray.target(value.shape, value.torch_dtype, chunk if value.shape else (),
                                   ShardedArray.grid(value.shape, chunk) if 0 not in value.shape else [])

    state = tree.rebuild(manifest.tree, leaf)
    return save_plan.plan_save(state, _save_options(options), Coordinator.single()), units


def _save_options(options: ConvertOptions) -> SaveOptions:
    return SaveOptions(use_ocdbt=options.use_ocdbt, fsync=options.fsync, host_batch_bytes=max(1, options.chunk_budget),
                       single_file_max_bytes=min(SaveOptions().single_file_max_bytes, options.chunk_budget),
                       compression=options.compression, compression_level=options.compression_level)


def _stored_chunk(meta: ArrayMetadata, stored: arrays.StoredArray) -> tuple[int, ...] | None:
    """The chunk shape the source array is read and decoded in (within the shape), or None for an array of
    which any region reads exactly its bytes (a safetensors tensor)."""
    if not stored.reads_whole_chunks or not meta.shape:
        return None
    return tuple(max(1, min(c, n)) for c, n in zip(stored.chunk_shape, meta.shape))


def _chunk_shape(meta: ArrayMetadata, stored: tuple[int, ...] | None, options: ConvertOptions) -> tuple[int, ...]:
    shape = meta.shape
    if not shape:
        return ()
    if options.chunk_shape is not None:
        given = options.chunk_shape[-len(shape):]
        chunk = (1,) * (len(shape) - len(given)) + given
    elif options.mesh is not None:
        parts = options.mesh[:len(shape)] + (1,) * (len(shape) - len(options.mesh[:len(shape)]))
        chunk = tuple(-(-n // p) for n, p in zip(shape, parts))
    elif stored is not None:
        chunk = stored  # a zarr chunk is decoded whole: cutting it would read it once per piece
    else:
        chunk = meta.chunk_shape
        itemsize = dtypes.by_name(meta.dtype).itemsize
        row = math.prod(chunk[1:]) * itemsize
        if math.prod(chunk) * itemsize > options.chunk_budget and row and row <= options.chunk_budget:
            chunk = (max(1, options.chunk_budget // row), *chunk[1:])
    return tuple(max(1, min(c, n)) for c, n in zip(chunk, shape))


def _unit_shape(shape: tuple[int, ...], chunk: tuple[int, ...], stored: tuple[int, ...] | None) -> tuple[int, ...]:
    """The region read at a time: one destination chunk from a raw source; from a zarr source, the smallest
    region whose edges are edges of both grids (per dimension the least common multiple of the two chunk
    sizes, or the whole dimension), so that every stored chunk is read once and every destination chunk
    is written from one read."""
    if stored is None:
        return chunk
    return tuple(min(n, math.lcm(c, s)) for n, c, s in zip(shape, chunk, stored))


def _check_budget(path: layout.KeyPath, meta: ArrayMetadata, stored: tuple[int, ...] | None,
                  chunk: tuple[int, ...], unit: tuple[int, ...], options: ConvertOptions) -> None:
    """`UsageError` naming the array and the budget it needs if a stored chunk, a destination chunk or a unit
    of the copy takes more than `ConvertOptions.chunk_budget`."""
    itemsize = dtypes.by_name(meta.dtype).itemsize
    key = tree.format_key_path(path)
    limit = (f"more than a quarter of the host-memory budget of {options.max_host_bytes} bytes (a chunk in flight "
             f"takes up to {COPIES_IN_FLIGHT} times its size)")
    stored_bytes = math.prod(stored) * itemsize if stored is not None else 0
    if stored_bytes > options.chunk_budget:
        raise UsageError(
            f"{key}: its stored chunks of {list(stored)} take {stored_bytes} bytes, {limit}, and a stored chunk is "
            f"read whole; raise --max-host-bytes to at least {stored_bytes * COPIES_IN_FLIGHT}")
    chunk_bytes = math.prod(chunk) * itemsize
    if chunk_bytes > options.chunk_budget:
        raise UsageError(
            f"{key}: chunks of {list(chunk)} take {chunk_bytes} bytes, {limit}; choose a smaller chunk shape or "
            f"raise --max-host-bytes to at least {chunk_bytes * COPIES_IN_FLIGHT}")
    unit_bytes = math.prod(unit) * itemsize
    if unit_bytes > options.chunk_budget:
        raise UsageError(
            f"{key}: copying its stored chunks of {list(stored)} into chunks of {list(chunk)} reads regions of "
            f"{list(unit)} at once (the smallest that both grids cut whole), which take {unit_bytes} bytes, {limit}; "
            f"choose a chunk shape that divides the stored chunks, or raise --max-host-bytes to at least "
            f"{unit_bytes * COPIES_IN_FLIGHT}")


def _copy(source: storage.Location, sources: dict[layout.KeyPath, Any], destination: storage.Location,
          plan: save_plan.SavePlan, unit_shapes: dict[layout.KeyPath, tuple[int, ...]], options: ConvertOptions,
          progress: Progress | None) -> None:
    """Read the source unit by unit (`_units`) and write each unit's chunks, keeping at most the budget in
    flight."""
    writer = writing.ChunkWriter(destination, plan, writer=0, writeback=options.fsync,
                                 zstd_level=_save_options(options).zstd_level)
    units = [unit for p in plan.arrays for unit in _units(p, unit_shapes.get(p.key_path))]
    total = sum(unit.nbytes for unit in units)
    done = 0
    in_flight: deque[tuple[int, list[arrays.Pending]]] = deque()
    in_flight_bytes = 0
    resident_at_start = host_memory.resident_bytes()
    try:
        for batch in grid.batches(units, lambda unit: unit.nbytes, options.chunk_budget):
            batch_bytes = sum(unit.nbytes for unit in batch)
            while in_flight and in_flight_bytes + batch_bytes > options.chunk_budget:
                finished_bytes, finished = in_flight.popleft()
                arrays.wait_all(finished)
                in_flight_bytes -= finished_bytes
                done += finished_bytes
                if progress:
                    progress(done, total)
            # Freed buffers stay in glibc's heaps (one per thread that read or wrote): given back to the OS when
            # the batch's copies would otherwise take the process past the budget, as a restore does.
            host_memory.keep_within(resident_at_start,
                                    options.max_host_bytes - COPIES_IN_FLIGHT * (in_flight_bytes + batch_bytes))
            in_flight.append((batch_bytes, writer.write([unit.plan for unit in batch],
                                                        _read_batch(batch, sources))))
            in_flight_bytes += batch_bytes
        writer.finish()
        arrays.wait_all(writer.writes.pending)
    except BaseException:
        writer.abandon()
        raise
    if progress:
        progress(total, total)
    if options.fsync:
        destination.sync_files(writer.writes.files, writer.writes.trees)


def _total(plan: save_plan.SavePlan, unit_shapes: dict[layout.KeyPath, tuple[int, ...]]) -> int:
    """The bytes `_copy` reads and writes for `plan`."""
    return sum(unit.nbytes for p in plan.arrays for unit in _units(p, unit_shapes.get(p.key_path)))


def _read_batch(batch: list[_Unit], sources: dict[layout.KeyPath, arrays.StoredArray]) -> list[list[torch.Tensor]]:
    """Read the units of a batch at once; the data of each unit's writes. Only those are kept: a region
    copied into pieces is released here."""
    reads = [sources[unit.plan.key_path].read([unit.region])[unit.region] if unit.plan.key_path in sources
             else None for unit in batch]
    return [unit.chunks(read.result()) if read is not None
            else [unit.plan.value]  # a number of the source's tree, stored as a 0-d array (Orbax's way)
            for unit, read in zip(batch, reads)]


@dataclass(frozen=True)
class _Unit:
    """A region of an array read from the source in one read (`region`), and the destination chunks it holds:
    `plan` is the array's plan with those writes only."""

    plan: save_plan.ArrayPlan
    region: grid.Index

    @property
    def nbytes(self) -> int:
        return math.prod(b - a for a, b in self.region) * self.plan.itemsize

    def chunks(self, data: np.ndarray) -> list[torch.Tensor]:
        """The data of each write: views of the region's `data` where they are contiguous (the region is cut
        along its leading dimension), else copies, which tensorstore would make anyway (a 0-d array is its own
        only write)."""
        if not self.region:
            return [dtypes.numpy_to_tensor(data)]
        return [dtypes.numpy_to_tensor(np.ascontiguousarray(data[tuple(slice(a - start, b - start)
                                                                       for (a, b), (start, _) in zip(w.region,
                                                                                                     self.region))]))
                for w in self.plan.writes]


def _units(p: save_plan.ArrayPlan, unit_shape: tuple[int, ...] | None) -> list[_Unit]:
    """The array's writes grouped by the unit of `unit_shape` they lie in (all of them for a single-file
    array, which is written at once), in C order."""
    if not p.writes:
        return []
    if p.single_file or unit_shape is None:
        groups = [p.writes]
    else:
        by_unit: dict[tuple[int, ...], list[save_plan.ChunkWrite]] = {}
        for w in p.writes:
            by_unit.setdefault(tuple(a // u for (a, _), u in zip(w.region, unit_shape)), []).append(w)
        groups = [tuple(g) for g in by_unit.values()]
    out = []
    for group in groups:
        region = tuple((min(w.region[d][0] for w in group), max(w.region[d][1] for w in group))
                       for d in range(len(p.meta.shape)))
        out.append(_Unit(dataclasses.replace(p, writes=tuple(group)), region))
    return out
