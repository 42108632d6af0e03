"""On-disk formats, by registry: the one entry point through which every reader (restore, the manager's step
index, inspection, export) gets an item's `ItemManifest` or a step's `StepMetadata`, and through which writers
encode them.

Each format is one module implementing the protocols of `base`: this library's versions (`v1`, frozen; `v2`, Orbax's
schema with ours inside, the one written), checkpoints Orbax wrote itself (`orbax`), Hugging Face safetensors files
and directories (`safetensors`), and torch.distributed.checkpoint directories (`dcp`); shared by them: the checksums
of our JSON metadata files (`checksums`) and what an incremental step's item references (`item_refs`). A format is
recognised by content, never by a file name alone: the names ``_METADATA`` and ``_CHECKPOINT_METADATA`` are shared
with Orbax, and version 1 used them with other contents. A document none claims is a `FormatVersionError` if it
declares a version of ours newer than this reader knows, else a `CorruptCheckpointError` naming it. Adding a format:
a module, and its name in `ITEM_FORMATS` / `STEP_FORMATS` (and `WRITERS` if this library writes it), or, for a
format of items read from outside the package, `register(module)`.
"""

from __future__ import annotations

from ..core import layout
from ..core.bounds import load_json
from ..core.errors import CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError, UsageError
from ..core.records import ItemManifest, StepMetadata
from ..storage import Location
from ..version import __version__
from . import dcp, orbax, safetensors, v1, v2
from .base import ItemFormat, StepFormat, WriteFormat

__all__ = ["ITEM_FORMATS", "STEP_FORMATS", "WRITERS", "WRITE_FORMAT", "array_names", "encode_step",
           "holds_orbax_items", "is_item", "item_files", "item_format", "read_item", "read_step", "step_files",
           "register", "step_format", "unregister", "writer", "writer_versions"]

# In the order asked: the first format that claims a document reads it.
ITEM_FORMATS: tuple[ItemFormat, ...] = (safetensors, dcp, v2, orbax, v1)
STEP_FORMATS: tuple[StepFormat, ...] = (v2, orbax, v1)
WRITERS: dict[str, WriteFormat] = {v2.NAME: v2}
WRITE_FORMAT = v2.NAME  # what `SaveOptions.format` names unless told otherwise
NEWEST_VERSION = max(f.VERSION for f in STEP_FORMATS)


def register(fmt: ItemFormat) -> None:
    """Add a format of items, asked after those registered so far (a document one of them claims stays
    theirs). Called once, at import, by the code adding a format (or by a test); not thread-safe against
    readers running meanwhile. Raises `UsageError` if a format of the same `NAME` is registered."""
    global ITEM_FORMATS
    if any(f.NAME == fmt.NAME for f in ITEM_FORMATS):
        raise UsageError(f"an item format named {fmt.NAME!r} is already registered")
    ITEM_FORMATS = (*ITEM_FORMATS, fmt)


def unregister(name: str) -> None:
    """Remove the item format `name` that `register` added (a test's toy format). Raises `UsageError` if there
    is none."""
    global ITEM_FORMATS
    if not any(f.NAME == name for f in ITEM_FORMATS):
        raise UsageError(f"no item format named {name!r} is registered")
    ITEM_FORMATS = tuple(f for f in ITEM_FORMATS if f.NAME != name)


def read_item(loc: Location) -> ItemManifest:
    """The manifest of the item at `loc`, in whichever format claims it (ours of any version, Orbax's, or a
    Hugging Face safetensors file or directory). Raises `CheckpointNotFoundError` if there is none,
    `CorruptCheckpointError` if it is malformed, `FormatVersionError` if it is newer than this reader. Blocks
    on that I/O (an Orbax item's arrays are opened to learn their shapes, a safetensors file's header read)."""
    for fmt in ITEM_FORMATS:  # an item that is one file: recognised without looking for _METADATA inside it
        if fmt.FILE_SUFFIX and loc.name.endswith(fmt.FILE_SUFFIX) and fmt.claims_item(loc, None):
            return fmt.decode_item(loc, None, where=str(loc))
    data = loc.read(layout.ITEM_METADATA)
    where = str(loc.child(layout.ITEM_METADATA)) if data is not None else str(loc)
    doc = None if data is None else load_json(data, where=where)
    for fmt in ITEM_FORMATS:
        if fmt.claims_item(loc, doc):
            return fmt.decode_item(loc, doc, where=where)
    if doc is None:
        raise CheckpointNotFoundError(f"{loc} holds no checkpoint item ({layout.ITEM_METADATA} is missing)")
    raise _unclaimed(v2.ours(doc, step=False), doc, where, "an item manifest")


