"""The save half of an item: plan (which chunks exist, which process writes each), stage (copy shards to the
host), write (concurrent tensorstore writes), manifest.

One chunk, one writer: every chunk of every array is written by exactly one process. Chunks held by several
processes (replicas) go to the least loaded holder, and a large tensor that every process holds in full is cut
into one chunk per process, so the bytes written spread over the job. With a single process all of this
reduces to "write each distinct local shard once". Planning is collective when a `Coordinator` spans several
processes (every process must call it, in the same order); the rest is local. Everything blocks.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from . import arrays, dtypes, formats, grid, layout, outputs, storage, tree
from .distributed import Coordinator, balance
from .errors import CheckpointExistsError, UnsupportedValueError
from .options import SaveOptions
from .plan import Index, LocalShard, Placement, TensorLayout, cpu_layout, host_layout
from .records import ArrayMetadata, ArrayStore, ItemManifest
from .sharded_array import ShardedArray

ArrayLike = torch.Tensor | ShardedArray


@dataclass(frozen=True)
class ChunkWrite:
    """A chunk this process writes, and the local shard holding its data (the chunk lies inside it)."""

    region: Index
    source: LocalShard

    @property
    def size(self) -> int:
        return math.prod(b - a for a, b in self.region)


@dataclass(frozen=True)
class ArrayPlan:
    """One array to save: its metadata, where its data is, the chunks this process writes, and the two
    decisions every process makes alike: one file for all chunks, and who writes ``zarr.json``."""

    key_path: layout.KeyPath
    meta: ArrayMetadata
    value: ArrayLike
    layout: TensorLayout
    writes: tuple[ChunkWrite, ...]
    single_file: bool
    writes_metadata: bool

    @cached_property
    def itemsize(self) -> int:
        return dtypes.by_name(self.meta.dtype).itemsize

    @cached_property
    def sources(self) -> tuple[LocalShard, ...]:
        """The distinct local shards the writes read from."""
        return tuple(dict.fromkeys(w.source for w in self.writes))

    @cached_property
    def staged_bytes(self) -> int:
        """Host bytes held until written."""
        return sum(s.size for s in self.sources) * self.itemsize

    @cached_property
    def write_bytes(self) -> int:
        """Bytes of the chunks this process writes."""
        return sum(math.prod(b - a for a, b in w.region) for w in self.writes) * self.itemsize

    @cached_property
    def host_bytes(self) -> int:
        """Bytes one fetch brings to the host (torch_xla fetches every local shard of a tiled tensor)."""
        if self.layout.placement is Placement.TILED:
            return math.prod(self.layout.shard_shape) * len(self.layout.shards) * self.itemsize
        return self.staged_bytes


@dataclass(frozen=True)
class SavePlan:
    """An item to save: its manifest (the primary's values for JSON leaves), the arrays (scalar leaves among
    them, as the 0-d arrays Orbax reads, written by the primary), and its string leaves by array name."""

    manifest: ItemManifest
    arrays: tuple[ArrayPlan, ...]
    strings: dict[str, str]

    @property
    def store(self) -> ArrayStore:
        return self.manifest.store

    @property
    def write_bytes(self) -> int:
        """Bytes of the chunks this process writes."""
        return sum(p.write_bytes for p in self.arrays)

    @property
    def staged_bytes(self) -> int:
        """Host bytes this process holds until written."""
        return sum(p.staged_bytes for p in self.arrays)


@dataclass
class PlanCache:
    """The array part of the last plan of one item (its layouts, chunk grids, writers and names), reused while
    the item's leaves keep their keys, kinds, shapes, dtypes and shardings — as a training loop's saves do:
    planning costs ~0.1 ms per tensor, most of what an asynchronous save of thousands of small tensors blocks.
    One per item and destination; not thread-safe."""

    key: tuple | None = None
    names: dict[layout.KeyPath, str] = dataclasses.field(default_factory=dict)
    arrays: tuple[ArrayPlan, ...] = ()


def plan_save(state: Any, options: SaveOptions | None = None, coordinator: Coordinator | None = None, *,
              own_copy: bool = False, cache: PlanCache | None = None) -> SavePlan:
    """Validate `state` and decide what every process writes. Collective when `coordinator` spans several
    processes, unless `own_copy`: then this process alone plans a copy of what it holds (a manager's local tier,
    one per process): every chunk it holds, written by itself, with every array's metadata; chunks only other
    processes hold are absent. With `cache`, the array part of the plan is reused when the state's structure,
    shapes, dtypes and shardings match the last call's (all processes agree on it), and the cache is refreshed
    otherwise. Raises `UnsupportedValueError` (naming the key) for a leaf that is neither an array nor a JSON
    scalar, an unsupported dtype, or processes that disagree on the arrays; warns (`UserWarning`, when planning
    anew) what the format warns of (v2: the keys Orbax cannot restore). Materializes pending XLA computations;
    runs no other device work."""
    options = options or SaveOptions()
    coordinator = coordinator or Coordinator.single()
    fmt = formats.writer(options.format)
    leaves = tree.flatten(state)
    values: list[tuple[layout.KeyPath, ArrayLike]] = []
    scalars: list[tuple[layout.KeyPath, torch.Tensor]] = []
    string_leaves: list[tuple[layout.KeyPath, str]] = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            _check_tensor(path, leaf)
            values.append((path, leaf))
        elif isinstance(leaf, ShardedArray):
            _check_dtype(path, leaf.dtype)
            values.append((path, leaf))
        elif isinstance(leaf, str):
            string_leaves.append((path, leaf))
        elif not isinstance(leaf, tree.JSON_SCALARS):
            raise UnsupportedValueError(
                f"cannot save {tree.format_key_path(path)}: {type(leaf).__name__} is neither a tensor nor a "
                "JSON value (int, float, str, bool, None)")
        elif fmt.scalar_dtype(leaf) is not None:  # a JSON scalar the format also stores as a 0-d array
            scalars.append((path, torch.tensor(leaf, dtype=dtypes.by_name(fmt.scalar_dtype(leaf)).torch)))
    specs = _sharding_specs([v for _, v in values])
    key = None
    if cache is not None:
        mesh = _mesh_key(specs)  # once: it is the same for every tensor
        key = (tuple(p for p, _ in leaves), tuple((p, *_signature(v, spec, mesh)) for (p, v), spec in
                                                  zip(values, specs)),
               tuple((p, t.dtype) for p, t in scalars), options, coordinator.index, coordinator.count, own_copy)
    hit = key is not None and cache is not None and cache.key == key
    if coordinator.distributed and not own_copy:
        hit = all(coordinator.all_gather(hit))  # collective planning: every process takes the same path
    if hit:
        names = cache.names  # type: ignore[union-attr]
        plans = [dataclasses.replace(template, value=value)
                 for template, value in zip(cache.arrays, [v for _, v in values] + [t for _, t in scalars])]
    else:
        names = dict(zip((p for p, _ in leaves), fmt.array_names([p for p, _ in leaves])))
        warning = fmt.save_warning(leaves, list(names.values()))
        if warning:
            warnings.warn(warning, UserWarning, stacklevel=2)
        plans = _plan_arrays(values, scalars, specs, names, options, coordinator, own_copy)
        if cache is not None:
            cache.key, cache.names, cache.arrays = key, names, tuple(plans)
    strings = {names[path]: leaf for path, leaf in string_leaves}
    tensors = {p.key_path: p.meta for p in plans[:len(values)]}
    store = ArrayStore(kind="ocdbt" if options.use_ocdbt else "directories")
    manifest = ItemManifest(tree.rebuild(state, lambda p, v: tensors.get(p, v)), fmt.NAME, store)
    return SavePlan(manifest, tuple(plans), strings)


def _plan_arrays(values: list[tuple[layout.KeyPath, ArrayLike]], scalars: list[tuple[layout.KeyPath, torch.Tensor]],
                 specs: list[str | None], names: dict[layout.KeyPath, str], options: SaveOptions,
                 coordinator: Coordinator, own_copy: bool) -> list[ArrayPlan]:
    """The `ArrayPlan` of every value, then of every scalar leaf (`plan_save`)."""
    local = []
    for (path, value), lay in zip(values, _layouts([v for _, v in values], specs)):
        local.append((path, value, lay, ArrayMetadata(names[path], lay.shape, dtypes.by_torch(value.dtype).name,
                                                      lay.chunk_shape, lay.sharding)))
    for path, value in scalars:  # the primary's value, as in the manifest
        lay = cpu_layout(()) if coordinator.is_primary or own_copy else TensorLayout((), Placement.CPU, (), ())
        local.append((path, value, lay, ArrayMetadata(names[path], (), dtypes.by_torch(value.dtype).name, ())))
    if own_copy:
        chunk_shapes = {meta.path: meta.chunk_shape for _, _, _, meta in local}
        writers = {(meta.path, shard.index): coordinator.index
                   for _, _, lay, meta in local for shard in lay.distinct_shards()}
    else:
        chunk_shapes, writers = _assign_writers([(meta, lay) for _, _, lay, meta in local], options, coordinator)
    plans = []
    for position, (path, value, lay, meta) in enumerate(local):
        meta = dataclasses.replace(meta, chunk_shape=chunk_shapes[meta.path])
        owner = {region: writers.get((meta.path, region), -1)  # -1: held elsewhere, absent from an own copy
                 for region in grid.regions(meta.shape, meta.chunk_shape)}
        writes = tuple(ChunkWrite(region, source) for region, source in _local_chunks(lay, meta.chunk_shape).items()
                       if owner[region] == coordinator.index)
        sole = set(owner.values())
        single_file = (not options.use_ocdbt and len(owner) > 1 and len(sole) == 1
                       and meta.nbytes <= options.single_file_max_bytes)
        if own_copy:
            metadata_writer = coordinator.index
        else:
            metadata_writer = next(iter(sole)) if single_file or not meta.shape else position % coordinator.count
        plans.append(ArrayPlan(path, meta, value, lay, writes, single_file, metadata_writer == coordinator.index))
    return plans


def _sharding_specs(values: Sequence[ArrayLike]) -> list[str | None]:
    """The HLO sharding string of each XLA tensor (None for the others), once pending computations have run."""
    xla = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.device.type == "xla"]
    out: list[str | None] = [None] * len(values)
    if xla:
        from . import sharding

        sharding.materialize([values[i] for i in xla])
        for i, spec in zip(xla, sharding.specs([values[i] for i in xla])):
            out[i] = spec
    return out


def _mesh_key(specs: Sequence[str | None]) -> tuple | None:
    """The global mesh XLA values are laid out on (`sharding.mesh_key`), None without XLA values (`specs` from
    `_sharding_specs`: None for every other value)."""
    if all(spec is None for spec in specs):
        return None
    from . import sharding

    return sharding.mesh_key()


def _signature(value: ArrayLike, spec: str | None, mesh: tuple | None) -> tuple:
    """What a value's plan depends on besides its key: kind, shape, dtype and how it is laid out (`mesh`: the
    global mesh, from `_mesh_key`)."""
    if isinstance(value, ShardedArray):
        return ("host", value.shape, value.dtype, value.shard_shape, tuple(index for index, _ in value.shards))
    if value.device.type == "xla":
        return ("xla", tuple(value.shape), value.dtype, spec, value.device, mesh)
    return ("cpu", tuple(value.shape), value.dtype)


def _check_tensor(path: layout.KeyPath, tensor: torch.Tensor) -> None:
    if tensor.layout != torch.strided:
        raise UnsupportedValueError(f"cannot save {tree.format_key_path(path)}: {tensor.layout} tensors "
                                    "are not supported; convert to dense first")
    if tensor.device.type not in ("cpu", "xla"):
        raise UnsupportedValueError(f"cannot save {tree.format_key_path(path)}: tensors on "
                                    f"{tensor.device} are not supported (use CPU or XLA tensors)")
    _check_dtype(path, tensor.dtype)


def _check_dtype(path: layout.KeyPath, dtype: torch.dtype) -> None:
    try:
        dtypes.by_torch(dtype)
    except UnsupportedValueError as exc:
        raise UnsupportedValueError(f"cannot save {tree.format_key_path(path)}: {exc}") from None


def _layouts(values: Sequence[ArrayLike], specs: Sequence[str | None]) -> list[TensorLayout]:
    """The layout of each value; `specs` from `_sharding_specs` (XLA tensors materialized)."""
    xla = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.device.type == "xla"]
    out: list[TensorLayout | None] = [
        host_layout(v) if isinstance(v, ShardedArray) else cpu_layout(tuple(v.shape)) if v.device.type == "cpu"
        else None for v in values]
    if xla:
        from . import sharding

        for i, lay in zip(xla, sharding.layouts([values[i] for i in xla], [specs[i] for i in xla])):
            out[i] = lay
    return out  # type: ignore[return-value]


def _local_chunks(lay: TensorLayout, chunk_shape: tuple[int, ...]) -> dict[Index, LocalShard]:
    """The chunks whose data this process holds, each with the local shard (lowest replica) holding it."""
    if chunk_shape == lay.chunk_shape:  # chunks are the shards themselves
        return {shard.index: shard for shard in lay.distinct_shards()}
    out: dict[Index, LocalShard] = {}
    meta_grid = grid.regions(lay.shape, chunk_shape)
    for shard in lay.distinct_shards():
        for region in meta_grid:
            if all(sa <= a and b <= sb for (a, b), (sa, sb) in zip(region, shard.index)) and region not in out:
                out[region] = shard
    return out


def _assign_writers(local: list[tuple[ArrayMetadata, TensorLayout]], options: SaveOptions,
                    coordinator: Coordinator) -> tuple[dict[str, tuple[int, ...]], dict[tuple[str, Index], int]]:
    """The final chunk shape of every array and the process writing each chunk, identical on every process.

    The chunk grid is the shard grid, except that a large array that every process holds whole (one chunk,
    held everywhere) is cut along its first dimension into one chunk per process, so that all share its
    writing. Collective with several processes."""
    mine = [(meta.path, meta.shape, meta.dtype, meta.chunk_shape,
             tuple(s.index for s in lay.distinct_shards())) for meta, lay in local]
    everyone = coordinator.all_gather(mine)
    reference = [entry[:4] for entry in everyone[0]]
    holders: dict[tuple[str, Index], list[int]] = {}
    for process, entries in enumerate(everyone):
        if [entry[:4] for entry in entries] != reference:
            raise UnsupportedValueError(
                f"process {process} saves other arrays (keys, shapes, dtypes or chunking) than process 0; "
                "every process must save the same tree")
        for directory, _shape, _dtype, _chunks, regions in entries:
            for region in regions:
                holders.setdefault((directory, region), []).append(process)
    chunk_shapes: dict[str, tuple[int, ...]] = {}
    chunks: list[tuple[tuple[str, Index], int, list[int]]] = []
    for meta, _ in local:
        regions = grid.regions(meta.shape, meta.chunk_shape)
        for region in regions:
            if (meta.path, region) not in holders:
                raise UnsupportedValueError(f"chunk {region} of {meta.path} is held by no process")
        everywhere = len(regions) == 1 and len(holders[(meta.path, regions[0])]) == coordinator.count
        if (coordinator.count > 1 and everywhere and meta.shape and meta.shape[0] >= coordinator.count
                and meta.nbytes >= options.split_bytes):
            meta = dataclasses.replace(meta, chunk_shape=(-(-meta.shape[0] // coordinator.count),
                                                          *meta.chunk_shape[1:]))
            held = {region: list(range(coordinator.count)) for region in grid.regions(meta.shape, meta.chunk_shape)}
        else:
            held = {region: holders[(meta.path, region)] for region in regions}
        chunk_shapes[meta.path] = meta.chunk_shape
        itemsize = dtypes.by_name(meta.dtype).itemsize
        chunks.extend(((meta.path, region), math.prod(b - a for a, b in region) * itemsize, procs)
                      for region, procs in held.items())
    return chunk_shapes, balance(chunks, coordinator.count)


def stage(batch: Sequence[ArrayPlan], *, copy_cpu: bool) -> list[list[torch.Tensor]]:
    """Host data of each plan's writes (one tensor per write), fetched from the devices with one torch_xla call
    per placement kind. Host tensors are referenced, not copied, unless `copy_cpu` (a caller that returns
    before the writes finish must copy: the training loop may change them)."""
    sources = _fetch_sources(batch, copy_cpu=copy_cpu)
    return [[_cut(sources[i][w.source], w) for w in p.writes] for i, p in enumerate(batch)]


def _fetch_sources(batch: Sequence[ArrayPlan], *, copy_cpu: bool) -> list[dict[LocalShard, torch.Tensor]]:
    """The host data of the local shards each plan's writes read from (`stage`)."""
    sources: list[dict[LocalShard, torch.Tensor]] = [{} for _ in batch]
    xla = [i for i, p in enumerate(batch) if p.layout.placement in (Placement.TILED, Placement.REPLICATED,
                                                                    Placement.UNSHARDED) and p.writes]
    for i, p in enumerate(batch):
        if p.layout.placement is Placement.CPU and p.writes:
            data = p.value.detach().resolve_conj().resolve_neg()
            sources[i] = {p.layout.shards[0]: data.clone() if copy_cpu else data}
        elif p.layout.placement is Placement.HOST and p.writes:
            held = dict(zip(p.layout.shards, (d for _, d in p.value.shards)))
            sources[i] = {s: held[s].clone() if copy_cpu else held[s] for s in p.sources}
    if xla:
        from . import sharding

        fetched = sharding.fetch([batch[i].value for i in xla], [batch[i].layout for i in xla],
                                 [batch[i].sources for i in xla])
        for i, shards in zip(xla, fetched):
            sources[i] = dict(zip(batch[i].sources, shards))
    return sources


