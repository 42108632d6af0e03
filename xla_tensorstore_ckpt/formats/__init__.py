"""On-disk formats: the one entry point through which every reader (restore, the manager's step index,
inspection, export) gets an item's `ItemManifest` or a step's `StepMetadata`, and through which writers encode
them.

Hugging Face safetensors checkpoints (a safetensors file, or a directory with its index or a
``model.safetensors``) are read as items too (`safetensors`), recognised by content like the rest.

Each format version lives in its own module (`v1`, `v2`) and is recognised by the content of the file, never by
its name alone: the names ``_METADATA`` and ``_CHECKPOINT_METADATA`` are shared with Orbax, and version 1 used
them with other contents. Checkpoints Orbax wrote itself are read too (`orbax`; format version 0 in the
records). A version newer than this reader knows is a `FormatVersionError`; a file no version recognises is a
`CorruptCheckpointError` naming it.
"""

from __future__ import annotations

from .. import layout
from ..bounds import load_json
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError
from ..records import ItemManifest, StepMetadata
from ..storage import Location
from ..version import __version__
from . import orbax, safetensors, v1, v2

__all__ = ["WRITE_VERSION", "encode_item", "encode_step", "read_item", "read_step", "writer_versions"]

WRITE_VERSION = v2.VERSION
NEWEST_VERSION = v2.VERSION


def read_item(loc: Location) -> ItemManifest:
    """The manifest of the item at `loc` (ours of any version, Orbax's, or a Hugging Face safetensors file or
    directory). Raises `CheckpointNotFoundError` if there is none, `CorruptCheckpointError` if it is malformed,
    `FormatVersionError` if it is newer than this reader. An Orbax item's arrays are opened to learn their
    shapes, a safetensors file's header is read (blocks on that I/O). A file is read as a safetensors file; a
    directory by what it holds, whatever its name."""
    if loc.name.endswith(safetensors.SUFFIX) and safetensors.is_file(loc):  # the usual case first: one read
        return safetensors.read_item(loc)
    data = loc.read(layout.ITEM_METADATA)
    if data is None:
        json_item = loc.read(layout.ORBAX_JSON_ITEM)
        if json_item is not None:  # Orbax's JsonCheckpointHandler: the item is one JSON document
            where = str(loc.child(layout.ORBAX_JSON_ITEM))
            return orbax.decode_json_item(load_json(json_item, where=where, expect=object), where=where)
        if safetensors.is_checkpoint(loc):
            return safetensors.read_item(loc)
        raise CheckpointNotFoundError(f"{loc} holds no checkpoint item ({layout.ITEM_METADATA} is missing)")
    where = str(loc.child(layout.ITEM_METADATA))
    doc = load_json(data, where=where)
    if orbax.is_item(doc):
        if v2.KEY not in doc:
            return orbax.decode_item(doc, loc, where=where)
        if not isinstance(doc[v2.KEY], dict):
            raise CorruptCheckpointError(f"{where}: malformed {v2.KEY!r} entry")
        _check_version(v2.ours(doc), where)
        return v2.decode_item(doc, where=where)
    _check_version(doc, where)
    if v1.is_item(doc):
        return v1.decode_item(doc, where=where)
    raise CorruptCheckpointError(f"{where}: not an item manifest of any known format")


def read_step(loc: Location, step: int | None = None) -> StepMetadata | None:
    """The commit marker of the step at `loc` (number `step`, or read from its name), or None if it has none
    (or `loc` is a lone Orbax item, whose ``_CHECKPOINT_METADATA`` describes the item).
    Raises `CorruptCheckpointError` or `FormatVersionError` for a marker that does not decode. Whether a step
    with a marker is committed is the step index's decision (`steps`): for Orbax's own steps it depends on
    more than the marker."""
    data = loc.read(layout.CHECKPOINT_METADATA)
    if data is None:
        return None
    where = str(loc.child(layout.CHECKPOINT_METADATA))
    doc = load_json(data, where=where)
    if v2.is_step(doc):
        _check_version(v2.ours(doc), where)
        return v2.decode_step(doc, where=where)
    if orbax.is_step(doc):
        if orbax.is_single_item(doc):
            return None  # an item's own metadata: not a step
        return orbax.decode_step(doc, loc, step, where=where)
    _check_version(doc, where)
    if v1.is_step(doc):
        return v1.decode_step(doc, where=where)
    raise CorruptCheckpointError(f"{where}: not a step marker of any known format")


def encode_item(manifest: ItemManifest) -> bytes:
    """``_METADATA`` of an item in the format this library writes."""
    return v2.encode_item(manifest)


def encode_step(marker: StepMetadata) -> bytes:
    """``_CHECKPOINT_METADATA`` of a step in the format this library writes."""
    return v2.encode_step(marker)


def writer_versions() -> dict[str, str]:
    """The versions of what writes a step, for its marker: this library, torch, and torch_xla if loaded."""
    import sys

    import torch

    versions = {"xla_tensorstore_ckpt": __version__, "torch": torch.__version__}
    if "torch_xla" in sys.modules:
        versions["torch_xla"] = getattr(sys.modules["torch_xla"], "__version__", "unknown")
    return versions


def _check_version(doc: dict, where: str) -> None:
    version = doc.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CorruptCheckpointError(f"{where}: missing or invalid format_version {version!r}")
    if version > NEWEST_VERSION:
        raise FormatVersionError(
            f"{where}: written in format version {version}, but this xla_tensorstore_ckpt reads up to "
            f"version {NEWEST_VERSION}; upgrade the package")
