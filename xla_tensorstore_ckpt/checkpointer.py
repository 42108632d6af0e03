"""One item (one state tree) to and from one directory: ``<dir>/_METADATA`` plus one zarr array per tensor.

Save: flatten → plan (layouts, chunk grid = shard grid, one writer per distinct shard) → fetch shards to host in
batches → concurrent chunk writes → ``_METADATA`` last. Restore: ``_METADATA`` → match against the target →
read, for each local shard of each target tensor, exactly its region → place on the devices → rebuild the
target's tree. The item counts as written only once ``_METADATA`` exists, so a crashed save leaves a directory
that `restore` refuses. Everything here blocks; nothing is thread-safe across calls on the same directory.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from . import arrays, dtypes, layout, storage, tree
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    KeyMismatchError,
    ShapeMismatchError,
    UnsupportedValueError,
)
from .metadata import ArrayMetadata, ItemManifest
from .options import RestoreOptions, SaveOptions
from .plan import Index, LocalShard, Placement, TensorLayout, cpu_layout

PathLike = str | storage.Location


# ----------------------------------------------------------------------------------------------- save


@dataclass(frozen=True)
class ArrayPlan:
    """One tensor to save: where it goes and which of its local shards this process writes."""

    key_path: layout.KeyPath
    meta: ArrayMetadata
    tensor: torch.Tensor
    layout: TensorLayout
    writes: tuple[LocalShard, ...]

    def single_file(self, options: SaveOptions) -> bool:
        """Store all chunks in one file: a small array, more than one chunk, and this process writes all."""
        return (len(self.writes) > 1 and len(self.writes) == self.meta.num_chunks
                and self.meta.nbytes <= options.single_file_max_bytes)

    @property
    def staged_bytes(self) -> int:
        """Host bytes this plan's writes hold until written."""
        return sum(s.size for s in self.writes) * dtypes.by_torch(self.tensor.dtype).itemsize

    @property
    def host_bytes(self) -> int:
        """Bytes one fetch of this tensor brings to the host (replicas included for tiled tensors)."""
        itemsize = dtypes.by_torch(self.tensor.dtype).itemsize
        if self.layout.placement is Placement.TILED:
            return math.prod(self.layout.shard_shape) * len(self.layout.shards) * itemsize
        return math.prod(self.layout.shape) * itemsize


@dataclass(frozen=True)
class SavePlan:
    manifest: ItemManifest
    arrays: tuple[ArrayPlan, ...]


def plan_save(state: Any) -> SavePlan:
    """Validate `state` and decide what to write. Raises `UnsupportedValueError` (naming the key) for a leaf
    that is neither a tensor nor a JSON scalar, an unsupported dtype, or two keys that map to one directory.
    Materializes pending XLA computations of the tensors; runs no other device work."""
    leaves = tree.flatten(state)
    tensors: list[tuple[layout.KeyPath, torch.Tensor]] = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            _check_tensor(path, leaf)
            tensors.append((path, leaf))
        elif not isinstance(leaf, tree.JSON_SCALARS):
            raise UnsupportedValueError(
                f"cannot save {tree.format_key_path(path)}: {type(leaf).__name__} is neither a tensor nor a "
                "JSON value (int, float, str, bool, None)")
    layouts = _layouts([t for _, t in tensors])
    plans: dict[layout.KeyPath, ArrayPlan] = {}
    seen_dirs: dict[str, layout.KeyPath] = {}
    for (path, tensor), lay in zip(tensors, layouts):
        directory = layout.array_path(path)
        if directory in seen_dirs:
            raise UnsupportedValueError(
                f"keys {tree.format_key_path(seen_dirs[directory])!r} and {tree.format_key_path(path)!r} "
                f"would both be stored in {directory!r}")
        seen_dirs[directory] = path
        meta = ArrayMetadata(directory, lay.shape, dtypes.by_torch(tensor.dtype).name, lay.chunk_shape,
                             lay.sharding)
        plans[path] = ArrayPlan(path, meta, tensor, lay, tuple(lay.distinct_shards()))
    manifest = ItemManifest(tree.rebuild(state, lambda p, v: plans[p].meta if p in plans else v))
    return SavePlan(manifest, tuple(plans.values()))


