"""Offline inspection of checkpoints: list steps, describe trees, read slices, statistics, diffs, verification.

Works on a checkpoint root, a step directory, a single item directory (written by `xtc.save` or Orbax) or a
Hugging Face safetensors file or directory, local or remote, without torch_xla and without the training code.
Arrays are addressed by keys of the form ``<item>/<array path>`` (``model/layers.0.weight``), the array path
being the escaped key path of `layout` (for safetensors, the tensor's name).
Everything streams chunk by chunk: memory stays near one chunk. Used by the command line; blocks.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import arrays, formats, incremental, storage
from ..checkpoint_manager import foreign_runs, local_tier
from ..checkpoint_manager.steps import ANY_PREFIX, StepIndex
from ..core import layout, tree
from ..core.errors import CheckpointError, CheckpointNotFoundError, UsageError
from ..core.records import ArrayMetadata, ItemManifest, StepMetadata
from ..core.sharded_array import ShardedArray
from ..restores import restore_plan

if TYPE_CHECKING:
    import tensorstore

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Checkpoint:
    """A step directory (items listed by its marker) or a lone item directory (one unnamed item)."""

    location: storage.Location
    marker: StepMetadata | None
    items: tuple[str, ...]
    _manifests: dict = field(default_factory=dict, compare=False, repr=False)  # read once: Orbax's are costly
    _readers: dict = field(default_factory=dict, compare=False, repr=False)

    def item_location(self, item: str) -> storage.Location:
        return self.location.child(item) if item else self.location

    def manifest(self, item: str) -> ItemManifest:
        if item not in self._manifests:
            self._manifests[item] = formats.read_item(self.item_location(item))
        return self._manifests[item]

    def reader(self, item: str) -> arrays.ArrayReader:
        """The reader of `item`'s arrays (one per item, kept for the inspection)."""
        if item not in self._readers:
            self._readers[item] = incremental.reader(self.item_location(item), self.manifest(item).store)
        return self._readers[item]

    def open(self, item: str, meta: ArrayMetadata) -> arrays.StoredArray:
        """The array `meta` of `item`, open for reading; blocks. Raises what opening raises."""
        return self.reader(item).open(meta).result()


def open_checkpoint(path: str | storage.Location) -> Checkpoint:
    """Resolve `path` to a committed step or an item directory. Raises `CheckpointNotFoundError` if it is
    neither (an uncommitted step included), `CorruptCheckpointError`/`FormatVersionError` for a bad marker."""
    loc = storage.location(path)
    marker = formats.read_step(loc)
    if marker is not None:
        return Checkpoint(loc, marker, marker.items)
    if formats.is_item(loc):
        return Checkpoint(loc, None, ("",))
    if layout.parse_step_name(loc.name, None, any_prefix=True) is not None and not loc.is_empty():
        raise CheckpointNotFoundError(f"{loc} is an uncommitted (partial) step: it has no "
                                      f"{layout.CHECKPOINT_METADATA}")
    raise CheckpointNotFoundError(f"{loc} is not a checkpoint step or item")


def split_key(key: str, checkpoint: Checkpoint) -> tuple[str, str]:
    """(item, array path) of a key; for a lone item the whole key is the array path."""
    if checkpoint.items == ("",):
        return "", key
    item, _, rest = key.partition("/")
    if item not in checkpoint.items:
        raise UsageError(f"unknown item {item!r} in key {key!r}; {checkpoint.location} has "
                         f"{', '.join(checkpoint.items)}")
    return item, rest


def full_key(item: str, path: str) -> str:
    return f"{item}/{path}" if item else path


def array_metadata(checkpoint: Checkpoint, key: str) -> tuple[str, ArrayMetadata]:
    """The item and `ArrayMetadata` of the array named by `key`. `UsageError` if there is none."""
    item, path = split_key(key, checkpoint)
    arrays_by_path = {meta.path: meta for _, meta in checkpoint.manifest(item).arrays()}
    if path not in arrays_by_path:
        close = sorted(full_key(item, p) for p in arrays_by_path if path.split("/")[-1] in p)[:5]
        hint = f"; similar: {', '.join(close)}" if close else ""
        raise UsageError(f"unknown array {key!r} in {checkpoint.location}{hint}")
    return item, arrays_by_path[path]


def open_array(step_path: str, key: str) -> tensorstore.TensorStore:
    """A read-only tensorstore array for ``<item>/<array path>`` of a step (or the array path of an item).
    Reads only the chunks indexed; every chunk's checksum is verified."""
    checkpoint = open_checkpoint(step_path)
    item, meta = array_metadata(checkpoint, key)
    return arrays.open_for_user(checkpoint.item_location(item), checkpoint.manifest(item).store, meta)


# ------------------------------------------------------------------------------------------------- steps


