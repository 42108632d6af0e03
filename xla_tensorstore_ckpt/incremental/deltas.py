"""Delta chunks: a chunk stored as its bitwise difference (XOR) from the same chunk of a base step, compressed by
zstd, lossless. Two encodings, by how much changed, each one byte of kind then a zstd frame:

* sparse (kind 1; at most 1 element in `SPARSE_EVERY` differs, as in RL-style steps where 1-3 % of bf16 weights
  move): the number of changed elements (8 bytes), then the frame of their positions (uint32 gaps) and XORs.
  Applying it touches only the changed elements, so a chain of deltas costs little more than its anchor's read.
* dense (kind 0): the frame of the whole XOR; applying it decompresses and XORs every byte.

Called by the save (`saving.Recorder`) and by the reader (`layered`); raise `ValueError` for a damaged delta.
"""

from __future__ import annotations

import struct

import numpy as np

from ..arrays import zstd

SPARSE_EVERY = 16
_DENSE, _SPARSE = 0, 1
_ELEMENT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _elements(array: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(array).reshape(-1)
    return flat.view(_ELEMENT.get(flat.itemsize, np.uint8))


def encode(new: np.ndarray, base: np.ndarray, level: int = zstd.DEFAULT_LEVEL) -> bytes:
    """The delta turning `base` into `new` (same shape and dtype)."""
    a, b = _elements(new), _elements(base)
    xor = np.bitwise_xor(a, b)
    changed = np.flatnonzero(xor)
    if len(changed) * SPARSE_EVERY <= len(xor) and len(xor) < 1 << 32:
        gaps = np.diff(changed, prepend=0).astype(np.uint32)
        payload = gaps.tobytes() + xor[changed].tobytes()
        return bytes([_SPARSE]) + struct.pack("<Q", len(changed)) + zstd.compress(memoryview(payload), level)
    return bytes([_DENSE]) + zstd.compress(memoryview(xor.view(np.uint8)), level)


def apply(base: np.ndarray, delta: bytes, *, in_place: bool = False) -> np.ndarray:
    """`base` with `delta` applied, an array of its shape and dtype: `base` itself, changed, with `in_place`
    where it is writable and contiguous (a buffer the caller owns), else a new array."""
    out = base if in_place and base.flags.writeable and base.flags.c_contiguous else np.array(base, order="C")
    elements = _elements(out)
    if delta[:1] == bytes([_DENSE]):
        xor = np.frombuffer(zstd.decompress(delta[1:], elements.nbytes), elements.dtype)
        np.bitwise_xor(elements, xor, out=elements)
        return out
    if delta[:1] != bytes([_SPARSE]) or len(delta) < 9:
        raise ValueError("not a delta of a known kind")
    (count,) = struct.unpack("<Q", delta[1:9])
    if count > len(elements):
        raise ValueError(f"a delta of {count} elements for a chunk of {len(elements)}")
    payload = zstd.decompress(delta[9:], count * (4 + elements.itemsize))
    positions = np.cumsum(np.frombuffer(payload, np.uint32, count), dtype=np.int64)
    if count and positions[-1] >= len(elements):
        raise ValueError("a delta's positions run past its chunk")
    elements[positions] ^= np.frombuffer(payload, elements.dtype, count, offset=4 * count)
    return out