def _check_tensor(path: layout.KeyPath, tensor: torch.Tensor) -> None:
    if tensor.layout != torch.strided:
        raise UnsupportedValueError(f"cannot save {tree.format_key_path(path)}: {tensor.layout} tensors "
                                    "are not supported; convert to dense first")
    if tensor.device.type not in ("cpu", "xla"):
        raise UnsupportedValueError(f"cannot save {tree.format_key_path(path)}: tensors on "
                                    f"{tensor.device} are not supported (use CPU or XLA tensors)")
    try:
        dtypes.by_torch(tensor.dtype)
    except UnsupportedValueError as exc:
        raise UnsupportedValueError(f"cannot save {tree.format_key_path(path)}: {exc}") from None


def _layouts(tensors: Sequence[torch.Tensor]) -> list[TensorLayout]:
    xla = [i for i, t in enumerate(tensors) if t.device.type == "xla"]
    out = [cpu_layout(tuple(t.shape)) if t.device.type == "cpu" else None for t in tensors]
    if xla:
        from . import sharding

        sharding.materialize([tensors[i] for i in xla])
        for i, lay in zip(xla, sharding.layouts([tensors[i] for i in xla])):
            out[i] = lay
    return out  # type: ignore[return-value]


def stage(batch: Sequence[ArrayPlan], *, copy_cpu: bool) -> list[list[torch.Tensor]]:
    """Host copies of the shards each plan writes, fetched with one torch_xla call per placement kind.
    CPU tensors are referenced, not copied, unless `copy_cpu` (a caller that returns before the writes finish
    must copy: the training loop may change them)."""
    out: list[list[torch.Tensor]] = [[] for _ in batch]
    xla = [i for i, p in enumerate(batch) if p.layout.placement is not Placement.CPU and p.writes]
    for i, p in enumerate(batch):
        if p.layout.placement is Placement.CPU and p.writes:
            data = p.tensor.detach().resolve_conj().resolve_neg()
            out[i] = [data.clone() if copy_cpu else data]
    if xla:
        from . import sharding

        fetched = sharding.fetch([batch[i].tensor for i in xla], [batch[i].layout for i in xla],
                                 [batch[i].writes for i in xla])
        for i, shards in zip(xla, fetched):
            out[i] = shards
    return out


def batches(plans: Sequence[ArrayPlan], limit: int) -> Iterator[list[ArrayPlan]]:
    """Consecutive groups of plans whose fetches stay within `limit` bytes (a larger plan is alone)."""
    group: list[ArrayPlan] = []
    size = 0
    for p in plans:
        if group and size + p.host_bytes > limit:
            yield group
            group, size = [], 0
        group.append(p)
        size += p.host_bytes
    if group:
        yield group


def issue_writes(loc: storage.Location, plans: Sequence[ArrayPlan], options: SaveOptions, *,
                 copy_cpu: bool = False, max_host_bytes: int | None = None) -> list[arrays.Pending]:
    """Create every array and start writing this process's chunks; return the futures to wait for.

    Blocks while shards are fetched to host memory, batch by batch. `copy_cpu` copies CPU tensors too; it is
    for callers that return before the writes finish (asynchronous saves), and then writes start only once
    everything is staged, so that the copy off the devices, which the caller waits for, does not compete
    with the writes. Otherwise the writes of one batch run while the next is fetched. With `max_host_bytes`,
    staged data not yet written never exceeds it (plus one batch): the call waits for earlier writes instead
    of fetching more. On error, every started operation is waited for first.
    """
    locations = {p.key_path: loc.child(p.meta.path) for p in plans}
    pending: list[arrays.Pending] = [
        arrays.create(locations[p.key_path], p.meta.shape, p.meta.dtype, p.meta.chunk_shape,
                      single_file=p.single_file(options)) for p in plans]
    created = dict(zip([p.key_path for p in plans], pending))
    staged: deque[tuple[list[ArrayPlan], list[list[torch.Tensor]]]] = deque()
    in_flight: deque[tuple[int, list[arrays.Pending]]] = deque()
    in_flight_bytes = 0
    deferred = copy_cpu and max_host_bytes is None

    def write(group: list[ArrayPlan], shards_per_plan: list[list[torch.Tensor]]) -> list[arrays.Pending]:
        out: list[arrays.Pending] = []
        for p, shards in zip(group, shards_per_plan):
            chunks = [(s.region, dtypes.tensor_to_numpy(d)) for s, d in zip(p.writes, shards)]
            out.extend(arrays.write(created[p.key_path].result(), locations[p.key_path], chunks,
                                    single_file=p.single_file(options)))
        return out

    try:
        for group in batches([p for p in plans if p.writes], options.host_batch_bytes):
            group_bytes = sum(p.staged_bytes for p in group)
            while max_host_bytes is not None and in_flight and in_flight_bytes + group_bytes > max_host_bytes:
                done_bytes, done = in_flight.popleft()
                arrays.wait_all(done)
                in_flight_bytes -= done_bytes
            staged.append((group, stage(group, copy_cpu=copy_cpu)))
            if not deferred:
                group_pending = write(*staged.popleft())
                pending.extend(group_pending)
                in_flight.append((group_bytes, group_pending))
                in_flight_bytes += group_bytes
        while staged:
            pending.extend(write(*staged.popleft()))
    except BaseException:
        drain(pending)
        raise
    return pending


