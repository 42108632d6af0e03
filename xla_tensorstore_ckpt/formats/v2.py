"""Format version 2: every item is also an Orbax PyTree checkpoint and every step an Orbax step.

Item ``_METADATA``: Orbax's document (`orbax.tree_metadata`, ``use_ocdbt``, ``use_zarr3: true``,
``store_array_data_equal_to_fill_value: true``, ``custom_metadata: null``) plus, under the top-level key
``"xla_tensorstore_ckpt"`` that Orbax ignores, what its schema cannot say: ``{"format_version": 2, "tree":
<the structure as in version 1: tuples, integer dict keys, JSON leaves with non-finite floats, and for each
array its name, shape, dtype, chunk shape and saved sharding>}``. Arrays are named as Orbax names them
(`array_names`), in one OCDBT store or one directory each, with a crc32c per chunk; scalar leaves are
also 0-d arrays and string leaves also in ``_strings.json``, so that Orbax restores them to the same values. Our
object ends with ``"strings_crc32c"`` (with string leaves) and ``"crc32c"``, the checksums of ``_strings.json``
and of the file itself (`checksums`). An item of an incremental step adds ``"incremental"`` (`item_refs`):
its chunk tables and the chunks it references in base steps; arrays with referenced chunks are ``None`` leaves
to Orbax.

Step ``_CHECKPOINT_METADATA``: Orbax's document (`orbax.step_document`) with ``{"format_version": 2, "step",
"items", "versions", "process_count"}`` under ``custom_metadata["xla_tensorstore_ckpt"]``; a step of a
manager's local tier adds ``"local_tier": {"writer": <process index>, "persistent_copy": <bool>,
"persistent_root": <the persistent tier's root>}``; an incremental step adds ``"bases": [<steps it
references>]``, a delta step ``"chain": <its longest chain of deltas>``; the object ends with ``"crc32c"``,
the file's checksum.
Documents without checksums (written before them) read as before, with nothing to verify.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any

from ..core import layout, tree
from ..core.errors import CorruptCheckpointError
from ..core.records import ArrayMetadata, ArrayStore, ItemManifest, StepMetadata
from ..storage import Location
from . import checksums, item_refs, orbax, v1

NAME = "v2"
DESCRIPTION = "xla_tensorstore_ckpt format 2"
FILE_SUFFIX = None
MATCH_BY_NAME = False
VERSION = 2
COMPLETION_MARK = True
KEY = "xla_tensorstore_ckpt"
COMPLETION_TEXT = b"Checkpoint commit was successful (xla_tensorstore_ckpt)"  # our commit_success.txt
ITEM_COMMIT_FILES = (layout.ITEM_METADATA, layout.COMMIT_SUCCESS)
STEP_COMMIT_FILES = (layout.CHECKPOINT_METADATA, layout.COMMIT_SUCCESS)

# Files of an Orbax item directory: no array may be named like them.
_ITEM_FILES = frozenset({layout.ITEM_METADATA, layout.CHECKPOINT_METADATA, layout.ZARR_METADATA, layout.COMMIT_SUCCESS,
                         layout.STRINGS, layout.OCDBT_MANIFEST, "_sharding", "array_metadatas", "d", ".", ".."})
_UNSAFE_IN_NAME = re.compile(r"[/\\\x00%]")


def ours(doc: dict, *, step: bool) -> object:
    """This library's part of a document (the object holding ``format_version``), None if it has none: under
    `KEY` at the top of an item's, under ``custom_metadata`` of a step's."""
    if step:
        custom = doc.get("custom_metadata")
        return custom.get(KEY) if isinstance(custom, dict) else None
    return doc.get(KEY)


def claims_item(_loc: Location, doc: dict | None) -> bool:
    mine = None if doc is None else ours(doc, step=False)
    return orbax.is_item(doc) and isinstance(mine, dict) and mine.get("format_version") == VERSION


def claims_step(doc: dict) -> bool:
    mine = ours(doc, step=True)
    return isinstance(mine, dict) and mine.get("format_version") == VERSION


def is_committed(_loc: Location, _marker: StepMetadata) -> bool:
    return True  # the marker is the commit point; Orbax's completion mark follows it (COMPLETION_MARK)


# ------------------------------------------------------------------------------------------------- names


def array_names(paths: list[layout.KeyPath]) -> list[str]:
    """The array name of each key path: its components joined by ``.`` as Orbax names it (``("state", 0,
    "exp_avg")`` -> ``state.0.exp_avg``), so that Orbax finds it. Where that name would be unsafe (a ``/``, a
    NUL, an empty or over-long component, a reserved file name) or taken by an earlier key path (``{"a.b": x,
    "a": {"b": y}}``), an escaped name instead, which Orbax never produces: ``%`` followed by the components
    escaped as in format 1 (``.`` percent-encoded too) and joined by ``.``. Deterministic: every process
    computes the same names from the same paths in the same order. `_METADATA` stores the true key paths."""
    taken: set[str] = set()
    names = []
    for path in paths:
        name = ".".join(str(k) for k in path)
        if (not path or any(str(k) == "" for k in path) or _UNSAFE_IN_NAME.search(name) or name in _ITEM_FILES
                or not layout.is_safe_relative_path(name, single=True)
                or name.startswith((layout.OCDBT_PROCESS_PREFIX, layout.CHUNK_TABLE_PREFIX, layout.CHUNK_DELTAS_PREFIX))
                or len(name) > v1.MAX_COMPONENT_LENGTH
                or name in taken):
            name = "%" + ".".join(v1.escape_component(k).replace(".", "%2E") for k in path)
            if len(name) > v1.MAX_COMPONENT_LENGTH:
                digest = hashlib.sha256(repr(path).encode("utf-8")).hexdigest()[:16]
                name = f"{name[: v1.MAX_COMPONENT_LENGTH - 40]}%~{digest}"
        taken.add(name)
        names.append(name)
    return names


def scalar_dtype(value: Any) -> str | None:
    return orbax.scalar_dtype(value)  # stored as Orbax stores it, so that Orbax restores the same value


def save_warning(leaves: list[tuple[layout.KeyPath, Any]], names: list[str]) -> str | None:
    hidden = orbax.hidden_keys(leaves, names)
    if not hidden:
        return None
    shown = ", ".join(str(tuple(path)) for path in hidden[:3]) + (f" and {len(hidden) - 3} more" if len(hidden) > 3
                                                                 else "")
    return (f"Orbax cannot restore {shown}: Orbax names a value by its keys joined with '.', and that name is taken "
            f"by another key or is unsafe as a file name, so it is stored under an escaped name; Orbax restores None "
            f"for it (this library restores every key)")


# ------------------------------------------------------------------------------------------------- items


def item_files(manifest: ItemManifest, strings: dict[str, str]) -> list[tuple[str, bytes]]:
    files = []
    if strings:
        data = json.dumps(strings).encode("utf-8")
        files.append((layout.STRINGS, data))
        manifest = dataclasses.replace(manifest, strings_crc32c=checksums.of(data))  # verified on read
    return [*files, (layout.ITEM_METADATA, encode_item(manifest)), (layout.COMMIT_SUCCESS, COMPLETION_TEXT)]


def encode_item(manifest: ItemManifest) -> bytes:
    mine = {"format_version": VERSION, "tree": v1.encode_tree(manifest.tree)}
    refs = manifest.store.refs
    if refs is not None:  # an incremental step's item (item_refs)
        mine["incremental"] = refs.to_json()
    if manifest.strings_crc32c is not None:
        mine[checksums.STRINGS_FIELD] = manifest.strings_crc32c
    leaves = tree.flatten(manifest.tree)
    hidden = orbax.hidden_keys(leaves, array_names([p for p, _ in leaves]))
    if refs is not None and refs.arrays:  # chunks stored in another step: Orbax would read fill values
        hidden += [p for p, v in leaves if isinstance(v, ArrayMetadata) and v.path in refs.arrays]
    doc = {"tree_metadata": orbax.tree_metadata(manifest.tree, hidden), "use_ocdbt": manifest.store.kind == "ocdbt",
           "use_zarr3": True, "store_array_data_equal_to_fill_value": True, "custom_metadata": None, KEY: mine}
    return checksums.seal(doc, mine, indent=None)


def decode_item(_loc: Location, doc: dict, *, where: str) -> ItemManifest:
    mine = doc[KEY]
    checksums.verify(doc, mine, indent=None, where=where)
    kind = "ocdbt" if doc.get("use_ocdbt") else "directories"
    store = ArrayStore(kind=kind, refs=item_refs.decode(mine.get("incremental"), where))
    manifest = v1.decode_tree(mine.get("tree"), where=where, format=NAME, store=store)
    for _, meta in manifest.arrays():
        if "/" in meta.path:
            raise CorruptCheckpointError(f"{where}: array name {meta.path!r} is not one path segment")
    strings = checksums.strings_checksum(mine.get(checksums.STRINGS_FIELD), where)
    return manifest if strings is None else dataclasses.replace(manifest, strings_crc32c=strings)


def encode_step(marker: StepMetadata) -> bytes:
    mine = {"format_version": VERSION, "step": marker.step, "items": list(marker.items),
            "versions": marker.versions, "process_count": marker.process_count}
    if marker.bases:  # an incremental step: the steps it references (retention keeps them)
        mine["bases"] = list(marker.bases)
    if marker.chain:  # a delta step: the most saves between a delta chunk and its anchor
        mine["chain"] = marker.chain
    if marker.since_anchor:  # an incremental step: saves since the last full anchor step
        mine["since_anchor"] = marker.since_anchor
    if marker.writer is not None:
        mine["local_tier"] = {"writer": marker.writer, "persistent_copy": marker.persistent_copy,
                              "persistent_root": marker.persistent_root}
    # Our object last (the user's custom metadata may not use our key), its checksum last in it.
    user = {k: v for k, v in (marker.custom or {}).items() if k != KEY} or None
    doc = orbax.step_document(dataclasses.replace(marker, custom=user), {KEY: mine})
    return checksums.seal(doc, mine, indent=1)


def step_files(marker: StepMetadata) -> list[tuple[str, bytes]]:
    return [(layout.CHECKPOINT_METADATA, encode_step(marker)), (layout.COMMIT_SUCCESS, COMPLETION_TEXT)]


def decode_step(_loc: Location, doc: dict, _step: int | None, *, where: str) -> StepMetadata:
    mine = doc["custom_metadata"][KEY]
    checksums.verify(doc, mine, indent=1, where=where)
    custom = {k: v for k, v in doc["custom_metadata"].items() if k != KEY}
    metrics = doc.get("metrics")
    if metrics is not None and not isinstance(metrics, dict):
        raise CorruptCheckpointError(f"{where}: metrics is not an object")
    items = v1.listing(mine.get("items"), where)
    for i in items:
        layout.relative_path(i, where=where, what="item", single=True)
    versions = mine.get("versions")
    local = mine.get("local_tier")
    if local is not None and not (isinstance(local, dict) and isinstance(local.get("persistent_copy"), bool)
                                  and isinstance(local.get("persistent_root"), str)):
        raise CorruptCheckpointError(f"{where}: malformed local_tier entry")
    bases = tuple(v1.integer(s, where, minimum=0) for s in v1.listing(mine.get("bases", []), where))
    return StepMetadata(step=v1.integer(mine.get("step"), where, minimum=0), items=tuple(items),
                        created_at=_seconds(doc.get("init_timestamp_nsecs"), where),
                        committed_at=_seconds(doc.get("commit_timestamp_nsecs"), where),
                        metrics=metrics or None, custom=custom or None,
                        versions=versions if isinstance(versions, dict) else None,
                        process_count=v1.integer(mine.get("process_count", 1), where, minimum=1),
                        format_version=VERSION, bases=bases,
                        chain=v1.integer(mine.get("chain", 0), where, minimum=0),
                        since_anchor=v1.integer(mine.get("since_anchor", 0), where, minimum=0),
                        writer=None if local is None else v1.integer(local.get("writer"), where, minimum=0),
                        persistent_copy=bool(local and local["persistent_copy"]),
                        persistent_root=None if local is None else local["persistent_root"])


def _seconds(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CorruptCheckpointError(f"{where}: a timestamp is not an integer")
    return value / 1e9
