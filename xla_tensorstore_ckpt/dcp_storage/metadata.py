"""DCP's `Metadata` of an item read by `reader.DCPStorageReader`: from the item's manifest (ours, Orbax's, a
safetensors file's or a DCP directory's), each array a `TensorStorageMetadata` (dtype, global size, and as chunks
the stored chunks: the chunk grid, a DCP tensor's pieces, a raw tensor whole), each opaque DCP byte array and each
JSON value a `BytesStorageMetadata`; `planner_data` maps each key to its key path (as DCP's planner records how
keys nest); `storage_data` is a `ReadIndex` the readers of every rank use. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.metadata import TensorProperties

from ..core import grid, layout, tree
from ..core.errors import KeyMismatchError
from ..core.records import ArrayMetadata, ArrayStore, ItemManifest, PiecesArrayMetadata, RawArrayMetadata


@dataclass(frozen=True)
class ReadIndex:
    """What `read_data` needs on every rank: how the item stores its arrays, and each DCP key's entry (an
    `ArrayMetadata`, or the JSON value itself)."""

    store: ArrayStore
    entries: dict[str, Any]


def dotted(path: layout.KeyPath) -> str:
    """DCP's flattened name of a key path (its planner joins the keys with ``.``)."""
    return ".".join(str(k) for k in path)


def dcp_metadata(manifest: ItemManifest, where: str,
                 key_map: Mapping[str, str | None] | Callable[[str], str | None] | None = None) -> Metadata:
    """DCP's `Metadata` of the item `manifest` describes (`where`: its location, for messages), its keys renamed
    by `key_map`. Raises `KeyMismatchError` if two keys get the same name."""
    rename = key_map.get if isinstance(key_map, Mapping) else key_map
    entries: dict[str, Any] = {}
    described: dict[str, Any] = {}
    paths: dict[str, layout.KeyPath] = {}
    for path, leaf in dcp_leaves(manifest.tree):
        name = dotted(path)
        if rename is not None:
            renamed = rename(name)
            if renamed is None:
                continue
            path = path if renamed == name else tuple(renamed.split("."))
            name = renamed
        if name in entries:
            raise KeyMismatchError(f"{where}: two keys are named {name!r} (after the key map)")
        entries[name] = leaf
        paths[name] = path
        described[name] = _describe(leaf)
    return Metadata(state_dict_metadata=described, planner_data=paths,
                    storage_data=ReadIndex(manifest.store, entries))


def dcp_leaves(node: Any, path: layout.KeyPath = ()) -> list[tuple[layout.KeyPath, Any]]:
    """The entries DCP's planner would flatten the tree `node` into (its `traverse_state_dict`): dicts are walked,
    lists when they hold an array, a dict or a list it walks; every other node, containers of JSON values
    included, is one value; tuples too, unless they hold an array (never handed to DCP as a value)."""
    if not _walked(node):
        return [(path, node)]
    items = node.items() if isinstance(node, dict) else enumerate(node)
    return [entry for key, value in items for entry in dcp_leaves(value, (*path, key))]


def _walked(node: Any) -> bool:
    if isinstance(node, dict):
        return True
    if isinstance(node, list):
        return any(isinstance(v, ArrayMetadata) or _walked(v) for v in node)
    if isinstance(node, tuple):
        return any(isinstance(v, ArrayMetadata) for _, v in tree.flatten(node))
    return False


def _describe(leaf: Any) -> TensorStorageMetadata | BytesStorageMetadata:
    if not isinstance(leaf, ArrayMetadata) or leaf.opaque is not None:
        return BytesStorageMetadata()
    properties = TensorProperties(dtype=leaf.torch_dtype)
    return TensorStorageMetadata(properties=properties, size=torch.Size(leaf.shape), chunks=_chunks(leaf))


def _chunks(meta: ArrayMetadata) -> list[ChunkStorageMetadata]:
    """The stored chunks: a DCP tensor's pieces, a raw tensor whole (one run of a file), else the chunk grid."""
    if isinstance(meta, PiecesArrayMetadata):
        boxes = [(p.offsets, p.sizes) for p in meta.pieces]
    elif isinstance(meta, RawArrayMetadata) or not meta.shape:
        boxes = [((0,) * len(meta.shape), meta.shape)]
    else:
        boxes = [(tuple(a for a, _ in region), tuple(b - a for a, b in region))
                 for _, region in grid.chunks(meta.shape, meta.chunk_shape)]
    return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in boxes]
