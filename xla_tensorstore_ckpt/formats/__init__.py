"""On-disk formats: the one entry point through which every reader (restore, the manager's step index,
inspection, export) gets an item's `ItemManifest` or a step's `StepMetadata`, and through which writers encode
them.

Each format version lives in its own module (`v1`, ...) and is recognised by the content of the file, never by
its name alone: the names ``_METADATA`` and ``_CHECKPOINT_METADATA`` are shared with Orbax, whose contents differ.
A version newer than this reader knows is a `FormatVersionError`; a file no version recognises is a
`CorruptCheckpointError` naming it.
"""

from __future__ import annotations

import json

from .. import layout
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError
from ..storage import Location
from . import v1
from .records import ArrayMetadata, ItemManifest, SavedSharding, StepMetadata

__all__ = ["ArrayMetadata", "ItemManifest", "SavedSharding", "StepMetadata", "WRITE_VERSION", "decode_item",
           "decode_step", "encode_item", "encode_step", "load_json", "read_item", "read_step"]

WRITE_VERSION = v1.VERSION
NEWEST_VERSION = v1.VERSION


def load_json(data: bytes, *, where: str) -> dict:
    """Parse a JSON object read from a checkpoint; `CorruptCheckpointError` naming `where` if it is not one."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: not a JSON object")
    return doc


def read_item(loc: Location) -> ItemManifest:
    """The manifest of the item at `loc`. Raises `CheckpointNotFoundError` if there is none,
    `CorruptCheckpointError` if it is malformed, `FormatVersionError` if it is newer than this reader."""
    data = loc.read(layout.ITEM_METADATA)
    if data is None:
        raise CheckpointNotFoundError(f"{loc} holds no checkpoint item ({layout.ITEM_METADATA} is missing)")
    where = str(loc.child(layout.ITEM_METADATA))
    return decode_item(load_json(data, where=where), where=where)


def decode_item(doc: dict, *, where: str) -> ItemManifest:
    _check_version(doc, where)
    if v1.is_item(doc):
        return v1.decode_item(doc, where=where)
    raise CorruptCheckpointError(f"{where}: not an item manifest of any known format")


def read_step(loc: Location) -> StepMetadata | None:
    """The commit marker of the step at `loc`, or None if it has none (not committed). Raises
    `CorruptCheckpointError` or `FormatVersionError` for a marker that does not decode."""
    data = loc.read(layout.CHECKPOINT_METADATA)
    if data is None:
        return None
    where = str(loc.child(layout.CHECKPOINT_METADATA))
    return decode_step(load_json(data, where=where), where=where)


def decode_step(doc: dict, *, where: str) -> StepMetadata:
    _check_version(doc, where)
    if v1.is_step(doc):
        return v1.decode_step(doc, where=where)
    raise CorruptCheckpointError(f"{where}: not a step marker of any known format")


def encode_item(manifest: ItemManifest) -> bytes:
    """``_METADATA`` of an item in the format this library writes."""
    return v1.encode_item(manifest)


def encode_step(marker: StepMetadata) -> bytes:
    """``_CHECKPOINT_METADATA`` of a step in the format this library writes."""
    return v1.encode_step(marker)


def _check_version(doc: dict, where: str) -> None:
    version = doc.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CorruptCheckpointError(f"{where}: missing or invalid format_version {version!r}")
    if version > NEWEST_VERSION:
        raise FormatVersionError(
            f"{where}: written in format version {version}, but this xla_tensorstore_ckpt reads up to "
            f"version {NEWEST_VERSION}; upgrade the package")
