"""Whole-array passes over checkpoints, chunk by chunk: the chunk walk (which `views.histogram`'s statistics take),
diffs and verification. Memory stays near a few chunks; every chunk's checksum is verified as it is read. Used by
the command line and the views; blocks; no torch_xla."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import arrays, storage
from ..arrays.base import Empty
from ..core import dtypes, grid, layout
from ..core.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, UsageError
from ..core.records import ArrayMetadata, ArrayStore
from ..formats import checksums
from .inspection import (
    Checkpoint,
    Progress,
    TreeRow,
    full_key,
    list_steps,
    open_checkpoint,
    split_key,
    tree_rows,
)

Cell = tuple[int, ...]


class WalkCounts(storage.Counts):
    """What `iter_chunks` walked in this process since it started (`WALKED`): arrays opened and chunks (or
    regions) read. The views read each array once; tests read it to see that."""

    FIELDS = ("arrays", "chunks")


WALKED = WalkCounts()


def chunk_regions(meta: ArrayMetadata) -> Iterator[tuple[Cell, grid.Index]]:
    """(chunk grid position, region) of every chunk of an array, in C order, lazily."""
    return grid.chunks(meta.shape, meta.chunk_shape)


def iter_chunks(checkpoint: Checkpoint, item: str, meta: ArrayMetadata, *, regions: Iterable | None = None,
                window: int = 8, empty: Empty = np.empty) -> Iterator[tuple[Cell, np.ndarray | Exception]]:
    """Every chunk's data of the array `meta` of `item`, or with `regions` ((position, region) pairs) those
    regions' data, or the error reading it; a few reads in flight at a time (memory stays near `window`
    chunks). The data are read into buffers from `empty` (called on this thread: a caller that knows when it
    is done with a chunk may hand out buffers again, as `views.histogram` does)."""
    loc = checkpoint.item_location(item).child(meta.path)
    try:
        stored = checkpoint.open(item, meta)
    except (CheckpointError, OSError) as exc:
        yield (), exc
        return
    if stored.shape != meta.shape or stored.dtype_name != meta.dtype:
        yield (), CorruptCheckpointError(
            f"{loc}/{layout.ZARR_METADATA} describes {stored.dtype_name}{list(stored.shape)} but "
            f"{layout.ITEM_METADATA} records {meta.dtype}{list(meta.shape)}")
        return
    cells = chunk_regions(meta) if regions is None else regions
    queue: list[tuple[Cell, arrays.PendingRead]] = []
    WALKED.add(arrays=1)
    for cell, region in cells:
        WALKED.add(chunks=1)
        queue.append((cell, stored.read([region], empty)[region]))
        if len(queue) >= window:
            yield _take(queue.pop(0))
    while queue:
        yield _take(queue.pop(0))


def _take(entry: tuple[Cell, arrays.PendingRead]) -> tuple[Cell, np.ndarray | Exception]:
    cell, pending = entry
    try:
        return cell, pending.result()
    except (CheckpointError, OSError) as exc:
        return cell, exc


# -------------------------------------------------------------------------------------------------- diff


@dataclass(frozen=True)
class DiffEntry:
    key: str
    change: str  # "added", "removed", "shape", "dtype", "values", "value", "equal"
    detail: dict

    def to_json(self) -> dict:
        return {"key": self.key, "change": self.change, **self.detail}


def diff(a: Checkpoint, b: Checkpoint, progress: Progress | None = None, *,
         key_map: Callable[[str], str | None] | None = None, include_equal: bool = False,
         observe_b: Callable[[str, np.ndarray], None] | None = None) -> list[DiffEntry]:
    """Differences from `a` to `b`: keys added and removed, shape and dtype changes, and for arrays whose
    values differ ("values"): the 2-norm of the difference ``|b - a|`` (``delta_l2``), of `a` (``a_l2``), their
    ratio (``relative_l2``), the elements that differ (``differing``, NaN equal to NaN, of ``elements``) and
    the max absolute difference. Streams chunk by chunk, each chunk of both read once. Equal arrays and values
    are listed (change "equal") only with `include_equal`. `key_map` renames `a`'s keys (None drops one) to
    compare checkpoints whose formats name keys otherwise; `UsageError` if two keys get the same name.
    `observe_b` is handed each region of `b` read (its key in `b`, the data), array after array, so that a
    caller may take statistics of `b` without reading it again."""
    rows_a = _renamed({r.key: r for r in tree_rows(a)}, key_map)
    rows_b = {r.key: r for r in tree_rows(b)}
    out = [DiffEntry(k, "removed", {}) for k in rows_a if k not in rows_b]
    out += [DiffEntry(k, "added", {}) for k in rows_b if k not in rows_a]
    common = [k for k in rows_a if k in rows_b]
    for done, key in enumerate(common, 1):
        ra, rb = rows_a[key], rows_b[key]
        if ra.meta is None or rb.meta is None:
            if ra.meta is not None or rb.meta is not None or not _same_value(ra.value, rb.value):
                out.append(DiffEntry(key, "value", {"a": _describe(ra), "b": _describe(rb)}))
            elif include_equal:
                out.append(DiffEntry(key, "equal", {}))
        elif ra.meta.shape != rb.meta.shape:
            out.append(DiffEntry(key, "shape", {"a": list(ra.meta.shape), "b": list(rb.meta.shape)}))
        elif ra.meta.dtype != rb.meta.dtype:
            out.append(DiffEntry(key, "dtype", {"a": ra.meta.dtype, "b": rb.meta.dtype}))
        else:
            entry = _array_diff(a, b, key, (ra.key, ra.meta), (rb.key, rb.meta), observe_b)
            if entry.change != "equal" or include_equal:
                out.append(entry)
        if progress:
            progress(done, len(common))
    return out


def _renamed(rows: dict[str, TreeRow], key_map: Callable[[str], str | None] | None) -> dict[str, TreeRow]:
    if key_map is None:
        return rows
    out: dict[str, TreeRow] = {}
    for key, row in rows.items():
        new = key_map(key)
        if new is None:
            continue
        if new in out:
            raise UsageError(f"the key map gives {out[new].key!r} and {key!r} the same name {new!r}")
        out[new] = row
    return out


def _same_value(a: Any, b: Any) -> bool:
    """Equal scalar leaves, NaN equal to NaN (as for arrays): a run's NaN loss is no difference."""
    if a == b:
        return True
    return isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)