def drain(pending: Sequence[arrays.Pending]) -> None:
    """Wait for futures whose results no longer matter (an error is already on its way)."""
    for item in pending:
        try:
            item.result()
        except (CorruptCheckpointError, OSError):
            pass


def save(path: PathLike, state: Any, *, overwrite: bool = False, options: SaveOptions | None = None) -> None:
    """Save one state tree into the directory `path` (local, ``gs://`` or ``memory://``). Blocks until
    every chunk and ``_METADATA`` are stored.

    `state` nests dicts, lists and tuples; leaves are torch tensors (XLA SPMD-sharded, XLA unsharded or CPU)
    or JSON scalars. Each distinct shard is written once into its chunk of the tensor's zarr array; the save
    causes no XLA compilation or execution beyond materializing pending computations.

    Raises `UnsupportedValueError` before writing anything if a leaf cannot be stored,
    `CheckpointExistsError` if `path` already holds data and `overwrite` is False, and `StorageError` /
    `CorruptCheckpointError` if storage fails (then no ``_METADATA`` is written).
    """
    options = options or SaveOptions()
    loc = storage.location(path)
    plan = plan_save(state)
    prepare_directory(loc, overwrite=overwrite)
    # Nothing needs the staged data once written, so at most two batches are held: the one being written and
    # the one being fetched.
    arrays.wait_all(issue_writes(loc, plan.arrays, options, max_host_bytes=2 * options.host_batch_bytes))
    if options.fsync:
        storage.sync(loc)
    write_manifest(loc, plan.manifest, options)


def prepare_directory(loc: storage.Location, *, overwrite: bool) -> None:
    """Make sure `loc` is empty: delete it if `overwrite`, else raise `CheckpointExistsError` if it holds
    anything."""
    if storage.is_empty(loc):
        return
    if not overwrite:
        what = "a checkpoint" if storage.read(loc, layout.ITEM_METADATA) is not None else "other files"
        raise CheckpointExistsError(f"{loc} already holds {what}; pass overwrite=True to replace it")
    storage.delete_tree(loc)


def write_manifest(loc: storage.Location, manifest: ItemManifest, options: SaveOptions) -> None:
    """Write ``_METADATA``, the last file of an item: its presence marks the item complete."""
    storage.write(loc, layout.ITEM_METADATA, manifest.to_bytes(), fsync=options.fsync)


# -------------------------------------------------------------------------------------------- restore


def read_manifest(path: PathLike) -> ItemManifest:
    """Read and validate ``<path>/_METADATA``. Raises `CheckpointNotFoundError` if absent,
    `CorruptCheckpointError` if malformed, `FormatVersionError` if newer than this reader."""
    loc = storage.location(path)
    data = storage.read(loc, layout.ITEM_METADATA)
    if data is None:
        raise CheckpointNotFoundError(f"{loc} holds no checkpoint item ({layout.ITEM_METADATA} is missing)")
    return ItemManifest.from_bytes(data, where=str(loc.child(layout.ITEM_METADATA)))