def _cut(data: torch.Tensor, write: ChunkWrite) -> torch.Tensor:
    if write.region == write.source.index:
        return data
    return data[tuple(slice(a - sa, b - sa) for (a, b), (sa, _) in zip(write.region, write.source.index))]


Staged = list[tuple[list[ArrayPlan], list[list[torch.Tensor]]]]


def stage_all(plans: Sequence[ArrayPlan], options: SaveOptions, *, copy_cpu: bool) -> Staged:
    """Host copies of everything this process writes, batch by batch (the transient fetch of a batch stays
    within `options.host_batch_bytes`). Blocks. For asynchronous saves: once this returns, training may change
    the tensors; `start_writes` then writes from the copies."""
    return [(group, stage(group, copy_cpu=copy_cpu))
            for group in grid.batches([p for p in plans if p.writes], lambda p: p.host_bytes,
                                      options.host_batch_bytes)]


def stage_shared(saves: Sequence[Mapping[str, SavePlan]], options: SaveOptions) -> list[dict[str, Staged]]:
    """Host copies for several saves of one state (a manager's tiers; items name -> plan each), for asynchronous
    saves: every local shard is copied off the devices once, by the first save that writes from it, and the
    writes of every save are cut from that copy (arrays are matched by identity: the saves must plan the same
    leaf objects). Holds one host copy of everything any save writes. Blocks."""
    fetched: dict[tuple[int, LocalShard], torch.Tensor] = {}
    out = []
    for plans in saves:
        staged_items: dict[str, Staged] = {}
        for name, plan in plans.items():
            staged: Staged = []
            for group in grid.batches([p for p in plan.arrays if p.writes], lambda p: p.host_bytes,
                                      options.host_batch_bytes):
                missing = [p for p in group if any((id(p.value), s) not in fetched for s in p.sources)]
                for p, shards in zip(missing, _fetch_sources(missing, copy_cpu=True) if missing else []):
                    fetched.update({(id(p.value), s): data for s, data in shards.items()})
                staged.append((group, [[_cut(fetched[(id(p.value), w.source)], w) for w in p.writes]
                                       for p in group]))
            staged_items[name] = staged
        out.append(staged_items)
    return out


