"""Chunk tables: per item and writing process, the content hash of every chunk the process was responsible for
and the step whose store holds the chunk's bytes. File ``<item>/_chunk_hashes.process_<i>.json`` (`table_name`),
JSON, its CRC32C last in it (`formats.checksums`), durable with the process's stores before the commit:

``{"format": 1, "hash": "xxh3_128", "deltas": "_chunk_deltas.process_<i>", "arrays": {"<array name>":
{"shape": [...], "dtype": "bfloat16", "chunk_shape": [...], "chunks": {"0.1": ["<32 hex digits>", null | <step>,
<chain>, null | [<base step>, <offset>, <length>, <crc32c>]]}}}, "crc32c": "..."}``

A chunk's step is null when this item holds it, else the step that holds it (never a step that itself
references it: references are flattened when recorded). An item holds a chunk in its own store, or as a *delta*:
the zstd frame of its bytes XORed with the same chunk of the base step named, at `offset`, `length` bytes long,
in the process's delta file (``"deltas"``), with the frame's CRC32C. `chain` counts the deltas a read of the chunk
applies (0: stored whole; a referenced chunk has the chain it has where it is stored).

The next incremental save reads every table of its base item; a reader of an item with references reads them to
learn where each chunk lives (`refs`, `layered`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .. import bounds, layout
from ..arrays.chunk_hashes import ALGORITHM
from ..errors import CorruptCheckpointError
from ..formats import checksums
from ..storage import Location

PREFIX = layout.CHUNK_TABLE_PREFIX
FORMAT = 1
_HASH = re.compile(r"[0-9a-f]{32}")
_INDEX = re.compile(r"[0-9]+(\.[0-9]+)*|")

Delta = tuple[int, int, int, int]  # (the base step it XORs with, offset, length, CRC32C of the frame)
Chunk = tuple[str, int | None, int, Delta | None]  # (hash, the step holding it or None, chain, delta or None)
DELTAS = layout.CHUNK_DELTAS_PREFIX


def table_name(writer: int) -> str:
    """The file of process `writer`'s table in an item."""
    return f"{PREFIX}{writer}.json"


def delta_name(writer: int) -> str:
    """The file of process `writer`'s delta frames in an item."""
    return f"{DELTAS}{writer}"


def index_name(index: tuple[int, ...]) -> str:
    """A chunk's grid position as a table names it (``0.1``; "" for a 0-d array)."""
    return ".".join(map(str, index))


@dataclass(frozen=True)
class ArrayChunks:
    """One array's entry of a table: what makes a chunk comparable (shape, dtype, chunk shape), and its chunks."""

    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    chunks: dict[str, Chunk]


def encode(arrays: dict[str, ArrayChunks], deltas: str) -> bytes:
    """A table's bytes (`deltas`: the name of the process's delta file). Called once per item by each process at
    the end of its writes."""
    body = {name: {"shape": list(a.shape), "dtype": a.dtype, "chunk_shape": list(a.chunk_shape),
                   "chunks": {i: [h, s, c, None if d is None else list(d)] for i, (h, s, c, d) in a.chunks.items()}}
            for name, a in arrays.items()}
    doc = {"format": FORMAT, "hash": ALGORITHM, "deltas": deltas, "arrays": body}
    return checksums.seal(doc, doc, indent=None)


def read(item: Location, name: str) -> dict[str, ArrayChunks] | None:
    """The table `name` of `item`, or None if the file is absent or hashed with another algorithm (nothing in
    it can match). Raises `CorruptCheckpointError` naming the file if it is damaged or malformed. Blocks."""
    found = read_with_deltas(item, name)
    return None if found is None else found[0]


def read_with_deltas(item: Location, name: str) -> tuple[dict[str, ArrayChunks], str] | None:
    """`read`, and the name of the table's delta file."""
    data = item.read(name)
    if data is None:
        return None
    where = str(item.child(name))
    doc = bounds.load_json(data, where=where)
    checksums.verify(doc, doc, indent=None, where=where)
    if doc.get("format") != FORMAT or not isinstance(doc.get("arrays"), dict):
        raise CorruptCheckpointError(f"{where}: not a chunk table of format {FORMAT}")
    if doc.get("hash") != ALGORITHM:
        return None
    deltas = layout.relative_path(doc.get("deltas"), where=where, what="delta file", single=True)
    return {array: _array(entry, f"{where}: array {array!r}") for array, entry in doc["arrays"].items()}, deltas


def _array(entry: object, where: str) -> ArrayChunks:
    try:
        shape = tuple(_int(n) for n in entry["shape"])
        chunk_shape = tuple(_int(n) for n in entry["chunk_shape"])
        dtype = entry["dtype"]
        chunks = {}
        for index, (digest, step, chain, delta) in entry["chunks"].items():
            if not (_INDEX.fullmatch(index) and isinstance(digest, str) and _HASH.fullmatch(digest)
                    and (step is None or _int(step) >= 0) and _int(chain) >= 0):
                raise ValueError(index)
            if delta is not None:
                delta = tuple(_int(v) for v in delta)
                if len(delta) != 4 or step is not None:
                    raise ValueError(index)
            chunks[index] = (digest, step, chain, delta)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{where}: malformed chunk table entry ({exc!r})") from None
    if not isinstance(dtype, str) or len(shape) != len(chunk_shape):
        raise CorruptCheckpointError(f"{where}: malformed chunk table entry")
    return ArrayChunks(shape, dtype, chunk_shape, chunks)


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(value)
    return value
