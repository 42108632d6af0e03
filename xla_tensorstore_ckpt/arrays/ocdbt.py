"""The OCDBT key-value stores an item keeps its arrays in (as Orbax does): their tensorstore specs, the merge of
the per-process stores into the item's root store, and the index of where each stored value lies (for readers
that fetch values straight from the data files).

Each process writes its chunks into stores of its own (``ocdbt.process_<i>``, and ``ocdbt.process_<i>x<k>`` for
its other lanes), one transaction per batch; once every process is done the primary merges them into the root
store, which references their data files rather than copying them. Everything blocks.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import tensorstore as ts

from .. import storage
from ..core import layout
from ..core.errors import CorruptCheckpointError, StorageError
from ..storage import operation_context, without_spec

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
MANIFEST = layout.OCDBT_MANIFEST
MAX_INLINE_VALUE_BYTES = _OCDBT_CONFIG["max_inline_value_bytes"]  # smaller values live in the B-tree nodes


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


def manifest_bytes(root: str | None, statistics: dict) -> bytes:
    """The ``manifest.ocdbt`` of a new store (this library's configuration, a fresh UUID) whose one version has the
    B-tree root node at `root` (a ``btreenode::<file>:<offset>:<length>`` location; None: no keys) with
    `statistics` (``num_keys``, ``num_tree_bytes``, ``num_indirect_value_bytes``). For stores written without
    tensorstore (`direct_ocdbt`); tensorstore encodes it."""
    config = {"compression": {"id": "zstd"}, "max_decoded_node_bytes": _OCDBT_CONFIG["max_decoded_node_bytes"],
              "max_inline_value_bytes": MAX_INLINE_VALUE_BYTES, "uuid": secrets.token_hex(16),
              "version_tree_arity_log2": 4}
    version = {"commit_time": time.time_ns(), "generation_number": 1, "root_height": 0,
               "root": {"statistics": statistics, **({"location": root} if root is not None else {})}}
    return ts.ocdbt.undump_manifest({"config": config, "version_tree_nodes": [], "versions": [version]})


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
        raise StorageError(f"cannot merge the array stores of {item}: {without_spec(str(exc))}") from exc


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
    storage.check_regular_files(item)  # a FIFO there would block tensorstore: refused
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
        raise CorruptCheckpointError(f"cannot read the array store of {item}: {without_spec(str(exc))}") \
            from exc
    return index


def _indirect(item: storage.Location, where: str) -> StoredValue:
    """A ``value:<base path>:<file>:<offset>:<length>`` reference of `ocdbt.dump`."""
    head, offset, length = where.rsplit(":", 2)
    kind, base, file = head.split(":", 2)
    path = base + file
    if kind != "value":
        raise CorruptCheckpointError(f"the array store of {item} references {where!r}, not a value in a file")
    if not layout.is_safe_relative_path(path):  # the message is made only for a bad path (asked once per chunk)
        layout.relative_path(path, where=f"the array store of {item} references {where!r}", what="data file")
    return StoredValue(file=path, offset=int(offset), length=int(length))