def start_staged(loc: storage.Location, plans: Mapping[str, SavePlan], staged: dict[str, Staged],
                 options: SaveOptions, *, writer: int) -> Callable[[], Writes]:
    """`start` (as `begin_writes` returns it) for items staged by `stage_shared`."""
    return lambda: Writes.combined({name: start_writes(loc.child(name), plan, staged.pop(name), options,
                                                       writer=writer)
                                    for name, plan in plans.items()})


@dataclass
class Writes:
    """The writes a process started for one item: the futures to wait for, and what they create (relative to
    the item directory), which a save that syncs makes durable once they are done: `files`, and `trees`
    (directories whose every file is this process's, such as its OCDBT store)."""

    pending: list[arrays.Pending]
    files: list[str]
    trees: list[str]

    @staticmethod
    def combined(by_item: Mapping[str, Writes]) -> Writes:
        """The writes of several items as one, names relative to their parent (``<item>/...``)."""
        return Writes([p for w in by_item.values() for p in w.pending],
                      [f"{item}/{f}" for item, w in by_item.items() for f in w.files],
                      [f"{item}/{t}" for item, w in by_item.items() for t in w.trees])


def start_writes(loc: storage.Location, plan: SavePlan, staged: Staged, options: SaveOptions, *,
                 writer: int) -> Writes:
    """Create the arrays this process creates and start writing staged chunks (`writer`: this process's
    index)."""
    out = ChunkWriter(loc, plan, writer=writer, writeback=options.fsync)
    try:
        for group, data in staged:
            out.write(group, data)
    except BaseException:
        arrays.drain(out.writes.pending)
        raise
    return out.writes


