"""Zarr arrays through tensorstore: specs, creation, chunk writes, region reads, and OCDBT stores.

Every array this library writes is zarr v3: a regular chunk grid (the SPMD shard grid), the ``bytes`` codec
followed by ``crc32c`` so every chunk carries a checksum that tensorstore (and zarr-python) verify on read. Reads
refuse missing chunks (``fill_missing_data_reads: false``, unless the item says otherwise) and writes store every
chunk, even all-zero ones, so a lost chunk is an error and never silent zeros.

An item keeps its arrays either as one directory each or in one OCDBT key-value store (`ArrayStore`), as Orbax
does: each process writes its chunks into stores of its own (``ocdbt.process_<i>``, and ``ocdbt.process_<i>x<k>``
for its other lanes), one transaction per batch, and once every process is done the primary merges them into
the item's root store (`merge_ocdbt`), which references their data files rather than copying them.

Arrays of Hugging Face safetensors files (store kind "safetensors") are raw byte ranges, read by `raw_arrays`;
`open_existing` and the read functions dispatch to it, so every reader handles both alike.

Functions start I/O and return at once with a `Pending` future; callers start many and then wait, so I/O
runs concurrently on tensorstore's threads. Errors are translated to `CorruptCheckpointError` (checksum,
missing data) or `StorageError` (the rest), with the array's location in the message.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import tensorstore as ts

from . import bounds, layout, raw_arrays, storage
from .errors import CheckpointError, CorruptCheckpointError, StorageError
from .records import ArrayMetadata, ArrayStore
from .staging import Empty

Region = tuple[slice, ...]

_CORRUPTION_CODES = ("DATA_LOSS", "NOT_FOUND", "FAILED_PRECONDITION", "INVALID_ARGUMENT", "OUT_OF_RANGE")
# B-tree settings as Orbax writes them: zarr metadata inline, one root node, a single-file manifest (each store
# has one writer). Data files of at most 256 MiB, written in parallel (one 2 GiB file took 1.6x as long).
_OCDBT_CONFIG = {"max_inline_value_bytes": 1024, "max_decoded_node_bytes": 100_000_000, "manifest_kind": "single"}
OCDBT_DATA_FILE_BYTES = 256 << 20
# An object store takes each object over one connection: smaller data files are uploaded many at once (S3's own
# advice is parallel requests of 8-16 MiB; measured: 1 GiB to a local S3 server in 2.7 s vs 6.2 s with 256 MiB).
OCDBT_REMOTE_DATA_FILE_BYTES = 16 << 20
# On object stores, reads of chunks that lie close together in one data file are merged into one ranged request
# (Orbax does the same there): requests, not bytes, are what remote reads of many chunks pay for.
_REMOTE_READ_COALESCING = {"experimental_read_coalescing_threshold_bytes": 1 << 20,
                           "experimental_read_coalescing_merged_bytes": 1 << 40,
                           "experimental_read_coalescing_interval": "1ms"}
# Commits to one OCDBT store are serialized, and each writes its data file sequentially: a process writes its
# batches round robin into this many stores of its own, so that large chunks are written in parallel.
OCDBT_LANES = 4


def operation_context() -> ts.Context:
    """A context for one save, restore or inspection: the process's shared resources (thread pools, file I/O
    settings, memory stores) with a cache of OCDBT B-tree nodes of its own. An OCDBT store cached beyond one
    operation would outlive a deletion of its directory and serve a stale manifest to the next save there."""
    return ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": 100_000_000}}, parent=storage.context())


@dataclass(frozen=True)
class ArrayRef:
    """Where one array lives: the item directory, the array's name in it, how the item stores arrays, and the
    tensorstore context of the operation it belongs to (`operation_context`)."""

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


def ocdbt_spec(item: storage.Location, store: str | None) -> dict:
    """The OCDBT kvstore of an item: the per-process store in directory `store`, or (None) the merged root."""
    loc = item if store is None else item.child(store)
    base = loc.kvstore_spec()
    spec = {"driver": "ocdbt", "base": base, "config": _OCDBT_CONFIG, "cache_pool": "cache_pool#ocdbt"}
    if base["driver"] == "file":  # data files need no atomic rename: only the manifest is ever replaced
        spec.update(base={**base, "file_io_locking": {"mode": "non_atomic"}}, manifest=base)
    remote = not loc.capabilities.cheap_refetch
    if remote:
        spec.update(_REMOTE_READ_COALESCING)
    if store is not None:
        spec["target_data_file_size"] = OCDBT_REMOTE_DATA_FILE_BYTES if remote else OCDBT_DATA_FILE_BYTES
    return spec


def merge_ocdbt(item: storage.Location, stores: Sequence[str]) -> None:
    """Merge the per-process OCDBT stores in the directories `stores` into the item's root store, in one atomic
    transaction that references their data files. Called by the primary once every process's writes are
    durable; blocks."""
    context = operation_context()
    try:
        root = ts.KvStore.open(ocdbt_spec(item, None), context=context).result()
        txn = ts.Transaction(atomic=True)
        for store in stores:
            child = ts.KvStore.open(ocdbt_spec(item, store), context=context).result()
            child.experimental_copy_range_to(root.with_transaction(txn)).result()
        txn.commit_async().result()
    except ValueError as exc:
        raise StorageError(f"cannot merge the array stores of {item}: {_SPEC_DUMP.sub('', str(exc))}") from exc


@dataclass(frozen=True)
class StoredValue:
    """Where one value of an OCDBT store lies: `inline` bytes held in the B-tree, or `length` bytes at `offset`
    of the data file `file` (a path relative to the store's directory)."""

    inline: bytes | None = None
    file: str = ""
    offset: int = 0
    length: int = 0


def ocdbt_index(item: storage.Location, context: ts.Context | None = None) -> dict[str, StoredValue]:
    """Every key of the item's OCDBT store (its newest version) and where its value lies, from the store's
    manifest and B-tree nodes (tensorstore's `ocdbt.dump`). Lets local readers fetch values straight from the
    data files. Raises `CorruptCheckpointError` for a store that cannot be read or whose data files lie outside
    the item directory. Blocks."""
    context = context or operation_context()
    item.read_range(layout.OCDBT_MANIFEST, 0, 0).result()  # a FIFO there would block tensorstore: refused
    try:
        base = ts.KvStore.open(item.kvstore_spec(), context=context).result()
        manifest = ts.ocdbt.dump(base, context=context).result()
        versions = manifest.get("versions") or []
        if not versions:
            raise CorruptCheckpointError(f"the array store of {item} records no version")
        root = max(versions, key=lambda v: v["generation_number"])["root"]
        index: dict[str, StoredValue] = {}
        level = [(b"", root["location"])] if "location" in root else []
        while level:  # one level of the B-tree at a time, its nodes fetched concurrently
            nodes = [(prefix, ts.ocdbt.dump(base, where, context=context)) for prefix, where in level]
            level = []
            for prefix, future in nodes:
                node = future.result()
                for entry in node["entries"]:
                    if node["height"] > 0:
                        level.append((prefix + entry.get("subtree_common_prefix", b""), entry["location"]))
                        continue
                    key = (prefix + entry["key"]).decode()
                    index[key] = (StoredValue(inline=entry["inline_value"]) if "inline_value" in entry
                                  else _indirect(item, entry["indirect_value"]))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"cannot read the array store of {item}: {_SPEC_DUMP.sub('', str(exc))}") \
            from exc
    return index


