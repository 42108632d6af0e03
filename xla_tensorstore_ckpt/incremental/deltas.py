"""Delta chunks: a chunk stored as its bitwise difference (XOR) from the same chunk of a base step, compressed by
zstd, lossless. The encodings, by how much changed, each one byte of kind then a zstd frame:

* sparse (kind 2, what a save writes where at most 1 element in `SPARSE_EVERY` differs, as in RL-style steps
  where 1-3 % of bf16 weights move): the number of changed elements and of long gaps (8 bytes each), then one frame
  of the changed elements' XORs, the long gaps (uint32 positions in the gap list, uint32 values) and the gaps
  between changed elements, one byte each (a gap over 255 is 0 there and listed among the long ones). Applying it
  touches only the changed elements. One byte per gap instead of four halves what zstd decompresses, which is
  most of a delta restore's cost (6 to 3 bytes per changed bf16 element: docs/incremental.md).
* sparse (kind 1, written before kind 2, still read): the count, then the frame of uint32 gaps and the XORs.
* dense (kind 0): the frame of the whole XOR; applying it decompresses and XORs every byte.

Called by the save (`saving.Recorder`) and by the reader (`layered`); raise `ValueError` for a damaged delta.
"""

from __future__ import annotations

import struct

import numpy as np

from ..arrays import zstd

SPARSE_EVERY = 5  # sparse costs ~7.5 ns per changed element to apply, dense ~1.5 ns per element: even at 1 in 5
_DENSE, _SPARSE, _SPARSE8 = 0, 1, 2
_ELEMENT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _elements(array: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(array).reshape(-1)
    return flat.view(_ELEMENT.get(flat.itemsize, np.uint8))


def encode(new: np.ndarray, base: np.ndarray, level: int = zstd.DEFAULT_LEVEL) -> bytes:
    """The delta turning `base` into `new` (same shape and dtype)."""
    a, b = _elements(new), _elements(base)
    xor = np.bitwise_xor(a, b)
    changed = _changed(xor)
    if len(changed) * SPARSE_EVERY <= len(xor) and len(xor) < 1 << 32:
        gaps = np.diff(changed, prepend=-1) - 1  # >= 0: positions strictly increase
        long = np.flatnonzero(gaps > 255)
        payload = b"".join((xor[changed].tobytes(), long.astype(np.uint32).tobytes(),
                            gaps[long].astype(np.uint32).tobytes(), gaps.astype(np.uint8).tobytes()))
        return (bytes([_SPARSE8]) + struct.pack("<QQ", len(changed), len(long))
                + zstd.compress(memoryview(payload), level))
    return bytes([_DENSE]) + zstd.compress(memoryview(xor.view(np.uint8)), level)


def _changed(xor: np.ndarray) -> np.ndarray:
    """The positions of `xor`'s non-zero elements, ascending. Found word by word (8 bytes: 4 bf16 elements) and
    only then element by element in the non-zero words: with a few percent changed, a quarter of the elements
    to scan (`np.flatnonzero` of the elements took 2/3 of a delta's encoding); each scan of a boolean mask,
    which numpy's `nonzero` runs several times faster than over integers."""
    per_word = 8 // xor.itemsize
    head = len(xor) - len(xor) % per_word
    if per_word == 1 or head == 0:
        return np.flatnonzero(xor != 0)
    words = np.flatnonzero(xor[:head].view(np.uint64) != 0)
    lanes = np.flatnonzero(xor[:head].reshape(-1, per_word)[words] != 0)
    changed = words[lanes // per_word] * per_word + lanes % per_word
    tail = np.flatnonzero(xor[head:] != 0)
    return np.concatenate((changed, tail + head)) if len(tail) else changed


def apply(base: np.ndarray, delta: bytes, *, in_place: bool = False) -> np.ndarray:
    """`base` with `delta` applied, an array of its shape and dtype: `base` itself, changed, with `in_place`
    where it is writable and contiguous (a buffer the caller owns), else a new array."""
    out = base if in_place and base.flags.writeable and base.flags.c_contiguous else np.array(base, order="C")
    elements = _elements(out)
    if delta[:1] == bytes([_DENSE]):
        xor = np.frombuffer(zstd.decompress(delta[1:], elements.nbytes), elements.dtype)
        np.bitwise_xor(elements, xor, out=elements)
        return out
    if delta[:1] == bytes([_SPARSE8]) and len(delta) >= 17:
        _apply_sparse8(elements, delta)
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


def _apply_sparse8(elements: np.ndarray, delta: bytes) -> None:
    count, nlong = struct.unpack("<QQ", delta[1:17])
    if count > len(elements) or nlong > count:
        raise ValueError(f"a delta of {count} elements ({nlong} long gaps) for a chunk of {len(elements)}")
    if count == 0:  # nothing changed (a save never writes such a delta: the chunk's hash matched)
        return
    size = elements.itemsize
    payload = zstd.decompress(delta[17:], count * (size + 1) + 8 * nlong)
    if len(payload) != count * (size + 1) + 8 * nlong:
        raise ValueError("a delta's frame is not of the size its header declares")
    positions = np.frombuffer(payload, np.uint8, count, offset=count * size + 8 * nlong).astype(np.intp)
    if nlong:
        at = np.frombuffer(payload, np.uint32, nlong, offset=count * size)
        if int(at.max()) >= count:
            raise ValueError("a delta's long gaps lie past its positions")
        positions[at] = np.frombuffer(payload, np.uint32, nlong, offset=count * size + 4 * nlong)
    positions += 1  # gap + 1 each; their running sum, less one, the positions
    np.cumsum(positions, out=positions)
    positions -= 1
    if count and positions[-1] >= len(elements):
        raise ValueError("a delta's positions run past its chunk")
    elements[positions] ^= np.frombuffer(payload, elements.dtype, count)
