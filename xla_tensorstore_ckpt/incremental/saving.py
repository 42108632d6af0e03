"""An incremental save, chunk by chunk: each chunk a process writes is hashed (`arrays.chunk_hashes`) and
compared with the base step's chunk of the same array name, shape, dtype, chunk shape and grid position; an
unchanged one is recorded as a reference to the step that stores its bytes instead of being written
(`Recorder`). At the end each process writes its chunk table (`tables`). At the commit, the primary reads the
item's tables and records the item's references and the step's bases (`commit_refs`).

The hooks: `writing.ChunkWriter` (a `Recorder` when `SaveOptions.incremental` holds a `BaseStep`) and
`tier.Tier.commit` (`commit_refs`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import crc32c
import numpy as np

from .. import formats
from ..arrays.chunk_hashes import chunk_hash
from ..core import buffers, dtypes
from ..core.errors import CheckpointError
from ..core.records import StepMetadata
from ..formats import item_refs as refs_mod
from ..formats.item_refs import ItemRefs
from ..multihost.distributed import Coordinator
from ..storage import Location
from . import deltas, layered, tables

logger = logging.getLogger("xla_tensorstore_ckpt")


@dataclass(frozen=True)
class BaseStep:
    """What an incremental save compares with: the committed `step` at `location` (its step directory), or
    nothing (`step` None: an anchor, every chunk written, the tables recorded for the next save). With `delta`, a
    changed chunk is stored as the zstd frame of its XOR with its anchor's chunk where that frame is at most
    `delta_max_ratio` of the chunk and the anchor lies fewer than `max_chain` saves back. `present`: the steps
    whose stored chunks may be referenced (the tier's committed steps); a base chunk held in, or chained on, any
    other step (one deleted by hand) is written again."""

    step: int | None = None
    location: Location | None = None
    present: frozenset[int] = frozenset()
    delta: bool = False
    max_chain: int = 8
    delta_max_ratio: float = 0.5


class Recorder:
    """Decides, chunk by chunk, what one process's save of one item writes, and keeps its chunk table. Reads
    the base item's tables when created (blocks; a missing or non-incremental base item: everything is
    written), and with deltas the base's changed chunks. Raises `CheckpointError` naming the base's file if a
    table or a chunk of it is damaged."""

    def __init__(self, item: Location, base: BaseStep, writer: int):
        self.options, self.writer = base, writer
        self.base_item = base.location.child(item.name) if base.location is not None else None
        self.base, self.gone = _base_tables(self.base_item, base.step, base.present) \
            if self.base_item is not None else ({}, {})
        self.table: dict[str, tables.ArrayChunks] = {}
        self.whole: dict[str, str] = {}  # arrays written whole although the base has them: why
        self.frames: list[bytes] = []
        self.delta_bytes = 0
        self._reader = None  # of the base item, for deltas
        self._anchor_buffer = buffers.Carved()  # the anchor's chunk, read there chunk after chunk

    def select(self, group: Sequence, data: Sequence[Sequence]) -> tuple[list, list[list]]:
        """The plans of `group` (`save_plan.ArrayPlan`) with only the chunks to write, and their data (as
        `ChunkWriter.write` takes them); every chunk of `group` is recorded."""
        plans, kept_data = [], []
        for p, chunk_data in zip(group, data):
            writes, kept = [], []
            for w, d in zip(p.writes, chunk_data):
                if any(b <= a for a, b in w.region) or not self._recorded(p.meta, w.region, d):
                    writes.append(w)
                    kept.append(d)
            if writes:
                plans.append(p if len(writes) == len(p.writes) else dataclasses.replace(p, writes=tuple(writes)))
                kept_data.append(kept)
        return plans, kept_data

    def _recorded(self, meta, region, data) -> bool:
        """Record the chunk; True if it is referenced or stored as a delta (not written to the store)."""
        array = dtypes.tensor_to_numpy(data)
        digest = chunk_hash(array)
        entry = self.table.get(meta.path)
        if entry is None:
            entry = self.table[meta.path] = tables.ArrayChunks(tuple(meta.shape), meta.dtype,
                                                               tuple(meta.chunk_shape), {})
        index = tables.index_name(tuple(a // c for (a, _), c in zip(region, meta.chunk_shape)))
        chunk: tables.Chunk = (digest, None, None)
        base = self.base.get(meta.path)
        if base is not None:
            if (base.shape, base.dtype, base.chunk_shape) != (entry.shape, entry.dtype, entry.chunk_shape):
                self.whole[meta.path] = (f"the base stored it as {base.dtype}{list(base.shape)} in chunks of "
                                         f"{list(base.chunk_shape)}")
            else:
                hit = base.chunks.get(index)
                if hit is None and meta.path in self.gone:
                    self.whole[meta.path] = f"the base's chunks of it in steps {sorted(self.gone[meta.path])} are gone"
                if hit is not None and hit[0] == digest:
                    chunk = hit  # unchanged: where the base has it (whole in a step, or a delta on its anchor)
                elif hit is not None and self.options.delta and tables.depth(hit) < self.options.max_chain:
                    chunk = self._delta(meta, region, array, digest, hit) or chunk
        entry.chunks[index] = chunk
        return chunk[1] is not None or chunk[2] is not None

    def _delta(self, meta, region, array, digest: str, hit: tables.Chunk) -> tables.Chunk | None:
        """The chunk as one delta on the anchor of the base's chunk (the step holding it whole), if its frame is
        small enough. Each delta is taken against the anchor, never against the base's value: a restore applies
        one frame however many saves lie between (a chain of per-step frames cost 2-3x a full restore at
        4 frames; the elements a small learning rate moves are mostly the same ones step after step, so the
        frame against the anchor grows slowly: docs/incremental.md). Reads the anchor's chunk from its own store
        (blocks)."""
        anchor = hit[2][0] if hit[2] is not None else hit[1]
        try:
            base = self._anchor_array(anchor, meta).read([region], self._anchor_chunk)[region].result()
        except CheckpointError as exc:  # a damaged anchor: the chunk written whole is right whatever it holds
            self.whole[meta.path] = f"its anchor's chunk in step {anchor} cannot be read ({exc})"
            return None
        frame = deltas.encode(array, base)
        if len(frame) > self.options.delta_max_ratio * array.nbytes:
            return None
        link = (None, tables.delta_name(self.writer), self.delta_bytes, len(frame), crc32c.crc32c(frame))
        self.frames.append(frame)
        self.delta_bytes += len(frame)
        return (digest, None, (anchor, (link,), tables.depth(hit) + 1))

    def _anchor_chunk(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """Where the anchor's chunk is read (`_delta`): one buffer for every chunk of the save (a `Recorder` takes
        one chunk's delta at a time; `buffers.Carved`, grown to the largest, given back by `finish`). Fresh
        memory for each chunk cost a page fault per 4 KiB (2-8 us each here), most of what reading the anchor's
        chunks cost a delta save."""
        self._anchor_buffer.reset(math.prod(shape) * np.dtype(dtype).itemsize)
        chunk = self._anchor_buffer.cut(shape, dtype)
        return np.empty(shape, dtype) if chunk is None else chunk

    def _anchor_array(self, anchor: int, meta):
        """Array `meta` in step `anchor`'s own store: the base item's own (the base is the anchor), or, through
        the base item's references, the step it names (opened once per save)."""
        if self._reader is None:
            manifest = formats.read_item(self.base_item)
            self._reader = layered.reader(self.base_item, manifest.store)
        if anchor == self.options.step:
            own = self._reader.own if isinstance(self._reader, layered.LayeredReader) else self._reader
            return own.open(meta).result()
        if not isinstance(self._reader, layered.LayeredReader):
            raise CheckpointError(f"{self.base_item}: its table names step {anchor} as holding a chunk of "
                                  f"{meta.path}, but the item references no other step")
        return self._reader.base_array(anchor, meta).result()

    def finish(self, item: Location) -> list[str]:
        """Write this process's table (and delta file) into `item`, made durable by the commit with the
        stores; their names."""
        if self._reader is not None:
            self._reader.close()
        self._anchor_buffer.give_back()
        name, frames = tables.table_name(self.writer), tables.delta_name(self.writer)
        item.write(frames, b"".join(self.frames), fsync=False)
        item.write(name, tables.encode(self.table), fsync=False)
        for path, why in self.whole.items():
            logger.info("incremental save of %s: %s written whole: %s", item, path, why)
        return [frames, name]


