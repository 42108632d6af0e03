"""Where an array's data lives, as boxes over its two largest dimensions, from metadata alone: the stored chunk
grid with the devices that held each chunk when it was saved (`saved_layout`), or the shards a restore onto a
mesh gives each process with the stored chunks each reads (`restore_layout`, planned by `restore_plan`).

Devices come from the saved sharding (`records.SavedSharding`): an HLO tile assignment (torch_xla), or a
DTensor's mesh and partition spec. Every holder of a chunk is named: the first is replica 0, which writes the
chunk unless the save balanced replicated writes over its holders. Processes are inferred from devices as
``device // (devices / processes)`` (devices numbered host by host), when the step records several processes.
Used by ``xtckpt show --layout``, the report and `views.layout`; blocks; no torch_xla.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

import numpy as np

from ..core import dtypes, grid, tree
from ..core.errors import UsageError
from ..core.records import ArrayMetadata, SavedSharding
from ..restores import restore_plan
from ..tools import inspection
from ..tools.inspection import Checkpoint

MAX_CHUNKS = 1 << 16  # chunks walked to draw one array
MAX_DEVICES = 1 << 14
_DEVICES_RE = re.compile(r"devices=\[([0-9,]+)\]([0-9,]*)")
_IOTA_RE = re.compile(r"<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")


@dataclass(frozen=True)
class Box:
    """One box of a layout: its region in the two drawn dimensions (``[start, stop)`` each), who holds or reads
    it (device or process numbers; none: not recorded), its bytes, and the stored chunks it holds (saved) or its
    reads touch (restore)."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    holders: tuple[int, ...]
    nbytes: int
    chunks: int = 1

    def to_json(self) -> dict:
        return {"rows": list(self.rows), "cols": list(self.cols), "holders": list(self.holders),
                "bytes": self.nbytes, "chunks": self.chunks}


@dataclass(frozen=True)
class Layout:
    """An array's boxes over dimensions `dims` (the two largest; one for 1-D, none for scalars). `kind` is
    ``saved`` (holders are devices) or ``restore`` (holders are processes); `processes` maps devices to
    processes when known; `notes` say what could not be known."""

    key: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    dims: tuple[int, ...]
    grid_shape: tuple[int, int]
    boxes: tuple[Box, ...]
    sharding: str
    device_processes: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"key": self.key, "kind": self.kind, "shape": list(self.shape), "dtype": self.dtype,
                "dims": list(self.dims), "grid": list(self.grid_shape), "sharding": self.sharding,
                "device_processes": list(self.device_processes), "notes": list(self.notes),
                "boxes": [b.to_json() for b in self.boxes]}