def _describe(row: TreeRow) -> Any:
    return f"array {row.meta.dtype}{list(row.meta.shape)}" if row.meta is not None else row.value


def _array_diff(a: Checkpoint, b: Checkpoint, key: str, side_a: tuple[str, ArrayMetadata],
                side_b: tuple[str, ArrayMetadata],
                observe_b: Callable[[str, np.ndarray], None] | None = None) -> DiffEntry:
    (key_a, ma), (key_b, mb) = side_a, side_b
    # b may be chunked otherwise: it is read by a's chunks (each side walks a's grid lazily, on its own)
    chunks_a = iter_chunks(a, split_key(key_a, a)[0], ma, regions=chunk_regions(ma))
    chunks_b = iter_chunks(b, split_key(key_b, b)[0], mb, regions=chunk_regions(ma))
    max_abs = diff_sq = ref_sq = 0.0
    differing = 0
    raw = dtypes.by_name(ma.dtype).copy_dtype
    for (cell, data_a), (_, data_b) in zip(chunks_a, chunks_b):
        for data in (data_a, data_b):
            if isinstance(data, Exception):
                raise CorruptCheckpointError(f"{key} chunk {layout.chunk_key(cell)}: {data}") from data
        if observe_b is not None:
            observe_b(key_b, data_b)
        if data_a.dtype == data_b.dtype and np.array_equal(data_a.view(raw), data_b.view(raw)):
            ref_sq += _sum_of_squares(data_a)  # the same bytes: no float copies of either side
            continue
        chunk_ref_sq, chunk_differing, chunk_max_abs, chunk_diff_sq = _chunk_diff(data_a, data_b)
        ref_sq += chunk_ref_sq
        differing += chunk_differing
        max_abs = max(max_abs, chunk_max_abs)
        diff_sq += chunk_diff_sq
    elements = math.prod(ma.shape)
    if not differing:
        return DiffEntry(key, "equal", {"elements": elements, "a_l2": math.sqrt(ref_sq)})
    relative = math.sqrt(diff_sq) / math.sqrt(ref_sq) if ref_sq else math.inf
    return DiffEntry(key, "values", {"max_abs_diff": max_abs, "relative_l2": relative, "delta_l2": math.sqrt(diff_sq),
                                     "a_l2": math.sqrt(ref_sq), "differing": differing, "elements": elements})


