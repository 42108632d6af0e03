"""Names on disk that every format shares: metadata files, commit markers, step directories, chunk keys. How a
format names its arrays is the format's own (`formats.v1.array_path`, `formats.v2.array_names`).
"""

from __future__ import annotations

import functools
import re

from .errors import CorruptCheckpointError

ITEM_METADATA = "_METADATA"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
ZARR_METADATA = "zarr.json"
MANAGER_LOCK = "_MANAGER_LOCK"
COMMIT_SUCCESS = "commit_success.txt"  # Orbax's finalization mark on object stores
STRINGS = "_strings.json"  # Orbax's file of string leaves
ORBAX_JSON_ITEM = "metadata"  # the file of an item Orbax's JsonCheckpointHandler wrote
OCDBT_MANIFEST = "manifest.ocdbt"
OCDBT_PROCESS_PREFIX = "ocdbt.process_"
CHUNK_TABLE_PREFIX = "_chunk_hashes.process_"  # an incremental save's chunk tables (`incremental.tables`)
CHUNK_DELTAS_PREFIX = "_chunk_deltas.process_"  # and its delta frames
TMP_STEP_SUFFIX = ".orbax-checkpoint-tmp-"  # a step being written on a file system that renames
_TMP_STEP = re.compile(r"(.+)\.orbax-checkpoint-tmp-[0-9]+")
_STEP = re.compile(r"[0-9]+")  # zero-padded too: Orbax's step_format_fixed_length names step 23 "0023"

KeyEntry = str | int
KeyPath = tuple[KeyEntry, ...]


MAX_PATH_BYTES = 4096  # a relative path read from a checkpoint: Linux's PATH_MAX
MAX_NAME_BYTES = 1024  # one component (an OCDBT key's may exceed a file name's 255; ours stay under 800)
_DRIVE = re.compile(r"[A-Za-z]:(/|$)")


def relative_path(name: object, *, where: str, what: str = "name", single: bool = False) -> str:
    """`name`, a string read from a checkpoint's file that becomes a path or an item name (an array's path, an
    item, an index's or a DCP record's file, a copy marker's file, an OCDBT data file), if it is a relative path
    that stays inside its directory: no absolute path, no ``..``, ``.`` or empty component, no NUL, no
    backslash, no drive (``C:``, ``C:/x``), at most `MAX_PATH_BYTES` long with components of at most
    `MAX_NAME_BYTES`; with `single`, one component (no ``/``). Every reader of such names calls this (or
    `is_safe_relative_path`). Raises `CorruptCheckpointError` naming `where` (the file) and the name otherwise."""
    problem = _path_problem(name, single=single)
    if problem is not None or not isinstance(name, str):
        raise CorruptCheckpointError(f"{where}: {what} {str(name)[:200]!r}, which {problem}")
    return name


def is_safe_relative_path(path: object, *, single: bool = False) -> bool:
    """True if `relative_path` accepts `path` (for callers that skip a bad name rather than refuse the file)."""
    return _path_problem(path, single=single) is None


def _path_problem(name: object, *, single: bool) -> str | None:
    if not isinstance(name, str):
        return "is not a string"
    return _str_path_problem(name, single)


@functools.lru_cache(maxsize=1024)
def _str_path_problem(name: str, single: bool) -> str | None:
    """Memoised: an OCDBT index names its few data files once per chunk (thousands of times a restore)."""
    if not name:
        return "is empty"
    if "\x00" in name or "\\" in name:
        return "holds a NUL byte or a backslash"
    if name.startswith("/") or _DRIVE.match(name):
        return "is an absolute path"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        return f"is longer than {MAX_PATH_BYTES} bytes"
    parts = name.split("/")
    if single and len(parts) > 1:
        return "is not a plain name in its directory"
    if any(p in ("", ".", "..") for p in parts):
        return "leaves its directory (an empty, '.' or '..' component)"
    if any(len(p.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES for p in parts):
        return f"has a component longer than {MAX_NAME_BYTES} bytes"
    return None


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