def _indirect(item: storage.Location, where: str) -> StoredValue:
    """A ``value:<base path>:<file>:<offset>:<length>`` reference of `ocdbt.dump`."""
    head, offset, length = where.rsplit(":", 2)
    kind, base, file = head.split(":", 2)
    path = base + file
    if kind != "value" or not layout.is_safe_relative_path(path):
        raise CorruptCheckpointError(f"the array store of {item} references {where!r}, outside its directory")
    return StoredValue(file=path, offset=int(offset), length=int(length))


def zarr_metadata(shape: Sequence[int], dtype_name: str, chunk_shape: Sequence[int], *,
                  single_file: bool = False) -> dict:
    """The ``zarr.json`` content (as a tensorstore metadata spec) for one checkpoint array.

    The chunk grid is `chunk_shape` (the SPMD shard grid). With `single_file`, all chunks of the array are
    stored in one file (zarr's ``sharding_indexed`` codec; each inner chunk keeps its own checksum), which
    saves thousands of small files for small tensors; it needs every chunk written by one writer at once.
    """
    item_codecs: list[dict] = [{"name": "bytes"}, {"name": "crc32c"}]
    if np.dtype(_numpy_dtype(dtype_name)).itemsize > 1:
        item_codecs[0] = {"name": "bytes", "configuration": {"endian": "little"}}
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
    from .dtypes import by_name

    return by_name(dtype_name).numpy