def read_step(loc: Location, step: int | None = None) -> StepMetadata | None:
    """The commit marker of the step at `loc` (number `step`, or read from its name), or None if it has none
    (or `loc` is a lone Orbax item, whose ``_CHECKPOINT_METADATA`` describes the item). Raises
    `CorruptCheckpointError` or `FormatVersionError` for a marker that does not decode. Whether a step with a
    marker is committed is the step index's decision (`steps`, asking `step_format(marker).is_committed`)."""
    data = loc.read(layout.CHECKPOINT_METADATA)
    if data is None:
        return None
    where = str(loc.child(layout.CHECKPOINT_METADATA))
    doc = load_json(data, where=where)
    for fmt in STEP_FORMATS:
        if fmt.claims_step(doc):
            return fmt.decode_step(loc, doc, step, where=where)
    raise _unclaimed(v2.ours(doc, step=True), doc, where, "a step marker")


def is_item(loc: Location) -> bool:
    """True if `loc` holds an item of some format (without decoding it: a damaged one included). Blocks on a
    few small reads."""
    if loc.read_range(layout.ITEM_METADATA, 0, 0).result() is not None:
        return True
    return any(fmt.claims_item(loc, None) for fmt in ITEM_FORMATS)


def holds_orbax_items(loc: Location) -> bool:
    """True if any item in the step directory `loc` is one Orbax wrote itself: a partial step holding one is
    not this library's to delete. Blocks on a read per entry."""
    for name in loc.list():
        item = loc.child(name)
        data = item.read(layout.ITEM_METADATA)
        if data is None:
            continue
        try:
            doc = load_json(data, where=str(item.child(layout.ITEM_METADATA)))
        except CorruptCheckpointError:
            continue
        if orbax.claims_item(item, doc):
            return True
    return False


def array_names(manifest: ItemManifest, paths: list[tuple[str | int, ...]]) -> list[str]:
    """The names the format of `manifest` gives the arrays at `paths` (how tools name its values too)."""
    return item_format(manifest).array_names(paths)


def item_format(manifest: ItemManifest) -> ItemFormat:
    """The format an item was read from (or will be written in)."""
    return next(f for f in ITEM_FORMATS if f.NAME == manifest.format)


def step_format(marker: StepMetadata) -> StepFormat:
    """The format a step marker was read from (or will be written in), by its `format_version`."""
    return next(f for f in STEP_FORMATS if f.VERSION == marker.format_version)


def writer(name: str) -> WriteFormat:
    """The format `name` (`SaveOptions.format`), for writing. Raises `ValueError` if this library does not
    write it."""
    if name not in WRITERS:
        readable = sorted({f.NAME for f in ITEM_FORMATS} - set(WRITERS))
        raise ValueError(f"cannot write format {name!r}: this library writes {', '.join(sorted(WRITERS))} "
                         f"(and reads {', '.join(readable)} too)")
    return WRITERS[name]


def item_files(manifest: ItemManifest, strings: dict[str, str]) -> list[tuple[str, bytes]]:
    """The files that finish an item in its format (one this library writes), in the order written (`commit`)."""
    return writer(manifest.format).item_files(manifest, strings)


def step_files(marker: StepMetadata) -> list[tuple[str, bytes]]:
    """The files that commit a step in its format (one this library writes), in the order written."""
    return writer(step_format(marker).NAME).step_files(marker)


def encode_step(marker: StepMetadata) -> bytes:
    """``_CHECKPOINT_METADATA`` of a step in its format (one this library writes)."""
    return writer(step_format(marker).NAME).encode_step(marker)


def writer_versions() -> dict[str, str]:
    """The versions of what writes a step, for its marker: this library, torch, and torch_xla if loaded."""
    import sys

    import torch

    versions = {"xla_tensorstore_ckpt": __version__, "torch": torch.__version__}
    if "torch_xla" in sys.modules:
        versions["torch_xla"] = getattr(sys.modules["torch_xla"], "__version__", "unknown")
    return versions


def _unclaimed(ours: object, doc: dict, where: str, what: str) -> Exception:
    """Why no format claimed `doc`: a version of ours newer than this reader, or a malformed document."""
    if ours is not None and not isinstance(ours, dict):
        return CorruptCheckpointError(f"{where}: malformed {v2.KEY!r} entry")
    declared = (ours if isinstance(ours, dict) else doc).get("format_version")
    if isinstance(declared, bool) or not isinstance(declared, int) or declared < 1:
        if ours is None and "format_version" not in doc:
            return CorruptCheckpointError(f"{where}: not {what} of any known format")
        return CorruptCheckpointError(f"{where}: missing or invalid format_version {declared!r}")
    if declared > NEWEST_VERSION:
        return FormatVersionError(
            f"{where}: written in format version {declared}, but this xla_tensorstore_ckpt reads up to "
            f"version {NEWEST_VERSION}; upgrade the package")
    return CorruptCheckpointError(f"{where}: not {what} of format version {declared} (malformed)")
