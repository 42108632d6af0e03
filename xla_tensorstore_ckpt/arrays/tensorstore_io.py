"""Zarr arrays through tensorstore: specs, creation, chunk writes and region reads.

Every array this library writes is zarr v3: a regular chunk grid (the SPMD shard grid), the ``bytes`` codec
followed by ``crc32c`` so every chunk carries a checksum that tensorstore (and zarr-python) verify on read (with
``SaveOptions.compression``, ``zstd`` between them, as Orbax writes it: `zstd`). Reads
refuse missing chunks (``fill_missing_data_reads: false``, unless the item says otherwise) and writes store every
chunk, even all-zero ones, so a lost chunk is an error and never silent zeros.

An item keeps its arrays either as one directory each or in one OCDBT key-value store (`ArrayStore`), as Orbax
does: each process writes its chunks into stores of its own (``ocdbt.process_<i>``, and ``ocdbt.process_<i>x<k>``
for its other lanes), one transaction per batch, merged into the item's root store at the commit (`ocdbt`).

Reading is `TensorstoreReader` (the `base.ArrayReader` for every zarr array; the picker in `arrays` chooses it
where no faster reader applies). Functions start I/O and return at once with a `Pending` future; callers start
many and then wait, so I/O runs concurrently on tensorstore's threads. Errors are translated to
`CorruptCheckpointError` (checksum, missing data) or `StorageError` (the rest), with the array's location in the
message.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import tensorstore as ts

from .. import storage
from ..core import bounds, dtypes, layout
from ..core.errors import CheckpointError, CorruptCheckpointError, StorageError
from ..core.records import ArrayMetadata, ArrayStore
from ..storage import operation_context, without_spec
from . import zstd
from .base import ArrayReader, Empty, Index, Ready
from .local_reads import COUNTS
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


def _error(action: str, loc: storage.Location, exc: Exception, *, writing: bool) -> Exception:
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
            raise _error(self.action, self.loc, exc, writing=self.writing) from exc
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
                        f"cannot write region {_format_region(region)} of array", loc, writing=True)
                for region, data in chunks], []
    if not single_file:
        shape = _chunk_shape(store)
        keys = [layout.chunk_key(tuple(r.start // c for r, c in zip(region, shape))) for region, _ in chunks]
        pending = [Pending(store[region].write(data, can_reference_source_data_indefinitely=reference).commit,
                           f"cannot write region {_format_region(region)} of array", loc, writing=True)
                   for region, data in chunks]
        if writeback:
            for key, item in zip(keys, pending):
                _on_done(item, loc, key)
        return pending, keys
    txn = ts.Transaction()
    view = store.with_transaction(txn)
    copies = [Pending(view[region].write(data, can_reference_source_data_indefinitely=reference).copy,
                      f"cannot write region {_format_region(region)} of array", loc, writing=True)
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
_WRITEBACK = ThreadPoolExecutor(1, thread_name_prefix="xtc-writeback")


def _on_done(item: Pending, loc: storage.Location, key: str) -> None:
    item.future.add_done_callback(lambda _: _submit(lambda: loc.file_written(key)))


def _submit(work) -> None:  # noqa: ANN001 - a callable of no arguments
    try:
        _WRITEBACK.submit(work)
    except RuntimeError:
        pass  # the interpreter is shutting down; the save's final sync decides durability anyway


class TensorstoreReader(ArrayReader):
    """Reads the zarr arrays (v3 or v2, in directories or an OCDBT store, on any backend) of one item through
    tensorstore. A read decodes each chunk it touches whole; a chunk feeding several regions of one call is
    fetched once per region (from the page cache or memory that is cheap; `ArrayReader.fetches_once` is
    False)."""

    def __init__(self, item: storage.Location, store: ArrayStore, context: ts.Context | None = None):
        self.item, self.store = item, store
        self._context = context
        self._driver = item.kvstore_spec()["driver"]
        self._bytes_read_at_start = _kvstore_bytes_read(self._driver)
        self._checked_files = False  # the item's local files, for special files, before tensorstore opens one

    @property
    def context(self) -> ts.Context:
        """The operation's tensorstore context, made on first use (`storage.operation_context`): making one takes
        about 3 ms, and a restore that `local_chunks` reads whole never needs it."""
        if self._context is None:
            self._context = operation_context()
        return self._context

    def fetched_bytes(self) -> int | None:
        """What tensorstore's key-value store of this item's backend read since this reader was made (its
        ``bytes_read`` metric): the chunks, and an OCDBT store's B-tree nodes. The metric is the process's, so
        reads of the same backend by other operations running meanwhile count too; None where the store keeps
        no such metric (``memory://``)."""
        now = _kvstore_bytes_read(self._driver)
        return None if now is None else now - (self._bytes_read_at_start or 0)

    def open(self, meta: ArrayMetadata) -> _Opening:
        return self.open_name(meta.path)

    def open_name(self, name: str) -> _Opening:
        """Start opening the array stored under `name` (for readers of items whose manifest lacks the arrays'
        metadata: Orbax's, opened to learn it).

        The array's zarr metadata (``zarr.json``, or ``.zarray`` for zarr v2) is read and checked here, bounded
        in size and depth, and handed to tensorstore as parsed JSON: tensorstore never parses a stored metadata
        file itself (a deeply nested one crashed it). Reading a missing chunk is an error (or the fill value,
        where the item's store says chunks equal to it were not stored)."""
        ref = ArrayRef(self.item, name, self.store, self.context)
        zarr3 = self.store.zarr_format == 3
        metadata = layout.ZARR_METADATA if zarr3 else _ZARR2_METADATA
        if self.item.local_file("") is not None:
            # No FIFO or device where tensorstore's file driver would open a file (it would block on it): the
            # item's OCDBT store, once per reader, or the array's directory; its metadata is read through the
            # backend, which refuses them likewise.
            if self.store.kind != "ocdbt":
                storage.check_regular_files(ref.location)
                return _Opening(ref, Ready(ref.location.read(metadata)), metadata, "zarr3" if zarr3 else "zarr")
            if not self._checked_files:
                storage.check_regular_files(self.item)
                self._checked_files = True
        try:
            kvstore = ts.KvStore.open(ref.kvstore_spec(), context=self.context).result()
            reading = kvstore.read(metadata)
        except ValueError as exc:
            raise _error("cannot open array", ref.location, exc, writing=False) from exc
        return _Opening(ref, reading, metadata, "zarr3" if zarr3 else "zarr")


_ZARR2_METADATA = ".zarray"


class _Opening:
    """An array being opened: its metadata file being read: a kvstore read, or the bytes (None: missing) read
    already."""

    __slots__ = ("ref", "reading", "name", "driver")

    def __init__(self, ref: ArrayRef, reading: ts.Future | Ready, name: str, driver: str):
        self.ref, self.reading, self.name, self.driver = ref, reading, name, driver

    def result(self) -> TensorstoreArray:
        where = f"{self.ref.location}/{self.name}"
        try:
            stored = self.reading.result()
        except ValueError as exc:
            raise _error("cannot open array", self.ref.location, exc, writing=False) from exc
        data = stored if isinstance(self.reading, Ready) else stored.value if stored.state == "value" else None
        if data is None:
            raise CorruptCheckpointError(f"cannot open array {self.ref.location}: {where} is missing")
        doc = bounds.load_json(data, where=where, max_bytes=bounds.MAX_ARRAY_JSON_BYTES,
                               max_depth=bounds.MAX_ARRAY_JSON_DEPTH)
        _check_zarr_grid(doc, self.driver, where)
        spec = {"driver": self.driver, "kvstore": self.ref.kvstore_spec(), "metadata": doc, "assume_metadata": True,
                "fill_missing_data_reads": self.ref.store.fill_missing}
        try:
            return TensorstoreArray(ts.open(spec, context=self.ref.context_or_default, read=True).result(),
                                    self.ref.location)
        except (ValueError, TypeError, OverflowError) as exc:  # the last two: numbers beyond int64
            raise CorruptCheckpointError(f"cannot open array {self.ref.location}: {where} is malformed: "
                                         f"{without_spec(str(exc))}"[:1000]) from exc


def _check_zarr_grid(doc: dict, driver: str, where: str) -> None:
    """`CorruptCheckpointError` unless the zarr metadata declares a sane shape and chunk grid (`bounds.check_grid`,
    for the chunks inside shards too): a chunk larger than this process may allocate would abort tensorstore."""
    shape, itemsize = doc.get("shape"), _itemsize(doc.get("dtype" if driver == "zarr" else "data_type"), driver)
    if driver == "zarr":
        chunks, inner = doc.get("chunks"), None
    else:
        grid = doc.get("chunk_grid")
        config = grid.get("configuration") if isinstance(grid, dict) else None
        chunks = config.get("chunk_shape") if isinstance(config, dict) else None
        codecs = doc.get("codecs")
        first = codecs[0] if isinstance(codecs, list) and codecs and isinstance(codecs[0], dict) else {}
        inner = first.get("configuration", {}).get("chunk_shape", False) if first.get("name") == "sharding_indexed" \
            and isinstance(first.get("configuration"), dict) else None
    if not isinstance(shape, list) or not isinstance(chunks, list) or not (inner is None or isinstance(inner, list)):
        raise CorruptCheckpointError(f"{where}: no shape and chunk shape")
    bounds.check_grid(tuple(shape), tuple(chunks), itemsize, where, shard=inner is not None)
    if inner is not None:
        bounds.check_grid(tuple(shape), tuple(inner), itemsize, where)


def _itemsize(dtype: object, driver: str) -> int:
    """The element size of a zarr data type, as far as it is known (8 otherwise: the largest common one)."""
    try:
        if driver == "zarr":
            return max(1, np.dtype(dtype).itemsize)
        return dtypes.by_name(dtype).itemsize if isinstance(dtype, str) else 8
    except (TypeError, ValueError, CheckpointError):
        return 8


class TensorstoreArray:
    """A zarr array open for reading (`base.StoredArray`); `tensorstore` is the open tensorstore array."""

    reads_whole_chunks = True

    def __init__(self, array: ts.TensorStore, location: storage.Location):
        self.tensorstore = array
        self.location = location
        self.shape = tuple(array.shape)
        self.dtype_name = array.dtype.name
        self.chunk_shape = _chunk_shape(array)

    def read(self, regions: Sequence[Index], empty: Empty = np.empty) -> dict[Index, Pending]:
        """Start reading each region (only the chunks it touches, each checksum verified) into a buffer from
        `empty`.

        The buffers are allocated here, on the caller's thread, and tensorstore copies into them. Arrays
        tensorstore allocates itself come from its worker threads' heaps, which gave every restore fresh memory
        from the OS: 1-2 GiB of page faults per GiB restored, measured, the largest cost of a restore on the
        benchmark VM. Memory allocated here is recycled from one batch (and one restore) to the next."""
        COUNTS.add(tensorstore_regions=len(regions))
        out = {}
        for region in regions:
            view = self.tensorstore[tuple(slice(a, b) for a, b in region)]
            data = empty(tuple(view.shape), view.dtype.numpy_dtype)
            future = ts.array(data, copy=False, write=True).write(view).commit
            out[region] = Pending(future, f"cannot read region {_format_region(region)} of array", self.location,
                                  output=data)
        return out

    def read_index(self, index: tuple[slice | int, ...]) -> Pending:
        COUNTS.add(tensorstore_regions=1)
        view = self.tensorstore[index] if index else self.tensorstore
        return Pending(view.read(), "cannot read array", self.location)


def _chunk_shape(array: ts.TensorStore) -> tuple[int, ...]:
    """The chunk shape of an open array (the inner chunks of a single-file array); () for a 0-d array."""
    shape = array.chunk_layout.read_chunk.shape
    return tuple(shape) if shape is not None else ()


def _format_region(region: Index | Region) -> str:
    return "[" + ", ".join(f"{r.start}:{r.stop}" if isinstance(r, slice) else f"{r[0]}:{r[1]}"
                           for r in region) + "]"


def _kvstore_bytes_read(driver: str) -> int | None:
    """The bytes tensorstore's key-value store `driver` has read in this process (None: it keeps no
    ``bytes_read`` metric, or has read nothing yet)."""
    name = f"/tensorstore/kvstore/{driver}/bytes_read"
    values = [v.get("value", 0) for m in ts.experimental_collect_matching_metrics(name) if m["name"] == name
              for v in m.get("values", ())]
    return sum(values) if values else None

