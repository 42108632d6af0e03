"""Orbax's PyTree checkpoint schema (orbax-checkpoint 0.11 / 0.12), both ways: the documents Orbax needs in the
checkpoints this library writes (`tree_metadata`, `step_document`), and the reading of checkpoints Orbax wrote
itself (this module is also the format `orbax` of the registry: `claims_item`, `decode_item`, `claims_step`,
`decode_step`; format version 0 in step records). Documents holding this library's object (`v2.KEY`) are never
claimed here: they are ours, of some version.

An Orbax item: ``_METADATA`` = ``{"tree_metadata": {"('a', 'b')": {"key_metadata": [{"key": "a", "key_type": 2},
...], "value_metadata": {"value_type": ..., "skip_deserialize": ..., "write_shape": [...]}}}, "use_ocdbt",
"use_zarr3", "store_array_data_equal_to_fill_value", "custom_metadata"}``; arrays named by their key path joined
with ``.``, in one OCDBT store or one directory each, zarr3 or zarr2; scalars as 0-d arrays, strings in
``_strings.json``; ``None`` and empty containers as metadata entries only. Unknown top-level keys are ignored by
Orbax, which is where this library keeps what Orbax's schema cannot say (see `v2`).
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import arrays
from ..core import bounds, layout, threads, tree
from ..core.errors import CorruptCheckpointError
from ..core.records import ArrayMetadata, ArrayStore, ItemManifest, StepMetadata
from ..storage import Location

STANDARD_HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
SEQUENCE, MAPPING = 1, 2  # key_type
ARRAY, SCALAR, STRING = "jax.Array", "scalar", "string"
_EMPTY = {"None": None, "Dict": dict, "List": list, "Tuple": tuple, "NamedTuple": tuple}
_INT64 = (-(1 << 63), (1 << 63) - 1)
_INDEX = re.compile(r"[0-9]{1,18}")  # a sequence index: ASCII digits ("²".isdigit() is true), of int64 size
_OURS = "xla_tensorstore_ckpt"  # v2.KEY (v2 builds on this module)

NAME = "orbax"
DESCRIPTION = "Orbax"
FILE_SUFFIX = None
MATCH_BY_NAME = False
VERSION = 0
COMPLETION_MARK = False  # its mark is its commit point on storage that cannot rename (`is_committed`)


def scalar_dtype(value: Any) -> str | None:
    """The zarr dtype Orbax stores a Python scalar leaf as (a 0-d array), or None if it cannot be one (a str,
    None, or an int beyond int64)."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int64" if _INT64[0] <= value <= _INT64[1] else None
    if isinstance(value, float):
        return "float64"
    return None


# ------------------------------------------------------------------------------------------------ writing


def tree_metadata(structure: Any, hidden: list[layout.KeyPath]) -> dict:
    """``tree_metadata`` for a tree whose leaves are `ArrayMetadata` (arrays) and JSON values, empty containers
    included, as Orbax would have written it for the same tree; except that a leaf stored under an escaped name
    (`hidden`, from `hidden_keys`) is an empty ``None`` to Orbax, which restores ``None`` for it: Orbax computes
    names itself, and under the name it would compute it would read another key's value or nothing."""
    hidden = set(hidden)
    entries: dict[str, dict] = {}
    for path, value in _leaves_and_empty_nodes(structure, ()):
        keys = [{"key": str(k), "key_type": SEQUENCE if isinstance(k, int) and _in_sequence(structure, path, i)
                 else MAPPING} for i, k in enumerate(path)]
        entries[str(tuple(str(k) for k in path))] = {
            "key_metadata": keys, "value_metadata": _value_metadata(None if path in hidden else value)}
    return entries


