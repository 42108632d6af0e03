"""Every zarr array read through tensorstore (`TensorstoreReader`, the `base.ArrayReader` the picker in `arrays`
chooses where no faster reader applies: object stores, other codecs, zarr v2, Orbax's arrays): an array's
``zarr.json`` checked before it is opened (a regular chunk grid, dtypes of known widths), then regions read as
`Pending` futures into the caller's buffers, with the bytes the kvstore fetched counted. Called by `arrays.reader`,
by `local_chunks` for the arrays it does not cover, and by `formats.orbax` to learn Orbax arrays' shapes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import tensorstore as ts

from .. import storage
from ..core import bounds, dtypes, layout
from ..core.errors import CheckpointError, CorruptCheckpointError
from ..core.records import ArrayMetadata, ArrayStore
from ..storage import operation_context, without_spec
from .base import ArrayReader, Empty, Index, Ready
from .local_reads import COUNTS
from .tensorstore_io import ArrayRef, Pending, chunk_shape, error, format_region


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
        # What this reader reads is as fresh as this moment at least: an OCDBT store's manifest fetched since
        # (for one array of the item) serves every other array's metadata and chunk reads, rather than being
        # fetched again (a conditional request) for nearly every read issued apart from the others. The cache
        # of manifests is the operation's own (`operation_context`), so no earlier operation's copy is trusted.
        self.fresh_since = time.time()

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
                return _Opening(ref, Ready(ref.location.read(metadata)), metadata, "zarr3" if zarr3 else "zarr",
                                self.fresh_since)
            if not self._checked_files:
                storage.check_regular_files(self.item)
                self._checked_files = True
        try:
            kvstore = ts.KvStore.open(ref.kvstore_spec(), context=self.context).result()
            reading = kvstore.read(metadata, staleness_bound=self.fresh_since)
        except ValueError as exc:
            raise error("cannot open array", ref.location, exc, writing=False) from exc
        return _Opening(ref, reading, metadata, "zarr3" if zarr3 else "zarr", self.fresh_since)


_ZARR2_METADATA = ".zarray"


class _Opening:
    """An array being opened: its metadata file being read: a kvstore read, or the bytes (None: missing) read
    already."""

    __slots__ = ("ref", "reading", "name", "driver", "fresh_since")

    def __init__(self, ref: ArrayRef, reading: ts.Future | Ready, name: str, driver: str, fresh_since: float):
        self.ref, self.reading, self.name, self.driver = ref, reading, name, driver
        self.fresh_since = fresh_since

    def result(self) -> TensorstoreArray:
        where = f"{self.ref.location}/{self.name}"
        try:
            stored = self.reading.result()
        except ValueError as exc:
            raise error("cannot open array", self.ref.location, exc, writing=False) from exc
        data = stored if isinstance(self.reading, Ready) else stored.value if stored.state == "value" else None
        if data is None:
            raise CorruptCheckpointError(f"cannot open array {self.ref.location}: {where} is missing")
        doc = bounds.load_json(data, where=where, max_bytes=bounds.MAX_ARRAY_JSON_BYTES,
                               max_depth=bounds.MAX_ARRAY_JSON_DEPTH)
        _check_zarr_grid(doc, self.driver, where)
        spec = {"driver": self.driver, "kvstore": self.ref.kvstore_spec(), "metadata": doc, "assume_metadata": True,
                "fill_missing_data_reads": self.ref.store.fill_missing, "recheck_cached_data": self.fresh_since}
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
        self.chunk_shape = chunk_shape(array)

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
            out[region] = Pending(future, f"cannot read region {format_region(region)} of array", self.location,
                                  output=data)
        return out

    def read_index(self, index: tuple[slice | int, ...]) -> Pending:
        COUNTS.add(tensorstore_regions=1)
        view = self.tensorstore[index] if index else self.tensorstore
        return Pending(view.read(), "cannot read array", self.location)


def _kvstore_bytes_read(driver: str) -> int | None:
    """The bytes tensorstore's key-value store `driver` has read in this process (None: it keeps no
    ``bytes_read`` metric, or has read nothing yet)."""
    name = f"/tensorstore/kvstore/{driver}/bytes_read"
    values = [v.get("value", 0) for m in ts.experimental_collect_matching_metrics(name) if m["name"] == name
              for v in m.get("values", ())]
    return sum(values) if values else None