def drawn_dims(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The two largest dimensions, in order (the earlier one on ties); all of them below two."""
    if len(shape) <= 2:
        return tuple(range(len(shape)))
    largest = sorted(range(len(shape)), key=lambda d: (-shape[d], d))[:2]
    return tuple(sorted(largest))


def tile_devices(sharding: SavedSharding, rank: int) -> dict[tuple[int, ...], tuple[int, ...]]:
    """The devices holding each tile (its position in the tile grid ``sharding.tiles``), replica 0 first. Empty
    if the sharding does not say (then the caller notes it)."""
    if sharding.num_devices > MAX_DEVICES or len(sharding.tiles) != rank:
        return {}
    if sharding.hlo and "devices=[" in sharding.hlo:
        return _hlo_tiles(sharding.hlo, rank)
    if sharding.mesh_shape and sharding.partition_spec is not None and not sharding.hlo:
        return _mesh_tiles(sharding.mesh_shape, _by_position(sharding.partition_spec, sharding.axis_names), rank)
    if "replicated" in sharding.hlo or math.prod(sharding.tiles) == 1:
        return {(0,) * rank: tuple(range(sharding.num_devices))}
    return {}


def _hlo_tiles(hlo: str, rank: int) -> dict[tuple[int, ...], tuple[int, ...]]:
    match = _DEVICES_RE.search(hlo)
    if match is None:
        return {}
    dims = tuple(int(d) for d in match.group(1).split(","))
    iota = _IOTA_RE.search(hlo)
    if iota is not None:
        reshape = [int(d) for d in iota.group(1).split(",")]
        if math.prod(reshape) > MAX_DEVICES:
            return {}
        ids = np.arange(math.prod(reshape)).reshape(reshape)
        if iota.group(2):
            ids = ids.transpose([int(p) for p in iota.group(2).split(",")])
        order = [int(d) for d in ids.reshape(-1)]
    else:
        order = [int(d) for d in match.group(2).split(",") if d]
    if len(dims) < rank or math.prod(dims) != len(order) or len(order) > MAX_DEVICES:
        return {}
    out: dict[tuple[int, ...], list[int]] = {}
    for flat, position in enumerate(itertools.product(*(range(d) for d in dims))):
        out.setdefault(position[:rank], []).append(order[flat])
    return {k: tuple(v) for k, v in out.items()}


def _by_position(spec: tuple, names: tuple[str, ...] | None) -> tuple:
    """A partition spec with mesh axis names replaced by their positions (unknown names: -1, refused later)."""
    index = {n: i for i, n in enumerate(names or ())}

    def one(axis: object) -> object:
        return index.get(axis, -1) if isinstance(axis, str) else axis

    return tuple(tuple(one(a) for a in s) if isinstance(s, (tuple, list)) else one(s) for s in spec)


def _mesh_tiles(mesh_shape: tuple[int, ...], spec: tuple, rank: int) -> dict[tuple[int, ...], tuple[int, ...]]:
    """A DTensor's (or a mesh's) tiles: device = its mesh coordinate in C order; tensor dimension d is cut by
    the mesh dimensions of ``spec[d]`` (outermost first)."""
    axes = [() if s is None else (s,) if isinstance(s, int) else tuple(s) for s in spec]
    if len(axes) != rank or any(not isinstance(a, int) or not 0 <= a < len(mesh_shape) for x in axes for a in x):
        return {}
    out: dict[tuple[int, ...], list[int]] = {}
    for device, coordinate in enumerate(itertools.product(*(range(n) for n in mesh_shape))):
        tile = []
        for dims in axes:
            k = 0
            for a in dims:
                k = k * mesh_shape[a] + coordinate[a]
            tile.append(k)
        out.setdefault(tuple(tile), []).append(device)
    return {k: tuple(v) for k, v in out.items()}


def saved_layout(checkpoint: Checkpoint, key: str) -> Layout:
    """The stored chunk grid of `key` with the devices that held each chunk, from metadata. Blocks (reads
    metadata only). Raises `UsageError` for an unknown key or a grid too large to draw."""
    _, meta = inspection.array_metadata(checkpoint, key)
    if meta.num_chunks > MAX_CHUNKS:
        raise UsageError(f"{key} has {meta.num_chunks} chunks: too many to draw (at most {MAX_CHUNKS})")
    sharding = meta.sharding
    rank = len(meta.shape)
    notes = []
    tiles = tile_devices(sharding, rank) if sharding is not None else {}
    if sharding is None:
        notes.append("saved without a recorded sharding (a CPU tensor, or a format that does not keep it)")
    elif not tiles:
        notes.append(f"the saved sharding does not name its devices: {sharding.describe()}")
    tile_shape = tuple(max(1, -(-n // t)) for n, t in zip(meta.shape, sharding.tiles)) if tiles else ()
    boxes = _boxes(meta, lambda region: _holders(region, tile_shape, meta.shape, tiles))
    processes = _device_processes(checkpoint, sharding)
    return Layout(key, "saved", meta.shape, meta.dtype, drawn_dims(meta.shape), _grid_of(boxes), boxes,
                  sharding.describe() if sharding else "unsharded", processes, tuple(notes))


def _holders(region: grid.Index, tile_shape: tuple[int, ...], shape: tuple[int, ...],
             tiles: dict[tuple[int, ...], tuple[int, ...]]) -> tuple[int, ...]:
    if not tiles:
        return ()
    held: list[int] = []
    for position, _ in grid.chunks_in(region, tile_shape, shape) if shape else [((), ())]:
        held.extend(d for d in tiles.get(position, ()) if d not in held)
    return tuple(held)


def _boxes(meta: ArrayMetadata, holders_of) -> tuple[Box, ...]:
    """One box per chunk position in the drawn dimensions, summed over the other dimensions."""
    dims = drawn_dims(meta.shape)
    itemsize = dtypes.by_name(meta.dtype).itemsize
    merged: dict[tuple, list] = {}
    for _, region in grid.chunks(meta.shape, meta.chunk_shape):
        spans = tuple(region[d] for d in dims)
        entry = merged.setdefault(spans, [[], 0, 0])
        entry[0].extend(h for h in holders_of(region) if h not in entry[0])
        entry[1] += math.prod(b - a for a, b in region) * itemsize
        entry[2] += 1
    out = []
    for spans, (holders, nbytes, count) in merged.items():
        rows = spans[0] if spans else (0, 1)
        cols = spans[1] if len(spans) > 1 else (0, 1)
        out.append(Box(rows, cols, tuple(holders), nbytes, count))
    return tuple(out)


def _grid_of(boxes: tuple[Box, ...]) -> tuple[int, int]:
    return len({b.rows for b in boxes}), len({b.cols for b in boxes})


def _device_processes(checkpoint: Checkpoint, sharding: SavedSharding | None) -> tuple[int, ...]:
    processes = checkpoint.marker.process_count if checkpoint.marker else 1
    if sharding is None or processes <= 1 or sharding.num_devices % processes or sharding.num_devices > MAX_DEVICES:
        return ()
    per = sharding.num_devices // processes
    return tuple(d // per for d in range(sharding.num_devices))


def restore_layout(checkpoint: Checkpoint, key: str, target: inspection.RestoreTarget
                   ) -> tuple[Layout, tuple[restore_plan.KeyPlan, ...]]:
    """The shards of a restore of `key` onto `target` (as ``xtckpt plan`` plans it, `inspection.plan_item`):
    one box per target shard, with the processes reading it, its bytes and the stored chunks it touches; and
    the plan of the key for each process. Blocks (reads metadata only). Raises `UsageError` for an unknown
    key, an impossible target, or too many shards to draw."""
    item, meta = inspection.array_metadata(checkpoint, key)
    key_path = next(p for p, m in checkpoint.manifest(item).arrays() if m.path == meta.path)
    itemsize = dtypes.by_name(meta.dtype).itemsize
    boxes, plans = [], []
    dims = drawn_dims(meta.shape)
    name = tree.format_key_path(key_path)
    for process, (target_tree, plan) in enumerate(inspection.plan_item(checkpoint, item, target)):
        key_plan = next((k for k in plan.keys if k.key == name), None)
        leaf = dict(tree.flatten(target_tree)).get(key_path)
        if key_plan is None or leaf is None:
            raise UsageError(f"the restore target {target.target} has no key {name!r} like {key}")
        plans.append(key_plan)
        for index, _ in getattr(leaf, "shards", ()):
            touched = sum(1 for _ in grid.chunks_in(index, meta.chunk_shape, meta.shape)) if meta.shape else 1
            nbytes = math.prod(b - a for a, b in index) * itemsize
            rows = index[dims[0]] if dims else (0, 1)
            cols = index[dims[1]] if len(dims) > 1 else (0, 1)
            boxes.append(Box(rows, cols, (process,), nbytes, touched))
        if len(boxes) > MAX_CHUNKS:
            raise UsageError(f"a restore of {key} onto {_target_text(target)} has too many shards to draw")
    merged = _merge_other_dims(boxes)
    layout = Layout(key, "restore", meta.shape, meta.dtype, dims, _grid_of(merged), merged, _target_text(target))
    return layout, tuple(plans)


def _target_text(target: inspection.RestoreTarget) -> str:
    mesh = "whole arrays" if target.mesh is None else f"mesh {'x'.join(map(str, target.mesh))}"
    spec = "" if target.spec is None else f" spec {target.spec}"
    processes = f"{target.processes} process{'es' if target.processes > 1 else ''}"
    other = f" as in {target.target}" if target.target else ""
    return f"restore onto {mesh}{spec}, {processes}{other}"


def _merge_other_dims(boxes: list[Box]) -> tuple[Box, ...]:
    merged: dict[tuple, Box] = {}
    for b in boxes:
        old = merged.get((b.rows, b.cols))
        merged[(b.rows, b.cols)] = b if old is None else Box(
            b.rows, b.cols, old.holders + tuple(h for h in b.holders if h not in old.holders),
            old.nbytes + b.nbytes, old.chunks + b.chunks)
    return tuple(merged.values())