def _base_tables(item: Location, step: int,
                 present: frozenset[int]) -> tuple[dict[str, tables.ArrayChunks], dict[str, set[int]]]:
    """The base item's chunks, merged over its tables, with every "this item" resolved to the base's step; and,
    by array, the steps outside `present` that its chunks left out were held in or chained on."""
    try:
        manifest = formats.read_item(item)
    except CheckpointError:
        return {}, {}  # an item the base step lacks (or never had): nothing to reference
    refs = manifest.store.refs
    merged: dict[str, tables.ArrayChunks] = {}
    gone: dict[str, set[int]] = {}
    for name in (refs.tables if refs is not None else ()):
        for array, entry in (tables.read(item, name) or {}).items():
            chunks = {}
            for i, chunk in entry.chunks.items():
                chunk = _resolved(chunk, step)
                missing = _steps_of(chunk) - present
                if missing:
                    gone.setdefault(array, set()).update(missing)
                else:
                    chunks[i] = chunk
            if array in merged:
                merged[array].chunks.update(chunks)
            else:
                merged[array] = dataclasses.replace(entry, chunks=chunks)
    return merged, gone


def _steps_of(chunk: tables.Chunk) -> set[int]:
    """The steps a resolved chunk's bytes are read from: the step holding it, or its anchor and frames'."""
    _, held, delta = chunk
    if delta is None:
        return {held}
    anchor, links, _ = delta
    return {anchor, *(s for s, *_ in links)}


