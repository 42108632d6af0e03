"""Zarr arrays through tensorstore: specs, creation, chunk writes and region reads.

Every array this library writes is zarr v3: a regular chunk grid (the SPMD shard grid), the ``bytes`` codec
followed by ``crc32c`` so every chunk carries a checksum that tensorstore (and zarr-python) verify on read (with
``SaveOptions.compression``, ``zstd`` between them, as Orbax writes it: `zstd`). Reads
refuse missing chunks (``fill_missing_data_reads: false``, unless the item says otherwise) and writes store every
chunk, even all-zero ones, so a lost chunk is an error and never silent zeros.

An item keeps its arrays either as one directory each or in one OCDBT key-value store (`ArrayStore`), as Orbax
does: each process writes its chunks into stores of its own (``ocdbt.process_<i>``, and ``ocdbt.process_<i>x<k>``
for its other lanes), one transaction per batch, merged into the item's root store at the commit (`ocdbt`).

Reading is `tensorstore_reads.TensorstoreReader` (the `base.ArrayReader` for every zarr array; the picker in
`arrays` chooses it where no faster reader applies), on the specs, futures and errors of this module. Functions
start I/O and return at once with a `Pending` future; callers start many and then wait, so I/O runs concurrently on
tensorstore's threads. Errors are translated to `CorruptCheckpointError` (checksum, missing data) or `StorageError`
(the rest), with the array's location in the message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import tensorstore as ts

from .. import storage
from ..core import dtypes, layout, threads
from ..core.errors import CorruptCheckpointError, StorageError
from ..core.records import ArrayStore
from ..storage import without_spec
from . import zstd
from .base import Index
from .ocdbt import ocdbt_spec

Region = tuple[slice, ...]

_CORRUPTION_CODES = ("DATA_LOSS", "NOT_FOUND", "FAILED_PRECONDITION", "INVALID_ARGUMENT", "OUT_OF_RANGE")


@dataclass(frozen=True)
class ArrayRef:
    """Where one array lives: the item directory, the array's name in it, how the item stores arrays, and the
    tensorstore context of the operation it belongs to (`storage.operation_context`)."""

    item: storage.Location
    name: str
    store: ArrayStore
    context: ts.Context | None = None

    @property
    def context_or_default(self) -> ts.Context:
        return self.context if self.context is not None else storage.context()

    @property
    def location(self) -> storage.Location:
        """The array's directory (for a store of directories; for OCDBT, the name messages show)."""
        return self.item.child(self.name)

    def kvstore_spec(self, *, store: str | None = None) -> dict:
        """The array's kvstore: its directory, or its key prefix in one of the item's OCDBT stores (`store`, a
        process's own, when writing; the merged root store otherwise)."""
        if self.store.kind == "directories":
            return self.location.kvstore_spec()
        return {**ocdbt_spec(self.item, store), "path": f"{self.name}/"}


def zarr_metadata(shape: Sequence[int], dtype_name: str, chunk_shape: Sequence[int], *,
                  single_file: bool = False, zstd_level: int | None = None) -> dict:
    """The ``zarr.json`` content (as a tensorstore metadata spec) for one checkpoint array.

    The chunk grid is `chunk_shape` (the SPMD shard grid). With `single_file`, all chunks of the array are
    stored in one file (zarr's ``sharding_indexed`` codec; each inner chunk keeps its own checksum), which
    saves thousands of small files for small tensors; it needs every chunk written by one writer at once.
    With `zstd_level`, each chunk is compressed by zstd at that level before its checksum is taken (`zstd`).
    """
    item_codecs: list[dict] = [{"name": "bytes"}, {"name": "crc32c"}]
    if np.dtype(_numpy_dtype(dtype_name)).itemsize > 1:
        item_codecs[0] = {"name": "bytes", "configuration": {"endian": "little"}}
    if zstd_level is not None:
        item_codecs.insert(1, zstd.codec(zstd_level))
    if single_file:
        grid = [-(-n // c) * c if n else c for n, c in zip(shape, chunk_shape)]
        codecs: list[dict] = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": list(chunk_shape), "codecs": item_codecs, "index_location": "end",
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]}}]
    else:
        grid, codecs = list(chunk_shape), item_codecs
    return {
        "shape": list(shape),
        "data_type": dtype_name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": codecs,
    }


def _numpy_dtype(dtype_name: str) -> np.dtype:
    return dtypes.by_name(dtype_name).numpy


def error(action: str, loc: storage.Location, exc: Exception, *, writing: bool) -> Exception:
    """A `CheckpointError` for a failed tensorstore operation: damaged or missing data found while reading is
    `CorruptCheckpointError`, anything else (and every failed write) `StorageError`. tensorstore's spec dump
    is cut from the message; the status, the file and the OS error stay."""
    text = without_spec(str(exc))
    if not writing and text.startswith(_CORRUPTION_CODES):
        return CorruptCheckpointError(f"{action} {loc}: {text}")
    return StorageError(f"{action} {loc}: {text}")


class Pending:
    """A tensorstore future with what it was for, so that its error can be reported in context."""

    __slots__ = ("future", "action", "loc", "writing", "output")

    def __init__(self, future: ts.Future, action: str, loc: storage.Location, *, writing: bool = False,
                 output: object = None):
        self.future = future
        self.action = action
        self.loc = loc
        self.writing = writing
        self.output = output  # what the operation fills in, the result once it is done (None: the future's)

    def result(self) -> object:
        """Wait for the future; translate its error into a `CheckpointError` naming the array."""
        try:
            result = self.future.result()
        except ValueError as exc:
            raise error(self.action, self.loc, exc, writing=self.writing) from exc
        return result if self.output is None else self.output


