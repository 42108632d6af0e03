"""Planning an item's save: which chunks exist, and which process writes each (`plan_save`); immutable plans
that staging (`staging`) and writing (`writing`) then follow.

One chunk, one writer: every chunk of every array is written by exactly one process. Chunks held by several
processes (replicas) go to the least loaded holder, and a large tensor that every process holds in full is cut
into one chunk per process, so the bytes written spread over the job. With a single process all of this
reduces to "write each distinct local shard once". Planning is collective when a `Coordinator` spans several
processes (every process must call it, in the same order). Everything blocks.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from .. import formats, targets
from ..core import dtypes, layout, tree
from ..core.errors import UnsupportedValueError
from ..core.records import ArrayMetadata, ArrayStore, ItemManifest
from ..core.sharded_array import ShardedArray
from ..core.tensor_layout import Index, LocalShard, TensorLayout
from ..multihost.distributed import Coordinator
from ..options import SaveOptions
from . import chunk_writers, writer_plans

ArrayLike = torch.Tensor | ShardedArray  # a value some target claims (`targets`): a tensor, a DTensor, host shards


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
    # A tensor planning made (a JSON scalar leaf's 0-d array): nothing else holds it, so staging need not copy it.
    owned: bool = False

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
        return targets.of_layout(self.layout).fetched_elements(self.layout, self.sources) * self.itemsize


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
    return plan_saves({"": state}, options, coordinator, own_copy=own_copy,
                      caches=None if cache is None else {"": cache})[""]


@dataclass
class Precondition:
    """What the caller did before planning, checked in the planning's own agreement rather than one of its own:
    `error` (None: it succeeded here) is raised on every process if it is set on any (`Coordinator.everywhere`
    semantics, naming `what`).

    `action`, when the agreement is collective, runs after the state is validated and before the agreement,
    unless `error` is set here (a manager's primary clearing the step directory: what needed a broadcast of
    its own); an exception it raises becomes `error`, and the maximum over the processes of the non-negative
    int it returns (0 where there is none) is `agreed` once `plan_saves` returns."""

    what: str
    error: BaseException | None
    action: Callable[[], int] | None = None
    agreed: int | None = None


def plan_saves(states: dict[str, Any], options: SaveOptions | None = None, coordinator: Coordinator | None = None,
               *, own_copy: bool = False, caches: dict[str, PlanCache] | None = None,
               precondition: Precondition | None = None) -> dict[str, SavePlan]:
    """`plan_save` of several items (name -> state; `caches`: name -> its `PlanCache`) with one agreement on
    which cached plans every process can reuse, instead of one per item: what a manager's step saves (called by
    `step_save.stage`). The same agreement carries `precondition` (with several processes and not `own_copy`;
    else it is checked on its own), so a training step's save agrees once before it stages. Collective and
    raising as `plan_save`, and the precondition's error on every process; items are planned in `states`'
    order."""
    options = options or SaveOptions()
    coordinator = coordinator or Coordinator.single()
    agreeing = coordinator.distributed and not own_copy
    if precondition is not None and not agreeing:
        coordinator.raise_unless_ok(precondition.error, precondition.what)
    drafts = {name: _draft(state, options, coordinator, own_copy, (caches or {}).get(name))
              for name, state in states.items()}
    misses = [int(not draft.hit) for draft in drafts.values()]
    if agreeing and precondition is not None:
        value = 0
        if precondition.action is not None and precondition.error is None:
            try:
                value = precondition.action()
            except Exception as exc:  # noqa: BLE001 - raised on every process by the agreement below
                precondition.error = exc
        failed, precondition.agreed, *misses = coordinator.reduce_max(
            [int(precondition.error is not None), value, *misses],
            f"{precondition.what}; checking the cached save plans")
        if failed:  # every process learns which failed and raises (statuses travel only now)
            coordinator.raise_unless_ok(precondition.error, precondition.what)
    elif agreeing and misses:
        # Collective planning: every process takes the same path for each item.
        misses = coordinator.reduce_max(misses, "checking the cached save plans")
    return {name: _complete(draft, not miss, options, coordinator, own_copy)
            for (name, draft), miss in zip(drafts.items(), misses)}


@dataclass
class _Draft:
    """An item's leaves sorted for planning, the key of its cached plan and whether this process can reuse it."""

    state: Any
    leaves: list[tuple[layout.KeyPath, Any]]
    values: list[tuple[layout.KeyPath, ArrayLike]]
    scalars: list[tuple[layout.KeyPath, torch.Tensor]]
    strings: list[tuple[layout.KeyPath, str]]
    owners: list[targets.Target]  # the target of each value
    signatures: list[tuple]  # each value's (`Target.signatures`)
    key: tuple | None
    cache: PlanCache | None
    hit: bool


