"""The item manifest (``<item>/_METADATA``): a versioned JSON document holding the tree structure, JSON leaves
inline, and for every tensor its array directory, shape, dtype, chunk shape and saved sharding.

Immutable records with `to_json`/`from_json`; decoding validates everything read from disk (types, ranges,
paths that stay inside the item) so that a hostile or damaged manifest is a `CorruptCheckpointError`, and a
newer format version is a `FormatVersionError`. No torch_xla, no tensorstore.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from . import dtypes, layout, tree
from .errors import CorruptCheckpointError, FormatVersionError, UnsupportedValueError

FORMAT_VERSION = 1
MAX_ARRAY_BYTES = 1 << 50  # 1 PiB: anything larger is a damaged or hostile manifest.
MAX_RANK = 32


@dataclass(frozen=True)
class SavedSharding:
    """How a tensor was sharded when saved: its HLO sharding, the number of tiles per dimension, the
    replication factor, and when they could be recovered the mesh and partition spec."""

    hlo: str
    tiles: tuple[int, ...]
    replicas: int
    num_devices: int
    mesh_shape: tuple[int, ...] | None = None
    axis_names: tuple[str, ...] | None = None
    partition_spec: tuple[Any, ...] | None = None

    def to_json(self) -> dict:
        return {
            "hlo": self.hlo, "tiles": list(self.tiles), "replicas": self.replicas,
            "num_devices": self.num_devices,
            "mesh_shape": None if self.mesh_shape is None else list(self.mesh_shape),
            "axis_names": None if self.axis_names is None else list(self.axis_names),
            "partition_spec": None if self.partition_spec is None else [
                list(p) if isinstance(p, tuple) else p for p in self.partition_spec],
        }

    @classmethod
    def from_json(cls, data: Any, *, where: str) -> SavedSharding:
        if not isinstance(data, dict):
            raise CorruptCheckpointError(f"{where}: sharding is not an object")
        spec = data.get("partition_spec")
        return cls(
            hlo=_str(data.get("hlo"), where),
            tiles=_ints(data.get("tiles"), where, minimum=1),
            replicas=_int(data.get("replicas"), where, minimum=1),
            num_devices=_int(data.get("num_devices"), where, minimum=1),
            mesh_shape=None if data.get("mesh_shape") is None else _ints(data["mesh_shape"], where, minimum=1),
            axis_names=None if data.get("axis_names") is None else tuple(
                _str(a, where) for a in _list(data["axis_names"], where)),
            partition_spec=None if spec is None else tuple(
                tuple(p) if isinstance(p, list) else p for p in _list(spec, where)),
        )

    def describe(self) -> str:
        """Short text for listings: ``mesh (4, 2) ('x', 'y') spec ('x', None)`` or the tile layout."""
        if self.mesh_shape is not None and self.partition_spec is not None:
            names = f" {self.axis_names}" if self.axis_names else ""
            return f"mesh {self.mesh_shape}{names} spec {self.partition_spec}"
        return f"tiles {self.tiles} x{self.replicas} replicas"


@dataclass(frozen=True)
class ArrayMetadata:
    """One stored tensor: its zarr array directory (relative to the item), shape, zarr dtype name, chunk
    shape and the sharding it was saved with (None for CPU or unsharded tensors)."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    sharding: SavedSharding | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtypes.by_name(self.dtype).torch

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.by_name(self.dtype).itemsize

    @property
    def num_chunks(self) -> int:
        """Chunks holding data (none for an array with a zero-length dimension)."""
        return math.prod(-(-n // c) for n, c in zip(self.shape, self.chunk_shape))

    def to_json(self) -> dict:
        return {
            "path": self.path, "shape": list(self.shape), "dtype": self.dtype,
            "chunk_shape": list(self.chunk_shape),
            "sharding": None if self.sharding is None else self.sharding.to_json(),
        }

    @classmethod
    def from_json(cls, data: Any, *, where: str) -> ArrayMetadata:
        if not isinstance(data, dict):
            raise CorruptCheckpointError(f"{where}: array entry is not an object")
        path = _str(data.get("path"), where)
        if not layout.is_safe_relative_path(path):
            raise CorruptCheckpointError(f"{where}: array path {path!r} escapes the item directory")
        shape = _ints(data.get("shape"), where, minimum=0)
        chunk_shape = _ints(data.get("chunk_shape"), where, minimum=1)
        dtype = _str(data.get("dtype"), where)
        try:
            itemsize = dtypes.by_name(dtype).itemsize
        except UnsupportedValueError:
            raise CorruptCheckpointError(f"{where}: unknown dtype {dtype!r} for {path}") from None
        if len(shape) > MAX_RANK or len(chunk_shape) != len(shape) or any(
                c > max(1, n) for c, n in zip(chunk_shape, shape)):
            raise CorruptCheckpointError(f"{where}: array {path} has shape {shape} and chunk shape {chunk_shape}")
        if math.prod(shape) * itemsize > MAX_ARRAY_BYTES:
            raise CorruptCheckpointError(f"{where}: array {path} claims an absurd shape {shape}")
        sharding = data.get("sharding")
        return cls(path, shape, dtype, chunk_shape,
                   None if sharding is None else SavedSharding.from_json(sharding, where=where))


@dataclass(frozen=True)
class ItemManifest:
    """The decoded ``_METADATA`` of one item: `tree` has `ArrayMetadata` leaves for tensors and the values
    themselves for JSON leaves."""

    tree: Any
    format_version: int = FORMAT_VERSION

    def arrays(self) -> list[tuple[layout.KeyPath, ArrayMetadata]]:
        return [(p, v) for p, v in tree.flatten(self.tree) if isinstance(v, ArrayMetadata)]

    def leaves(self) -> dict[layout.KeyPath, Any]:
        return dict(tree.flatten(self.tree))

    def to_bytes(self) -> bytes:
        def leaf(_path: layout.KeyPath, value: Any) -> dict:
            if isinstance(value, ArrayMetadata):
                return {"array": value.to_json()}
            return tree.encode_value(value)

        doc = {"format_version": self.format_version, "tree": tree.encode(self.tree, leaf)}
        return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str) -> ItemManifest:
        doc = _load_json(data, where)
        check_format_version(doc, where)

        def leaf(path: layout.KeyPath, node: dict) -> Any:
            if "array" in node:
                return ArrayMetadata.from_json(node["array"], where=f"{where} ({tree.format_key_path(path)})")
            return tree.decode_value(node, where=where)

        structure = tree.decode(doc.get("tree"), leaf, where=where)
        if not tree.is_container(structure):
            raise CorruptCheckpointError(f"{where}: the tree root is not a container")
        seen: set[str] = set()
        for _path, meta in cls(structure).arrays():
            if meta.path in seen:
                raise CorruptCheckpointError(f"{where}: two arrays share the directory {meta.path!r}")
            seen.add(meta.path)
        return cls(structure, doc["format_version"])


def _load_json(data: bytes, where: str) -> dict:
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: not a JSON object")
    return doc


def load_json(data: bytes, *, where: str) -> dict:
    """Parse a JSON object read from a checkpoint; `CorruptCheckpointError` naming `where` if it is not one."""
    return _load_json(data, where)


def check_format_version(doc: dict, where: str) -> None:
    """Raise unless `doc` carries a format version this reader knows."""
    version = doc.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CorruptCheckpointError(f"{where}: missing or invalid format_version {version!r}")
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{where}: written in format version {version}, but this xla_tensorstore_ckpt reads up to "
            f"version {FORMAT_VERSION}; upgrade the package")


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise CorruptCheckpointError(f"{where}: expected a list, got {value!r}"[:300])
    return value