def create(ref: ArrayRef, shape: Sequence[int], dtype_name: str, chunk_shape: Sequence[int], *,
           store: str | None = None, single_file: bool = False, write_metadata: bool = True,
           transaction: ts.Transaction | None = None, zstd_level: int | None = None) -> Pending:
    """Start creating the array `ref` (writing its ``zarr.json`` unless `write_metadata` is False, when another
    process writes it, or another of this process's OCDBT stores) in OCDBT store `store`; the result is the
    array open for chunk writes. With `transaction`, the metadata write is part of it. `single_file`,
    `zstd_level`: as in `zarr_metadata`."""
    spec = {
        "driver": "zarr3",
        "kvstore": ref.kvstore_spec(store=store),
        "metadata": zarr_metadata(shape, dtype_name, chunk_shape, single_file=single_file, zstd_level=zstd_level),
        "store_data_equal_to_fill_value": True,
    }
    if not write_metadata:
        spec["assume_metadata"] = True
        return Pending(ts.open(spec, context=ref.context_or_default), "cannot create array", ref.location, writing=True)
    spec["create"] = True
    future = ts.open(spec, context=ref.context_or_default, transaction=transaction) if transaction is not None \
        else ts.open(spec, context=ref.context_or_default)
    return Pending(future, "cannot create array", ref.location, writing=True)


def write(store: ts.TensorStore, ref: ArrayRef, chunks: Sequence[tuple[Region, np.ndarray]], *, single_file: bool,
          writeback: bool = False, transaction: ts.Transaction | None = None) -> tuple[list[Pending], list[str]]:
    """Start writing whole chunks (region, data) of one array; return the futures, ready once the chunks are
    stored, and the files they go to (relative to the array's directory; none in an OCDBT store). The data
    must stay unchanged until then: tensorstore references it without copying. With `transaction` (an OCDBT
    store's batch) the futures are ready once the chunks are in it; its commit stores them. With `single_file`
    (see `zarr_metadata`) the chunks are written in one transaction, as one file. With `writeback` (saves that
    end with `Location.sync_files`), each finished chunk file is handed to the disk at once."""
    loc = ref.location
    reference = loc.capabilities.zero_copy_writes
    if transaction is not None:
        view = store.with_transaction(transaction)
        return [Pending(view[region].write(data, can_reference_source_data_indefinitely=reference).copy,
                        f"cannot write region {format_region(region)} of array", loc, writing=True)
                for region, data in chunks], []
    if not single_file:
        shape = chunk_shape(store)
        keys = [layout.chunk_key(tuple(r.start // c for r, c in zip(region, shape))) for region, _ in chunks]
        pending = [Pending(store[region].write(data, can_reference_source_data_indefinitely=reference).commit,
                           f"cannot write region {format_region(region)} of array", loc, writing=True)
                   for region, data in chunks]
        if writeback:
            for key, item in zip(keys, pending):
                _on_done(item, loc, key)
        return pending, keys
    txn = ts.Transaction()
    view = store.with_transaction(txn)
    copies = [Pending(view[region].write(data, can_reference_source_data_indefinitely=reference).copy,
                      f"cannot write region {format_region(region)} of array", loc, writing=True)
              for region, data in chunks]
    commit = Pending(txn.commit_async(), "cannot write array", loc, writing=True)
    key = layout.chunk_key((0,) * store.rank)
    if writeback:
        _on_done(commit, loc, key)
    return [*copies, commit], [key]


def commit(transaction: ts.Transaction, item: storage.Location, store: str, *, writeback: bool = False) -> Pending:
    """Start committing a batch transaction of `item`'s OCDBT store `store`. With `writeback` (saves that end
    with `Location.sync_files`), the store's data files are handed to the disk once it is done."""
    pending = Pending(transaction.commit_async(), "cannot write the arrays of", item, writing=True)
    if writeback:
        data = item.child(store, "d")
        pending.future.add_done_callback(lambda _: _submit(lambda: [data.file_written(f) for f in data.list()]))
    return pending


def new_transaction() -> ts.Transaction:
    return ts.Transaction()


# One thread hands finished chunk files to the disk: off tensorstore's threads, and never on the caller's.
_WRITEBACK = threads.pool("ordered", "xtc-writeback")


def _on_done(item: Pending, loc: storage.Location, key: str) -> None:
    item.future.add_done_callback(lambda _: _submit(lambda: loc.file_written(key)))


def _submit(work) -> None:  # noqa: ANN001 - a callable of no arguments
    try:
        _WRITEBACK.submit(work)
    except RuntimeError:
        pass  # the interpreter is shutting down; the save's final sync decides durability anyway


def chunk_shape(array: ts.TensorStore) -> tuple[int, ...]:
    """The chunk shape of an open array (the inner chunks of a single-file array); () for a 0-d array."""
    shape = array.chunk_layout.read_chunk.shape
    return tuple(shape) if shape is not None else ()


def format_region(region: Index | Region) -> str:
    return "[" + ", ".join(f"{r.start}:{r.stop}" if isinstance(r, slice) else f"{r[0]}:{r[1]}"
                           for r in region) + "]"
