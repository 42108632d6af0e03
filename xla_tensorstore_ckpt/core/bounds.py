"""Limits on what metadata read from a checkpoint may declare, and the bounded decoders that enforce them.

Every number and document that comes from a file is untrusted until it passes here: JSON is parsed with a
bounded size, and with a bounded nesting depth where tensorstore parses it next (a 200 KB ``zarr.json`` nested
100,000 levels deep crashed tensorstore), and an array's declared shape, dtype, chunk shape and chunk count are
checked before anything sizes a buffer, a loop or a listing by them (a 2^40-element array of 1-element chunks
would otherwise be walked chunk by chunk, or allocated). Decoders run in linear time in their input. A
violation is a `CorruptCheckpointError` naming the file (and the key where there is one). Pure Python.
"""

from __future__ import annotations

import json
import math
import os
import resource
from collections.abc import Callable
from typing import Any

from . import dtypes
from .errors import CorruptCheckpointError, UnsupportedValueError

MAX_RANK = 32
MAX_ARRAY_BYTES = 1 << 50  # 1 PiB: anything larger is a damaged or hostile manifest
MAX_DIMENSION = 1 << 50  # per dimension, also of empty arrays (a zero-size array may not declare 2^63 rows)
MAX_CHUNKS = 1 << 24  # per array: 16 M chunks (real checkpoints have one per shard, thousands at most)
MAX_KEY_PATH = 100  # components of a key path (as `tree.MAX_DEPTH`)
MAX_ARRAY_JSON_DEPTH = 32  # nesting of an array's zarr metadata (``zarr.json``, ``.zarray``) before tensorstore
MAX_ARRAY_JSON_BYTES = 1 << 20


def load_json(data: bytes, *, where: str, max_depth: int | None = None, max_bytes: int | None = None,
              unique_keys: bool = False, expect: type = dict) -> Any:
    """Parse a JSON document read from a checkpoint, bounded: at most `max_bytes` (None: any size), of type
    `expect` (dict, list, or object for any), with duplicate object keys refused if `unique_keys`, and with
    `max_depth` nested at most that deep (for documents handed on to tensorstore's parser; Python's own stops
    near 1,000 levels). `CorruptCheckpointError` naming `where` otherwise."""
    if max_bytes is not None and len(data) > max_bytes:
        raise CorruptCheckpointError(f"{where}: {len(data)} bytes, more than the {max_bytes} such a file may hold")
    hook = _unique_pairs(where) if unique_keys else None
    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=hook)
    except CorruptCheckpointError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({exc})"[:500]) from None
    if expect is not object and not isinstance(doc, expect):
        raise CorruptCheckpointError(f"{where}: not a JSON {'object' if expect is dict else 'array'}")
    if max_depth is not None and _depth_exceeds(doc, max_depth):
        raise CorruptCheckpointError(f"{where}: nested more than {max_depth} levels deep")
    return doc


def _depth_exceeds(doc: Any, max_depth: int) -> bool:
    """True if `doc` nests containers deeper than `max_depth` (an iterative walk: no recursion)."""
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > max_depth:
                return True
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False


def _unique_pairs(where: str) -> Callable[[list[tuple[str, Any]]], dict]:
    def build(pairs: list[tuple[str, Any]]) -> dict:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise CorruptCheckpointError(f"{where}: key {duplicate!r} appears twice")
        return out

    return build


def check_shape(shape: tuple[int, ...], where: str, *, what: str = "shape") -> None:
    """`CorruptCheckpointError` for a shape beyond `MAX_RANK` dimensions or a dimension beyond
    `MAX_DIMENSION` (or a value that is no size)."""
    if len(shape) > MAX_RANK:
        raise CorruptCheckpointError(f"{where}: {what} of rank {len(shape)} exceeds {MAX_RANK}")
    for n in shape:
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_DIMENSION:
            raise CorruptCheckpointError(f"{where}: {what} {list(shape)[:MAX_RANK]} holds {n!r}, which is no size "
                                         f"(0 to {MAX_DIMENSION})"[:500])


