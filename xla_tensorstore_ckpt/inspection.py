"""Offline inspection of checkpoints: list steps, describe trees, read slices, statistics, diffs, verification.

Works on a checkpoint root, a step directory or a single item directory (written by `xtc.save`), local or
remote, without torch_xla and without the training code. Arrays are addressed by keys of the form
``<item>/<array path>`` (``model/layers.0.weight``), the array path being the escaped key path of `layout`.
Everything streams chunk by chunk: memory stays near one chunk. Used by the command line; blocks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts

from . import arrays, layout, restoring, storage, tree
from .errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError
from .metadata import ArrayMetadata, ItemManifest, StepMetadata

Progress = Callable[[int, int], None]


class UsageError(CheckpointError, ValueError):
    """The request is malformed (unknown key, bad slice); distinct from damaged data."""


@dataclass(frozen=True)
class Checkpoint:
    """A step directory (items listed by its marker) or a lone item directory (one unnamed item)."""

    location: storage.Location
    marker: StepMetadata | None
    items: tuple[str, ...]

    def item_location(self, item: str) -> storage.Location:
        return self.location.child(item) if item else self.location

    def manifest(self, item: str) -> ItemManifest:
        return restoring.read_manifest(self.item_location(item))


def open_checkpoint(path: str | storage.Location) -> Checkpoint:
    """Resolve `path` to a committed step or an item directory. Raises `CheckpointNotFoundError` if it is
    neither (an uncommitted step included), `CorruptCheckpointError`/`FormatVersionError` for a bad marker."""
    loc = storage.location(path)
    data = storage.read(loc, layout.CHECKPOINT_METADATA)
    if data is not None:
        marker = StepMetadata.from_bytes(data, where=str(loc.child(layout.CHECKPOINT_METADATA)))
        return Checkpoint(loc, marker, marker.items)
    if storage.read(loc, layout.ITEM_METADATA) is not None:
        return Checkpoint(loc, None, ("",))
    if layout.parse_step_name(loc.name, None) is not None and not storage.is_empty(loc):
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


def open_array(step_path: str, key: str) -> ts.TensorStore:
    """A read-only tensorstore array for ``<item>/<array path>`` of a step (or the array path of an item).
    Reads only the chunks indexed; every chunk's checksum is verified."""
    checkpoint = open_checkpoint(step_path)
    item, meta = array_metadata(checkpoint, key)
    return arrays.open_existing(checkpoint.item_location(item).child(meta.path)).result()


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


def list_steps(root: str) -> list[StepInfo]:
    """Every step-named directory under `root` with its status; sizes are the bytes of the stored arrays."""
    loc = storage.location(root)
    out = []
    for name in storage.list_children(loc):
        step = _step_number(name)
        if step is None:
            continue
        data = storage.read(loc.child(name), layout.CHECKPOINT_METADATA)
        if data is None:
            out.append(StepInfo(step, name, "partial", None, None, None))
            continue
        try:
            marker = StepMetadata.from_bytes(data, where=str(loc.child(name, layout.CHECKPOINT_METADATA)))
            nbytes = sum(meta.nbytes for item in marker.items
                         for _, meta in restoring.read_manifest(loc.child(name, item)).arrays())
        except (CorruptCheckpointError, FormatVersionError, CheckpointNotFoundError) as exc:
            out.append(StepInfo(step, name, "invalid", None, None, None, str(exc)))
            continue
        out.append(StepInfo(step, name, "committed", marker.committed_at, nbytes, marker.metrics))
    return sorted(out, key=lambda s: (s.step, s.name))


def _step_number(name: str) -> int | None:
    match = re.fullmatch(r"(?:.*_)?(0|[1-9][0-9]*)", name)
    return int(match.group(1)) if match else None


# -------------------------------------------------------------------------------------------------- tree


@dataclass(frozen=True)
class TreeRow:
    key: str
    meta: ArrayMetadata | None  # None for a JSON value
    value: Any = None


def tree_rows(checkpoint: Checkpoint, item: str | None = None) -> list[TreeRow]:
    """One row per leaf of every item (or of `item`), in tree order."""
    items = checkpoint.items if item is None else (item,)
    if item is not None and item not in checkpoint.items:
        raise UsageError(f"unknown item {item!r}; {checkpoint.location} has {', '.join(checkpoint.items)}")
    rows = []
    for name in items:
        for path, leaf in tree.flatten(checkpoint.manifest(name).tree):
            if isinstance(leaf, ArrayMetadata):
                rows.append(TreeRow(full_key(name, leaf.path), leaf))
            else:
                rows.append(TreeRow(full_key(name, layout.array_path(path)), None, leaf))
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
    store = arrays.open_existing(checkpoint.item_location(item).child(meta.path)).result()
    normalized = tuple(_normalize(i, n) for i, n in zip(index, meta.shape))
    region = store[normalized] if normalized else store
    return arrays.Pending(region.read(), "cannot read", checkpoint.item_location(item).child(meta.path)).result()