def _int(value: Any, where: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < (1 << 62):
        raise CorruptCheckpointError(f"{where}: expected an integer >= {minimum}, got {value!r}"[:300])
    return value


def _ints(value: Any, where: str, *, minimum: int) -> tuple[int, ...]:
    items = _list(value, where)
    if len(items) > MAX_RANK:
        raise CorruptCheckpointError(f"{where}: rank {len(items)} exceeds {MAX_RANK}")
    return tuple(_int(v, where, minimum=minimum) for v in items)


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise CorruptCheckpointError(f"{where}: expected a string, got {value!r}"[:300])
    return value


@dataclass(frozen=True)
class StepMetadata:
    """The commit marker of a step (``<step>/_CHECKPOINT_METADATA``), written last: a step is committed iff
    it exists and decodes. Holds what the step contains and how it came to be."""

    step: int
    items: tuple[str, ...]
    created_at: float
    committed_at: float
    metrics: dict[str, Any] | None = None
    custom: dict[str, Any] | None = None
    versions: dict[str, str] | None = None
    process_count: int = 1
    format_version: int = FORMAT_VERSION

    def to_bytes(self) -> bytes:
        doc = {"format_version": self.format_version, "step": self.step, "items": list(self.items),
               "created_at": self.created_at, "committed_at": self.committed_at, "metrics": self.metrics,
               "custom": self.custom, "versions": self.versions, "process_count": self.process_count}
        return json.dumps(doc, allow_nan=False, indent=1).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str) -> StepMetadata:
        doc = _load_json(data, where)
        check_format_version(doc, where)
        items = _list(doc.get("items"), where)
        if not all(isinstance(i, str) and layout.is_safe_relative_path(i) and "/" not in i for i in items):
            raise CorruptCheckpointError(f"{where}: malformed item list {items!r}"[:300])
        for name in ("metrics", "custom", "versions"):
            if doc.get(name) is not None and not isinstance(doc[name], dict):
                raise CorruptCheckpointError(f"{where}: {name} is not an object")
        for name in ("created_at", "committed_at"):
            if isinstance(doc.get(name), bool) or not isinstance(doc.get(name), (int, float)):
                raise CorruptCheckpointError(f"{where}: {name} is not a number")
        return cls(step=_int(doc.get("step"), where, minimum=0), items=tuple(items),
                   created_at=float(doc["created_at"]), committed_at=float(doc["committed_at"]),
                   metrics=doc.get("metrics"), custom=doc.get("custom"), versions=doc.get("versions"),
                   process_count=_int(doc.get("process_count", 1), where, minimum=1),
                   format_version=doc["format_version"])