def _chunk_diff(data_a: np.ndarray, data_b: np.ndarray) -> tuple[float, int, float, float]:
    """(Σ a² with NaN as 0, the elements that differ (NaN equal to NaN), max |b - a|, Σ (b - a)² over the
    differing elements) of two chunks of one shape whose bytes differ, in float64. Finite data (the usual case)
    takes one float64 copy of each side and reading passes over them (for finite values b - a is 0 exactly
    where they are equal); NaN or Inf, the masks that compare them."""
    if data_a.dtype.kind in "iu":
        return _int_chunk_diff(data_a.reshape(-1), data_b.reshape(-1))
    va, vb = data_a.reshape(-1).astype(np.float64), data_b.reshape(-1).astype(np.float64)
    if _all_finite(data_a) and _all_finite(data_b):
        ref_sq = float(va @ va)
        delta = np.subtract(vb, va, out=vb)
        differing = int(np.count_nonzero(delta))
        if not differing:
            return ref_sq, 0, 0.0, 0.0
        diff_sq = float(delta @ delta)
        return ref_sq, differing, float(np.abs(delta, out=delta).max()), diff_sq
    ref_sq = float(np.square(np.nan_to_num(va)).sum())
    if np.array_equal(va, vb, equal_nan=True):
        return ref_sq, 0, 0.0, 0.0
    unequal = (va != vb) & ~(np.isnan(va) & np.isnan(vb))
    delta = np.abs(vb - va)
    return (ref_sq, int(np.count_nonzero(unequal)), float(np.nanmax(delta)) if delta.size else 0.0,
            float(np.nansum(np.square(vb - va))))


def _int_chunk_diff(a: np.ndarray, b: np.ndarray) -> tuple[float, int, float, float]:
    """`_chunk_diff` of integer chunks, exact where float64 is not (int64 values beyond 2^53 that differ by
    less than their spacing in float64): each |b - a| taken exactly as a uint64 (the difference of the two
    values' 64-bit words, modulo 2^64, in the order that makes it non-negative), then in float64."""
    wide = np.int64 if a.dtype.kind == "i" else np.uint64
    a, b = a.astype(wide, copy=False), b.astype(wide, copy=False)
    words_a, words_b = a.view(np.uint64), b.view(np.uint64)
    gap = np.where(b >= a, words_b - words_a, words_a - words_b).astype(np.float64)
    va = a.astype(np.float64)
    differing = int(np.count_nonzero(gap))
    return (float(va @ va), differing, float(gap.max()) if differing else 0.0,
            float(gap @ gap) if differing else 0.0)


def _all_finite(data: np.ndarray) -> bool:
    return data.dtype.kind in "iub" or bool(np.isfinite(data).all())