def _normalize(index: slice | int, size: int) -> slice | int:
    if isinstance(index, int):
        return index % size
    start, stop, step = index.indices(size)
    return slice(start, stop, step) if step != 1 else slice(start, max(start, stop))


# ------------------------------------------------------------------------------------------ chunk walking


def chunk_regions(meta: ArrayMetadata) -> Iterator[tuple[tuple[int, ...], tuple[slice, ...]]]:
    """(chunk grid index, region) of every chunk of an array, in C order."""
    if 0 in meta.shape:
        return
    grid = [range(-(-n // c)) for n, c in zip(meta.shape, meta.chunk_shape)]
    for cell in np.ndindex(*[len(g) for g in grid]) if grid else [()]:
        yield cell, tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(cell, meta.chunk_shape, meta.shape))


def iter_chunks(loc: storage.Location, meta: ArrayMetadata, *, window: int = 8
                ) -> Iterator[tuple[tuple[int, ...], np.ndarray | Exception]]:
    """Every chunk's data (or the error reading it), a few reads in flight at a time."""
    try:
        store = arrays.open_existing(loc).result()
    except (CorruptCheckpointError, OSError) as exc:
        yield (), exc
        return
    if tuple(store.shape) != meta.shape or arrays.stored_dtype_name(store) != meta.dtype:
        yield (), CorruptCheckpointError(
            f"{loc}/{layout.ZARR_METADATA} describes {arrays.stored_dtype_name(store)}{list(store.shape)} but "
            f"{layout.ITEM_METADATA} records {meta.dtype}{list(meta.shape)}")
        return
    cells = chunk_regions(meta)
    queue: list[tuple[tuple[int, ...], arrays.Pending]] = []
    for cell, region in cells:
        queue.append((cell, arrays.read(store, loc, region)))
        if len(queue) >= window:
            yield _take(queue.pop(0))
    while queue:
        yield _take(queue.pop(0))


def _take(entry: tuple[tuple[int, ...], arrays.Pending]) -> tuple[tuple[int, ...], np.ndarray | Exception]:
    cell, pending = entry
    try:
        return cell, pending.result()
    except (CorruptCheckpointError, OSError) as exc:
        return cell, exc


def chunk_name(cell: tuple[int, ...]) -> str:
    return "c/" + "/".join(str(i) for i in cell) if cell else "c"


# ------------------------------------------------------------------------------------------------- stats


@dataclass(frozen=True)
class ArrayStats:
    key: str
    count: int
    min: float | None
    max: float | None
    mean: float | None
    std: float | None
    nan: int
    inf: int


def array_stats(checkpoint: Checkpoint, key: str) -> ArrayStats:
    """Min, max, mean, std (over finite values), NaN and Inf counts, streaming chunk by chunk. Raises
    `CorruptCheckpointError` naming the chunk for damaged data."""
    item, meta = array_metadata(checkpoint, key)
    loc = checkpoint.item_location(item).child(meta.path)
    count = nan = inf = 0
    total = total_sq = 0.0
    low, high = math.inf, -math.inf
    for cell, data in iter_chunks(loc, meta):
        if isinstance(data, Exception):
            raise CorruptCheckpointError(f"{key} chunk {chunk_name(cell)}: {data}") from data
        values = data.astype(np.float64) if data.dtype.kind != "c" else np.abs(data).astype(np.float64)
        finite = values[np.isfinite(values)]
        nan += int(np.isnan(values).sum())
        inf += int(np.isinf(values).sum())
        if finite.size:
            count += finite.size
            total += float(finite.sum())
            total_sq += float(np.square(finite).sum())
            low, high = min(low, float(finite.min())), max(high, float(finite.max()))
    if not count:
        return ArrayStats(key, 0, None, None, None, None, nan, inf)
    mean = total / count
    return ArrayStats(key, count, low, high, mean, math.sqrt(max(0.0, total_sq / count - mean * mean)), nan, inf)


def all_array_keys(checkpoint: Checkpoint) -> list[str]:
    return [row.key for row in tree_rows(checkpoint) if row.meta is not None]


# -------------------------------------------------------------------------------------------------- diff


@dataclass(frozen=True)
class DiffEntry:
    key: str
    change: str  # "added", "removed", "shape", "dtype", "values", "value"
    detail: dict


def diff(a: Checkpoint, b: Checkpoint, progress: Progress | None = None) -> list[DiffEntry]:
    """Differences from `a` to `b`: keys added and removed, shape and dtype changes, and for arrays whose
    values differ the max absolute difference and relative L2 distance ``|b - a| / |a|``. Streams chunk by
    chunk. Equal arrays and values are not listed."""
    rows_a = {r.key: r for r in tree_rows(a)}
    rows_b = {r.key: r for r in tree_rows(b)}
    out = [DiffEntry(k, "removed", {}) for k in rows_a if k not in rows_b]
    out += [DiffEntry(k, "added", {}) for k in rows_b if k not in rows_a]
    common = [k for k in rows_a if k in rows_b]
    for done, key in enumerate(common, 1):
        ra, rb = rows_a[key], rows_b[key]
        if ra.meta is None or rb.meta is None:
            if ra.meta is not None or rb.meta is not None or ra.value != rb.value:
                out.append(DiffEntry(key, "value", {"a": _describe(ra), "b": _describe(rb)}))
        elif ra.meta.shape != rb.meta.shape:
            out.append(DiffEntry(key, "shape", {"a": list(ra.meta.shape), "b": list(rb.meta.shape)}))
        elif ra.meta.dtype != rb.meta.dtype:
            out.append(DiffEntry(key, "dtype", {"a": ra.meta.dtype, "b": rb.meta.dtype}))
        else:
            entry = _array_diff(a, b, key, ra.meta, rb.meta)
            if entry is not None:
                out.append(entry)
        if progress:
            progress(done, len(common))
    return out


def _describe(row: TreeRow) -> Any:
    return f"array {row.meta.dtype}{list(row.meta.shape)}" if row.meta is not None else row.value


def _array_diff(a: Checkpoint, b: Checkpoint, key: str, ma: ArrayMetadata, mb: ArrayMetadata
                ) -> DiffEntry | None:
    store_a = arrays.open_existing(a.item_location(split_key(key, a)[0]).child(ma.path)).result()
    store_b = arrays.open_existing(b.item_location(split_key(key, b)[0]).child(mb.path)).result()
    max_abs = 0.0
    diff_sq = ref_sq = 0.0
    differs = False
    for _, region in chunk_regions(ma):
        va = store_a[region].read().result().astype(np.float64)
        vb = store_b[region].read().result().astype(np.float64)
        if np.array_equal(va, vb, equal_nan=True):
            ref_sq += float(np.square(np.nan_to_num(va)).sum())
            continue
        differs = True
        delta = np.abs(vb - va)
        max_abs = max(max_abs, float(np.nanmax(delta)) if delta.size else 0.0)
        diff_sq += float(np.nansum(np.square(vb - va)))
        ref_sq += float(np.square(np.nan_to_num(va)).sum())
    if not differs:
        return None
    relative = math.sqrt(diff_sq) / math.sqrt(ref_sq) if ref_sq else math.inf
    return DiffEntry(key, "values", {"max_abs_diff": max_abs, "relative_l2": relative})


# ------------------------------------------------------------------------------------------------ verify


@dataclass(frozen=True)
class Problem:
    where: str  # step / key / chunk
    message: str


def verify(path: str, progress: Progress | None = None) -> tuple[int, list[Problem]]:
    """Check every chunk of every array of a step, an item, or every step under a root: present, checksum
    valid, metadata consistent (steps with an invalid commit marker are problems; uncommitted ones are not
    checkpoints and are skipped). Returns (arrays checked,
    problems). Raises `CheckpointNotFoundError` if `path` is none of these."""
    try:
        return _verify_all([open_checkpoint(path)], progress)
    except CheckpointNotFoundError:
        steps = list_steps(path)
        if not steps:
            raise
    loc = storage.location(path)
    problems = [Problem(f"step {s.step}", s.problem or "invalid commit marker")
                for s in steps if s.status == "invalid"]  # partial steps are not checkpoints: skipped
    checked, more = _verify_all([open_checkpoint(loc.child(s.name)) for s in steps if s.status == "committed"],
                                progress)
    return checked, problems + more


def _verify_all(targets: list[Checkpoint], progress: Progress | None) -> tuple[int, list[Problem]]:
    problems: list[Problem] = []
    work = []
    for checkpoint in targets:
        prefix = f"step {checkpoint.marker.step}: " if checkpoint.marker else ""
        for item in checkpoint.items:
            try:
                manifest = checkpoint.manifest(item)
            except (CorruptCheckpointError, FormatVersionError, CheckpointNotFoundError) as exc:
                problems.append(Problem(prefix + (item or "item"), str(exc)))
                continue
            work.extend((checkpoint, prefix, item, meta) for _, meta in manifest.arrays())
    for done, (checkpoint, prefix, item, meta) in enumerate(work, 1):
        loc = checkpoint.item_location(item).child(meta.path)
        key = full_key(item, meta.path)
        for cell, data in iter_chunks(loc, meta):
            if isinstance(data, Exception):
                problems.append(Problem(f"{prefix}{key} {chunk_name(cell)}", str(data)))
        if progress:
            progress(done, len(work))
    return len(work), problems
