"""Hugging Face checkpoints: one ``.safetensors`` file, or a directory of them with
``model.safetensors.index.json``. Read as an item whose tree is the flat ``state_dict`` of the files (keys such as
``model.layers.0.self_attn.q_proj.weight``) and whose arrays are byte ranges of the files (`RawArrayMetadata`).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (per tensor: dtype, shape and
``data_offsets`` relative to the data that follows the header, plus an optional ``__metadata__`` of strings),
then the tensors' bytes in C order. Everything in a header is checked before any number from it is used for
reading or allocating: a header over `MAX_HEADER_BYTES`, malformed JSON, duplicate keys, unknown dtypes, sizes
that disagree with shape and dtype, overlapping tensors, and data past the end of the file (a truncated file)
are each a `CorruptCheckpointError` naming the file and the key. Headers are read with ranged reads; data is
never read here. No torch_xla, no tensorstore.
"""

from __future__ import annotations

import json
import math
import struct
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..core import bounds, dtypes, layout, threads
from ..core.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedValueError
from ..core.records import ArrayStore, ItemManifest, RawArrayMetadata
from ..storage import Location, RangeNotSatisfiableError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SUFFIX = ".safetensors"
# The safetensors library refuses larger headers; so do we, before reading one.
MAX_HEADER_BYTES = 100_000_000
# Streaming readers (stats, diff, convert) take a tensor in row blocks of about this size (`chunk_shape`).
READ_BLOCK_BYTES = 64 << 20

# safetensors dtype names <-> this library's (zarr) names
TO_ZARR = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
           "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
           "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
FROM_ZARR = {zarr: st for st, zarr in TO_ZARR.items()}

STORE = ArrayStore(kind="safetensors", zarr_format=0, checksums=False)
NAME = "safetensors"
DESCRIPTION = "Hugging Face safetensors"
FILE_SUFFIX = SUFFIX
MATCH_BY_NAME = False


def is_file(loc: Location) -> bool:
    """True if `loc` is a file rather than a directory (a directory reads as missing on every backend). A file
    given as a checkpoint is read as a safetensors file, whatever its name. Blocks on one small read."""
    return bool(loc.name) and loc.parent.read_range(loc.name, 0, 0).result() is not None


def is_checkpoint(loc: Location) -> bool:
    """True if `loc` is a file (`is_file`) or a directory holding an index or a ``model.safetensors``: found by
    content, never by name (an item directory may be called ``x.safetensors``)."""
    return is_file(loc) or loc.read_range(INDEX_NAME, 0, 0).result() is not None or \
        loc.read_range(SINGLE_NAME, 0, 0).result() is not None


def array_names(paths: list[tuple[str | int, ...]]) -> list[str]:
    """A tensor's name is its key (one per tensor: the tree is flat)."""
    return [".".join(str(k) for k in p) for p in paths]


def claims_item(loc: Location, doc: dict | None) -> bool:
    return doc is None and is_checkpoint(loc)


def decode_item(loc: Location, _doc: dict | None, *, where: str) -> ItemManifest:
    """The manifest of the Hugging Face checkpoint at `loc` (a file, or a directory with an index or a lone
    ``model.safetensors``). Blocks on reading the headers (all files' at once). Raises
    `CheckpointNotFoundError` if there is none, `CorruptCheckpointError` naming file and key if anything in
    it is inconsistent, `UnsupportedValueError` for a dtype this library cannot hold."""
    if is_file(loc):
        return ItemManifest(_tensors(loc.parent, loc.name, ""), format=NAME, store=STORE)
    index = loc.read(INDEX_NAME)
    if index is None:
        if loc.read_range(SINGLE_NAME, 0, 0).result() is None:
            raise CheckpointNotFoundError(f"{loc} holds no {INDEX_NAME} and no {SINGLE_NAME}")
        return ItemManifest(_tensors(loc, SINGLE_NAME, SINGLE_NAME), format=NAME, store=STORE)
    weight_map = weight_map_of(index, f"{loc.child(INDEX_NAME)}")
    keys_in: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        keys_in.setdefault(name, []).append(key)
    files = sorted(keys_in)
    by_file = _headers(loc, files, keys_in)
    tree: dict[str, RawArrayMetadata] = {}
    for key, name in weight_map.items():
        if key not in by_file[name]:
            raise CorruptCheckpointError(f"{loc.child(INDEX_NAME)} places {key!r} in {name}, which does not hold "
                                         f"it")
        tree[key] = by_file[name][key]
    return ItemManifest(tree, format=NAME, store=STORE)