def _resolved(chunk: tables.Chunk, step: int) -> tables.Chunk:
    digest, held, delta = chunk
    if delta is not None:
        anchor, links, depth = delta
        return (digest, None, (anchor, tuple((step if s is None else s, *rest) for s, *rest in links), depth))
    return (digest, step if held is None else held, None)


def commit_refs(coordinator: Coordinator, location: Location, plans: dict, marker: StepMetadata,
                step_dir: Callable[[int], str]) -> tuple[dict, StepMetadata]:
    """`plans` (item name -> `save_plan.SavePlan`) with each item's references in its manifest, and `marker`
    with the step's bases, read by the primary from the items' chunk tables under `location` once every
    process's writes are durable. Collective; blocks. Called by `Tier.commit`."""
    def collect() -> dict:
        found = {}
        for name in plans:
            item = location.child(name)
            names = sorted(n for n in item.list() if n.startswith(tables.PREFIX))
            found[name] = summarize({n: tables.read(item, n) or {} for n in names}, step_dir).to_json()
        return found

    found = coordinator.on_primary(f"reading the chunk tables of step {marker.step}", collect, share=True)
    out = {}
    for name, plan in plans.items():
        item_refs = refs_mod.decode(found[name], where=f"step {marker.step} item {name}")
        store = dataclasses.replace(plan.manifest.store, refs=item_refs)
        out[name] = dataclasses.replace(plan, manifest=dataclasses.replace(plan.manifest, store=store))
    bases = sorted({s for value in found.values() for s, _ in value["bases"]})
    chain = max((value["chain"] for value in found.values()), default=0)
    return out, dataclasses.replace(marker, bases=tuple(bases), chain=chain)


def summarize(tables: dict[str, dict], step_dir) -> ItemRefs:
    """The `ItemRefs` of an item from its processes' chunk tables (file name -> `tables.read` result);
    `step_dir(step)` names a base step's directory. Called at the commit, on the primary."""
    bases, arrays, chain = set(), set(), 0
    for table in tables.values():
        for name, entry in table.items():
            stored = {s for _, s, _ in entry.chunks.values() if s is not None}
            for _, _, delta in entry.chunks.values():  # a delta chain: its anchor and the steps of its frames
                if delta is not None:
                    stored |= {delta[0]} | {link[0] for link in delta[1] if link[0] is not None}
                    chain = max(chain, delta[2])
                    arrays.add(name)
            if stored:
                bases |= stored
                arrays.add(name)
    return ItemRefs(tuple(sorted(tables)), tuple((s, step_dir(s)) for s in sorted(bases)), frozenset(arrays),
                    chain)
