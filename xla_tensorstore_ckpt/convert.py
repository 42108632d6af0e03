"""Conversion between checkpoint formats, streaming under a host-memory budget, without torch_xla.

Sources: a Hugging Face safetensors file or directory, an item of this library (any format version), an item
Orbax wrote, or one item of a step. Destinations: an item of this library in the current format (which Orbax
restores: so this is also how an older item becomes Orbax-readable), a committed step holding it, or
Hugging Face safetensors files (`export`). Arrays are copied chunk by chunk: at most `max_host_bytes` of chunk
data is read or being written at any time, and no tensor is ever held whole unless it is one chunk. Called by
``xtckpt convert``; blocks.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from . import arrays, commit, dtypes, formats, grid, layout, saving, storage, tree
from .distributed import Coordinator
from .errors import CheckpointExistsError, UsageError
from .formats import ArrayMetadata, ItemManifest, StepMetadata
from .inspection import Progress
from .options import SaveOptions
from .sharded_array import ShardedArray

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
        rank takes the last entries); None: see `mesh`.
    mesh: the stored chunk grid as the shards of a mesh: dimension i of every array is cut into ``mesh[i]``
        chunks (dimensions beyond the mesh are whole), which is how FSDP (first axis) and tensor parallelism
        (second) shard weight matrices; a restore onto that mesh reads one chunk per shard. None with no
        `chunk_shape`: the source's chunks, cut further along the first dimension where the budget needs.
    use_ocdbt, fsync: as in `SaveOptions`.
    """

    max_host_bytes: int = DEFAULT_MAX_HOST_BYTES
    chunk_shape: tuple[int, ...] | None = None
    mesh: tuple[int, ...] | None = None
    use_ocdbt: bool = True
    fsync: bool = True

    def __post_init__(self) -> None:
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
    `progress(bytes_done, bytes_total)` is called as chunks are written. Raises `CheckpointExistsError` if
    `destination` holds anything and not `overwrite`, `UsageError` if a chunk would not fit the budget,
    and what reading the source raises (`CorruptCheckpointError` naming file and key)."""
    options = options or ConvertOptions()
    manifest = formats.read_item(source)
    plan = _plan(manifest, options)
    if not destination.is_empty():
        if not overwrite:
            raise CheckpointExistsError(f"{destination} already holds files; pass overwrite to replace them")
        destination.delete_tree()
    _copy(source, manifest, destination, plan, options, progress)
    commit.finish_item(destination, plan, fsync=options.fsync)
    return plan.manifest


def convert_to_step(source: storage.Location, step_dir: storage.Location, *, item: str = "model",
                    options: ConvertOptions | None = None, overwrite: bool = False,
                    progress: Progress | None = None) -> StepMetadata:
    """`convert_item` into item `item` of a new committed step at `step_dir` (``<root>/<step>``), which a
    `CheckpointManager` on ``<root>`` then lists and restores; its commit marker is written last."""
    options = options or ConvertOptions()
    step = layout.parse_step_name(step_dir.name, None, any_prefix=False)
    if step is None:
        raise UsageError(f"{step_dir}: a step directory is named by its step number (e.g. <root>/0)")
    if not step_dir.is_empty():
        if not overwrite:
            raise CheckpointExistsError(f"{step_dir} already holds files; pass overwrite to replace them")
        step_dir.delete_tree()
    created = time.time()
    convert_item(source, step_dir.child(item), options=options, progress=progress)
    marker = StepMetadata(step=step, items=(item,), created_at=created, committed_at=time.time(),
                          custom={"converted_from": str(source)}, versions=formats.writer_versions(),
                          format_version=formats.WRITE_VERSION)
    step_dir.write(layout.CHECKPOINT_METADATA, formats.encode_step(marker), fsync=options.fsync)
    return marker


def _plan(manifest: ItemManifest, options: ConvertOptions) -> saving.SavePlan:
    """The save plan of the converted item: every array on its new chunk grid, as the shards of a
    `ShardedArray` this process holds whole (so every chunk is written here)."""
    def leaf(path: layout.KeyPath, value: Any) -> Any:
        if not isinstance(value, ArrayMetadata):
            return value
        chunk = _chunk_shape(value, options)
        itemsize = dtypes.by_name(value.dtype).itemsize
        if math.prod(chunk) * itemsize > options.chunk_budget:
            raise UsageError(
                f"{tree.format_key_path(path)}: chunks of {list(chunk)} take {math.prod(chunk) * itemsize} bytes, "
                f"more than a quarter of the host-memory budget of {options.max_host_bytes}; choose a smaller "
                f"chunk shape or a larger budget")
        return ShardedArray.target(value.shape, value.torch_dtype, chunk if value.shape else (),
                                   ShardedArray.grid(value.shape, chunk) if 0 not in value.shape else [])

    state = tree.rebuild(manifest.tree, leaf)
    save_options = SaveOptions(use_ocdbt=options.use_ocdbt, fsync=options.fsync,
                               host_batch_bytes=max(1, options.chunk_budget))
    return saving.plan_save(state, save_options, Coordinator.single())


def _chunk_shape(meta: ArrayMetadata, options: ConvertOptions) -> tuple[int, ...]:
    shape = meta.shape
    if not shape:
        return ()
    if options.chunk_shape is not None:
        given = options.chunk_shape[-len(shape):]
        chunk = (1,) * (len(shape) - len(given)) + given
    elif options.mesh is not None:
        parts = options.mesh[:len(shape)] + (1,) * (len(shape) - len(options.mesh[:len(shape)]))
        chunk = tuple(-(-n // p) for n, p in zip(shape, parts))
    else:
        chunk = meta.chunk_shape
        itemsize = dtypes.by_name(meta.dtype).itemsize
        row = math.prod(chunk[1:]) * itemsize
        if math.prod(chunk) * itemsize > options.chunk_budget and row and row <= options.chunk_budget:
            chunk = (max(1, options.chunk_budget // row), *chunk[1:])
    return tuple(max(1, min(c, n)) for c, n in zip(chunk, shape))


def _copy(source: storage.Location, manifest: ItemManifest, destination: storage.Location, plan: saving.SavePlan,
          options: ConvertOptions, progress: Progress | None) -> None:
    """Read each chunk's region from the source and write it, keeping at most the budget in flight."""
    context = arrays.operation_context()
    sources = {path: arrays.open_existing(arrays.ArrayRef(source, meta.path, manifest.store, context), meta)
               for path, meta in manifest.arrays()}
    writer = saving.ChunkWriter(destination, plan, writer=0, writeback=options.fsync)
    units = []  # (plan with the writes of one unit, bytes): a chunk, or all chunks of a single-file array
    for p in plan.arrays:
        groups = [p.writes] if p.single_file else [(w,) for w in p.writes]
        units.extend((dataclasses.replace(p, writes=tuple(g)), sum(w.size for w in g) * p.itemsize) for g in groups)
    total = sum(size for _, size in units)
    done = 0
    in_flight: deque[tuple[int, list[arrays.Pending]]] = deque()
    in_flight_bytes = 0
    try:
        for batch in grid.batches(units, lambda unit: unit[1], options.chunk_budget):
            batch_bytes = sum(size for _, size in batch)
            while in_flight and in_flight_bytes + batch_bytes > options.chunk_budget:
                finished_bytes, finished = in_flight.popleft()
                arrays.wait_all(finished)
                in_flight_bytes -= finished_bytes
                done += finished_bytes
                if progress:
                    progress(done, total)
            group = [unit for unit, _ in batch]
            data = [[dtypes.numpy_to_tensor(r.result()) for r in unit_reads] if unit.key_path in sources
                    else [unit.value]  # a number of the source's tree, stored as a 0-d array (Orbax's way)
                    for unit, unit_reads in zip(group, [_start_reads(unit, sources, source) for unit in group])]
            in_flight.append((batch_bytes, writer.write(group, data)))
            in_flight_bytes += batch_bytes
        arrays.wait_all(writer.writes.pending)
    except BaseException:
        arrays.drain(writer.writes.pending)
        raise
    if progress:
        progress(total, total)
    if options.fsync:
        destination.sync_files(writer.writes.files, writer.writes.trees)


def _start_reads(unit: saving.ArrayPlan, sources: dict, source: storage.Location) -> list:
    if unit.key_path not in sources:
        return []
    array = sources[unit.key_path].result()
    return [arrays.read(array, source, tuple(slice(a, b) for a, b in w.region)) for w in unit.writes]