def hidden_keys(leaves: list[tuple[layout.KeyPath, Any]], names: list[str]) -> list[layout.KeyPath]:
    """The key paths of `leaves` (tensors or `ArrayMetadata`, strings, numbers; `names` their array names, from
    `v2.array_names`) that Orbax cannot restore: stored under an escaped name, not under the key path
    joined with ``.`` (that name is taken by another key, or unsafe as a file name). Called by `tree_metadata`
    and by the save planner, which warns about them."""
    return [path for (path, value), name in zip(leaves, names)
            if name != layout.key_name(path) and value is not None
            and not (isinstance(value, (bool, int, float)) and scalar_dtype(value) is None)]


def _leaves_and_empty_nodes(node: Any, path: layout.KeyPath):
    if isinstance(node, dict) and node:
        for key, child in node.items():
            yield from _leaves_and_empty_nodes(child, (*path, key))
    elif isinstance(node, (list, tuple)) and node:
        for index, child in enumerate(node):
            yield from _leaves_and_empty_nodes(child, (*path, index))
    elif path:
        yield path, node


def _in_sequence(root: Any, path: layout.KeyPath, depth: int) -> bool:
    node = root
    for key in path[:depth]:
        node = node[key]
    return isinstance(node, (list, tuple))


def _value_metadata(value: Any) -> dict:
    if isinstance(value, ArrayMetadata):
        return {"value_type": ARRAY, "skip_deserialize": False, "write_shape": list(value.chunk_shape)}
    if isinstance(value, str):
        return {"value_type": STRING, "skip_deserialize": False}
    if scalar_dtype(value) is not None:
        return {"value_type": SCALAR, "skip_deserialize": False}
    empty = {dict: "Dict", list: "List", tuple: "Tuple"}.get(type(value), "None")  # beyond int64: None to Orbax
    return {"value_type": empty, "skip_deserialize": True}


def step_document(marker: StepMetadata, ours: dict) -> dict:
    """``_CHECKPOINT_METADATA`` in Orbax's schema; what Orbax has no field for goes into `custom_metadata`
    under the key `v2.KEY`, beside the user's own custom metadata."""
    custom = dict(marker.custom or {})
    custom.update(ours)
    return {"item_handlers": {item: STANDARD_HANDLER for item in marker.items}, "metrics": marker.metrics or {},
            "performance_metrics": {}, "init_timestamp_nsecs": int(marker.created_at * 1e9),
            "commit_timestamp_nsecs": int(marker.committed_at * 1e9), "custom_metadata": custom}


# ------------------------------------------------------------------------------------------------ reading


def is_item(doc: dict | None) -> bool:
    """True if a decoded ``_METADATA`` is in Orbax's PyTree schema (ours of format 2 included)."""
    return doc is not None and isinstance(doc.get("tree_metadata"), dict)


def array_names(paths: list[layout.KeyPath]) -> list[str]:
    """How Orbax names an array: its key path joined with ``.``."""
    return [layout.key_name(p) for p in paths]


def claims_item(loc: Location, doc: dict | None) -> bool:
    if doc is None:  # Orbax's JsonCheckpointHandler: the item is one JSON document
        return loc.read_range(layout.ORBAX_JSON_ITEM, 0, 0).result() is not None
    return is_item(doc) and _OURS not in doc


def claims_step(doc: dict) -> bool:
    custom = doc.get("custom_metadata")
    return ("item_handlers" in doc or "commit_timestamp_nsecs" in doc) and not (
        isinstance(custom, dict) and _OURS in custom)


def is_committed(loc: Location, _marker: StepMetadata) -> bool:
    """Orbax renames a finished step into place where the storage renames; elsewhere (object stores) its step
    is finished once ``commit_success.txt`` exists."""
    return loc.capabilities.renames or loc.read(layout.COMMIT_SUCCESS) is not None


