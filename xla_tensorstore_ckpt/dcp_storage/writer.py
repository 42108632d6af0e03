"""`DCPStorageWriter`: ``dcp.save(state_dict, storage_writer=DCPStorageWriter(path))`` writes an item of this
library (format 2, also an Orbax PyTree checkpoint) instead of DCP's ``.distcp`` files and pickled ``.metadata``.

DCP drives it: every rank's planner lists its write items (its shards, with their offsets in the global tensor);
the coordinator's `prepare_global_plan` chooses every tensor's chunk grid and the rank writing each chunk
(`plans`); each rank's `write_data` writes its chunks into the global zarr v3 arrays through the save path's
`writing.ChunkWriter` (its own OCDBT store, CRC32C per chunk) and makes them durable; the coordinator's `finish`
merges the stores and writes ``_METADATA`` (`commit.finish_item`), then swaps a replaced item into place. Values
DCP serializes itself (byte-IO items: ``param_groups``, an int) are stored as opaque uint8 arrays marked
`records.OPAQUE_DCP_BYTES`; nothing of this library decodes them. Works with `dcp.save`, `dcp.async_save`, the
default and de-duplicating planners, on torch 2.9 to 2.14 (public DCP names only).
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import SavePlan, SavePlanner, StorageWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from .. import arrays, storage
from ..core import grid
from ..core.errors import UsageError
from ..core.records import OPAQUE_DCP_BYTES, ArrayMetadata, ArrayStore, ItemManifest
from ..formats import v2
from ..formats.dcp import nest
from ..multihost.distributed import Coordinator, default_coordinator
from ..options import SaveOptions
from ..saves import commit
from ..saves.save_plan import ArrayPlan, ChunkWrite
from ..saves.save_plan import SavePlan as ItemPlan
from ..saves.writing import ChunkWriter, prepare_directory
from ..targets import cpu
from .plans import ArrayWrite, GlobalPlan, RankPlan, plan_global

PathLike = str | os.PathLike


class DCPStorageWriter(StorageWriter):
    """A DCP `StorageWriter` saving into the item directory `path` (local, ``gs://``, ``s3://``; or DCP's
    ``checkpoint_id``) in this library's format. `overwrite`: an item already there is replaced once the new one is
    committed (written beside it first); without it, a non-empty `path` is an error. `options`: `use_ocdbt`,
    `fsync`, `direct_io` and `host_batch_bytes` of `SaveOptions` apply. One instance per rank; DCP calls its
    methods (every rank: `set_up_storage_writer`, `prepare_local_plan`, `write_data`; the coordinator:
    `prepare_global_plan`, `finish`). Errors are this library's (`CheckpointExistsError`, `ShapeMismatchError`,
    `UnsupportedValueError`, `StorageError`, ...), which DCP re-raises wrapped in its `CheckpointException`."""

    def __init__(self, path: PathLike | None = None, *, overwrite: bool = False, options: SaveOptions | None = None):
        super().__init__()
        self.path = path
        self.overwrite = overwrite
        self.options = options or SaveOptions()
        self.rank = 0
        self.is_coordinator = False
        self._global: GlobalPlan | None = None

    # --------------------------------------------------------------------------------------- DCP's protocol

    def reset(self, checkpoint_id: PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = checkpoint_id
        self._global = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: PathLike) -> bool:
        return storage.is_location(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self._location()))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.rank = int(rank)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator: checks the destination (`CheckpointExistsError`), chooses every tensor's chunk grid and
        the writer of each chunk (`plans.plan_global`) and hands each rank its part. Blocks on a listing."""
        loc = self._location()
        if not all(getattr(plan, "usable", True) for plan in plans):
            raise UsageError(f"{loc}: DCPStorageWriter needs every rank's plan at each save; the planner sent cached "
                             "ones (DefaultSavePlanner(enable_plan_caching=True) is not supported)")
        temporary = prepare_directory(loc, overwrite=self.overwrite)
        rank_plans, self._global = plan_global(plans, temporary, str(loc))
        return [dataclasses.replace(plan, storage_data=mine) for plan, mine in zip(plans, rank_plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        """Every rank: writes the chunks and byte-IO items its plan assigns it and makes them durable (with
        `options.fsync`); the returned future is already done. Blocks. When the save replaces an item, the
        processes then agree whether every one wrote its part (one flag reduction) and, if not, the first deletes
        the temporary directory: DCP never calls `finish` after a failed write."""
        mine = plan.storage_data
        if not isinstance(mine, RankPlan):
            raise UsageError("DCPStorageWriter.write_data got a plan its prepare_global_plan did not make")
        target = self._target(mine.temporary)
        items = {}
        for item in plan.items:
            items.setdefault(item.index.fqn, []).append(item)
        try:
            byte_sizes = _write(target, mine, items, planner, self.options, self.rank)
        except Exception:
            if mine.temporary is not None:
                _discard_with_peers(mine.processes, target, failed=True)
            raise
        if mine.temporary is not None:
            _discard_with_peers(mine.processes, target, failed=False)
        results = [WriteResult(index=item.index, size_in_bytes=_item_bytes(item, byte_sizes),
                               storage_data=byte_sizes.get(item.index.fqn)) for item in plan.items]
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator, once every rank's writes are durable: merges the stores, writes ``_METADATA`` (the
        tree as DCP's planner nested the keys) and swaps a replaced item into place. Blocks."""
        if self._global is None:
            raise UsageError("DCPStorageWriter.finish called without prepare_global_plan")
        plan, loc = self._global, self._location()
        sizes = {r.index.fqn: r.storage_data for rank in results for r in rank if r.index.fqn in plan.byte_names}
        leaves: dict[tuple, ArrayMetadata] = {plan.paths[fqn]: meta for fqn, meta in plan.tensors.items()}
        for fqn, name in plan.byte_names.items():
            n = int(sizes.get(fqn) or 0)
            leaves[plan.paths[fqn]] = ArrayMetadata(name, (n,), "uint8", (max(n, 1),), opaque=OPAQUE_DCP_BYTES)
        manifest = ItemManifest(nest(leaves, str(loc)), v2.NAME, _store(self.options))
        target = self._target(plan.temporary)
        try:
            commit.finish_item(target, ItemPlan(manifest, (), {}), fsync=self.options.fsync)
            if plan.temporary is not None:
                target.replace(loc.resolved(), commit_files=v2.ITEM_COMMIT_FILES)
        except BaseException:
            if plan.temporary is not None:
                target.delete_tree()  # the replacement that failed; the old item is untouched
            raise

    # --------------------------------------------------------------------------------------- helpers

    def _location(self) -> storage.Location:
        if self.path is None:
            raise UsageError("DCPStorageWriter has no path: pass one, or checkpoint_id= to dcp.save")
        return storage.location(self.path)

    def _target(self, temporary: str | None) -> storage.Location:
        loc = self._location()
        return loc if temporary is None else loc.resolved().parent.child(temporary)


def _discard_with_peers(processes: int, target: storage.Location, *, failed: bool) -> None:
    """Delete `target` (the replacement being written) if this process or, once all have written, any of the
    save's `processes` failed. Collective when the save's processes are torch.distributed's world; a save over
    a smaller group (DCP's ``process_group=``) cannot agree, and leaves a failed replacement in place."""
    coordinator = Coordinator.single()
    if processes > 1 and torch.distributed.is_initialized() and torch.distributed.get_world_size() == processes:
        coordinator = default_coordinator()
    elif processes > 1:
        return  # the others may still be writing into target: deleting it now would race them
    if coordinator.any(failed, f"writing {target}") and coordinator.is_primary:
        target.delete_tree()


def _store(options: SaveOptions) -> ArrayStore:
    return ArrayStore(kind="ocdbt" if options.use_ocdbt else "directories")


def _item_bytes(item: WriteItem, byte_sizes: dict[str, int]) -> int:
    if item.type == WriteItemType.BYTE_IO:
        return byte_sizes.get(item.index.fqn, 0)
    data = item.tensor_data
    count = 1
    for n in data.chunk.sizes:
        count *= int(n)
    return count * data.properties.dtype.itemsize


def _write(target: storage.Location, mine: RankPlan, items: dict[str, list[WriteItem]], planner: SavePlanner,
           options: SaveOptions, rank: int) -> dict[str, int]:
    """Write this rank's chunks and byte-IO items under `target`, wait for them and sync them; the size of each
    byte-IO item written, by key."""
    plans: list[ArrayPlan] = []
    data: list[list[torch.Tensor]] = []
    for write in mine.arrays:
        plans.append(_array_plan(write.fqn, write.metadata(), write.regions, write.writes_metadata))
        data.append(_chunks(write, items.get(write.fqn, []), planner))
    sizes = {}
    for fqn, name in mine.byte_items:
        blob = _bytes(planner.resolve_data(items[fqn][0]))
        sizes[fqn] = len(blob)
        meta = ArrayMetadata(name, (len(blob),), "uint8", (max(len(blob), 1),), opaque=OPAQUE_DCP_BYTES)
        plans.append(_array_plan(fqn, meta, (((0, len(blob)),),), True))
        data.append([torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob
                     else torch.empty(0, dtype=torch.uint8)])
    out = ChunkWriter(target, ItemPlan(ItemManifest({}, v2.NAME, _store(options)), tuple(plans), {}), writer=rank,
                      writeback=options.fsync, direct=options.direct_io)
    try:
        position = {id(p): i for i, p in enumerate(plans)}
        for group in grid.batches([p for p in plans if p.writes], lambda p: p.write_bytes, options.host_batch_bytes):
            out.write(group, [data[position[id(p)]] for p in group])
        out.finish()
        arrays.wait_all(out.writes.pending)
    except BaseException:
        out.abandon()
        raise
    if options.fsync:
        target.sync_files(out.writes.files, out.writes.trees)
    return sizes


def _array_plan(fqn: str, meta: ArrayMetadata, regions: Sequence[grid.Index], writes_metadata: bool) -> ArrayPlan:
    source = cpu.layout(meta.shape).shards[0]  # unused by the writer: the data comes with each batch
    return ArrayPlan((fqn,), meta, None, cpu.layout(meta.shape),  # type: ignore[arg-type]
                     tuple(ChunkWrite(region, source) for region in regions), single_file=False,
                     writes_metadata=writes_metadata)


def _chunks(write: ArrayWrite, items: list[WriteItem], planner: SavePlanner) -> list[torch.Tensor]:
    """The data of each chunk `write` assigns this rank, cut from the write item holding it (its local shard)."""
    held = []
    for item in items:
        offsets, sizes = item.tensor_data.chunk.offsets, item.tensor_data.chunk.sizes
        held.append((tuple((int(o), int(o) + int(n)) for o, n in zip(offsets, sizes)), item))
    resolved: dict[int, torch.Tensor] = {}
    out = []
    for region in write.regions:
        found = next(((i, h) for i, h in enumerate(held) if grid.contains(h[0], region)), None)
        if found is None:
            raise UsageError(f"{write.fqn!r}: this rank's plan writes {region}, which none of its write items holds")
        position, (box, item) = found
        if position not in resolved:
            resolved[position] = planner.resolve_data(item).detach().to("cpu")
        tensor = resolved[position]
        if region != box:
            tensor = tensor[grid.within(region, box)].contiguous()
        out.append(tensor.contiguous())
    return out


def _bytes(value: Any) -> bytes:
    if isinstance(value, io.BytesIO):
        return value.getvalue()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise UsageError(f"a byte-IO item resolved to a {type(value).__name__}, not bytes")
