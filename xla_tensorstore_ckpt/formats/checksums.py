"""CRC32C checksums of this library's JSON metadata files, so that a flipped digit in a data loader's position, an
`extra` value, a metric or an item list is found on read instead of restored.

An item's ``_METADATA`` and a step's ``_CHECKPOINT_METADATA`` each carry the checksum of their own bytes as the
last field of this library's object (`FIELD`, 8 lowercase hex digits): the CRC32C of the file as written with that
value replaced by `PLACEHOLDER`. The file is written by `dumps` (compact for an item, one-space indents for a step
marker), so a reader may also re-serialise the parsed document with `dumps` and the placeholder: for a file this
library wrote the bytes are the same, and a change that alters any value alters them. An item's ``_METADATA``
also records the CRC32C of its ``_strings.json`` (`STRINGS_FIELD`), the file Orbax reads string leaves from.

Files without these fields (format 1, format 2 written before them, Orbax's own) have nothing to verify. A
mismatch is a `CorruptCheckpointError` naming the file. Pure functions; no I/O except `verify_strings`.
"""

from __future__ import annotations

import json
import re

import crc32c

from ..core import layout
from ..core.errors import CorruptCheckpointError
from ..core.records import ItemManifest
from ..storage import Location

FIELD = "crc32c"  # in this library's object of the document: the checksum of the document itself
STRINGS_FIELD = "strings_crc32c"  # in an item's: the checksum of its _strings.json
PLACEHOLDER = "00000000"
_HEX = re.compile(r"[0-9a-f]{8}")


def of(data: bytes) -> str:
    """The CRC32C of `data` as 8 lowercase hex digits."""
    return f"{crc32c.crc32c(data):08x}"


def dumps(doc: dict, *, indent: int | None) -> bytes:
    """The bytes of a metadata document as this library writes it: compact (`indent` None) or indented."""
    separators = (",", ":") if indent is None else None
    return json.dumps(doc, allow_nan=False, indent=indent, separators=separators).encode("utf-8")


def seal(doc: dict, ours: dict, *, indent: int | None) -> bytes:
    """The bytes of `doc` with its checksum in `ours` (this library's object inside `doc`, which must come last
    in it, as `FIELD` comes last in `ours`). `ours` is changed."""
    ours.pop(FIELD, None)
    ours[FIELD] = PLACEHOLDER
    body = dumps(doc, indent=indent)
    ours[FIELD] = of(body)
    # The placeholder is the last occurrence of the field in the file: only closing brackets follow it.
    token = json.dumps(FIELD).encode() + (b":" if indent is None else b": ") + json.dumps(PLACEHOLDER).encode()
    at = body.rfind(token)
    return body[:at] + token.replace(PLACEHOLDER.encode(), ours[FIELD].encode()) + body[at + len(token):]


def verify(doc: dict, ours: dict, *, indent: int | None, where: str) -> None:
    """Raise `CorruptCheckpointError` naming `where` if `doc` (parsed from the file at `where`) records a
    checksum (in `ours`) that its content does not match; nothing to do if it records none."""
    recorded = ours.get(FIELD)
    if recorded is None:
        return
    if not isinstance(recorded, str) or not _HEX.fullmatch(recorded):
        raise CorruptCheckpointError(f"{where}: malformed checksum {str(recorded)[:40]!r}: the file is damaged")
    ours[FIELD] = PLACEHOLDER
    try:
        actual = of(dumps(doc, indent=indent))
    except (ValueError, RecursionError):  # NaN or absurd nesting: not what this library wrote
        actual = None
    finally:
        ours[FIELD] = recorded
    if actual != recorded:
        raise CorruptCheckpointError(f"{where}: the file is damaged: its content does not match the CRC32C it "
                                     f"records ({recorded}, computed {actual})")


def strings_checksum(value: object, where: str) -> str | None:
    """The `STRINGS_FIELD` value read from an item's ``_METADATA``, validated (None if absent)."""
    if value is None:
        return None
    if not isinstance(value, str) or not _HEX.fullmatch(value):
        raise CorruptCheckpointError(f"{where}: malformed {STRINGS_FIELD} {str(value)[:40]!r}")
    return value


def verify_strings(item: Location, manifest: ItemManifest) -> None:
    """Check the item's ``_strings.json`` against the checksum its ``_METADATA`` records (nothing to do if it
    records none). This library reads string values from ``_METADATA``; ``_strings.json`` is Orbax's copy, and a
    damaged one would give Orbax wrong values. Raises `CorruptCheckpointError` naming the file. Blocks (one
    small read)."""
    if manifest.strings_crc32c is None:
        return
    where = item.child(layout.STRINGS)
    data = item.read(layout.STRINGS)
    if data is None:
        raise CorruptCheckpointError(f"{where} is missing, but {item.child(layout.ITEM_METADATA)} records its "
                                     "checksum")
    actual = of(data)
    if actual != manifest.strings_crc32c:
        raise CorruptCheckpointError(f"{where}: the file is damaged: CRC32C {actual}, but "
                                     f"{layout.ITEM_METADATA} records {manifest.strings_crc32c}")
