"""`DCPStorageReader`: ``dcp.load(state_dict, storage_reader=DCPStorageReader(path))`` reads an item of this
library (any format version), an Orbax item, a Hugging Face safetensors file or directory, or a DCP directory into
whatever state dict DCP's planner plans for (DTensors of any mesh, plain tensors), on any process count.

`read_metadata` turns the item's manifest (`formats.read_item`) into DCP's `Metadata` (`metadata.dcp_metadata`:
each array a `TensorStorageMetadata` whose chunks are the stored chunks, every other value a bytes entry);
`read_data` reads exactly the regions the rank's read items name through the item's array reader
(`incremental.reader`, CRC32C verified where the format stores checksums) and copies them into the planner's tensors.
Byte-IO reads get the opaque bytes DCP wrote (our writer's `OPAQUE_DCP_BYTES` arrays) or, for a JSON value of an
item of ours or Orbax's, that value serialized for DCP's planner. Nothing from the checkpoint is unpickled here.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import LoadPlan, LoadPlanner, StorageReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from .. import arrays, incremental, storage
from ..checkpointer import read_manifest
from ..core import dtypes, grid
from ..core.errors import KeyMismatchError, ShapeMismatchError, UnsupportedValueError, UsageError
from ..core.records import OPAQUE_DCP_BYTES, ArrayMetadata
from ..options import RestoreOptions
from .metadata import ReadIndex, dcp_metadata
from .shared_reads import SharedReads, exchange, plan_shared

PathLike = str | os.PathLike
KeyMap = Mapping[str, str | None] | Callable[[str], str | None]


class DCPStorageReader(StorageReader):
    """A DCP `StorageReader` of the item at `path` (or DCP's ``checkpoint_id``). `key_map` renames the item's
    dotted key names to the state dict's (a dict, or a function; None drops a key), as `xtc.restore`'s does.
    `options.read_batch_bytes` bounds the data read before it is copied into place; with
    `options.single_replica_reads`, a region several ranks' plans read is read by one of them and sent to the others
    (`shared_reads`; only when DCP's process group is the default world). `read_bytes`: the bytes of the regions
    this rank has read from storage itself. One instance per rank;
    DCP calls its methods. Errors are this library's (`CheckpointNotFoundError`, `CorruptCheckpointError`
    naming the damaged chunk, `KeyMismatchError`, `ShapeMismatchError`, `UnsupportedValueError`, each naming the
    key and the path), re-raised by DCP wrapped in its `CheckpointException`."""

    def __init__(self, path: PathLike | None = None, *, key_map: KeyMap | None = None,
                 options: RestoreOptions | None = None):
        super().__init__()
        self.path = path
        self.key_map = key_map
        self.options = options or RestoreOptions()
        self._index: ReadIndex | None = None
        self._failure: Exception | None = None
        self._rank = 0
        self.read_bytes = 0

    def reset(self, checkpoint_id: PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = checkpoint_id
        self._index = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: PathLike) -> bool:
        return storage.is_location(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's `Metadata` of the item (every rank calls it). Blocks on reading the item's metadata files.
        Raises what `xtc.restore` raises for a missing or damaged item.

        ``dcp.load`` swallows that error and asks again for "rank-local" metadata (``rank=``); that second call,
        after a failure, returns metadata holding the error, which `set_up_storage_reader` raises as it is: DCP
        hands it on intact (torch 2.9 would otherwise fail on a bare ``assert metadata is not None``)."""
        if kwargs.get("rank") is not None and self._failure is not None:
            return Metadata(state_dict_metadata={}, storage_data=_Failed(self._failure))
        loc = self._location()
        try:
            metadata = dcp_metadata(read_manifest(loc), str(loc), self.key_map)
        except Exception as exc:
            self._failure = exc
            raise
        self._failure = None
        metadata.storage_meta = StorageMeta(checkpoint_id=str(loc))
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Every rank, before planning: keeps the metadata's read index. Raises the error `read_metadata` met."""
        if isinstance(metadata.storage_data, _Failed):
            raise metadata.storage_data.error
        if not isinstance(metadata.storage_data, ReadIndex):
            raise UsageError("DCPStorageReader got metadata its read_metadata did not make")
        self._index = metadata.storage_data
        self._rank = int(kwargs.get("rank", _world_rank()))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Every rank: checks each read item against the item's metadata before anything is read, raising
        `KeyMismatchError` (a key the item lacks), `UnsupportedValueError` (a tensor read of a value or the
        reverse) or `ShapeMismatchError` (a region outside the stored shape), each naming the key and path."""
        if self._index is None:
            raise UsageError("DCPStorageReader.prepare_local_plan called before set_up_storage_reader")
        loc = self._location()
        for item in plan.items:
            entry = self._entry(item, loc)
            if item.type == LoadItemType.BYTE_IO:
                _check_bytes(item.storage_index.fqn, entry, loc)
            else:
                self._region(item, _check_array(item.storage_index.fqn, entry, loc), loc)
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The coordinator: with `options.single_replica_reads`, picks one reader per region several ranks read."""
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if not self.options.single_replica_reads or len(plans) < 2 or len(plans) != world:
            return plans
        loc = self._location()
        shared = plan_shared(plans, lambda item: self._region(item, self._entry(item, loc), loc), self._nbytes)
        return [dataclasses.replace(plan, storage_data=mine) for plan, mine in zip(plans, shared)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        """Every rank: read the regions and values its plan asks for into the planner's tensors; the returned
        future is already done. Blocks."""
        if self._index is None:
            raise UsageError("DCPStorageReader.read_data called before set_up_storage_reader")
        loc = self._location()
        reader = incremental.reader(loc, self._index.store)
        try:
            shared = plan.storage_data if isinstance(plan.storage_data, SharedReads) else None
            skip = shared.skip if shared is not None else frozenset()
            keep = {p for _, positions in shared.sends for p in positions} if shared is not None else set()
            tensors = [(p, item) for p, item in enumerate(plan.items)
                       if item.type != LoadItemType.BYTE_IO and p not in skip]
            for item in plan.items:
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(self._bytes(reader, item, loc)))
            sent: dict[int, np.ndarray] = {}
            for batch in grid.batches(tensors, lambda entry: self._nbytes(entry[1]), self.options.read_batch_bytes):
                sent.update(self._read_tensors(reader, batch, planner, loc, keep))
            if shared is not None:
                self._receive(shared, plan, planner, loc, sent)
        finally:
            reader.close()
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    # --------------------------------------------------------------------------------------- helpers

    def _location(self) -> storage.Location:
        if self.path is None:
            raise UsageError("DCPStorageReader has no path: pass one, or checkpoint_id= to dcp.load")
        return storage.location(self.path)

    def _entry(self, item: ReadItem, loc: storage.Location) -> Any:
        fqn = item.storage_index.fqn
        if fqn not in self._index.entries:  # type: ignore[union-attr]
            raise KeyMismatchError(f"{loc}: the plan reads {fqn!r}, which the checkpoint does not hold", missing=(fqn,))
        return self._index.entries[fqn]  # type: ignore[union-attr]

    def _nbytes(self, item: ReadItem) -> int:
        meta = self._index.entries.get(item.storage_index.fqn)  # type: ignore[union-attr]
        itemsize = dtypes.by_name(meta.dtype).itemsize if isinstance(meta, ArrayMetadata) else 1
        return int(np.prod([int(n) for n in item.lengths], dtype=np.int64)) * itemsize

    def _region(self, item: ReadItem, meta: ArrayMetadata, loc: storage.Location) -> grid.Index:
        fqn = item.storage_index.fqn
        chunk = tuple(item.storage_index.offset or (0,) * len(meta.shape))
        starts = [int(c) + int(o) for c, o in zip(chunk, item.storage_offsets)]
        region = tuple((a, a + int(n)) for a, n in zip(starts, item.lengths))
        if len(region) != len(meta.shape) or any(a < 0 or b > n for (a, b), n in zip(region, meta.shape)):
            raise ShapeMismatchError(f"{loc}: the plan reads region {region} of {fqn!r}, whose stored shape is "
                                     f"{meta.shape}", key=fqn, saved_shape=meta.shape,
                                     target_shape=tuple(b for _, b in region))
        return region

    def _read_tensors(self, reader: arrays.ArrayReader, items: list[tuple[int, ReadItem]], planner: LoadPlanner,
                      loc: storage.Location, keep: set[int]) -> dict[int, np.ndarray]:
        """Start every read of `items` (position in the plan, item), each straight into its destination tensor
        where that is a contiguous CPU tensor of the stored dtype (no copy), else into a buffer copied into it;
        then wait and commit each. Returns the data read for the positions in `keep` (to send to other ranks)."""
        wanted = []
        kept = {}
        for position, item in items:
            meta = _check_array(item.storage_index.fqn, self._entry(item, loc), loc)
            wanted.append((position, item, meta, self._region(item, meta, loc)))
        opened = {meta.path: reader.open(meta) for _, _, meta, _ in wanted}
        pending = []
        try:
            for position, item, meta, region in wanted:
                target = planner.resolve_tensor(item).detach()
                shape = tuple(b - a for a, b in region)
                if tuple(target.shape) != shape:
                    fqn = item.storage_index.fqn
                    raise ShapeMismatchError(f"{loc}: {fqn!r}: the plan places {shape} into a tensor of shape "
                                             f"{tuple(target.shape)}", key=fqn, saved_shape=shape,
                                             target_shape=tuple(target.shape))
                direct = (target.device.type == "cpu" and target.is_contiguous()
                          and target.dtype == meta.torch_dtype)
                empty = _into(dtypes.tensor_to_numpy(target)) if direct else np.empty
                read = opened[meta.path].result().read([region], empty)[region]
                pending.append((position, item, target, direct, read))
                self.read_bytes += self._nbytes(item)
            for position, item, target, direct, read in pending:
                data = read.result()
                if position in keep:
                    kept[position] = data
                if not direct:
                    target.copy_(dtypes.numpy_to_tensor(data.view(dtypes.by_name(
                        self._entry(item, loc).dtype).numpy)))
                planner.commit_tensor(item, target)
        except BaseException:
            arrays.drain([read for *_, read in pending])
            raise
        return kept

    def _receive(self, shared: SharedReads, plan: LoadPlan, planner: LoadPlanner, loc: storage.Location,
                 sent: dict[int, np.ndarray]) -> None:
        """Send what this rank read for others and receive what others read for it, then place and commit it."""
        buffers = {}
        for _, positions in shared.receives:
            for p in positions:
                item = plan.items[p]
                row = dtypes.by_name(self._entry(item, loc).dtype)
                buffers[p] = np.empty(tuple(int(n) for n in item.lengths), row.copy_dtype)
        exchange(shared, self._rank, torch.distributed.get_world_size(), sent, buffers,
                 str(loc))
        for p, data in buffers.items():
            item = plan.items[p]
            target = planner.resolve_tensor(item).detach()
            target.copy_(dtypes.numpy_to_tensor(data.view(dtypes.by_name(self._entry(item, loc).dtype).numpy)))
            planner.commit_tensor(item, target)

    def _bytes(self, reader: arrays.ArrayReader, item: ReadItem, loc: storage.Location) -> bytes:
        entry = _check_bytes(item.storage_index.fqn, self._entry(item, loc), loc)
        if isinstance(entry, ArrayMetadata):
            if entry.shape[0] == 0:
                return b""
            return bytes(reader.open(entry).result().read([((0, entry.shape[0]),)])[((0, entry.shape[0]),)].result())
        buffer = io.BytesIO()  # a JSON value of ours or Orbax's, serialized for DCP's planner to load
        torch.save(entry, buffer)
        return buffer.getvalue()


@dataclasses.dataclass(frozen=True)
class _Failed:
    """`Metadata.storage_data` after a failed `read_metadata`: the error, for `set_up_storage_reader` to raise."""

    error: Exception


def _check_array(fqn: str, entry: Any, loc: storage.Location) -> ArrayMetadata:
    if not isinstance(entry, ArrayMetadata) or entry.opaque is not None:
        raise UnsupportedValueError(f"{loc}: the plan reads {fqn!r} as a tensor; the checkpoint holds it as a value")
    return entry


def _check_bytes(fqn: str, entry: Any, loc: storage.Location) -> Any:
    if isinstance(entry, ArrayMetadata) and entry.opaque != OPAQUE_DCP_BYTES:
        raise UnsupportedValueError(f"{loc}: the plan reads {fqn!r} as a byte-IO value; the checkpoint holds it as "
                                    f"an array of shape {entry.shape}")
    return entry


def _into(destination: np.ndarray) -> arrays.Empty:
    """An `arrays.Empty` handing out `destination` itself (viewed as the reader's dtype of the same width)."""
    def empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return destination.view(dtype).reshape(shape)

    return empty


def _world_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
