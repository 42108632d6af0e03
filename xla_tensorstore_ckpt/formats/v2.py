"""Format version 2: every item is also an Orbax PyTree checkpoint and every step an Orbax step.

Item ``_METADATA``: Orbax's document (`orbax.tree_metadata`, ``use_ocdbt``, ``use_zarr3: true``,
``store_array_data_equal_to_fill_value: true``, ``custom_metadata: null``) plus, under the top-level key
``"xla_tensorstore_ckpt"`` that Orbax ignores, what its schema cannot say: ``{"format_version": 2, "tree":
<the structure as in version 1: tuples, integer dict keys, JSON leaves with non-finite floats, and for each
array its name, shape, dtype, chunk shape and saved sharding>}``. Arrays are named as Orbax names them
(`layout.array_names`), in one OCDBT store or one directory each, with a crc32c per chunk; scalar leaves are
also 0-d arrays and string leaves also in ``_strings.json``, so that Orbax restores them to the same values. Our
object ends with ``"strings_crc32c"`` (with string leaves) and ``"crc32c"``, the checksums of ``_strings.json``
and of the file itself (`checksums`).

Step ``_CHECKPOINT_METADATA``: Orbax's document (`orbax.step_document`) with ``{"format_version": 2, "step",
"items", "versions", "process_count"}`` under ``custom_metadata["xla_tensorstore_ckpt"]``; a step of a
manager's local tier adds ``"local_tier": {"writer": <process index>, "persistent_copy": <bool>,
"persistent_root": <the persistent tier's root>}``; the object ends with ``"crc32c"``, the file's checksum.
Documents without checksums (written before them) read as before, with nothing to verify.
"""

from __future__ import annotations

import dataclasses

from .. import layout, tree
from ..errors import CorruptCheckpointError
from ..records import ArrayStore, ItemManifest, StepMetadata
from . import checksums, orbax, v1

VERSION = 2
KEY = "xla_tensorstore_ckpt"


def is_item(doc: dict) -> bool:
    ours = doc.get(KEY)
    return orbax.is_item(doc) and isinstance(ours, dict) and "format_version" in ours


def is_step(doc: dict) -> bool:
    custom = doc.get("custom_metadata")
    return isinstance(custom, dict) and isinstance(custom.get(KEY), dict)


def ours(doc: dict) -> dict:
    """The part of a version-2 document that is this library's (the one with ``format_version``)."""
    return doc[KEY] if KEY in doc else doc["custom_metadata"][KEY]


def encode_item(manifest: ItemManifest) -> bytes:
    mine = {"format_version": VERSION, "tree": v1.encode_tree(manifest.tree)}
    if manifest.strings_crc32c is not None:
        mine[checksums.STRINGS_FIELD] = manifest.strings_crc32c
    doc = {"tree_metadata": orbax.tree_metadata(manifest.tree), "use_ocdbt": manifest.store.kind == "ocdbt",
           "use_zarr3": True, "store_array_data_equal_to_fill_value": True, "custom_metadata": None, KEY: mine}
    return checksums.seal(doc, mine, indent=None)


def decode_item(doc: dict, *, where: str) -> ItemManifest:
    mine = ours(doc)
    checksums.verify(doc, mine, indent=None, where=where)
    kind = "ocdbt" if doc.get("use_ocdbt") else "directories"
    manifest = v1.decode_tree(mine.get("tree"), where=where, version=VERSION, store=ArrayStore(kind=kind))
    for _, meta in manifest.arrays():
        if "/" in meta.path:
            raise CorruptCheckpointError(f"{where}: array name {meta.path!r} is not one path segment")
    strings = checksums.strings_checksum(mine.get(checksums.STRINGS_FIELD), where)
    return manifest if strings is None else dataclasses.replace(manifest, strings_crc32c=strings)


def encode_step(marker: StepMetadata) -> bytes:
    mine = {"format_version": VERSION, "step": marker.step, "items": list(marker.items),
            "versions": marker.versions, "process_count": marker.process_count}
    if marker.writer is not None:
        mine["local_tier"] = {"writer": marker.writer, "persistent_copy": marker.persistent_copy,
                              "persistent_root": marker.persistent_root}
    # Our object last (the user's custom metadata may not use our key), its checksum last in it.
    user = {k: v for k, v in (marker.custom or {}).items() if k != KEY} or None
    doc = orbax.step_document(dataclasses.replace(marker, custom=user), {KEY: mine})
    return checksums.seal(doc, mine, indent=1)


def decode_step(doc: dict, *, where: str) -> StepMetadata:
    mine = ours(doc)
    checksums.verify(doc, mine, indent=1, where=where)
    custom = {k: v for k, v in doc["custom_metadata"].items() if k != KEY}
    metrics = doc.get("metrics")
    if metrics is not None and not isinstance(metrics, dict):
        raise CorruptCheckpointError(f"{where}: metrics is not an object")
    items = v1.listing(mine.get("items"), where)
    if not all(isinstance(i, str) and layout.is_safe_relative_path(i) and "/" not in i for i in items):
        raise CorruptCheckpointError(f"{where}: malformed item list {items!r}"[:300])
    versions = mine.get("versions")
    local = mine.get("local_tier")
    if local is not None and not (isinstance(local, dict) and isinstance(local.get("persistent_copy"), bool)
                                  and isinstance(local.get("persistent_root"), str)):
        raise CorruptCheckpointError(f"{where}: malformed local_tier entry")
    return StepMetadata(step=v1.integer(mine.get("step"), where, minimum=0), items=tuple(items),
                        created_at=_seconds(doc.get("init_timestamp_nsecs"), where),
                        committed_at=_seconds(doc.get("commit_timestamp_nsecs"), where),
                        metrics=metrics or None, custom=custom or None,
                        versions=versions if isinstance(versions, dict) else None,
                        process_count=v1.integer(mine.get("process_count", 1), where, minimum=1),
                        format_version=VERSION,
                        writer=None if local is None else v1.integer(local.get("writer"), where, minimum=0),
                        persistent_copy=bool(local and local["persistent_copy"]),
                        persistent_root=None if local is None else local["persistent_root"])


def _seconds(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CorruptCheckpointError(f"{where}: a timestamp is not an integer")
    return value / 1e9


def leaf_names(structure: object) -> dict:
    """The array name of every leaf of a tree (what `layout.array_names` gives, keyed by key path)."""
    paths = [p for p, _ in tree.flatten(structure)]
    return dict(zip(paths, layout.array_names(paths)))