def issue_writes(loc: storage.Location, plan: SavePlan, options: SaveOptions, *, writer: int,
                 copy_cpu: bool = False, max_host_bytes: int | None = None) -> Writes:
    """Stage and write, interleaved: the writes of one batch run while the next is fetched. Blocks while shards
    are fetched. With `max_host_bytes`, staged data not yet written never exceeds it (plus one batch): the call
    waits for earlier writes instead of fetching more. `copy_cpu` copies host tensors too (for callers that
    return before the writes finish). On error, every started operation is waited for first."""
    out = ChunkWriter(loc, plan, writer=writer, writeback=options.fsync)
    in_flight: deque[tuple[int, list[arrays.Pending]]] = deque()
    in_flight_bytes = 0
    try:
        for group in grid.batches([p for p in plan.arrays if p.writes], lambda p: p.host_bytes,
                                  options.host_batch_bytes):
            group_bytes = sum(p.staged_bytes for p in group)
            while max_host_bytes is not None and in_flight and in_flight_bytes + group_bytes > max_host_bytes:
                done_bytes, done = in_flight.popleft()
                arrays.wait_all(done)
                in_flight_bytes -= done_bytes
            in_flight.append((group_bytes, out.write(group, stage(group, copy_cpu=copy_cpu))))
            in_flight_bytes += group_bytes
    except BaseException:
        arrays.drain(out.writes.pending)
        raise
    return out.writes


