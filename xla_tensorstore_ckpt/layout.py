"""Names on disk: metadata files, commit markers, step directories, chunk keys, and array names.

Format 2 names an array as Orbax does: the key path's components joined by ``.`` (``("state", 0, "exp_avg")`` ->
``state.0.exp_avg``), so that Orbax finds it. Where that name would be unsafe (a ``/``, a NUL, an empty or
over-long component, a reserved file name) or taken by an earlier key path (``{"a.b": x, "a": {"b": y}}``), the
array gets an escaped name instead, which Orbax never produces: ``%`` followed by its components escaped as
below (``.`` percent-encoded too) and joined by ``.``. The item's ``_METADATA`` always stores the true key path.

Format 1 made each component one directory (``state/0/exp_avg``), escaped so that it is one safe path segment:
bytes outside ``[A-Za-z0-9._-]`` are percent-encoded, ``.``/``..`` and the empty string cannot occur, and a string
that looks like an integer is distinguished from an integer key; components longer than `MAX_COMPONENT_LENGTH`
are shortened with a hash.
"""

from __future__ import annotations

import hashlib
import re

ITEM_METADATA = "_METADATA"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
ZARR_METADATA = "zarr.json"
MANAGER_LOCK = "_MANAGER_LOCK"
COMMIT_SUCCESS = "commit_success.txt"  # Orbax's finalization mark on object stores
STRINGS = "_strings.json"  # Orbax's file of string leaves
ORBAX_JSON_ITEM = "metadata"  # the file of an item Orbax's JsonCheckpointHandler wrote
OCDBT_MANIFEST = "manifest.ocdbt"
OCDBT_PROCESS_PREFIX = "ocdbt.process_"
TMP_STEP_SUFFIX = ".orbax-checkpoint-tmp-"  # a step being written on a file system that renames
_TMP_STEP = re.compile(r"(.+)\.orbax-checkpoint-tmp-[0-9]+")
# Files of an Orbax item directory: no array may be named like them.
_ITEM_FILES = frozenset({ITEM_METADATA, CHECKPOINT_METADATA, ZARR_METADATA, COMMIT_SUCCESS, STRINGS, OCDBT_MANIFEST,
                         "_sharding", "array_metadatas", "d", ".", ".."})
_UNSAFE_IN_NAME = re.compile(r"[/\\\x00%]")

MAX_COMPONENT_LENGTH = 200
_SAFE_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_INTEGER = re.compile(r"-?[0-9]+")
_STEP = re.compile(r"[0-9]+")  # zero-padded too: Orbax's step_format_fixed_length names step 23 "0023"
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


def step_name(step: int, prefix: str | None, width: int | None = None) -> str:
    """Directory name of a step: ``100`` or, with a prefix, ``checkpoint_100``; with `width`, the number is
    zero-padded to that many digits as Orbax's ``step_format_fixed_length`` does (``00100``)."""
    number = f"{step:0{width}d}" if width else str(step)
    return f"{prefix}_{number}" if prefix else number


def parse_step_name(name: str, prefix: str | None, *, any_prefix: bool = False) -> int | None:
    """The step a directory name denotes, or None if it is not a step directory of this prefix. With
    `any_prefix`, ``<anything>_<step>`` and ``<step>`` both are (for tools that do not know the prefix). A
    zero-padded number (``0023``, ``checkpoint_0023``) is a step too."""
    number = _step_digits(name, prefix, any_prefix=any_prefix)
    return None if number is None else int(number)


def step_name_width(name: str, prefix: str | None, *, any_prefix: bool = False) -> int | None:
    """The width a step directory's number is zero-padded to (4 for ``0023``), or None if it is not padded
    (``23``, ``0``) or not a step directory of this prefix."""
    number = _step_digits(name, prefix, any_prefix=any_prefix)
    return len(number) if number is not None and len(number) > 1 and number[0] == "0" else None


def _step_digits(name: str, prefix: str | None, *, any_prefix: bool) -> str | None:
    if any_prefix:
        name = name.rsplit("_", 1)[-1]
    elif prefix:
        if not name.startswith(prefix + "_"):
            return None
        name = name[len(prefix) + 1:]
    return name if _STEP.fullmatch(name) else None


def chunk_key(position: tuple[int, ...]) -> str:
    """The file of the chunk at a grid position, under zarr v3's default chunk key encoding (``c/0/1``; ``c``
    for a 0-d array)."""
    return "/".join(("c", *map(str, position)))


def array_names(paths: list[KeyPath]) -> list[str]:
    """The format-2 array name of each key path (see the module docstring). Deterministic: every process
    computes the same names from the same paths in the same order."""
    taken: set[str] = set()
    names = []
    for path in paths:
        name = ".".join(str(k) for k in path)
        if (not path or any(str(k) == "" for k in path) or _UNSAFE_IN_NAME.search(name) or name in _ITEM_FILES
                or name.startswith(OCDBT_PROCESS_PREFIX) or len(name) > MAX_COMPONENT_LENGTH or name in taken):
            name = "%" + ".".join(escape_component(k).replace(".", "%2E") for k in path)
            if len(name) > MAX_COMPONENT_LENGTH:
                digest = hashlib.sha256(repr(path).encode("utf-8")).hexdigest()[:16]
                name = f"{name[: MAX_COMPONENT_LENGTH - 40]}%~{digest}"
        taken.add(name)
        names.append(name)
    return names


def ocdbt_store(process: int, lane: int) -> str:
    """The directory of one of process `process`'s own OCDBT stores in an item (Orbax's name for lane 0)."""
    return f"{OCDBT_PROCESS_PREFIX}{process}" + (f"x{lane}" if lane else "")


def key_name(path: KeyPath) -> str:
    """A key path as one dotted name, as Orbax and a torch ``state_dict`` spell it: ``layers.0.weight``."""
    return ".".join(str(k) for k in path)


def tmp_step_name(name: str, stamp: int) -> str:
    """Where step directory `name` is written before it is renamed into place (Orbax's temporary name)."""
    return f"{name}{TMP_STEP_SUFFIX}{stamp}"


def is_tmp_step_name(name: str) -> bool:
    return _TMP_STEP.fullmatch(name) is not None
