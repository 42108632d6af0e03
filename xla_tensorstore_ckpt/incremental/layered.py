"""Reading an item of an incremental step (`LayeredReader`, an `arrays.ArrayReader`): its own chunks from its
own store, every referenced chunk from the step that stores it, through that step's own reader (local chunk
reads, tensorstore, object stores alike). `arrays.reader` returns it for an item whose ``_METADATA`` records
references (`refs`), so every reader of ours follows them: restore in every mode, ``xtckpt`` (show, stats,
diff, verify, convert), `plan_restore`. A region that lies in one step is one read there; one spanning chunks of
several steps is read piece by piece (each piece within one chunk) and assembled.

A base step that is missing, or whose array differs from the one the tables describe, is a
`CorruptCheckpointError` naming the item, the array, the step and its path.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Sequence

import numpy as np

from .. import arrays, formats, storage
from ..arrays.base import ArrayReader, Empty, Index, PendingRead, Picked, StoredArray, index_box
from ..errors import CheckpointError, CorruptCheckpointError
from ..records import ArrayMetadata, ArrayStore
from . import tables

Own = None  # a chunk's source: the item's own store


class LayeredReader(ArrayReader):
    """Reads the arrays of an item with references (see the module). Opening blocks on the item's chunk
    tables (once) and on each base's manifest (once per base)."""

    def __init__(self, item: storage.Location, store: ArrayStore, context: object = None):
        self.item, self.refs, self.context = item, store.refs, context
        self.own = arrays.reader(item, dataclasses.replace(store, refs=None), context)
        self.fetches_once = self.own.fetches_once
        self._bases: dict[int, tuple[ArrayReader, dict[str, ArrayMetadata]]] = {}
        self._where: dict[str, dict[tuple[int, ...], int | None]] | None = None
        self._lock = threading.Lock()

    def open(self, meta: ArrayMetadata) -> arrays.Opening:
        opening = self.own.open(meta)
        if meta.path not in self.refs.arrays:
            return opening
        return _Opening(self, meta, opening)

    def close(self) -> None:
        self.own.close()
        for reader, _ in self._bases.values():
            reader.close()

    def fetched_bytes(self) -> int | None:
        counts = [self.own.fetched_bytes(), *(r.fetched_bytes() for r, _ in self._bases.values())]
        return None if any(c is None for c in counts) else sum(counts)

    # ------------------------------------------------------------------------------------------ lookups

    def chunk_steps(self, name: str) -> dict[tuple[int, ...], int | None]:
        """Where each chunk of array `name` lives: grid position -> the step storing it (None: this item)."""
        with self._lock:
            if self._where is None:
                where: dict[str, dict[tuple[int, ...], int | None]] = {}
                for table in self.refs.tables:
                    found = tables.read(self.item, table)
                    if found is None:
                        raise CorruptCheckpointError(f"{self.item}: its chunk table {table} is missing or of "
                                                     f"another hash; the item's references cannot be followed")
                    for array, entry in found.items():
                        chunks = where.setdefault(array, {})
                        for index, (_, step) in entry.chunks.items():
                            chunks[tuple(int(i) for i in index.split("."))if index else ()] = step
                self._where = where
            return self._where.get(name, {})

    def base_array(self, step: int, meta: ArrayMetadata) -> arrays.Opening:
        """Start opening array `meta` in base `step`, checked against `meta`."""
        with self._lock:
            if step not in self._bases:
                loc = self.item.parent.parent.child(self.refs.base_dir(step), self.item.name)
                try:
                    manifest = formats.read_item(loc)
                except CheckpointError as exc:
                    raise CorruptCheckpointError(
                        f"{self.item}: array {meta.path} references chunks of step {step} at {loc}, which is "
                        f"missing or damaged ({exc}); that step was deleted or is incomplete") from exc
                store = dataclasses.replace(manifest.store, refs=None)  # references are flattened: one level
                metas = {m.path: m for _, m in manifest.arrays()}
                self._bases[step] = (arrays.reader(loc, store, self.context), metas)
            reader, metas = self._bases[step]
        base = metas.get(meta.path)
        if base is None or (tuple(base.shape), base.dtype, tuple(base.chunk_shape)) != (
                tuple(meta.shape), meta.dtype, tuple(meta.chunk_shape)):
            raise CorruptCheckpointError(f"{self.item}: array {meta.path} references chunks of step {step}, whose "
                                         f"item holds no such array (or one of another shape, dtype or chunking)")
        return reader.open(base)