def _sum_of_squares(data: np.ndarray) -> float:
    """Σ x² in float64 (NaN as 0), without a float64 copy for finite float32/float64 data."""
    flat = data.reshape(-1)
    if flat.dtype in (np.float32, np.float64) and np.isfinite(flat).all():
        return float(np.einsum("i,i->", flat, flat, dtype=np.float64))
    return float(np.square(np.nan_to_num(flat.astype(np.float64))).sum())


# ------------------------------------------------------------------------------------------------ verify


@dataclass(frozen=True)
class Problem:
    where: str  # step / key / chunk
    message: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Verification:
    """What `verify` found: arrays checked, problems, and notes on what could not be checked."""

    arrays: int
    problems: list[Problem]
    notes: list[str]

    def to_json(self) -> dict:
        return {"arrays": self.arrays, "ok": not self.problems, "problems": [p.to_json() for p in self.problems],
                "notes": self.notes}


def verify(path: str, progress: Progress | None = None) -> Verification:
    """Check every chunk of every array of a step, an item, or every step under a root: present, checksum
    valid, metadata consistent, ``_METADATA``, ``_CHECKPOINT_METADATA`` and ``_strings.json`` matching the
    checksums they record (steps with an invalid commit marker are problems; uncommitted ones are not
    checkpoints and are skipped). Items Orbax wrote and Hugging Face files carry no per-chunk checksums: their
    chunks are checked to be present and to decode (their tensors' bytes to be present), and a note says so.
    Raises `CheckpointNotFoundError` if `path` is none of these."""
    try:
        return _verify_all([open_checkpoint(path)], [], progress)
    except CheckpointNotFoundError:
        steps = list_steps(path)
        if not steps:
            raise
    except CheckpointError as exc:  # a step whose marker does not decode
        return Verification(0, [Problem(str(path), str(exc))], [])
    loc = storage.location(path)
    problems = [Problem(f"step {s.step}", s.problem or "invalid commit marker")
                for s in steps if s.status == "invalid"]  # partial steps are not checkpoints: skipped
    return _verify_all([open_checkpoint(loc.child(s.name)) for s in steps if s.status == "committed"], problems,
                       progress)


def _verify_all(targets: list[Checkpoint], problems: list[Problem], progress: Progress | None) -> Verification:
    work = []
    notes = []
    for checkpoint in targets:
        prefix = f"step {checkpoint.marker.step}: " if checkpoint.marker else ""
        for item in checkpoint.items:
            try:
                manifest = checkpoint.manifest(item)
                checksums.verify_strings(checkpoint.item_location(item), manifest)
            except CheckpointError as exc:
                problems.append(Problem(prefix + (item or "item"), str(exc)))
                continue
            if not manifest.store.checksums and manifest.arrays():
                notes.append(f"{prefix}{item or 'item'}: {_unchecked(manifest.store)}")
            work.extend((checkpoint, prefix, item, meta) for _, meta in manifest.arrays())
    for done, (checkpoint, prefix, item, meta) in enumerate(work, 1):
        key = full_key(item, meta.path)
        for cell, data in iter_chunks(checkpoint, item, meta):
            if isinstance(data, Exception):
                problems.append(Problem(f"{prefix}{key} {layout.chunk_key(cell)}", str(data)))
        if progress:
            progress(done, len(work))
    return Verification(len(work), problems, notes)


def _unchecked(store: ArrayStore) -> str:
    """What `verify` can check in a store whose data carries no checksums, by the kind of store."""
    if store.kind == "safetensors":
        return ("Hugging Face safetensors files carry no checksums: checked that every tensor's bytes are present "
                "and read")
    if store.kind == "dcp":
        return ("torch.distributed.checkpoint files carry no checksums: checked that every chunk's entry is present, "
                "is the tensor the metadata describes, and reads")
    note = "written by Orbax, whose chunks carry no checksums: checked that every chunk is present and decodes"
    if store.fill_missing:
        note += (" (written without store_array_data_equal_to_fill_value, so chunks equal to the fill value are not "
                 "stored: a missing chunk reads as that value and cannot be found)")
    return note