def _error(action: str, loc: storage.Location, exc: Exception, *, writing: bool) -> Exception:
    """A `CheckpointError` for a failed tensorstore operation: damaged or missing data found while reading is
    `CorruptCheckpointError`, anything else (and every failed write) `StorageError`. tensorstore's spec dump
    is cut from the message; the status, the file and the OS error stay."""
    text = _SPEC_DUMP.sub("", str(exc))
    if not writing and text.startswith(_CORRUPTION_CODES):
        return CorruptCheckpointError(f"{action} {loc}: {text}")
    return StorageError(f"{action} {loc}: {text}")


_SPEC_DUMP = re.compile(r"\s*\[tensorstore_spec='.*'\]", re.S)


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


def wait_all(pending: Sequence[Pending]) -> list[object]:
    """Wait for every future (even after one fails) and raise the first error, noting how many failed."""
    results: list[object] = []
    errors: list[Exception] = []
    for item in pending:
        try:
            results.append(item.result())
        except (CorruptCheckpointError, StorageError) as exc:
            errors.append(exc)
            results.append(None)
    if errors:
        first = errors[0]
        if len(errors) > 1:
            first.args = (f"{first} (and {len(errors) - 1} more failed operations)",)
        raise first
    return results


def drain(pending: Sequence[Pending]) -> None:
    """Wait for futures whose results no longer matter (an error is already on its way)."""
    for item in pending:
        try:
            item.result()
        except (CorruptCheckpointError, StorageError):
            pass