def begin_writes(loc: storage.Location, plans: Mapping[str, SavePlan], options: SaveOptions, *, writer: int,
                 background: bool, max_host_bytes: int | None) -> Callable[[], Writes]:
    """Begin saving items (name -> plan) under `loc`; return `start`, which starts the writes not started yet
    and returns all of them. With `background` (an asynchronous save), every shard is on the host when this
    returns and training may change the tensors: without `max_host_bytes` only the copies happen here and
    `start` (called on a background thread) issues the writes; with it, staging and writing interleave here
    within the cap. Without `background`, nothing happens here: `start` stages and writes, holding at most two
    batches of host memory. Blocks while shards are copied."""
    if not background:
        return lambda: Writes.combined({name: issue_writes(loc.child(name), plan, options, writer=writer,
                                                           max_host_bytes=2 * options.host_batch_bytes)
                                        for name, plan in plans.items()})
    if max_host_bytes is not None:
        started = Writes.combined({name: issue_writes(loc.child(name), plan, options, writer=writer, copy_cpu=True,
                                                      max_host_bytes=max_host_bytes)
                                   for name, plan in plans.items()})
        return lambda: started
    # Only the copy off the devices happens here; creating arrays and issuing writes (a fraction of a millisecond
    # per chunk) is left to the caller of `start`.
    staged = {name: stage_all(plan.arrays, options, copy_cpu=True) for name, plan in plans.items()}
    return start_staged(loc, plans, staged, options, writer=writer)


