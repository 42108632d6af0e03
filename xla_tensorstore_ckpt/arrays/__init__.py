"""Array I/O: this library's zarr arrays written through tensorstore, and every stored array read through one
protocol (`base`).

Reading: `reader(item, store)` picks, once per item and operation, the `ArrayReader` for how the item stores its own
arrays and what its storage can do (an incremental step's item, whose arrays reference other steps, is read through
`incremental.reader`, which builds on this one): byte ranges of files for Hugging Face tensors (`byte_ranges`), the
pieces of DCP tensors (`pieces`, at the records `torch_zip` locates), chunk files read straight from local disk for
this library's checksummed arrays (`local_chunks`, at the byte ranges `chunk_files` locates), tensorstore for every
other zarr array, on any backend (`tensorstore_reads`). Callers see only the protocol: `reader.open(meta)` gives an
`Opening`, its result a `StoredArray` that reads regions.

Writing (saves, conversions): `create`, `write`, `commit` and `new_transaction` start tensorstore operations and
return `Pending` futures (`tensorstore_io`); `wait_all` and `drain` wait for them; on local disk, `DirectStore`
writes a process's OCDBT store itself, around the page cache (`direct_ocdbt`, values from `encode_chunk`);
`merge_ocdbt` merges the per-process OCDBT stores of an item (`ocdbt`); Orbax's zstd codec (`zstd`); the content
hash an incremental save compares chunks by (`chunk_hashes`). Local files are read with positioned reads around a
cold page cache (`local_reads`), which asks the kernel whether the page cache holds their bytes (`page_cache`).
Errors are `CorruptCheckpointError` (damaged or missing data) or `StorageError`, naming the array.
"""

from __future__ import annotations

import tensorstore as ts

from .. import storage
from ..core.errors import UsageError
from ..core.records import ArrayMetadata, ArrayStore
from . import local_chunks
from .base import ArrayReader, Empty, Index, Opening, PendingRead, Ready, StoredArray, drain, wait_all
from .byte_ranges import ByteRangeReader
from .direct_ocdbt import DirectStore, encode_chunk
from .ocdbt import OCDBT_DATA_FILE_BYTES, OCDBT_LANES, merge_ocdbt
from .pieces import PiecesReader
from .tensorstore_io import ArrayRef, Pending, commit, create, new_transaction, write, zarr_metadata
from .tensorstore_reads import TensorstoreReader

__all__ = ["OCDBT_DATA_FILE_BYTES", "OCDBT_LANES", "ArrayReader", "ArrayRef", "DirectStore", "Empty", "Index",
           "Opening", "Pending", "PendingRead", "Ready", "StoredArray", "TensorstoreReader", "commit", "create",
           "drain", "encode_chunk", "merge_ocdbt", "new_transaction", "open_for_user", "reader", "wait_all", "write",
           "zarr_metadata"]


def reader(item: storage.Location, store: ArrayStore, context: ts.Context | None = None) -> ArrayReader:
    """The reader of the arrays of the item at `item` that keeps them as `store` says, for one operation
    (`context`: its tensorstore context, `storage.operation_context()` by default). Does no I/O. Raises
    `UsageError` for an incremental step's item with referenced arrays: read through `incremental.reader`, this
    reader would not see the chunks other steps hold."""
    if store.refs is not None and store.refs.arrays:
        raise UsageError(f"{item}: an incremental step's item references chunks of other steps; "
                         f"read it through incremental.reader")
    if store.kind == "safetensors":
        return ByteRangeReader(item)
    if store.kind == "dcp":
        return PiecesReader(item)
    tensorstore = TensorstoreReader(item, store, context)
    if local_chunks.covers(item, store):
        return local_chunks.LocalChunkReader(item, store, tensorstore)
    return tensorstore


def open_for_user(item: storage.Location, store: ArrayStore, meta: ArrayMetadata) -> object:
    """The array `meta` of an item for a caller of `xtc.open_array`: a read-only tensorstore array where
    tensorstore reads it (every zarr array), else the reader's own `StoredArray` (a Hugging Face tensor). Blocks."""
    if store.kind in ("safetensors", "dcp"):
        return reader(item, store).open(meta).result()
    return TensorstoreReader(item, store).open(meta).result().tensorstore