@dataclass(frozen=True)
class StepInfo:
    step: int
    name: str
    status: str  # "committed", "partial" or "invalid"
    committed_at: float | None
    nbytes: int | None
    metrics: dict | None
    problem: str | None = None
    tier: str = "persistent"  # or "local": a manager's local tier, which holds one process's shards
    writer: int | None = None  # the process that wrote a local step
    process_count: int | None = None  # of the job that wrote a committed step
    ignored: str | None = None  # why a manager of `root` would ignore this committed local step, if it would
    marker: StepMetadata | None = field(default=None, compare=False, repr=False)  # of a committed step
    base_of: tuple[int, ...] = ()  # the committed steps of its tier referencing its chunks (retention keeps it)

    def to_json(self) -> dict:
        return {"step": self.step, "name": self.name, "status": self.status, "committed_at": self.committed_at,
                "bytes": self.nbytes, "metrics": self.metrics, "problem": self.problem, "tier": self.tier,
                "writer": self.writer, "process_count": self.process_count, "ignored": self.ignored,
                "bases": list(self.marker.bases) if self.marker is not None else [],
                "chain": self.marker.chain if self.marker is not None else 0, "base_of": list(self.base_of)}


def list_steps(root: str, local: str | None = None, processes: int | None = None) -> list[StepInfo]:
    """Every step-named directory under `root` and, if given, under the local tier `local`, whatever its prefix,
    with its status (as the manager sees it: `steps.StepIndex`), ordered by step (the local tier's first);
    sizes are the bytes of the stored arrays (a local step holds the shards of one process of them). A committed
    local step that a manager of `root` would ignore (`local_tier.foreign_reason`: another run's, another
    writer's, or with `processes` a job of another size) says why in `ignored`."""
    steps = _steps_of(root, "persistent") + ([] if local is None else _steps_of(local, "local"))
    if local is not None:
        steps = [s if s.tier != "local" or s.marker is None else dataclasses.replace(
            s, ignored=local_tier.foreign_reason(s.marker, root, processes)) for s in steps]
    return sorted(steps, key=lambda s: (s.step, s.tier != "local"))


def _steps_of(root: str, tier: str) -> list[StepInfo]:
    loc = storage.location(root)
    entries = StepIndex(loc, ANY_PREFIX).scan()
    if all(entry.marker is None for entry in entries):
        foreign = foreign_runs.torch_xla_steps(loc)
        if foreign is not None:
            return [_torch_xla_step(loc, s, tier) for s in foreign]
    out = []
    for entry in entries:
        if entry.marker is None:
            out.append(StepInfo(entry.step, entry.name, entry.status, None, None, None, entry.problem, tier))
            continue
        try:
            nbytes = sum(meta.nbytes for item in entry.marker.items
                         for _, meta in formats.read_item(storage.location(root).child(entry.name, item)).arrays())
        except CheckpointError as exc:  # one damaged or malformed step: reported, and the listing goes on
            out.append(StepInfo(entry.step, entry.name, "invalid", None, None, None, str(exc), tier))
            continue
        out.append(StepInfo(entry.step, entry.name, "committed", entry.marker.committed_at, nbytes,
                            entry.marker.metrics, tier=tier, writer=entry.marker.writer,
                            process_count=entry.marker.process_count, marker=entry.marker))
    users: dict[int, list[int]] = {}
    for s in out:
        for base in (s.marker.bases if s.marker is not None else ()):
            users.setdefault(base, []).append(s.step)
    return [dataclasses.replace(s, base_of=tuple(users[s.step])) if s.step in users and s.marker is not None else s
            for s in out]


def _torch_xla_step(root: storage.Location, found: foreign_runs.TorchXlaStep, tier: str) -> StepInfo:
    """A step of a torch_xla CheckpointManager root, as ``xtckpt steps`` shows it (its marker as the commit)."""
    if found.problem is not None:
        return StepInfo(found.step, found.name, "partial", None, None, None, found.problem, tier)
    try:
        nbytes = sum(meta.nbytes for _, meta in formats.read_item(root.child(found.name)).arrays())
    except CheckpointError as exc:
        return StepInfo(found.step, found.name, "invalid", None, None, None, str(exc), tier)
    return StepInfo(found.step, found.name, "committed", found.committed_at, nbytes, None, tier=tier)


# -------------------------------------------------------------------------------------------------- tree


@dataclass(frozen=True)
class TreeRow:
    key: str
    meta: ArrayMetadata | None  # None for a JSON value
    value: Any = None

    def to_json(self) -> dict:
        if self.meta is None:
            return {"key": self.key, "value": self.value}
        out = {"key": self.key, "shape": list(self.meta.shape), "dtype": self.meta.dtype,
               "chunk_shape": list(self.meta.chunk_shape), "bytes": self.meta.nbytes,
               "sharding": dataclasses.asdict(self.meta.sharding) if self.meta.sharding else None}
        if self.meta.opaque is not None:
            out["opaque"] = self.meta.opaque
        return out


