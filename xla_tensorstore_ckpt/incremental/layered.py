"""Reading an item of an incremental step (`LayeredReader`, an `arrays.ArrayReader`): its own chunks from its own
store, every referenced chunk from the step that stores it, through that step's own reader (local chunk reads,
tensorstore, object stores alike). `reader` returns it for an item whose ``_METADATA`` records references
(`formats.item_refs`), else `arrays.reader`'s reader of the item's own arrays; every reader of ours asks `reader`,
so all follow references: restore in every mode, ``xtckpt`` (show, stats, diff, verify, convert), `plan_restore`,
`DCPStorageReader`, an incremental save's deltas. A region that lies in one step is one read there; one spanning
chunks of several steps is read piece by piece (each piece within one chunk) and assembled. A delta chunk (`tables`)
is its anchor's chunk, read whole from the anchor step's own store, with the chain's frames applied in order, each
read from the delta file of this item or of the step holding it, checked (CRC32C) and applied (`deltas`): chains are
flattened, so no step between is opened.

A base step that is missing, or whose array differs from the one the tables describe, is a
`CorruptCheckpointError` naming the item, the array, the step and its path.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Sequence

import crc32c
import numpy as np

from .. import arrays, formats, storage
from ..arrays.base import ArrayReader, Empty, Index, PendingRead, Picked, StoredArray, index_box
from ..core import threads
from ..core.errors import CheckpointError, CorruptCheckpointError
from ..core.records import ArrayMetadata, ArrayStore
from . import deltas, tables

Own = None  # a chunk's source: the item's own store
# Delta chunks are rebuilt here as soon as their reads are asked for, beside the other chunks' reads and each
# other (zstd decompresses without the GIL), rather than one by one when the restore waits for each.
_REBUILDS = threads.pool("cpu", "xtc-delta-rebuild")
# Where a chunk is: (the step holding it whole, None: this item; or a delta chain `tables.Delta`)
Where = tuple[int | None, tables.Delta | None]


def reader(item: storage.Location, store: ArrayStore, context: object = None) -> ArrayReader:
    """The reader of the arrays of the item at `item`, whatever the item: `LayeredReader` for an incremental
    step's item with referenced arrays, else the reader of its own arrays (`arrays.reader`), for one operation
    (`context`: its tensorstore context). Called by every reader of items (restores, tools, `dcp_storage`, an
    incremental save's deltas). Does no I/O."""
    if store.refs is not None and store.refs.arrays:
        return LayeredReader(item, store, context)
    return arrays.reader(item, store, context)


class LayeredReader(ArrayReader):
    """Reads the arrays of an item with references (see the module). Opening blocks on the item's chunk
    tables (once) and on each base's manifest (once per base)."""

    def __init__(self, item: storage.Location, store: ArrayStore, context: object = None):
        self.item, self.refs, self.context = item, store.refs, context
        self.own = arrays.reader(item, dataclasses.replace(store, refs=None), context)
        self.fetches_once = self.own.fetches_once
        self._bases: dict[int, tuple[ArrayReader, dict[str, ArrayMetadata]]] = {}
        self._where: dict[str, dict[tuple[int, ...], Where]] | None = None
        self._lock = threading.Lock()
        # Delta frames: those of the arrays opened, by file, not read yet (`want_frames`), and those read with
        # another's span and not asked for yet (`read_frame`); one lock per file serializes its span reads
        self._wanted: dict[tuple[int | None, str], set[tables.Link]] = {}
        self._frames: dict[tables.Link, memoryview] = {}
        self._file_locks: dict[tuple[int | None, str], threading.Lock] = {}

    def open(self, meta: ArrayMetadata) -> arrays.Opening:
        if meta.path not in self.refs.arrays:
            return self.own.open(meta)
        where = self.chunk_steps(meta.path)
        self.want_frames(where)
        # The bases' arrays are opened now, beside the other arrays' openings, not when the restore waits for
        # each: an OCDBT store's reads issued together share its manifest's fetch (opened one by one, a base
        # store's manifest was fetched again for nearly every array: 46 requests of a delta restore's 103 on
        # gs://, against 16 for a full restore's store).
        steps = sorted({s for s, _ in where.values() if s is not None}
                       | {d[0] for _, d in where.values() if d is not None})
        bases = {s: self.base_array(s, meta) for s in steps}
        # An array none of whose chunks is in this item's store is not opened there (its metadata read and
        # parsed for nothing: a third of a delta step's opens on an object store, each a request's CPU)
        return _Opening(self, meta, None if _all_elsewhere(where, meta) else self.own.open(meta), where, bases)

    def close(self) -> None:
        self.own.close()
        for reader, _ in self._bases.values():
            reader.close()

    def fetched_bytes(self) -> int | None:
        counts = [self.own.fetched_bytes(), *(r.fetched_bytes() for r, _ in self._bases.values())]
        return None if any(c is None for c in counts) else sum(counts)

    # ------------------------------------------------------------------------------------------ lookups

    def chunk_steps(self, name: str) -> dict[tuple[int, ...], Where]:
        """Where each chunk of array `name` lives (grid position -> `Where`); a chunk not listed is this item's."""
        with self._lock:
            if self._where is None:
                where: dict[str, dict[tuple[int, ...], Where]] = {}
                for table in self.refs.tables:
                    found = tables.read(self.item, table)
                    if found is None:
                        raise CorruptCheckpointError(f"{self.item}: its chunk table {table} is missing or of "
                                                     f"another hash; the item's references cannot be followed")
                    for array, entry in found.items():
                        chunks = where.setdefault(array, {})
                        for index, (_, step, delta) in entry.chunks.items():
                            position = tuple(int(i) for i in index.split(".")) if index else ()
                            chunks[position] = (step, delta)
                self._where = where
            return self._where.get(name, {})

    def want_frames(self, where: dict[tuple[int, ...], Where]) -> None:
        """Note the delta frames of an array being opened (its chunks' `where`), for `read_frame` to read with
        the others of their file. Never blocks (but on the reader's lock)."""
        with self._lock:
            for _, delta in where.values():
                for link in delta[1] if delta is not None else ():
                    if link not in self._frames:
                        self._wanted.setdefault(link[:2], set()).add(link)

    def read_frame(self, link: tables.Link, meta: ArrayMetadata) -> bytes | memoryview:
        """The checked frame of one delta of a chain. Blocks. Read with the other frames of its file that the
        arrays opened so far want (`want_frames`) and that lie with it within `FRAME_GAP` of each other, up to
        `FRAME_SPAN` bytes in one read: a step's frames lie end to end in its delta file, so a restore reads
        them in a few reads rather than one per chunk (on an object store each read is a request, and its CPU);
        the others are kept for their chunks' `read_frame` (until the reader is dropped). Raises
        `CorruptCheckpointError` naming the file for a frame missing or damaged."""
        step, file, at, length, crc = link
        item = self.item if step is None else self.step_item(step)
        with self._lock:
            lock = self._file_locks.setdefault(link[:2], threading.Lock())
        with lock:
            with self._lock:
                frame = self._frames.pop(link, None)
                wanted = self._wanted.get(link[:2], set())
                wanted.discard(link)
                span = [link] if frame is not None else _span(link, wanted)
                wanted.difference_update(span)
            if frame is None:
                start, stop = span[0][2], max(a + n for _, _, a, n, _ in span)
                data = item.read_range(file, start, stop).result()
                if data is not None and len(data) == stop - start:
                    data = memoryview(data).cast("B")
                    with self._lock:
                        for other in span:
                            if other != link:
                                self._frames[other] = data[other[2] - start:other[2] - start + other[3]]
                    frame = data[at - start:at - start + length]
        if frame is None or len(frame) != length or crc32c.crc32c(frame) != crc:
            raise CorruptCheckpointError(f"{item.child(file)}: the delta of a chunk of array {meta.path} "
                                         f"(bytes {at}-{at + length}) is missing or damaged (CRC32C mismatch)")
        return frame

    def step_item(self, step: int) -> storage.Location:
        """This item in base `step` (a sibling step directory)."""
        return self.item.parent.parent.child(self.refs.base_dir(step), self.item.name)

    def base_array(self, step: int, meta: ArrayMetadata) -> arrays.Opening:
        """Start opening array `meta` in base `step`, checked against `meta`."""
        with self._lock:
            if step not in self._bases:
                loc = self.step_item(step)
                try:
                    manifest = formats.read_item(loc)
                except CheckpointError as exc:
                    raise CorruptCheckpointError(
                        f"{self.item}: array {meta.path} references chunks of step {step} at {loc}, which is "
                        f"missing or damaged ({exc}); that step was deleted or is incomplete") from exc
                metas = {m.path: m for _, m in manifest.arrays()}
                # Its own store only: references and chains are flattened, what is read there is held there whole
                self._bases[step] = (arrays.reader(loc, dataclasses.replace(manifest.store, refs=None),
                                                   self.context), metas)
            reader, metas = self._bases[step]
        base = metas.get(meta.path)
        if base is None or (tuple(base.shape), base.dtype, tuple(base.chunk_shape)) != (
                tuple(meta.shape), meta.dtype, tuple(meta.chunk_shape)):
            raise CorruptCheckpointError(f"{self.item}: array {meta.path} references chunks of step {step}, whose "
                                         f"item holds no such array (or one of another shape, dtype or chunking)")
        return reader.open(base)


FRAME_GAP = 64 << 10  # bytes between two frames read in one span at most (`read_frame`)
FRAME_SPAN = 8 << 20  # bytes of one span of frames at most: the first of them waits for the whole span


def _span(link: tables.Link, wanted: set[tables.Link]) -> list[tables.Link]:
    """The frames read with `link` (`LayeredReader.read_frame`): those of `wanted` (of its file) that lie in a
    run with it, each within `FRAME_GAP` of the one before, at most `FRAME_SPAN` bytes in all; by offset."""
    run = [link]
    ordered = sorted(wanted - {link}, key=lambda other: other[2])
    after = [o for o in ordered if o[2] > link[2]]
    before = [o for o in reversed(ordered) if o[2] < link[2]]
    start, stop = link[2], link[2] + link[3]
    for other in after:
        if other[2] - stop > FRAME_GAP or other[2] + other[3] - start > FRAME_SPAN:
            break
        run.append(other)
        stop = max(stop, other[2] + other[3])
    for other in before:
        if start - (other[2] + other[3]) > FRAME_GAP or stop - other[2] > FRAME_SPAN:
            break
        run.insert(0, other)
        start = other[2]
    return run


def _all_elsewhere(where: dict[tuple[int, ...], Where], meta: ArrayMetadata) -> bool:
    """True if every chunk of array `meta` is held by another step (whole or as a delta on its anchor)."""
    if meta.num_chunks == 0 or len(where) < meta.num_chunks:
        return False
    grid = [-(-n // c) for n, c in zip(meta.shape, meta.chunk_shape)]
    elsewhere = {index for index, (step, delta) in where.items() if step is not None or delta is not None
                 if len(index) == len(grid) and all(0 <= i < g for i, g in zip(index, grid))}
    return len(elsewhere) == meta.num_chunks


class _Opening:
    def __init__(self, reader: LayeredReader, meta: ArrayMetadata, own: arrays.Opening | None,
                 where: dict[tuple[int, ...], Where], bases: dict[int, arrays.Opening]):
        self.reader, self.meta, self.own, self.where, self.bases = reader, meta, own, where, bases

    def result(self) -> StoredArray:
        return LayeredArray(None if self.own is None else self.own.result(),
                            {s: o.result() for s, o in self.bases.items()}, self.where,
                            lambda link: self.reader.read_frame(link, self.meta),
                            self.reader.item.child(self.meta.path))


class LayeredArray:
    """An array whose chunks live in several steps (see the module); `own` None where none is in this item's
    store (`LayeredReader.open`): its shape and chunking are then its bases', checked equal to its own."""

    def __init__(self, own: StoredArray | None, bases: dict[int, StoredArray], where: dict[tuple[int, ...], Where],
                 read_frame, location: storage.Location):
        self.own, self.bases, self.where, self.read_frame = own, bases, where, read_frame
        like = own if own is not None else next(iter(bases.values()))
        self.location = like.location if own is not None else location
        self.shape, self.dtype_name = like.shape, like.dtype_name
        self.chunk_shape, self.reads_whole_chunks = like.chunk_shape, like.reads_whole_chunks

    def _source(self, step) -> StoredArray:
        if isinstance(step, tuple):  # a delta chunk: ("delta", grid position)
            return _DeltaChunk(self, step[1])
        return self.own if step is None else self.bases[step]

    def _pieces(self, region: Index) -> list[tuple[object, Index]]:
        """The parts of `region`, each within one chunk, with where it is read: a step (None: this item's
        store) or ("delta", grid position)."""
        if any(b <= a for a, b in region):  # nothing to read: any store of the array answers
            return [(Own if self.own is not None else next(iter(self.bases)), region)]
        ranges = [range(a // c, -(-b // c)) for (a, b), c in zip(region, self.chunk_shape)]
        pieces = []
        for index in itertools.product(*ranges):
            sub = tuple((max(a, i * c), min(b, (i + 1) * c)) for (a, b), i, c in zip(region, index, self.chunk_shape))
            step, delta = self.where.get(tuple(index), (Own, None))
            pieces.append((("delta", tuple(index)) if delta is not None else step, sub))
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


class _DeltaChunk:
    """The reads of one delta chunk, shaped as a `StoredArray`'s: the chunk is rebuilt whole (its base's chunk
    XOR the delta), then each region is cut out of it."""

    def __init__(self, array: LayeredArray, index: tuple[int, ...]):
        self.array, self.index = array, index

    def read(self, regions: Sequence[Index], empty: Empty = np.empty) -> dict[Index, PendingRead]:
        chunk = tuple((i * c, min((i + 1) * c, n)) for i, c, n in zip(self.index, self.array.chunk_shape,
                                                                    self.array.shape))
        anchor, links, _ = self.array.where[self.index][1]
        where = f"{self.array.location}: chunk {list(self.index)}"

        def frames() -> list[bytes]:
            return [self.array.read_frame(link) for link in links]

        if list(regions) == [chunk]:  # the whole chunk: read into the caller's buffer, the deltas applied there
            whole = _Rebuilt(self.array.bases[anchor].read([chunk], empty)[chunk], frames, where)
            _REBUILDS.submit(whole.result)  # its error, if any, is raised again to the caller's `result`
            return {chunk: whole}
        whole = _Rebuilt(self.array.bases[anchor].read([chunk])[chunk], frames, where)
        _REBUILDS.submit(whole.result)
        return {r: _Cut(whole, tuple(slice(a - ca, b - ca) for (a, b), (ca, _) in zip(r, chunk)), empty)
                for r in regions}


class _Rebuilt:
    """A delta chunk's values (its anchor's chunk, the chain applied), rebuilt once however many regions cut
    from it, on whichever thread asks first (`_REBUILDS`, or the restoring thread); a failure is raised to every
    caller, never retried (deltas applied in place may have been applied in part)."""

    def __init__(self, base: PendingRead, frames, where: str):
        self.base, self.frames, self.where = base, frames, where
        self.value, self.error, self._lock = None, None, threading.Lock()

    def result(self) -> np.ndarray:
        with self._lock:
            if self.value is None and self.error is None:
                try:
                    # the anchor's chunk was read into a buffer of its own (`np.empty`, or the caller's for the
                    # whole chunk): deltas go in place
                    value = self.base.result()
                    for frame in self.frames():
                        value = deltas.apply(value, frame, in_place=True)
                    self.value = value
                except ValueError as exc:
                    self.error = CorruptCheckpointError(f"{self.where}, a delta chunk: {exc}")
                except CheckpointError as exc:
                    self.error = exc
            if self.error is not None:
                raise self.error
            return self.value


class _Cut:
    def __init__(self, whole: _Rebuilt, within: tuple, empty: Empty):
        self.whole, self.within, self.empty = whole, within, empty

    def result(self) -> np.ndarray:
        value = self.whole.result()[self.within]
        out = self.empty(value.shape, value.dtype)
        out[...] = value
        return out


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
