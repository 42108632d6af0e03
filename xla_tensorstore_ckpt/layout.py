"""Names on disk: item metadata files, commit marker, and the escaping of key paths into array directories.

A key path such as ``("state", 0, "exp_avg")`` becomes the relative directory ``state/0/exp_avg``. Each
component is escaped so that it is one safe path segment: bytes outside ``[A-Za-z0-9._-]`` are percent-encoded,
``.``/``..`` and the empty string cannot occur, and a string that looks like an integer is distinguished from an
integer key. The escaping is reversible (``unescape_component``) except for components longer than
`MAX_COMPONENT_LENGTH`, which are shortened with a hash; the item's ``_METADATA`` always stores the true key path.
"""

from __future__ import annotations

import hashlib
import re

ITEM_METADATA = "_METADATA"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
ZARR_METADATA = "zarr.json"
MANAGER_LOCK = "_MANAGER_LOCK"

MAX_COMPONENT_LENGTH = 200
_SAFE_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_INTEGER = re.compile(r"-?[0-9]+")
_STEP = re.compile(r"0|[1-9][0-9]*")
_RESERVED = frozenset({ITEM_METADATA, CHECKPOINT_METADATA, ZARR_METADATA, ".", ".."})
EMPTY_COMPONENT = "%"

KeyEntry = str | int
KeyPath = tuple[KeyEntry, ...]


def _percent(byte: int) -> str:
    return f"%{byte:02X}"


def escape_component(key: KeyEntry) -> str:
    """One key (a dict key or a sequence index) as one safe directory name.

    Integers are written as plain decimal; strings that would read back as integers, reserved names and
    ``.``/``..`` have their first byte percent-encoded.
    """
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    if not isinstance(key, str):
        raise TypeError(f"key {key!r} is neither str nor int")
    if key == "":
        return EMPTY_COMPONENT
    raw = key.encode("utf-8")
    escaped = "".join(chr(b) if b in _SAFE_BYTES else _percent(b) for b in raw)
    if _INTEGER.fullmatch(key) or key in _RESERVED:
        escaped = _percent(raw[0]) + escaped[1:]
    if len(escaped) > MAX_COMPONENT_LENGTH:
        digest = hashlib.sha256(raw).hexdigest()[:16]
        escaped = f"{escaped[: MAX_COMPONENT_LENGTH - 40].rstrip('%0123456789ABCDEF')}~{digest}"
    return escaped


def unescape_component(name: str) -> KeyEntry:
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


def array_path(key_path: KeyPath) -> str:
    """Relative directory of the array stored at `key_path`, e.g. ``state/0/exp_avg``."""
    return "/".join(escape_component(k) for k in key_path)


def is_safe_relative_path(path: str) -> bool:
    """True if `path` (read from a checkpoint's metadata) stays inside its item directory."""
    if not path or path.startswith("/") or "\\" in path or "\x00" in path:
        return False
    parts = path.split("/")
    return all(p not in ("", ".", "..") for p in parts)


def step_name(step: int, prefix: str | None) -> str:
    """Directory name of a step: ``100`` or, with a prefix, ``checkpoint_100``."""
    return f"{prefix}_{step}" if prefix else str(step)


def parse_step_name(name: str, prefix: str | None, *, any_prefix: bool = False) -> int | None:
    """The step a directory name denotes, or None if it is not a step directory of this prefix. With
    `any_prefix`, ``<anything>_<step>`` and ``<step>`` both are (for tools that do not know the prefix)."""
    if any_prefix:
        name = name.rsplit("_", 1)[-1]
    elif prefix:
        if not name.startswith(prefix + "_"):
            return None
        name = name[len(prefix) + 1:]
    if not _STEP.fullmatch(name):
        return None
    return int(name)


def chunk_key(position: tuple[int, ...]) -> str:
    """The file of the chunk at a grid position, under zarr v3's default chunk key encoding (``c/0/1``; ``c``
    for a 0-d array)."""
    return "/".join(("c", *map(str, position)))