def _headers(loc: Location, files: list[str], keys_in: dict[str, list[str]]) -> dict[str, dict[str, RawArrayMetadata]]:
    """The tensors of every file of an index, a few headers read at a time (object stores: one at a time is
    slow); the first file that fails stops the reading (an index of 200,000 missing files fails at the first,
    without queuing the rest)."""
    workers = threads.count("storage_requests", len(files))
    out: dict[str, dict[str, RawArrayMetadata]] = {}
    with ThreadPoolExecutor(workers) as pool:
        window: deque = deque()
        for name in files:
            window.append((name, pool.submit(_tensors, loc, name, name, listed=keys_in[name])))
            if len(window) >= 2 * workers:
                done, future = window.popleft()
                out[done] = future.result()
        for done, future in window:
            out[done] = future.result()
    return out


def weight_map_of(data: bytes, where: str) -> dict[str, str]:
    """The validated ``weight_map`` of an index file: tensor name -> file name (a plain name in the index's
    directory)."""
    doc = bounds.load_json(data, where=where, unique_keys=True)
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise CorruptCheckpointError(f"{where}: 'weight_map' must map tensor names to file names")
    for name in set(weight_map.values()):
        layout.relative_path(name, where=where, what="file name", single=True)
    return weight_map


def _tensors(directory: Location, name: str, file: str, *, listed: list[str] | None = None
             ) -> dict[str, RawArrayMetadata]:
    """The validated tensors of file `name` in `directory`, recorded as living in `file` (relative to the
    item). `listed`: the keys an index places in the file, named if it is missing."""
    where = str(directory.child(name))
    try:
        head = directory.read_range(name, 0, 8).result()
    except RangeNotSatisfiableError:
        raise CorruptCheckpointError(f"{where}: truncated: shorter than the 8-byte header length") from None
    if head is None:
        if listed is not None:
            raise CorruptCheckpointError(f"{where}: missing, but {INDEX_NAME} places {_some_keys(listed)} in it")
        raise CorruptCheckpointError(f"{where}: missing") if file else \
            CheckpointNotFoundError(f"{where} does not exist")
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER_BYTES:
        raise CorruptCheckpointError(f"{where}: header of {length} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    try:
        header = directory.read_range(name, 8, 8 + length).result()
    except RangeNotSatisfiableError as exc:
        raise CorruptCheckpointError(f"{where}: truncated: the header of {length} bytes ends past the end of the "
                                     f"file{_size_text(exc.size)}") from None
    if header is None:
        raise CorruptCheckpointError(f"{where}: disappeared while being read")
    doc = bounds.load_json(header, where=where, unique_keys=True)
    data_start = 8 + length
    entries = _entries(doc, where)
    _check_layout(entries, where)
    end = max((stop for _, _, _, (_, stop) in entries), default=0)
    if end:  # one byte at the end of the data proves the file holds all of it
        try:
            directory.read_range(name, data_start + end - 1, data_start + end).result()
        except RangeNotSatisfiableError as exc:
            by_end = sorted(entries, key=lambda e: e[3][1])
            past = by_end[-1][0] if exc.size is None else \
                next(key for key, _, _, (_, stop) in by_end if data_start + stop > exc.size)
            raise CorruptCheckpointError(
                f"{where}: truncated, or its header lies about offsets: tensor {past!r} ends past the end of "
                f"the file{_size_text(exc.size)}") from None
    out = {}
    for key, dtype, shape, (start, _) in entries:
        chunk = row_block(shape, dtypes.by_name(dtype).itemsize)
        out[key] = RawArrayMetadata(path=key, shape=shape, dtype=dtype, chunk_shape=chunk, file=file,
                                     offset=data_start + start)
    return out


def _entries(doc: dict, where: str) -> list[tuple[str, str, tuple[int, ...], tuple[int, int]]]:
    entries = []
    for key, entry in doc.items():
        if key == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise CorruptCheckpointError(f"{where}: '__metadata__' must map names to strings")
            continue
        if not isinstance(entry, dict):
            raise CorruptCheckpointError(f"{where}: tensor {key!r}: not an object")
        st_dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(st_dtype, str):
            raise CorruptCheckpointError(f"{where}: tensor {key!r}: missing dtype")
        if st_dtype not in TO_ZARR:
            raise UnsupportedValueError(f"{where}: tensor {key!r} has dtype {st_dtype!r}, which this library "
                                        f"cannot hold (it reads {', '.join(TO_ZARR)})")
        if not isinstance(shape, list):
            raise CorruptCheckpointError(f"{where}: tensor {key!r}: shape {shape!r} is not a list of sizes"[:500])
        if len(shape) > bounds.MAX_RANK or not all(type(n) is int and 0 <= n <= bounds.MAX_DIMENSION for n in shape):
            bounds.check_shape(tuple(shape), f"{where}: tensor {key!r}")  # raises, naming the bound
        if not (type(offsets) is list and len(offsets) == 2 and _is_count(offsets[0]) and _is_count(offsets[1])
                and offsets[0] <= offsets[1]):
            raise CorruptCheckpointError(f"{where}: tensor {key!r}: data_offsets {offsets!r} are not [begin, end] "
                                         f"within {bounds.MAX_ARRAY_BYTES} bytes"[:500])
        dtype = TO_ZARR[st_dtype]
        expected = math.prod(shape) * dtypes.by_name(dtype).itemsize
        if offsets[1] - offsets[0] != expected:
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r}: {st_dtype}{shape} takes {expected} bytes but its data_offsets "
                f"{offsets} span {offsets[1] - offsets[0]}")
        entries.append((key, dtype, tuple(shape), (offsets[0], offsets[1])))
    return entries