def metadata(path: PathLike) -> Any:
    """The saved tree with an `ArrayMetadata` (shape, dtype, chunk shape, saved sharding) for each tensor
    and the values of JSON leaves. Reads only ``_METADATA``; never imports torch_xla."""
    return read_manifest(path).tree


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
    reference: torch.Tensor | None  # gives sharding and device; None: a CPU tensor
    dtype: torch.dtype
    layout: TensorLayout  # where the data goes: the reference's local shards, or one whole-array shard

    @cached_property
    def reads(self) -> tuple[Index, ...]:
        """The regions to read. When the local shards tile a box (always on a single host), the box is read
        once, so a chunk shared by several target shards is decoded once, not once per shard."""
        shards = self.layout.distinct_shards()
        if len(shards) <= 1:
            return tuple(s.index for s in shards)
        box = tuple((min(s.index[d][0] for s in shards), max(s.index[d][1] for s in shards))
                    for d in range(len(self.meta.shape)))
        if sum(s.size for s in shards) == math.prod(b - a for a, b in box):
            return (box,)
        return tuple(s.index for s in shards)

    @property
    def read_bytes(self) -> int:
        itemsize = dtypes.by_name(self.meta.dtype).itemsize
        return sum(math.prod(b - a for a, b in r) for r in self.reads) * itemsize


def restore(path: PathLike, target: Any = None, *, strict: bool = True,
            options: RestoreOptions | None = None) -> Any:
    """Read the item at `path`. Blocks until every tensor is in place.

    With `target` None: the saved tree with CPU tensors of the saved dtypes. With a `target` tree: a new tree
    of the target's structure in which each tensor has the target's sharding, device and dtype (values are
    cast when the dtype differs), reading for each local shard exactly its region. Non-tensor target leaves
    take the saved value. The target is not modified.

    Raises `KeyMismatchError` listing keys missing from the checkpoint or not in the target (with
    `strict=False` these are skipped with a warning and missing ones keep the target's leaf),
    `ShapeMismatchError` naming key, both shapes and the path, `CorruptCheckpointError` for damaged data
    (naming array and chunk), `CheckpointNotFoundError` if `path` holds no item.
    """
    manifest = read_manifest(path)
    values = read_item(path, target, strict=strict, options=options, manifest=manifest)
    return tree.rebuild(manifest.tree if target is None else target, lambda p, v: values.get(p, v))


def read_item(path: PathLike, target: Any = None, *, strict: bool = True, options: RestoreOptions | None = None,
              manifest: ItemManifest | None = None) -> dict[layout.KeyPath, Any]:
    """The restored value of every key path `restore` would fill: tensors placed like their target leaf
    (a tensor or a `RestoreAs`; CPU tensors for other leaves) and saved JSON values. Same errors as
    `restore`; callers that restore in place (the manager) assign the values themselves."""
    options = options or RestoreOptions()
    loc = storage.location(path)
    manifest = manifest or read_manifest(loc)
    saved = manifest.leaves()
    wanted = {p: None for p in saved} if target is None else _match(loc, saved, dict(tree.flatten(target)), strict)
    values = read_arrays(loc, _read_jobs(saved, wanted), options)
    values.update((p, saved[p]) for p in wanted if not isinstance(saved[p], ArrayMetadata))
    return values


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
        if isinstance(reference, torch.Tensor):
            if not isinstance(stored, ArrayMetadata):
                raise UnsupportedValueError(
                    f"cannot restore {tree.format_key_path(path)} from {loc}: the checkpoint holds the value "
                    f"{stored!r}, the target a tensor")
            if tuple(reference.shape) != stored.shape:
                raise ShapeMismatchError(
                    f"cannot restore {tree.format_key_path(path)}: checkpoint shape {stored.shape} at "
                    f"{loc.child(stored.path)} does not match target shape {tuple(reference.shape)}")
        wanted[path] = value if isinstance(value, (torch.Tensor, RestoreAs)) else None
    return wanted


