"""Zarr v3 arrays through tensorstore: specs, creation, chunk writes and region reads.

Every array is plain zarr v3: a regular chunk grid (the SPMD shard grid), the ``bytes`` codec followed by
``crc32c`` so every chunk carries a checksum that tensorstore (and zarr-python) verify on read. Reads refuse
missing chunks (``fill_missing_data_reads: false``) and writes store every chunk, even all-zero ones, so a lost
chunk is an error and never silent zeros.

Functions start I/O and return at once with a `Pending` future; callers start many and then wait, so I/O
runs concurrently on tensorstore's threads. Errors are translated to `CorruptCheckpointError` (checksum,
missing data) or `StorageError` (the rest), with the array's location in the message.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tensorstore as ts

from . import layout, storage
from .errors import CorruptCheckpointError, StorageError

Region = tuple[slice, ...]

_CORRUPTION_CODES = ("DATA_LOSS", "NOT_FOUND", "FAILED_PRECONDITION", "INVALID_ARGUMENT", "OUT_OF_RANGE")


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
        return CorruptCheckpointError(f"{action} array {loc}: {text}")
    return StorageError(f"{action} array {loc}: {text}")


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


def create(loc: storage.Location, shape: Sequence[int], dtype_name: str, chunk_shape: Sequence[int],
           *, single_file: bool = False, write_metadata: bool = True) -> Pending:
    """Start creating the array at `loc` (writing ``zarr.json`` unless `write_metadata` is False, when another
    process writes it); the result is the array open for chunk writes."""
    spec = {
        "driver": "zarr3",
        "kvstore": loc.kvstore_spec(),
        "metadata": zarr_metadata(shape, dtype_name, chunk_shape, single_file=single_file),
        "store_data_equal_to_fill_value": True,
    }
    if write_metadata:
        spec["create"] = True
    else:
        spec["assume_metadata"] = True
    return Pending(ts.open(spec, context=storage.context()), "cannot create", loc, writing=True)


def write(store: ts.TensorStore, loc: storage.Location, chunks: Sequence[tuple[Region, np.ndarray]], *,
          single_file: bool, writeback: bool = False) -> tuple[list[Pending], list[str]]:
    """Start writing whole chunks (region, data) of one array; return the futures, ready once the chunks are
    stored, and the files they go to (relative to `loc`). The data must stay unchanged until then: tensorstore
    references it without copying. With `single_file` (see `zarr_metadata`) the chunks are written in one
    transaction, as one file. With `writeback` (saves that end with `Location.sync_files`), each finished chunk
    file is handed to the disk at once."""
    reference = loc.capabilities.zero_copy_writes
    if not single_file:
        shape = chunk_shape(store)
        keys = [layout.chunk_key(tuple(r.start // c for r, c in zip(region, shape))) for region, _ in chunks]
        pending = [Pending(store[region].write(data, can_reference_source_data_indefinitely=reference).commit,
                           f"cannot write region {_format_region(region)} of", loc, writing=True)
                   for region, data in chunks]
        if writeback:
            for key, item in zip(keys, pending):
                _on_done(item, loc, key)
        return pending, keys
    txn = ts.Transaction()
    view = store.with_transaction(txn)
    copies = [Pending(view[region].write(data, can_reference_source_data_indefinitely=reference).copy,
                      f"cannot write region {_format_region(region)} of", loc, writing=True)
              for region, data in chunks]
    commit = Pending(txn.commit_async(), "cannot write", loc, writing=True)
    key = layout.chunk_key((0,) * store.rank)
    if writeback:
        _on_done(commit, loc, key)
    return [*copies, commit], [key]


# One thread hands finished chunk files to the disk: off tensorstore's threads, and never on the caller's.
_WRITEBACK = ThreadPoolExecutor(1, thread_name_prefix="xtc-writeback")


def _on_done(item: Pending, loc: storage.Location, key: str) -> None:
    item.future.add_done_callback(lambda _: _hand_to_disk(loc, key))


def _hand_to_disk(loc: storage.Location, key: str) -> None:
    try:
        _WRITEBACK.submit(loc.file_written, key)
    except RuntimeError:
        pass  # the interpreter is shutting down; the save's final sync decides durability anyway


def open_existing(loc: storage.Location) -> Pending:
    """Start opening a stored array for reading; reading a missing chunk will be an error."""
    spec = {"driver": "zarr3", "kvstore": loc.kvstore_spec(), "open": True, "fill_missing_data_reads": False}
    return Pending(ts.open(spec, context=storage.context(), read=True), "cannot open", loc)


def read(store: ts.TensorStore, loc: storage.Location, region: Region) -> Pending:
    """Start reading `region` (only the chunks it touches, each checksum verified); the result is a numpy
    array.

    The array is allocated here, on the caller's thread, and tensorstore copies into it. Arrays tensorstore
    allocates itself come from its worker threads' heaps, which gave every restore fresh memory from the OS:
    1-2 GiB of page faults per GiB restored, measured, the largest cost of a restore on the benchmark VM. Memory
    allocated here is recycled from one batch (and one restore) to the next."""
    view = store[region]
    out = np.empty(view.shape, dtype=view.dtype.numpy_dtype)
    future = ts.array(out, copy=False, write=True).write(view).commit
    return Pending(future, f"cannot read region {_format_region(region)} of", loc, output=out)


def read_index(store: ts.TensorStore, loc: storage.Location, index: tuple[slice | int, ...]) -> Pending:
    """Start reading `index` of an array (normalized integers and slices, strides allowed; () is everything),
    only the chunks it touches; the result is a numpy array."""
    view = store[index] if index else store
    return Pending(view.read(), "cannot read", loc)


def chunk_shape(store: ts.TensorStore) -> tuple[int, ...]:
    """The chunk shape of an open array (the inner chunks of a single-file array); () for a 0-d array."""
    shape = store.chunk_layout.read_chunk.shape
    return tuple(shape) if shape is not None else ()


def stored_dtype_name(store: ts.TensorStore) -> str:
    """The zarr data type name of an open array (e.g. ``bfloat16``)."""
    return store.dtype.name


def _format_region(region: Region) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in region) + "]"
