"""Writing a staged save: creating this process's arrays and issuing its chunk writes (`ChunkWriter`), in the
three ways a save runs them: stage and write interleaved (`stage_and_write`), write what was staged before
(`write_staged`), or either as `begin_writes` picks for a synchronous or asynchronous save. Returns the
futures and files (`Writes`) for `commit` to wait for and make durable.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .. import arrays, storage
from ..core import dtypes, grid, layout, threads
from ..core.errors import CheckpointExistsError
from ..incremental.saving import BaseStep, Recorder
from ..options import SaveOptions
from ..storage import outputs
from .save_plan import ArrayPlan, SavePlan
from .staging import Staged, stage, stage_all


def deferred_writes(loc: storage.Location, plans: Mapping[str, SavePlan], staged: dict[str, Staged],
                    options: SaveOptions, *, writer: int) -> Callable[[], Writes]:
    """`start` (as `begin_writes` returns it) for items staged by `stage_shared`."""
    return lambda: Writes.combined({name: write_staged(loc.child(name), plan, staged.pop(name), options,
                                                       writer=writer)
                                    for name, plan in plans.items()})


@dataclass
class Writes:
    """The writes a process started for one item: the futures to wait for, and what they create (relative to
    the item directory), which a save that syncs makes durable once they are done: `files`, and `trees`
    (directories whose every file is this process's, such as its OCDBT store). For an incremental save, also
    `whole`: the arrays it wrote whole although the base has them, and why. `chunks` and `chunk_bytes`: the
    chunks whose writes it started and their bytes before any compression; `peak_staged_bytes`: for saves that
    stage and write interleaved (`stage_and_write`), the most staged bytes whose writes were not yet waited for
    at any time, 0 for others (all told in ``save_written``)."""

    pending: list[arrays.Pending]
    files: list[str]
    trees: list[str]
    whole: dict[str, str] = field(default_factory=dict)
    chunks: int = 0
    chunk_bytes: int = 0
    peak_staged_bytes: int = 0

    @staticmethod
    def combined(by_item: Mapping[str, Writes]) -> Writes:
        """The writes of several items as one, names relative to their parent (``<item>/...``)."""
        return Writes([p for w in by_item.values() for p in w.pending],
                      [f"{item}/{f}" for item, w in by_item.items() for f in w.files],
                      [f"{item}/{t}" for item, w in by_item.items() for t in w.trees],
                      {f"{item}/{a}": why for item, w in by_item.items() for a, why in w.whole.items()},
                      sum(w.chunks for w in by_item.values()), sum(w.chunk_bytes for w in by_item.values()),
                      max((w.peak_staged_bytes for w in by_item.values()), default=0))


def write_staged(loc: storage.Location, plan: SavePlan, staged: Staged, options: SaveOptions, *,
                 writer: int) -> Writes:
    """Create the arrays this process creates and start writing staged chunks (`writer`: this process's
    index)."""
    out = ChunkWriter(loc, plan, writer=writer, writeback=options.fsync, direct=options.direct_io,
                      page_cache=options.page_cache, zstd_level=options.zstd_level, base=options.incremental)
    try:
        for group, data in staged:
            out.write(group, data)
        out.finish()
    except BaseException:
        out.abandon()
        raise
    return out.writes


def stage_and_write(loc: storage.Location, plan: SavePlan, options: SaveOptions, *, writer: int,
                    copy_cpu: bool = False, max_host_bytes: int | None = None) -> Writes:
    """Stage and write, interleaved: the writes of one batch run while the next is fetched. Blocks while shards
    are fetched. With `max_host_bytes`, staged data not yet written never exceeds it (plus one batch): the call
    waits for earlier writes instead of fetching more. `copy_cpu` copies host tensors too (for callers that
    return before the writes finish). On error, every started operation is waited for first."""
    out = ChunkWriter(loc, plan, writer=writer, writeback=options.fsync, direct=options.direct_io,
                      page_cache=options.page_cache, zstd_level=options.zstd_level, base=options.incremental)
    in_flight: deque[tuple[int, int, list[arrays.Pending]]] = deque()
    in_flight_bytes = staged_bytes = 0  # as planned (what the cap is kept by), and as staged (what is reported)
    try:
        for group in grid.batches([p for p in plan.arrays if p.writes], lambda p: p.host_bytes,
                                  options.host_batch_bytes):
            group_bytes = sum(p.staged_bytes for p in group)
            while max_host_bytes is not None and in_flight and in_flight_bytes + group_bytes > max_host_bytes:
                done_bytes, done_staged, done = in_flight.popleft()
                arrays.wait_all(done)
                in_flight_bytes -= done_bytes
                staged_bytes -= done_staged
            data = stage(group, copy_cpu=copy_cpu)
            group_staged = sum(chunk.nbytes for chunks in data for chunk in chunks)
            in_flight.append((group_bytes, group_staged, out.write(group, data)))
            in_flight_bytes += group_bytes
            staged_bytes += group_staged
            out.writes.peak_staged_bytes = max(out.writes.peak_staged_bytes, staged_bytes)
        out.finish()
    except BaseException:
        out.abandon()
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
        return lambda: Writes.combined({name: stage_and_write(loc.child(name), plan, options, writer=writer,
                                                              max_host_bytes=2 * options.host_batch_bytes)
                                        for name, plan in plans.items()})
    if max_host_bytes is not None:
        started = Writes.combined({name: stage_and_write(loc.child(name), plan, options, writer=writer,
                                                         copy_cpu=True, max_host_bytes=max_host_bytes)
                                   for name, plan in plans.items()})
        return lambda: started
    # Only the copy off the devices happens here; creating arrays and issuing writes (a fraction of a millisecond
    # per chunk) is left to the caller of `start`.
    staged = {name: stage_all(plan.arrays, options, copy_cpu=True) for name, plan in plans.items()}
    return deferred_writes(loc, plans, staged, options, writer=writer)


class ChunkWriter:
    """Creates the arrays this process creates and issues its chunk writes; collects every future and what
    they create. Saves feed it the staged shards; `convert` feeds it chunks read from another checkpoint, a
    batch at a time (`write` takes plans whose `writes` are any subset of the array's); once every batch is
    written, `finish` (or, on failure, `abandon`). In a store of directories, with `writeback` (saves that
    fsync), finished chunk files are handed to the disk while later ones are still being staged. In an OCDBT
    store, every array's metadata is created in one transaction; on a local file system with `direct`, each
    batch of chunks is then appended by a thread of its own to one of `DIRECT_LANES` stores this process writes
    itself around the page cache (`arrays.direct_ocdbt`; through it with `page_cache`); elsewhere each batch
    is one tensorstore transaction into one of `arrays.OCDBT_LANES` stores. Either way the B-trees grow by a few
    nodes per batch, not per chunk, and host memory holds at most a batch of encoded chunks. With `zstd_level`,
    every chunk is compressed (`arrays.zstd`): by the direct lanes themselves, or by tensorstore's codec."""

    def __init__(self, loc: storage.Location, plan: SavePlan, *, writer: int, writeback: bool, direct: bool = True,
                 zstd_level: int | None = None, base: BaseStep | None = None, page_cache: bool = False):
        self.item, self.writer, self.store = loc, writer, plan.store
        # Incremental saves: unchanged chunks are referenced, not written (`incremental.saving`).
        self.recorder = Recorder(loc, base, writer) if base is not None else None
        self.zstd_level = zstd_level
        self.page_cache = page_cache  # the direct lanes write buffered (a local tier's warm step)
        self.ocdbt = plan.store.kind == "ocdbt"
        self.writeback = writeback and not loc.capabilities.durable_writes
        self.direct_root = loc.local_file("") if self.ocdbt and direct else None
        context = storage.operation_context()
        self.refs = {p.key_path: arrays.ArrayRef(loc, p.meta.path, plan.store, context) for p in plan.arrays}
        self.plans = {p.key_path: p for p in plan.arrays}
        self.writes = Writes([], [], [])
        self.batches = 0
        self.lanes: dict[int, _DirectLane] = {}
        mine = [p for p in plan.arrays if p.writes or p.writes_metadata]
        if self.ocdbt and mine:
            created = arrays.new_transaction()
            arrays.wait_all([self._open(p, lane=0, metadata=True, transaction=created)
                             for p in mine if p.writes_metadata])
            arrays.wait_all([arrays.commit(created, loc, layout.ocdbt_store(writer, 0))])
            self.writes.trees.append(layout.ocdbt_store(writer, 0))
        self.opened: dict[tuple[layout.KeyPath, int], arrays.Pending] = {} if self.direct_root is not None else {
            (p.key_path, 0): self._open(p, lane=0, metadata=not self.ocdbt and p.writes_metadata) for p in mine}
        self.writes.pending.extend(self.opened.values())
        if not self.ocdbt:
            self.writes.files.extend(f"{p.meta.path}/{layout.ZARR_METADATA}" for p in mine if p.writes_metadata)

    def _open(self, p: ArrayPlan, *, lane: int, metadata: bool, transaction: object = None) -> arrays.Pending:
        return arrays.create(self.refs[p.key_path], p.meta.shape, p.meta.dtype, p.meta.chunk_shape,
                             store=layout.ocdbt_store(self.writer, lane) if self.ocdbt else None,
                             single_file=p.single_file, write_metadata=metadata, transaction=transaction,
                             zstd_level=self.zstd_level)

    def _handle(self, p: ArrayPlan, lane: int) -> object:
        if (p.key_path, lane) not in self.opened:  # another lane of an OCDBT store: no I/O, the metadata is known
            self.opened[(p.key_path, lane)] = self._open(p, lane=lane, metadata=False)
            if layout.ocdbt_store(self.writer, lane) not in self.writes.trees:
                self.writes.trees.append(layout.ocdbt_store(self.writer, lane))
        return self.opened[(p.key_path, lane)].result()

    def write(self, group: Sequence[ArrayPlan], data: Sequence[Sequence[torch.Tensor]]) -> list[arrays.Pending]:
        """Start writing one batch: `data` holds each plan's chunks, in the order of its `writes`. Returns the
        batch's futures; the data must stay unchanged until they are done."""
        if self.recorder is not None:
            group, data = self.recorder.select(group, data)
        if self.direct_root is not None:
            out = [self._write_direct(group, data)]
        else:
            out = self._write_tensorstore(group, data)
        self.batches += 1
        self.writes.chunks += sum(len(chunks) for chunks in data)
        self.writes.chunk_bytes += sum(chunk.nbytes for chunks in data for chunk in chunks)
        self.writes.pending.extend(out)
        return out

    def finish(self) -> None:
        """After the last batch: start finishing the stores written here (`writes.pending` includes it)."""
        self.writes.pending.extend(lane.finish() for lane in self.lanes.values())
        if self.recorder is not None:
            self.writes.files.extend(self.recorder.finish(self.item))
            self.writes.whole.update(self.recorder.whole)

    def abandon(self) -> None:
        """After a failure: wait for the writes started (their errors no longer matter) and close every file."""
        arrays.drain(self.writes.pending)
        for lane in self.lanes.values():
            lane.abandon()

    def _write_direct(self, group: Sequence[ArrayPlan], data: Sequence[Sequence[torch.Tensor]]) -> Future:
        lane = 1 + self.batches % DIRECT_LANES  # lane 0 is tensorstore's store of the arrays' metadata
        if lane not in self.lanes:
            name = layout.ocdbt_store(self.writer, lane)
            self.lanes[lane] = _DirectLane(arrays.DirectStore(os.path.join(self.direct_root, name),
                                                              data_file_bytes=arrays.OCDBT_DATA_FILE_BYTES,
                                                              buffered=self.page_cache),
                                           self.zstd_level)
            self.writes.trees.append(name)
        chunks = [(f"{p.meta.path}/{_chunk_key(w.region, p.meta.chunk_shape)}", dtypes.tensor_to_numpy(d),
                   p.meta.chunk_shape)
                  for p, chunk_data in zip(group, data) for w, d in zip(p.writes, chunk_data)
                  if all(b > a for a, b in w.region)]
        return self.lanes[lane].put(chunks)

    def _write_tensorstore(self, group: Sequence[ArrayPlan],
                           data: Sequence[Sequence[torch.Tensor]]) -> list[arrays.Pending]:
        out: list[arrays.Pending] = []
        lane = self.batches % arrays.OCDBT_LANES if self.ocdbt else 0
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
        return out


def _chunk_key(region: Sequence[tuple[int, int]], chunk_shape: Sequence[int]) -> str:
    return layout.chunk_key(tuple(a // c for (a, _), c in zip(region, chunk_shape)))


# Stores a process writes around the page cache at once, each by a thread of its own: while one thread waits for
# the disk, the other copies and checksums. (Not tuned: other counts were not measured.)
DIRECT_LANES = 2


class _DirectLane:
    """A `DirectStore` and the one thread that writes it, batch after batch, in order."""

    def __init__(self, store: arrays.DirectStore, zstd_level: int | None):
        self.store = store
        self.zstd_level = zstd_level
        self.thread = threads.pool("ordered", "xtc-direct-write")

    def put(self, chunks: list[tuple[str, object, tuple[int, ...]]]) -> Future:
        """Start writing `chunks` after the lane's earlier work; the future raises the lane's `StorageError`
        (`arrays.wait_all` waits for it as for tensorstore's)."""
        def work() -> None:
            for key, value, chunk_shape in chunks:
                try:
                    parts = arrays.encode_chunk(value, chunk_shape, self.zstd_level)
                except Exception as exc:  # noqa: BLE001 - the store is failed with it and it is re-raised
                    self.store.fail(f"cannot encode {key}", exc)
                self.store.put(key, parts)
        return self.thread.submit(work)

    def finish(self) -> Future:
        done = self.thread.submit(self.store.finish)
        self.thread.shutdown(wait=False)
        return done

    def abandon(self) -> None:
        self.thread.shutdown(wait=True)
        self.store.abort()


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