def create(ref: ArrayRef, shape: Sequence[int], dtype_name: str, chunk_shape: Sequence[int], *,
           store: str | None = None, single_file: bool = False, write_metadata: bool = True,
           transaction: ts.Transaction | None = None) -> Pending:
    """Start creating the array `ref` (writing its ``zarr.json`` unless `write_metadata` is False, when another
    process writes it, or another of this process's OCDBT stores) in OCDBT store `store`; the result is the
    array open for chunk writes. With `transaction`, the metadata write is part of it."""
    spec = {
        "driver": "zarr3",
        "kvstore": ref.kvstore_spec(store=store),
        "metadata": zarr_metadata(shape, dtype_name, chunk_shape, single_file=single_file),
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
        shape = chunk_shape(store)
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


def open_existing(ref: ArrayRef, meta: ArrayMetadata | None = None) -> _Opening | Ready:
    """Start opening the stored array of `ref` for reading; reading a missing chunk will be an error (or the
    fill value, where the item's store says chunks equal to it were not stored). `meta` is the array's entry in
    its manifest: raw arrays (safetensors) are known only from it; zarr arrays carry their own metadata.

    The array's zarr metadata (``zarr.json``, or ``.zarray`` for zarr v2) is read and checked here, bounded in
    size and depth, and handed to tensorstore as parsed JSON: tensorstore never parses a stored metadata file
    itself (a deeply nested one crashed it). `result()` raises `CorruptCheckpointError` for missing or
    malformed metadata, naming the file."""
    if ref.store.kind == "safetensors":
        if meta is None:
            raise TypeError("a safetensors tensor is opened from its manifest entry")
        return Ready(raw_arrays.RawArray(ref.item, meta))
    zarr3 = ref.store.zarr_format == 3
    name = layout.ZARR_METADATA if zarr3 else _ZARR2_METADATA
    if ref.item.local_file("") is not None:
        # Local files are read through the backend, which refuses a FIFO or a device where a file belongs
        # (tensorstore's file driver would block on it); for OCDBT, the store's manifest is checked likewise.
        if ref.store.kind == "ocdbt":
            ref.item.read_range(layout.OCDBT_MANIFEST, 0, 0).result()
        else:
            return _Opening(ref, Ready(ref.location.read(name)), name, "zarr3" if zarr3 else "zarr")
    try:
        kvstore = ts.KvStore.open(ref.kvstore_spec(), context=ref.context_or_default).result()
        reading = kvstore.read(name)
    except ValueError as exc:
        raise _error("cannot open array", ref.location, exc, writing=False) from exc
    return _Opening(ref, reading, name, "zarr3" if zarr3 else "zarr")


_ZARR2_METADATA = ".zarray"


class _Opening:
    """An array being opened: its metadata file being read (`open_existing`): a kvstore read, or the bytes
    (None: missing) read already."""

    __slots__ = ("ref", "reading", "name", "driver")

    def __init__(self, ref: ArrayRef, reading: ts.Future | Ready, name: str, driver: str):
        self.ref, self.reading, self.name, self.driver = ref, reading, name, driver

    def result(self) -> ts.TensorStore:
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
            return ts.open(spec, context=self.ref.context_or_default, read=True).result()
        except (ValueError, TypeError, OverflowError) as exc:  # the last two: numbers beyond int64
            raise CorruptCheckpointError(f"cannot open array {self.ref.location}: {where} is malformed: "
                                         f"{_SPEC_DUMP.sub('', str(exc))}"[:1000]) from exc


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
        from .dtypes import by_name

        return by_name(dtype).itemsize if isinstance(dtype, str) else 8
    except (TypeError, ValueError, CheckpointError):
        return 8


class Ready:
    """An operation that finished at once, shaped like `Pending`."""

    __slots__ = ("value",)

    def __init__(self, value: object):
        self.value = value

    def result(self) -> object:
        return self.value


def read(store: ts.TensorStore | raw_arrays.RawArray, loc: storage.Location, region: Region,
         empty: Empty = np.empty) -> Pending | raw_arrays.RawRead:
    """Start reading `region` (only the chunks it touches, each checksum verified) into a buffer from `empty`;
    the result is a numpy array.

    The array is allocated here, on the caller's thread, and tensorstore copies into it. Arrays tensorstore
    allocates itself come from its worker threads' heaps, which gave every restore fresh memory from the OS:
    1-2 GiB of page faults per GiB restored, measured, the largest cost of a restore on the benchmark VM. Memory
    allocated here is recycled from one batch (and one restore) to the next."""
    if isinstance(store, raw_arrays.RawArray):
        return store.read(region, empty)
    view = store[region]
    out = empty(tuple(view.shape), view.dtype.numpy_dtype)
    future = ts.array(out, copy=False, write=True).write(view).commit
    return Pending(future, f"cannot read region {_format_region(region)} of array", loc, output=out)


def read_index(store: ts.TensorStore | raw_arrays.RawArray, loc: storage.Location, index: tuple[slice | int, ...]
               ) -> Pending | raw_arrays.RawRead:
    """Start reading `index` of an array (normalized integers and slices, strides allowed; () is everything),
    only the chunks it touches; the result is a numpy array."""
    if isinstance(store, raw_arrays.RawArray):
        return store.read_index(index)
    view = store[index] if index else store
    return Pending(view.read(), "cannot read array", loc)


def chunk_shape(store: ts.TensorStore | raw_arrays.RawArray) -> tuple[int, ...]:
    """The chunk shape of an open array (the inner chunks of a single-file array); () for a 0-d array."""
    if not isinstance(store, ts.TensorStore):  # a raw or local chunk array (`local_chunks`)
        return store.chunk_shape
    shape = store.chunk_layout.read_chunk.shape
    return tuple(shape) if shape is not None else ()


def stored_dtype_name(store: ts.TensorStore | raw_arrays.RawArray) -> str:
    """The zarr data type name of an open array (e.g. ``bfloat16``)."""
    if not isinstance(store, ts.TensorStore):  # a raw or local chunk array (`local_chunks`)
        return store.dtype_name
    return store.dtype.name


def _format_region(region: Region) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in region) + "]"