def tree_rows(checkpoint: Checkpoint, item: str | None = None) -> list[TreeRow]:
    """One row per leaf of every item (or of `item`), in tree order."""
    items = checkpoint.items if item is None else (item,)
    if item is not None and item not in checkpoint.items:
        raise UsageError(f"unknown item {item!r}; {checkpoint.location} has {', '.join(checkpoint.items)}")
    rows = []
    for name in items:
        manifest = checkpoint.manifest(name)
        leaves = tree.flatten(manifest.tree)
        # A value is shown under the name the writing format would give it as an array: like the arrays beside it
        names = formats.array_names(manifest, [p for p, _ in leaves])
        for (_, leaf), leaf_name in zip(leaves, names):
            if isinstance(leaf, ArrayMetadata):
                rows.append(TreeRow(full_key(name, leaf.path), leaf))
            else:
                rows.append(TreeRow(full_key(name, leaf_name), None, leaf))
    return rows


# ------------------------------------------------------------------------------------------------ slices


_SLICE = re.compile(r"^(?P<key>[^\[\]]+?)(?:\[(?P<slice>[^\[\]]*)\])?$")


def parse_key_and_slice(text: str, rank_of: Callable[[str], int]) -> tuple[str, tuple[slice | int, ...]]:
    """Split ``key[0:4, :8]`` into the key and index expressions (ints and slices with optional step).
    `UsageError` for malformed input."""
    match = _SLICE.match(text.strip())
    if match is None:
        raise UsageError(f"malformed key or slice {text!r}; expected KEY or KEY[start:stop, ...]")
    key, spec = match.group("key"), match.group("slice")
    if spec is None:
        return key, ()
    parts = [p.strip() for p in spec.split(",")]
    if parts == [""]:
        return key, ()
    rank = rank_of(key)
    if len(parts) > rank:
        raise UsageError(f"slice {spec!r} has {len(parts)} indices but {key} has {rank} dimensions")
    index: list[slice | int] = []
    for part in parts:
        try:
            if ":" in part:
                fields = part.split(":")
                if len(fields) > 3:
                    raise ValueError(part)
                numbers = [int(f) if f.strip() else None for f in fields]
                if len(numbers) == 3 and numbers[2] is not None and numbers[2] <= 0:
                    raise ValueError(part)
                index.append(slice(*numbers))
            else:
                index.append(int(part))
        except ValueError:
            raise UsageError(f"malformed index {part!r} in {text!r}") from None
    return key, tuple(index)


def read_slice(checkpoint: Checkpoint, key: str, index: tuple[slice | int, ...]) -> np.ndarray:
    """The values of `index` of an array, reading only the chunks it touches."""
    item, meta = array_metadata(checkpoint, key)
    for dim, (i, n) in enumerate(zip(index, meta.shape)):
        if isinstance(i, int) and not -n <= i < n:
            raise UsageError(f"index {i} is out of range for dimension {dim} of {key} (size {n})")
    normalized = tuple(_normalize(i, n) for i, n in zip(index, meta.shape))
    return checkpoint.open(item, meta).read_index(normalized).result()


def _normalize(index: slice | int, size: int) -> slice | int:
    if isinstance(index, int):
        return index % size
    start, stop, step = index.indices(size)
    return slice(start, stop, step) if step != 1 else slice(start, max(start, stop))


# -------------------------------------------------------------------------------------------- restore plans


@dataclass(frozen=True)
class RestoreTarget:
    """What ``xtckpt plan`` and ``xtckpt show --layout`` plan a restore onto (their shared ``--mesh``,
    ``--spec``, ``--processes`` and ``--target`` arguments): the shards of `mesh` (None: whole arrays), tensor
    dimensions cut by the mesh dimensions `spec` names (None: dimension i by mesh dimension i), split over
    `processes`, for the keys, shapes and dtypes of the checkpoint at `target` (None: the checkpoint's own)."""

    mesh: tuple[int, ...] | None = None
    spec: tuple | None = None
    processes: int = 1
    target: str | None = None

    @classmethod
    def of(cls, args: Any) -> RestoreTarget:
        """The target the parsed arguments of `cli_text.add_target_arguments` describe."""
        return cls(args.mesh, args.spec, args.processes, args.target)


