"""The content hash of a stored chunk, by which an incremental save decides that a chunk is unchanged since its
base step (`incremental`): xxh3-128 of the chunk's raw little-endian bytes before compression (128 bits against
accidental equality; the chunk's CRC32C is not added: the save computes it later, on other bytes, and a second
pass would triple the hash's cost). xxh3-128 because it is the one strong-enough hash cheap enough for a save
(docs/incremental.md measures it at ~5 % of a save's CPU; SHA-256 costs ~90 %). Without
the `xxhash` package (a dependency, but a stripped install may lack it) BLAKE2b-128 stands in: ~30× slower, and
named differently (`ALGORITHM`), so a table written with one never matches the other. The one module importing
`xxhash`.
"""

from __future__ import annotations

import hashlib

import numpy as np

try:
    import xxhash
except ImportError:  # pragma: no cover - the dependency is declared; a stripped install falls back, slower
    xxhash = None

ALGORITHM = "xxh3_128" if xxhash is not None else "blake2b_128"


def chunk_hash(data: np.ndarray) -> str:
    """The hash of one chunk's data (any dtype, any layout: hashed as its C-contiguous bytes), 32 hex digits.
    Called by the thread issuing the chunk's write; copies only a non-contiguous array."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)  # bfloat16 has no buffer format: bytes
    if xxhash is not None:
        return xxhash.xxh3_128_hexdigest(raw)
    return hashlib.blake2b(raw, digest_size=16).hexdigest()