def _draft(state: Any, options: SaveOptions, coordinator: Coordinator, own_copy: bool,
           cache: PlanCache | None) -> _Draft:
    fmt = formats.writer(options.format)
    leaves = tree.flatten(state)
    values: list[tuple[layout.KeyPath, ArrayLike]] = []
    owners: list[targets.Target] = []  # the target of each value
    scalar_leaves: list[tuple[layout.KeyPath, Any, str]] = []  # with the dtype the format stores them as
    string_leaves: list[tuple[layout.KeyPath, str]] = []
    for path, leaf in leaves:
        target = targets.of(leaf)
        if target is not None:
            _check(path, leaf, target)
            values.append((path, leaf))
            owners.append(target)
        elif isinstance(leaf, str):
            string_leaves.append((path, leaf))
        elif not isinstance(leaf, tree.JSON_SCALARS):
            raise UnsupportedValueError(
                f"cannot save {tree.format_key_path(path)}: {type(leaf).__name__} is neither a tensor nor a "
                "JSON value (int, float, str, bool, None)")
        elif (dtype := fmt.scalar_dtype(leaf)) is not None:  # a JSON scalar the format also stores as a 0-d array
            scalar_leaves.append((path, leaf, dtype))
    scalars = _scalar_tensors(scalar_leaves)
    signatures = targets.signatures([v for _, v in values], owners)
    key = None
    if cache is not None:
        key = (tuple(p for p, _ in leaves), tuple((p, *sig) for (p, _), sig in zip(values, signatures)),
               tuple((p, t.dtype) for p, t in scalars), options, coordinator.index, coordinator.count, own_copy)
    hit = key is not None and cache is not None and cache.key == key
    return _Draft(state, leaves, values, scalars, string_leaves, owners, signatures, key, cache, hit)


def _scalar_tensors(leaves: list[tuple[layout.KeyPath, Any, str]]) -> list[tuple[layout.KeyPath, torch.Tensor]]:
    """The 0-d tensor of each scalar leaf (path, value, the dtype the format stores it as), in order: one tensor
    per dtype, unbound into views. An optimizer's hyperparameters are hundreds of scalar leaves per step; a
    ``torch.tensor`` each cost ~25 us, which every asynchronous save blocked on."""
    by_dtype: dict[str, list[int]] = {}
    for position, (_, _, dtype) in enumerate(leaves):
        by_dtype.setdefault(dtype, []).append(position)
    made: list[Any] = [None] * len(leaves)
    for dtype, where in by_dtype.items():
        views = torch.tensor([leaves[i][1] for i in where], dtype=dtypes.by_name(dtype).torch).unbind()
        for i, view in zip(where, views):
            made[i] = view
    return [(path, tensor) for (path, _, _), tensor in zip(leaves, made)]


def _complete(draft: _Draft, hit: bool, options: SaveOptions, coordinator: Coordinator, own_copy: bool) -> SavePlan:
    """The item's plan: the cached arrays bound to this call's values when every process can reuse them (`hit`),
    else planned anew (collective) and cached."""
    fmt = formats.writer(options.format)
    values, scalars, cache = draft.values, draft.scalars, draft.cache
    if hit:
        names = cache.names  # type: ignore[union-attr]
        plans = [_bound(template, value)
                 for template, value in zip(cache.arrays, [v for _, v in values] + [t for _, t in scalars])]  # type: ignore[union-attr]
    else:
        names = dict(zip((p for p, _ in draft.leaves), fmt.array_names([p for p, _ in draft.leaves])))
        warning = fmt.save_warning(draft.leaves, list(names.values()))
        if warning:
            warnings.warn(warning, UserWarning, stacklevel=4)
        lays = targets.layouts([v for _, v in values], draft.owners, draft.signatures)
        plans = _plan_arrays(values, lays, scalars, names, options, coordinator, own_copy)
        if cache is not None:
            for plan in plans:  # computed once, carried by every plan bound from these (`_bound`)
                plan.sources, plan.staged_bytes, plan.write_bytes, plan.host_bytes  # noqa: B018
            cache.key, cache.names, cache.arrays = draft.key, names, tuple(plans)
    strings = {names[path]: leaf for path, leaf in draft.strings}
    tensors = {p.key_path: p.meta for p in plans[:len(values)]}
    store = ArrayStore(kind="ocdbt" if options.use_ocdbt else "directories")
    manifest = ItemManifest(tree.rebuild(draft.state, lambda p, v: tensors.get(p, v)), fmt.NAME, store)
    return SavePlan(manifest, tuple(plans), strings)