def decode_item(loc: Location, doc: dict | None, *, where: str) -> ItemManifest:
    """An item Orbax wrote: the tree rebuilt from ``key_metadata`` (sequences become lists, dict keys strings),
    arrays opened for their shape, dtype and chunks, scalars and strings read; or the one JSON document of its
    JsonCheckpointHandler. Blocks."""
    if doc is None:
        json_where = str(loc.child(layout.ORBAX_JSON_ITEM))
        data = loc.read(layout.ORBAX_JSON_ITEM)
        if data is None:
            raise CorruptCheckpointError(f"{json_where} disappeared while being read")
        return _json_item(bounds.load_json(data, where=json_where, expect=object), where=json_where)
    use_ocdbt = doc.get("use_ocdbt")
    if use_ocdbt is None:  # written before Orbax recorded it
        use_ocdbt = loc.read(layout.OCDBT_MANIFEST) is not None
    store = ArrayStore(kind="ocdbt" if use_ocdbt else "directories", zarr_format=3 if doc.get("use_zarr3") else 2,
                       checksums=False, fill_missing=not doc.get("store_array_data_equal_to_fill_value", False))
    entries = _entries(doc["tree_metadata"], where)
    names = {path: ".".join(str(k) for k in path) for path, _ in entries}
    strings = _strings(loc, where) if any(v.get("value_type") == STRING for _, v in entries) else {}
    to_open = [path for path, v in entries if v.get("value_type") not in (STRING, *_EMPTY) and
               not v.get("skip_deserialize")]
    for path in to_open:
        _check_array_name(path, names[path], where)
    reader = arrays.TensorstoreReader(loc, store)  # Orbax's arrays are zarr, read by tensorstore
    with ThreadPoolExecutor(threads.count("storage_requests", len(to_open))) as pool:
        opened = dict(zip(to_open, pool.map(lambda p: reader.open_name(names[p]).result(), to_open)))
    leaves: list[tuple[layout.KeyPath, Any]] = []
    for path, value in entries:
        kind = value.get("value_type")
        if path in opened:
            stored = opened[path]
            meta = ArrayMetadata(names[path], stored.shape, stored.dtype_name, stored.chunk_shape)
            array_where = f"{loc.child(names[path])} (key {_key_text(path)})"
            bounds.check_array(meta.path, meta.shape, meta.dtype, meta.chunk_shape, array_where, foreign=True)
            if kind == SCALAR:
                if math.prod(meta.shape) != 1:  # read only a single element: never an array's data
                    raise CorruptCheckpointError(f"{array_where}: a scalar leaf stored as an array of shape "
                                                 f"{list(meta.shape)}")
                leaves.append((path, stored.read_index(()).result().item()))
            else:
                leaves.append((path, meta))
        elif kind == STRING:
            if names[path] not in strings:
                raise CorruptCheckpointError(f"{where}: string {names[path]!r} is missing from {layout.STRINGS}")
            leaves.append((path, strings[names[path]]))
        else:
            empty = _EMPTY.get(kind)
            leaves.append((path, empty() if empty is not None else None))
    return ItemManifest(_build(leaves, where), NAME, store)


def _check_array_name(path: layout.KeyPath, name: str, where: str) -> None:
    """`CorruptCheckpointError` if the array Orbax names by `path` would lie outside the item directory. A
    ``/`` within a name is allowed: Orbax stores the key ``"a/b"`` as the nested directory ``a/b`` and restores
    it; a name that leaves the item (``..`` or ``.`` or empty components, a leading ``/``, ``\\``, NUL) is not."""
    layout.relative_path(name, where=where, what=f"the array of key {_key_text(path)[:200]} would be read from")


def _json_item(doc: Any, *, where: str) -> ItemManifest:
    """An item Orbax's JsonCheckpointHandler wrote: one JSON container, its values the leaves."""
    if not tree.is_container(doc):
        raise CorruptCheckpointError(f"{where}: not a JSON object or array")
    return ItemManifest(doc, NAME, ArrayStore(checksums=False))