def _read_jobs(saved: dict, wanted: dict) -> list[_ReadJob]:
    targets = {p: (t.reference, t.dtype) if isinstance(t, RestoreAs) else (t, t.dtype)
               for p, t in wanted.items() if isinstance(t, (torch.Tensor, RestoreAs))}
    xla = [(p, ref) for p, (ref, _) in targets.items() if ref.device.type == "xla"]
    xla_layouts = {}
    if xla:
        from . import sharding

        xla_layouts = dict(zip([p for p, _ in xla], sharding.layouts([t for _, t in xla])))
    jobs = []
    for path in wanted:
        meta = saved[path]
        if not isinstance(meta, ArrayMetadata):
            continue
        reference, dtype = targets.get(path, (None, meta.torch_dtype))
        if reference is not None and reference.device.type != "xla":
            reference = None
        jobs.append(_ReadJob(path, meta, reference, dtype, xla_layouts.get(path) or cpu_layout(meta.shape)))
    return jobs


def read_arrays(loc: storage.Location, jobs: Sequence[_ReadJob], options: RestoreOptions) -> dict:
    """Read every job's regions and build its tensor; the reads of the next batch overlap building this one.
    On error, outstanding reads are waited for before the error propagates."""
    opened = {job.key_path: arrays.open_existing(loc.child(job.meta.path)) for job in jobs}
    groups = _read_batches(jobs, options.read_batch_bytes)
    results: dict[layout.KeyPath, torch.Tensor] = {}
    current: list[dict] = []
    following: list[dict] = []
    try:
        current = _issue_reads(loc, groups[0], opened) if groups else []
        for k, group in enumerate(groups):
            following = _issue_reads(loc, groups[k + 1], opened) if k + 1 < len(groups) else []
            for job, reads in zip(group, current):
                results[job.key_path] = _build(job, {index: r.result() for index, r in reads.items()})
            current, following = following, []
    except BaseException:
        drain([*opened.values(), *(r for reads in current + following for r in reads.values())])
        raise
    return results


def _read_batches(jobs: Sequence[_ReadJob], limit: int) -> list[list[_ReadJob]]:
    groups: list[list[_ReadJob]] = []
    size = 0
    for job in jobs:
        if not groups or (size + job.read_bytes > limit and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(job)
        size += job.read_bytes
    return groups


def _issue_reads(loc: storage.Location, group: Sequence[_ReadJob], opened: dict) -> list[dict]:
    issued = []
    for job in group:
        store = opened[job.key_path].result()
        _check_stored(loc, job, store)
        array_loc = loc.child(job.meta.path)
        issued.append({r: arrays.read(store, array_loc, tuple(slice(a, b) for a, b in r)) for r in job.reads})
    return issued


def _check_stored(loc: storage.Location, job: _ReadJob, store: Any) -> None:
    shape, dtype = tuple(store.shape), arrays.stored_dtype_name(store)
    if shape != job.meta.shape or dtype != job.meta.dtype:
        raise CorruptCheckpointError(
            f"array {loc.child(job.meta.path)} holds {dtype}{list(shape)} but {layout.ITEM_METADATA} "
            f"records {job.meta.dtype}{list(job.meta.shape)}")


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


def _build(job: _ReadJob, regions: dict) -> torch.Tensor:
    saved_dtype = dtypes.by_name(job.meta.dtype).torch
    lay = job.layout
    if lay.placement in (Placement.CPU, Placement.UNSHARDED):
        region = _region(lay.shards[0].index, regions)
        data = dtypes.numpy_to_tensor(region) if region is not None else torch.empty(lay.shape, dtype=saved_dtype)
        data = data.to(job.dtype)
        if lay.placement is Placement.CPU:
            return data
        from . import sharding

        return sharding.build(job.reference, lay, [data])
    padded: dict[Any, torch.Tensor] = {}
    shards = []
    for shard in lay.shards:
        if shard.index not in padded:
            padded[shard.index] = _pad(_region(shard.index, regions), shard, lay.shard_shape, saved_dtype,
                                       job.dtype)
        shards.append(padded[shard.index])
    from . import sharding

    return sharding.build(job.reference, lay, shards)


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