def _bound(template: ArrayPlan, value: ArrayLike) -> ArrayPlan:
    """A cached plan bound to this save's value: a copy of `template` keeping its computed properties (they
    depend on its layout and writes alone). `dataclasses.replace` would run ``__init__`` and drop them, at
    thousands of leaves per step (an optimizer's hyperparameters) a cost every asynchronous save blocks on."""
    plan = object.__new__(ArrayPlan)
    plan.__dict__.update(template.__dict__)
    plan.__dict__["value"] = value
    return plan


def _plan_arrays(values: list[tuple[layout.KeyPath, ArrayLike]], lays: list[TensorLayout],
                 scalars: list[tuple[layout.KeyPath, torch.Tensor]], names: dict[layout.KeyPath, str],
                 options: SaveOptions, coordinator: Coordinator, own_copy: bool) -> list[ArrayPlan]:
    """The `ArrayPlan` of every value (`lays`: their layouts), then of every scalar leaf (`plan_save`)."""
    local = []
    for (path, value), lay in zip(values, lays):
        local.append((path, value, lay, ArrayMetadata(names[path], lay.shape, dtypes.by_torch(value.dtype).name,
                                                      lay.chunk_shape, lay.sharding)))
    for path, value in scalars:  # the primary's value, as in the manifest
        lay = targets.cpu.layout(())
        if not (coordinator.is_primary or own_copy):
            lay = dataclasses.replace(lay, shards=())
        local.append((path, value, lay, ArrayMetadata(names[path], (), dtypes.by_torch(value.dtype).name, ())))
    if own_copy:
        chunk_shapes = {meta.path: meta.chunk_shape for _, _, _, meta in local}
        writers = {(meta.path, shard.index): coordinator.index
                   for _, _, lay, meta in local for shard in lay.distinct_shards()}
    else:
        holdings = [writer_plans.holding(value, lay, coordinator.count, scalar=position >= len(values))
                    for position, (_, value, lay, _) in enumerate(local)]
        chunk_shapes, writers = chunk_writers.assign([(meta, lay) for _, _, lay, meta in local], holdings, options,
                                                coordinator)
    plans = []
    for position, (path, value, lay, meta) in enumerate(local):
        meta = dataclasses.replace(meta, chunk_shape=chunk_shapes[meta.path])
        owner = {region: writers.get((meta.path, region), -1)  # -1: held elsewhere, absent from an own copy
                 for region in chunk_writers.grid_regions(meta.shape, meta.chunk_shape)}
        held = chunk_writers.local_chunks(lay, meta.chunk_shape)
        writes = tuple(ChunkWrite(region, source) for region, source in held.items()
                       if owner[region] == coordinator.index)
        sole = set(owner.values())
        single_file = (not options.use_ocdbt and len(owner) > 1 and len(sole) == 1
                       and meta.nbytes <= options.single_file_max_bytes)
        if own_copy:
            metadata_writer = coordinator.index
        else:
            metadata_writer = next(iter(sole)) if single_file or not meta.shape else position % coordinator.count
        plans.append(ArrayPlan(path, meta, value, lay, writes, single_file, metadata_writer == coordinator.index,
                               owned=position >= len(values)))
    return plans


def _check(path: layout.KeyPath, value: ArrayLike, target: targets.Target) -> None:
    """Refuse what `target` cannot save, and dtypes the format has none for, naming the key."""
    reason = target.unsaveable(value)
    if reason is not None:
        raise UnsupportedValueError(f"cannot save {tree.format_key_path(path)}: {reason}")
    try:
        dtypes.by_torch(value.dtype)
    except UnsupportedValueError as exc:
        raise UnsupportedValueError(f"cannot save {tree.format_key_path(path)}: {exc}") from None