def _entries(tree_doc: dict, where: str) -> list[tuple[layout.KeyPath, dict]]:
    out = []
    for name, entry in tree_doc.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("key_metadata"), list) or not isinstance(
                entry.get("value_metadata"), dict) or not isinstance(entry["value_metadata"].get("value_type"), str):
            raise CorruptCheckpointError(f"{where}: malformed tree_metadata entry {name[:200]!r}")
        bounds.check_key_path(len(entry["key_metadata"]), f"{where} ({name[:200]!r})")
        path: list[layout.KeyEntry] = []
        for key in entry["key_metadata"]:
            if not isinstance(key, dict) or not isinstance(key.get("key"), str):
                raise CorruptCheckpointError(f"{where}: malformed key in tree_metadata entry {name[:200]!r}")
            if key.get("key_type") == SEQUENCE:
                if not _INDEX.fullmatch(key["key"]):
                    raise CorruptCheckpointError(f"{where}: sequence index {key['key'][:40]!r} is not a number")
                path.append(int(key["key"]))
            else:
                path.append(key["key"])
        out.append((tuple(path), entry["value_metadata"]))
    return out


def _key_text(path: layout.KeyPath) -> str:
    return str(tuple(str(k) for k in path))[:300]


def _strings(loc: Location, where: str) -> dict[str, str]:
    """The string leaves of ``_strings.json``: an object of strings, by array name."""
    data = loc.read(layout.STRINGS)
    if data is None:
        raise CorruptCheckpointError(f"{where}: string leaves, but no {layout.STRINGS}")
    file = str(loc.child(layout.STRINGS))
    strings = bounds.load_json(data, where=file, unique_keys=True)
    bad = next((k for k, v in strings.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise CorruptCheckpointError(f"{file}: the value of {bad!r} is not a string")
    return strings


def _build(leaves: list[tuple[layout.KeyPath, Any]], where: str) -> Any:
    """Nested dicts and lists from (path, value) pairs; list indices must run 0..n-1."""
    root: dict = {}
    for path, value in leaves:
        if not path:
            raise CorruptCheckpointError(f"{where}: a leaf with an empty key path")
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise CorruptCheckpointError(f"{where}: key path {path} runs through a leaf")
        if path[-1] in node:
            raise CorruptCheckpointError(f"{where}: key path {path} appears twice")
        node[path[-1]] = value

    def listify(node: Any) -> Any:
        if not isinstance(node, dict) or not node:
            return node
        items = {k: listify(v) for k, v in node.items()}
        if all(isinstance(k, int) for k in items):
            if sorted(items) != list(range(len(items))):
                raise CorruptCheckpointError(f"{where}: sequence indices {sorted(items)} are not 0..{len(items) - 1}")
            return [items[i] for i in range(len(items))]
        return items

    out = listify(root)
    if not tree.is_container(out):
        raise CorruptCheckpointError(f"{where}: the tree root is not a container")
    return out


def decode_step(loc: Location, doc: dict, step: int | None, *, where: str) -> StepMetadata | None:
    """A step Orbax's CheckpointManager wrote; its number comes from the directory name. None for the
    ``_CHECKPOINT_METADATA`` of a lone item (a Checkpointer's, not a manager's step), which names its handler
    directly rather than per item."""
    if isinstance(doc.get("item_handlers"), str):
        return None
    if step is None:
        step = layout.parse_step_name(loc.name, None, any_prefix=True)
        if step is None:
            raise CorruptCheckpointError(f"{where}: not in a step directory")
    handlers = doc.get("item_handlers")
    if isinstance(handlers, dict):
        items = tuple(name for name in handlers if layout.is_safe_relative_path(name, single=True))
    else:
        items = tuple(name for name in loc.list() if loc.child(name).read(layout.ITEM_METADATA) is not None)
    metrics = doc.get("metrics")
    custom = doc.get("custom_metadata")
    return StepMetadata(step=step, items=items, created_at=_seconds(doc.get("init_timestamp_nsecs")),
                        committed_at=_seconds(doc.get("commit_timestamp_nsecs")),
                        metrics=metrics if isinstance(metrics, dict) else None,
                        custom=custom if isinstance(custom, dict) else None, format_version=VERSION)


def _seconds(nanoseconds: Any) -> float:
    return nanoseconds / 1e9 if isinstance(nanoseconds, int) and not isinstance(nanoseconds, bool) else 0.0

