"""Format version 1, frozen: the item manifest (``<item>/_METADATA``) and the step marker
(``<step>/_CHECKPOINT_METADATA``) as this library wrote them before Orbax compatibility.

Item: ``{"format_version": 1, "tree": <tree.encode of the structure>}`` with ``{"array": {path, shape, dtype,
chunk_shape, sharding}}`` leaves for arrays and ``{"value": ...}`` / ``{"float": "nan"}`` for JSON leaves. Step:
``{"format_version": 1, "step", "items", "created_at", "committed_at", "metrics", "custom", "versions",
"process_count"}``. Arrays are zarr v3 directories with a crc32c codec, one per array, at ``path``: each key
path component one directory (``state/0/exp_avg``), escaped so that it is one safe path segment
(`escape_component`). Read only: its tree encoding lives on inside format 2 (`encode_tree`).

Decoding validates everything read from disk (types, ranges, paths that stay inside the item) so that a hostile
or damaged file is a `CorruptCheckpointError`.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from ..core import bounds, layout, tree
from ..core.errors import CorruptCheckpointError
from ..core.records import OPAQUE_KINDS, ArrayMetadata, ArrayStore, ItemManifest, SavedSharding, StepMetadata
from ..storage import Location

NAME = "v1"
DESCRIPTION = "xla_tensorstore_ckpt format 1"
FILE_SUFFIX = None
MATCH_BY_NAME = False
VERSION = 1
COMPLETION_MARK = False  # never wrote Orbax's

MAX_COMPONENT_LENGTH = 200
EMPTY_COMPONENT = "%"
_SAFE_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_INTEGER = re.compile(r"-?[0-9]+")
_RESERVED = frozenset({layout.ITEM_METADATA, layout.CHECKPOINT_METADATA, layout.ZARR_METADATA, ".", ".."})


def claims_item(_loc: Location, doc: dict | None) -> bool:
    return doc is not None and doc.get("format_version") == VERSION and "tree" in doc


def claims_step(doc: dict) -> bool:
    return doc.get("format_version") == VERSION and "items" in doc


def is_committed(_loc: Location, _marker: StepMetadata) -> bool:
    return True  # the marker, written last, is the commit point


# ------------------------------------------------------------------------------------------------- names


def escape_component(key: layout.KeyEntry) -> str:
    """One key (a dict key or a sequence index) as one safe directory name: bytes outside
    ``[A-Za-z0-9._-]`` percent-encoded; integers as plain decimal, while strings that would read back as
    integers, reserved names and ``.``/``..`` have their first byte percent-encoded; components longer than
    `MAX_COMPONENT_LENGTH` shortened with a hash."""
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    if not isinstance(key, str):
        raise TypeError(f"key {key!r} is neither str nor int")
    if key == "":
        return EMPTY_COMPONENT
    raw = key.encode("utf-8")
    escaped = "".join(chr(b) if b in _SAFE_BYTES else f"%{b:02X}" for b in raw)
    if _INTEGER.fullmatch(key) or key in _RESERVED:
        escaped = f"%{raw[0]:02X}" + escaped[1:]
    if len(escaped) > MAX_COMPONENT_LENGTH:
        digest = hashlib.sha256(raw).hexdigest()[:16]
        escaped = f"{escaped[: MAX_COMPONENT_LENGTH - 40].rstrip('%0123456789ABCDEF')}~{digest}"
    return escaped


def unescape_component(name: str) -> layout.KeyEntry:
    """Inverse of `escape_component` (for names not shortened by hashing)."""
    if name == EMPTY_COMPONENT:
        return ""
    if _INTEGER.fullmatch(name):
        return int(name)
    out = bytearray()
    i = 0
    while i < len(name):
        if name[i] == "%":
            out.append(int(name[i + 1 : i + 3], 16))
            i += 3
        else:
            out.append(ord(name[i]))
            i += 1
    return out.decode("utf-8")


def array_path(key_path: layout.KeyPath) -> str:
    """Relative directory of the array stored at `key_path` in format 1, e.g. ``state/0/exp_avg``."""
    return "/".join(escape_component(k) for k in key_path)


def array_names(paths: list[layout.KeyPath]) -> list[str]:
    return [array_path(p) for p in paths]


# ------------------------------------------------------------------------------------------------- items


def decode_item(_loc: Location, doc: dict, *, where: str) -> ItemManifest:
    return decode_tree(doc.get("tree"), where=where, format=NAME, store=ArrayStore())


def encode_tree(structure: Any) -> dict:
    """The structure and leaves of an item tree as JSON (also the core of format 2)."""
    def leaf(_path: layout.KeyPath, value: Any) -> dict:
        if isinstance(value, ArrayMetadata):
            return {"array": _array_json(value)}
        return tree.encode_value(value)

    return tree.encode(structure, leaf)


def decode_tree(node: Any, *, where: str, format: str, store: ArrayStore) -> ItemManifest:
    """Inverse of `encode_tree`, validated: the manifest of an item in `format` keeping its arrays in
    `store`."""
    def leaf(path: layout.KeyPath, value: dict) -> Any:
        if "array" in value:
            return _array(value["array"], where=f"{where} ({tree.format_key_path(path)})")
        return tree.decode_value(value, where=where)

    structure = tree.decode(node, leaf, where=where)
    if not tree.is_container(structure):
        raise CorruptCheckpointError(f"{where}: the tree root is not a container")
    manifest = ItemManifest(structure, format, store)
    seen: set[str] = set()
    for _path, meta in manifest.arrays():
        if meta.path in seen:
            raise CorruptCheckpointError(f"{where}: two arrays share the directory {meta.path!r}")
        seen.add(meta.path)
    return manifest


def _array_json(meta: ArrayMetadata) -> dict:
    out = {"path": meta.path, "shape": list(meta.shape), "dtype": meta.dtype, "chunk_shape": list(meta.chunk_shape),
           "sharding": None if meta.sharding is None else _sharding_json(meta.sharding)}
    if meta.opaque is not None:  # only when set: every other entry stays as format 1 wrote it
        out["opaque"] = meta.opaque
    return out


def _array(data: Any, *, where: str) -> ArrayMetadata:
    if not isinstance(data, dict):
        raise CorruptCheckpointError(f"{where}: array entry is not an object")
    path = layout.relative_path(string(data.get("path"), where), where=where, what="array path")
    shape = integers(data.get("shape"), where, minimum=0)
    chunk_shape = integers(data.get("chunk_shape"), where, minimum=1)
    dtype = string(data.get("dtype"), where)
    bounds.check_array(path, shape, dtype, chunk_shape, where)
    sharding = data.get("sharding")
    opaque = data.get("opaque")
    if opaque is not None and not (opaque in OPAQUE_KINDS and dtype == "uint8" and len(shape) == 1):
        raise CorruptCheckpointError(f"{where}: array {path!r} is marked opaque {str(opaque)[:40]!r}, which is not "
                                     "a 1-D uint8 array of a known kind")
    return ArrayMetadata(path, shape, dtype, chunk_shape, None if sharding is None else _sharding(sharding, where),
                         opaque)


def _sharding_json(sharding: SavedSharding) -> dict:
    return {
        "hlo": sharding.hlo, "tiles": list(sharding.tiles), "replicas": sharding.replicas,
        "num_devices": sharding.num_devices,
        "mesh_shape": None if sharding.mesh_shape is None else list(sharding.mesh_shape),
        "axis_names": None if sharding.axis_names is None else list(sharding.axis_names),
        "partition_spec": None if sharding.partition_spec is None else [
            list(p) if isinstance(p, tuple) else p for p in sharding.partition_spec],
        **({} if sharding.placements is None else {"placements": list(sharding.placements)}),
    }


def _sharding(data: Any, where: str) -> SavedSharding:
    if not isinstance(data, dict):
        raise CorruptCheckpointError(f"{where}: sharding is not an object")
    spec = data.get("partition_spec")
    return SavedSharding(
        hlo=string(data.get("hlo"), where),
        tiles=integers(data.get("tiles"), where, minimum=1),
        replicas=integer(data.get("replicas"), where, minimum=1),
        num_devices=integer(data.get("num_devices"), where, minimum=1),
        mesh_shape=None if data.get("mesh_shape") is None else integers(data["mesh_shape"], where, minimum=1),
        axis_names=None if data.get("axis_names") is None else tuple(
            string(a, where) for a in listing(data["axis_names"], where)),
        partition_spec=None if spec is None else tuple(
            tuple(p) if isinstance(p, list) else p for p in listing(spec, where)),
        placements=None if data.get("placements") is None else tuple(
            string(p, where) for p in listing(data["placements"], where)),
    )


# ------------------------------------------------------------------------------------------------- steps


def decode_step(_loc: Location, doc: dict, _step: int | None, *, where: str) -> StepMetadata:
    items = listing(doc.get("items"), where)
    for i in items:
        layout.relative_path(i, where=where, what="item", single=True)
    for name in ("metrics", "custom", "versions"):
        if doc.get(name) is not None and not isinstance(doc[name], dict):
            raise CorruptCheckpointError(f"{where}: {name} is not an object")
    for name in ("created_at", "committed_at"):
        if isinstance(doc.get(name), bool) or not isinstance(doc.get(name), (int, float)):
            raise CorruptCheckpointError(f"{where}: {name} is not a number")
    return StepMetadata(step=integer(doc.get("step"), where, minimum=0), items=tuple(items),
                        created_at=float(doc["created_at"]), committed_at=float(doc["committed_at"]),
                        metrics=doc.get("metrics"), custom=doc.get("custom"), versions=doc.get("versions"),
                        process_count=integer(doc.get("process_count", 1), where, minimum=1), format_version=VERSION)


# ------------------------------------------------------------------------------------------- validation


def listing(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise CorruptCheckpointError(f"{where}: expected a list, got {value!r}"[:300])
    return value


def integer(value: Any, where: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < (1 << 62):
        raise CorruptCheckpointError(f"{where}: expected an integer >= {minimum}, got {value!r}"[:300])
    return value


def integers(value: Any, where: str, *, minimum: int) -> tuple[int, ...]:
    items = listing(value, where)
    if len(items) > bounds.MAX_RANK:
        raise CorruptCheckpointError(f"{where}: rank {len(items)} exceeds {bounds.MAX_RANK}")
    return tuple(integer(v, where, minimum=minimum) for v in items)


def string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise CorruptCheckpointError(f"{where}: expected a string, got {value!r}"[:300])
    return value