def _check_layout(entries: Iterable[tuple[str, str, tuple[int, ...], tuple[int, int]]], where: str) -> None:
    previous: tuple[str, int] | None = None
    for key, _, _, (start, stop) in sorted(entries, key=lambda e: e[3]):
        if previous is not None and start < previous[1] and stop > start:
            raise CorruptCheckpointError(f"{where}: tensors {previous[0]!r} and {key!r} overlap")
        if stop > start:
            previous = (key, stop)


def row_block(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Whole trailing dimensions, and as many leading rows as fit in `READ_BLOCK_BYTES`."""
    if not shape:
        return ()
    row_bytes = math.prod(shape[1:]) * itemsize
    rows = min(shape[0], READ_BLOCK_BYTES // row_bytes) if row_bytes else shape[0]
    return (max(1, rows), *shape[1:])


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= bounds.MAX_ARRAY_BYTES


def _some_keys(keys: list[str], shown: int = 3) -> str:
    """``'a', 'b', 'c' and 4 more``: the first few of `keys` for a message."""
    named = ", ".join(repr(k) for k in keys[:shown])
    return named if len(keys) <= shown else f"{named} and {len(keys) - shown} more"


def _size_text(size: int | None) -> str:
    return f" ({size} bytes)" if size is not None else ""


def encode_header(tensors: Iterable[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
                  ) -> tuple[bytes, list[tuple[int, int]]]:
    """The first bytes of a safetensors file holding `tensors` ((name, zarr dtype, shape), in file order): the
    length, the JSON header padded so the data starts 8-byte aligned; and each tensor's data offsets
    (relative to the data). `UnsupportedValueError` for a dtype safetensors cannot store."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offsets = []
    position = 0
    for name, dtype, shape in tensors:
        if dtype not in FROM_ZARR:
            raise UnsupportedValueError(f"safetensors cannot store {name} of dtype {dtype}")
        nbytes = math.prod(shape) * dtypes.by_name(dtype).itemsize
        header[name] = {"dtype": FROM_ZARR[dtype], "shape": list(shape), "data_offsets": [position, position + nbytes]}
        offsets.append((position, position + nbytes))
        position += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded, offsets