class ChunkWriter:
    """Creates the arrays this process creates and issues its chunk writes; collects every future and what
    they create. Saves feed it the staged shards; `convert` feeds it chunks read from another checkpoint, a
    batch at a time (`write` takes plans whose `writes` are any subset of the array's). In a store of
    directories, with `writeback` (saves that fsync), finished chunk files are handed to the disk while later
    ones are still being staged. In an OCDBT store, every array's metadata is created in one transaction, then
    each batch of chunks is one transaction: the store's B-tree grows by a few nodes per batch, not per chunk,
    and host memory holds at most a batch of encoded chunks."""

    def __init__(self, loc: storage.Location, plan: SavePlan, *, writer: int, writeback: bool):
        self.item, self.writer, self.store = loc, writer, plan.store
        self.ocdbt = plan.store.kind == "ocdbt"
        self.writeback = writeback and not loc.capabilities.durable_writes
        context = storage.operation_context()
        self.refs = {p.key_path: arrays.ArrayRef(loc, p.meta.path, plan.store, context) for p in plan.arrays}
        self.plans = {p.key_path: p for p in plan.arrays}
        self.writes = Writes([], [], [])
        self.batches = 0
        mine = [p for p in plan.arrays if p.writes or p.writes_metadata]
        if self.ocdbt and mine:
            created = arrays.new_transaction()
            arrays.wait_all([self._open(p, lane=0, metadata=True, transaction=created)
                             for p in mine if p.writes_metadata])
            arrays.wait_all([arrays.commit(created, loc, layout.ocdbt_store(writer, 0))])
            self.writes.trees.append(layout.ocdbt_store(writer, 0))
        self.opened: dict[tuple[layout.KeyPath, int], arrays.Pending] = {
            (p.key_path, 0): self._open(p, lane=0, metadata=not self.ocdbt and p.writes_metadata) for p in mine}
        self.writes.pending.extend(self.opened.values())
        if not self.ocdbt:
            self.writes.files.extend(f"{p.meta.path}/{layout.ZARR_METADATA}" for p in mine if p.writes_metadata)

    def _open(self, p: ArrayPlan, *, lane: int, metadata: bool, transaction: object = None) -> arrays.Pending:
        return arrays.create(self.refs[p.key_path], p.meta.shape, p.meta.dtype, p.meta.chunk_shape,
                             store=layout.ocdbt_store(self.writer, lane) if self.ocdbt else None,
                             single_file=p.single_file, write_metadata=metadata, transaction=transaction)

    def _handle(self, p: ArrayPlan, lane: int) -> object:
        if (p.key_path, lane) not in self.opened:  # another lane of an OCDBT store: no I/O, the metadata is known
            self.opened[(p.key_path, lane)] = self._open(p, lane=lane, metadata=False)
            if layout.ocdbt_store(self.writer, lane) not in self.writes.trees:
                self.writes.trees.append(layout.ocdbt_store(self.writer, lane))
        return self.opened[(p.key_path, lane)].result()

    def write(self, group: Sequence[ArrayPlan], data: Sequence[Sequence[torch.Tensor]]) -> list[arrays.Pending]:
        out: list[arrays.Pending] = []
        lane = self.batches % arrays.OCDBT_LANES if self.ocdbt else 0
        self.batches += 1
        transaction = arrays.new_transaction() if self.ocdbt else None
        for p, chunk_data in zip(group, data):
            chunks = [(tuple(slice(a, b) for a, b in w.region), dtypes.tensor_to_numpy(d))
                      for w, d in zip(p.writes, chunk_data)]
            pending, files = arrays.write(self._handle(p, lane), self.refs[p.key_path], chunks,
                                          single_file=p.single_file, writeback=self.writeback and not self.ocdbt,
                                          transaction=transaction)
            out.extend(pending)
            self.writes.files.extend(f"{p.meta.path}/{f}" for f in files)
        if transaction is not None:
            out.append(arrays.commit(transaction, self.item, layout.ocdbt_store(self.writer, lane),
                                     writeback=self.writeback))
        self.writes.pending.extend(out)
        return out


def prepare_directory(loc: storage.Location, *, overwrite: bool) -> str | None:
    """Where an item saved to `loc` is written: None for `loc` itself when it is empty; when it holds something
    and `overwrite`, the name of a new temporary directory beside it (in the parent of `loc.resolved()`; see
    `outputs`), which replaces it once the item is committed, so that a failed save leaves the old item as it
    was. Raises `CheckpointExistsError` if `loc` holds anything and not `overwrite`."""
    if loc.is_empty() and not loc.is_file():
        return None
    if not overwrite:
        what = "a checkpoint" if loc.read(layout.ITEM_METADATA) is not None else "other files"
        raise CheckpointExistsError(f"{loc} already holds {what}; pass overwrite=True to replace it")
    return outputs.temporary_sibling(loc.resolved()).name
