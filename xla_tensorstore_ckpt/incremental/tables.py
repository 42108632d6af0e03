"""Chunk tables: per item and writing process, the content hash of every chunk the process was responsible for
and the step whose store holds the chunk's bytes. File ``<item>/_chunk_hashes.process_<i>.json`` (`table_name`),
JSON, its CRC32C last in it (`formats.checksums`), durable with the process's stores before the commit:

``{"format": 1, "hash": "xxh3_128", "arrays": {"<array name>": {"shape": [...], "dtype": "bfloat16",
"chunk_shape": [...], "chunks": {"0.1": ["<32 hex digits>", null | <step>, null | [<anchor step>, [[null |
<step>, "<delta file>", <offset>, <length>, <crc32c>], ...]]]}}}, "crc32c": "..."}``

A chunk is held whole in this item's store (step and delta null), or whole in another step's store (its step:
a reference, flattened when recorded, so that step holds it itself), or as a *delta chain* (delta not null): the
chunk of the anchor step (held whole there) with each delta of the list applied in order, each the frame of a
bitwise XOR (`deltas`), `length` bytes at `offset` in a delta file of this item (step null) or of the step named,
with its CRC32C. Chains are flattened too: a reader reads the anchor's chunk and the frames, never the steps in
between through their own tables.

The next incremental save reads every table of its base item; a reader of an item with references reads them to
learn where each chunk lives (`refs`, `layered`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..arrays.chunk_hashes import ALGORITHM
from ..core import bounds, layout
from ..core.errors import CorruptCheckpointError
from ..formats import checksums
from ..storage import Location

PREFIX = layout.CHUNK_TABLE_PREFIX
FORMAT = 1
_HASH = re.compile(r"[0-9a-f]{32}")
_INDEX = re.compile(r"[0-9]+(\.[0-9]+)*|")

Link = tuple[int | None, str, int, int, int]  # a delta frame: (its step or None: this item, file, offset, length, crc)
# (the anchor step, the frames applied to its chunk in order, how many saves since the anchor: `depth`)
Delta = tuple[int, tuple[Link, ...], int]
Chunk = tuple[str, int | None, Delta | None]  # (hash, the step holding it whole or None, delta chain or None)
DELTAS = layout.CHUNK_DELTAS_PREFIX


def table_name(writer: int) -> str:
    """The file of process `writer`'s table in an item."""
    return f"{PREFIX}{writer}.json"


def delta_name(writer: int) -> str:
    """The file of process `writer`'s delta frames in an item."""
    return f"{DELTAS}{writer}"


def depth(chunk: Chunk) -> int:
    """How many saves since the chunk's anchor: 0 for a chunk held whole, else its delta's depth (`max_chain`
    bounds it)."""
    return 0 if chunk[2] is None else chunk[2][2]


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


def encode(arrays: dict[str, ArrayChunks]) -> bytes:
    """A table's bytes. Called once per item by each process at the end of its writes."""
    body = {name: {"shape": list(a.shape), "dtype": a.dtype, "chunk_shape": list(a.chunk_shape),
                   "chunks": {i: [h, s, None if d is None else [d[0], [list(link) for link in d[1]], d[2]]]
                              for i, (h, s, d) in a.chunks.items()}}
            for name, a in arrays.items()}
    doc = {"format": FORMAT, "hash": ALGORITHM, "arrays": body}
    return checksums.seal(doc, doc, indent=None)


def read(item: Location, name: str) -> dict[str, ArrayChunks] | None:
    """The table `name` of `item`, or None if the file is absent or hashed with another algorithm (nothing in
    it can match). Raises `CorruptCheckpointError` naming the file if it is damaged or malformed. Blocks."""
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
    return {array: _array(entry, f"{where}: array {array!r}") for array, entry in doc["arrays"].items()}


def _array(entry: object, where: str) -> ArrayChunks:
    try:
        shape = tuple(_int(n) for n in entry["shape"])
        chunk_shape = tuple(_int(n) for n in entry["chunk_shape"])
        dtype = entry["dtype"]
        chunks = {}
        for index, (digest, step, delta) in entry["chunks"].items():
            if not (_INDEX.fullmatch(index) and isinstance(digest, str) and _HASH.fullmatch(digest)
                    and (step is None or _int(step) >= 0)):
                raise ValueError(index)
            if delta is not None:
                if step is not None:
                    raise ValueError(index)
                anchor, links, *depth = delta  # no depth: a table written before it, one save per frame
                links = tuple(_link(link, where) for link in links)
                delta = (_int(anchor), links, _int(depth[0]) if depth else len(links))
                if len(depth) > 1 or not links or delta[2] < 1:
                    raise ValueError(index)
            chunks[index] = (digest, step, delta)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{where}: malformed chunk table entry ({exc!r})") from None
    if not isinstance(dtype, str) or len(shape) != len(chunk_shape):
        raise CorruptCheckpointError(f"{where}: malformed chunk table entry")
    return ArrayChunks(shape, dtype, chunk_shape, chunks)


def _link(link: object, where: str) -> Link:
    step, file, at, length, crc = link
    layout.relative_path(file, where=where, what="delta file", single=True)
    if not file.startswith(DELTAS):
        raise ValueError(file)
    return (None if step is None else _int(step), file, _int(at), _int(length), _int(crc))


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(value)
    return value