class _Opening:
    def __init__(self, reader: LayeredReader, meta: ArrayMetadata, own: arrays.Opening):
        self.reader, self.meta, self.own = reader, meta, own

    def result(self) -> StoredArray:
        where = self.reader.chunk_steps(self.meta.path)
        steps = sorted({s for s in where.values() if s is not None})
        bases = {s: self.reader.base_array(s, self.meta) for s in steps}
        return LayeredArray(self.own.result(), {s: o.result() for s, o in bases.items()}, where)


class LayeredArray:
    """An array whose chunks live in several steps (see the module)."""

    def __init__(self, own: StoredArray, bases: dict[int, StoredArray], where: dict[tuple[int, ...], int | None]):
        self.own, self.bases, self.where = own, bases, where
        self.location, self.shape, self.dtype_name = own.location, own.shape, own.dtype_name
        self.chunk_shape, self.reads_whole_chunks = own.chunk_shape, own.reads_whole_chunks

    def _source(self, step: int | None) -> StoredArray:
        return self.own if step is None else self.bases[step]

    def _pieces(self, region: Index) -> list[tuple[int | None, Index]]:
        """The parts of `region`, each within one chunk, with the step storing it."""
        if any(b <= a for a, b in region):
            return [(Own, region)]
        ranges = [range(a // c, -(-b // c)) for (a, b), c in zip(region, self.chunk_shape)]
        pieces = []
        for index in itertools.product(*ranges):
            sub = tuple((max(a, i * c), min(b, (i + 1) * c)) for (a, b), i, c in zip(region, index, self.chunk_shape))
            pieces.append((self.where.get(tuple(index), Own), sub))
        return pieces

    def read(self, regions: Sequence[Index], empty: Empty = np.empty) -> dict[Index, PendingRead]:
        plans = {region: self._pieces(region) for region in regions}
        whole: dict[int | None, list[Index]] = {}
        split: dict[int | None, list[Index]] = {}
        for region, pieces in plans.items():
            steps = {s for s, _ in pieces}
            if len(steps) == 1:
                whole.setdefault(steps.pop(), []).append(region)
            else:
                for s, sub in pieces:
                    split.setdefault(s, []).append(sub)
        out: dict[Index, PendingRead] = {}
        for step, group in whole.items():
            out.update(self._source(step).read(group, empty))
        parts: dict[tuple[int | None, Index], PendingRead] = {}
        for step, group in split.items():
            for sub, pending in self._source(step).read(list(dict.fromkeys(group))).items():
                parts[(step, sub)] = pending
        for region, pieces in plans.items():
            if region not in out:
                out[region] = _Assembled(region, [(sub, parts[(s, sub)]) for s, sub in pieces], empty)
        return out

    def read_index(self, index: tuple[slice | int, ...]) -> PendingRead:
        box, within = index_box(index, self.shape)
        return Picked(self.read([box])[box], within)


class _Assembled:
    """A region read piece by piece: `result()` waits for every piece and copies it into place."""

    def __init__(self, region: Index, pieces: list[tuple[Index, PendingRead]], empty: Empty):
        self.region, self.pieces, self.empty = region, pieces, empty

    def result(self) -> np.ndarray:
        values = arrays.wait_all([p for _, p in self.pieces])
        out = self.empty(tuple(b - a for a, b in self.region), values[0].dtype)
        for (sub, _), value in zip(self.pieces, values):
            out[tuple(slice(a - ra, b - ra) for (a, b), (ra, _) in zip(sub, self.region))] = value
        return out