def check_array(name: str, shape: tuple[int, ...], dtype: str, chunk_shape: tuple[int, ...], where: str, *,
                foreign: bool = False) -> None:
    """Reject array metadata that no real checkpoint has: an unknown dtype, chunks that do not fit the shape, an
    absurd size or chunk count (which a reader would otherwise allocate or walk). An unknown dtype is damage in
    a checkpoint of ours, and `UnsupportedValueError` in a `foreign` one (Orbax's int4, say)."""
    check_shape(shape, where)
    check_shape(chunk_shape, where, what="chunk shape")
    try:
        itemsize = dtypes.by_name(dtype).itemsize
    except UnsupportedValueError:
        error = UnsupportedValueError if foreign else CorruptCheckpointError
        raise error(f"{where}: array {name} has dtype {dtype!r}, which this library cannot hold"[:500]) from None
    if len(chunk_shape) != len(shape) or any(c < 1 or c > max(1, n) for c, n in zip(chunk_shape, shape)):
        raise CorruptCheckpointError(f"{where}: array {name} has shape {shape} and chunk shape {chunk_shape}")
    if math.prod(shape) * itemsize > MAX_ARRAY_BYTES:
        raise CorruptCheckpointError(f"{where}: array {name} claims an absurd shape {shape}")
    chunks = math.prod(-(-n // c) for n, c in zip(shape, chunk_shape))
    if chunks > MAX_CHUNKS:
        raise CorruptCheckpointError(f"{where}: array {name} of shape {shape} in chunks of {chunk_shape} declares "
                                     f"{chunks} chunks, more than the {MAX_CHUNKS} an array may have")


def check_grid(shape: tuple[int, ...], chunk_shape: tuple[int, ...], itemsize: int, where: str, *,
               shard: bool = False) -> None:
    """The chunk grid a zarr metadata file declares (before tensorstore opens the array): sizes as in
    `check_shape`, a chunk shape of the array's rank whose chunks fit the shape, at most `MAX_CHUNKS` chunks,
    and chunks this process can hold (tensorstore decodes a chunk whole, and aborts when it cannot allocate
    one). `shard`: the outer grid of zarr's ``sharding_indexed`` codec, whose shards may reach past the shape
    and are never decoded whole (their inner chunks are checked as chunks)."""
    check_shape(shape, where)
    check_shape(chunk_shape, where, what="chunk shape")
    if len(chunk_shape) != len(shape) or any(c < 1 for c in chunk_shape) or (
            not shard and any(c > max(1, n) for c, n in zip(chunk_shape, shape))):
        raise CorruptCheckpointError(f"{where}: chunk shape {list(chunk_shape)} does not fit the shape {list(shape)}")
    chunks = math.prod(-(-n // c) for n, c in zip(shape, chunk_shape))
    if chunks > MAX_CHUNKS:
        raise CorruptCheckpointError(f"{where}: shape {list(shape)} in chunks of {list(chunk_shape)} makes {chunks} "
                                     f"chunks, more than the {MAX_CHUNKS} an array may have")
    chunk_bytes = math.prod(chunk_shape) * itemsize
    if not shard and chunk_bytes > memory_limit():
        raise CorruptCheckpointError(f"{where}: a chunk of {list(chunk_shape)} takes {chunk_bytes} bytes, more than "
                                     f"this process may allocate ({memory_limit()}); it cannot be read here")


def memory_limit() -> int:
    """The bytes this process may allocate at most: the machine's memory, or the address-space limit if lower."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return physical if soft == resource.RLIM_INFINITY else min(physical, soft)


def check_key_path(length: int, where: str) -> None:
    if length > MAX_KEY_PATH:
        raise CorruptCheckpointError(f"{where}: a key path of {length} components (at most {MAX_KEY_PATH})")