def plan_item(checkpoint: Checkpoint, item: str, target: RestoreTarget) -> list[tuple[Any, restore_plan.RestorePlan]]:
    """(the target tree, its `restore_plan.RestorePlan`) of each process restoring `item` onto `target`, from
    metadata alone. Blocks. Raises `UsageError` for an impossible target (see `plan_target`)."""
    if target.processes < 1:
        raise UsageError(f"--processes {target.processes}: there must be at least one process")
    target_of = open_checkpoint(target.target) if target.target else None
    out = []
    for process in range(target.processes):
        tree_ = plan_target(checkpoint, item, target_of, mesh=target.mesh, spec=target.spec, process=process,
                            processes=target.processes)
        out.append((tree_, restore_plan.plan_restore(checkpoint.item_location(item), tree_, process=process,
                                                     processes=target.processes)))
    return out


def plan_target(checkpoint: Checkpoint, item: str, target_of: Checkpoint | None, *, mesh: tuple[int, ...] | None,
                process: int, processes: int, spec: tuple | None = None) -> Any:
    """A restore target for planning, without data: the tree of `item` (or of the same item of `target_of`, or
    its only item), each array a `ShardedArray` target holding the shards of `mesh` (dimension i cut into
    ``mesh[i]``; None: the whole array) that process `process` of `processes` would hold, the grid's shards
    split contiguously in C order. With a partition `spec` (per tensor dimension: None, a mesh dimension or a
    tuple of them, outermost first; missing trailing entries None), the mesh's devices (numbered in C order,
    split contiguously over the processes) hold the shards their coordinates pick, replicated over the mesh
    dimensions no tensor dimension uses. Raises `UsageError` for a spec naming a mesh dimension it lacks or
    twice, or devices that do not split evenly."""
    if processes < 1 or not 0 <= process < processes:
        raise UsageError(f"process {process} of {processes}: there must be at least one process")
    if spec is not None:
        _check_spec(mesh, spec, processes)
    source = checkpoint if target_of is None else target_of
    name = item if item in source.items else source.items[0] if len(source.items) == 1 else None
    if name is None:
        raise UsageError(f"{source.location} has no item {item!r} to stand for the target (it holds "
                         f"{', '.join(source.items)})")

    def leaf(_path: Any, value: Any) -> Any:
        if not isinstance(value, ArrayMetadata):
            return value
        shape = value.shape
        if spec is not None:
            shard, mine = _spec_shards(shape, mesh, spec, process, processes)
            return ShardedArray.target(shape, value.torch_dtype, shard, mine)
        parts = tuple(mesh[d] if mesh is not None and d < len(mesh) else 1 for d in range(len(shape)))
        shard = tuple(max(1, -(-n // p)) for n, p in zip(shape, parts))
        indices = ShardedArray.grid(shape, shard) if 0 not in shape else []
        share = -(-len(indices) // processes)
        mine = indices[process * share:(process + 1) * share]
        return ShardedArray.target(shape, value.torch_dtype, shard, mine)

    return tree.rebuild(source.manifest(name).tree, leaf)


def _spec_axes(spec: tuple, rank: int) -> list[tuple[int, ...]]:
    """The mesh dimensions cutting each of `rank` tensor dimensions (entries beyond the spec: none)."""
    padded = tuple(spec[:rank]) + (None,) * max(0, rank - len(spec))
    return [() if s is None else (s,) if isinstance(s, int) else tuple(s) for s in padded]


def _check_spec(mesh: tuple[int, ...] | None, spec: tuple, processes: int) -> None:
    if mesh is None:
        raise UsageError("a partition spec (--spec) needs a mesh (--mesh)")
    used = [a for axes in _spec_axes(spec, len(spec)) for a in axes]
    bad = [a for a in used if not 0 <= a < len(mesh)]
    if bad or len(set(used)) != len(used):
        raise UsageError(f"partition spec {spec}: each entry names mesh dimensions 0..{len(mesh) - 1} of mesh "
                         f"{'x'.join(map(str, mesh))}, each at most once")
    if math.prod(mesh) % processes:
        raise UsageError(f"the {math.prod(mesh)} devices of mesh {'x'.join(map(str, mesh))} do not split evenly "
                         f"over {processes} processes")


def _spec_shards(shape: tuple[int, ...], mesh: tuple[int, ...], spec: tuple, process: int,
                 processes: int) -> tuple[tuple[int, ...], list]:
    """(shard shape, the distinct shards the devices of `process` hold) of an array under a partition spec."""
    axes = _spec_axes(spec, len(shape))
    shard = tuple(max(1, -(-n // math.prod(mesh[a] for a in dims))) for n, dims in zip(shape, axes))
    per = math.prod(mesh) // processes
    mine: list = []
    for device in range(process * per, (process + 1) * per):
        coordinate = np.unravel_index(device, mesh)
        index = []
        for n, s, dims in zip(shape, shard, axes):
            k = 0
            for a in dims:
                k = k * mesh[a] + int(coordinate[a])
            index.append((min(k * s, n), min((k + 1) * s, n)))
        if all(b > a for a, b in index) and tuple(index) not in mine:
            mine.append(tuple(index))
    return shard, mine
