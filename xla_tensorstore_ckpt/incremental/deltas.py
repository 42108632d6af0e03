"""Delta chunks: a chunk stored as its bitwise difference (XOR) from the same chunk of a base step, compressed by
zstd, lossless. The encodings, by how much changed, each one byte of kind then a zstd frame:

* sparse (kind 2, what a save writes where at most 1 element in `SPARSE_EVERY` differs, as in RL-style steps
  where 1-3 % of bf16 weights move): the number of changed elements and of long gaps (8 bytes each), then one frame
  of the changed elements' XORs, the long gaps (uint32 positions in the gap list, uint32 values) and the gaps
  between changed elements, one byte each (a gap over 255 is listed among the long ones; its low byte there is
  ignored). Applying it touches only the changed elements, in one pass of the compiled loop (`_xor_at.c`) where
  the package was built with a C compiler, else in numpy's passes (`_xor_at`). One byte per gap instead of four
  halves what zstd decompresses, the larger part of a delta restore's cost (6 to 3 bytes per changed bf16
  element: docs/incremental.md).
* sparse (kind 1, written before kind 2, still read): the count, then the frame of uint32 gaps and the XORs.
* dense (kind 0): the frame of the whole XOR; applying it decompresses and XORs every byte.

Called by the save (`saving.Recorder`) and by the reader (`layered`); raise `ValueError` for a damaged delta.
"""

from __future__ import annotations

import struct

import numpy as np

from ..arrays import zstd
from ..core import buffers

try:  # the fused apply loop of kind 2, where the package was built with a C compiler (`_xor_at.c`)
    from ._xor_at import xor_at as _fused_xor_at
except ImportError:
    _fused_xor_at = None

# zstd's level for delta frames. Level 1 decodes faster than zstd's default (3) on these frames, at the same size:
# step 5's 18 frames of the RL workload at scale 4 (51 MB of XORs and gaps) decoded in 34 ms against 46 ms, 25.5
# against 25.7 MB, and compressed in half the time; the levels above 3 were no smaller by 3 % and decoded slower
# (a delta restore's zstd is ~40 % of its apply, which costs the delta restore's extra CPU over a full restore).
# The reader decodes any level.
LEVEL = 1
SPARSE_EVERY = 5  # sparse costs ~7.5 ns per changed element to apply, dense ~1.5 ns per element: even at 1 in 5
_DENSE, _SPARSE, _SPARSE8 = 0, 1, 2
_BLOCK = 64 << 10  # positions decoded at a time (`_xor_at`)
_ELEMENT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _elements(array: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(array).reshape(-1)
    return flat.view(_ELEMENT.get(flat.itemsize, np.uint8))


def encode(new: np.ndarray, base: np.ndarray, level: int = LEVEL) -> bytes:
    """The delta turning `base` into `new` (same shape and dtype). Called by the save (`saving.Recorder`) on
    the thread writing the chunk; blocks while it compresses."""
    a, b = _elements(new), _elements(base)
    changed = _changed(a, b)
    if len(changed) * SPARSE_EVERY <= len(a) and len(a) < 1 << 32:
        return _sparse8(a, b, changed, level)
    xor = np.bitwise_xor(a, b)
    return bytes([_DENSE]) + zstd.compress(memoryview(xor.view(np.uint8)), level)


def _sparse8(a: np.ndarray, b: np.ndarray, changed: np.ndarray, level: int) -> bytes:
    """The sparse (kind 2) delta of the elements at `changed`, laid out in one buffer that zstd compresses:
    the XORs gathered straight into it (never the whole chunk's XOR), then the long gaps, then the gaps."""
    count, size = len(changed), a.itemsize
    gaps = np.empty(count, np.intp)
    np.subtract(changed[1:], changed[:-1], out=gaps[1:])
    gaps[1:] -= 1
    gaps[:1] = changed[:1]  # >= 0: positions strictly increase
    long = np.flatnonzero(gaps > 255)
    end = count * size
    payload = np.empty(end + 8 * len(long) + count, np.uint8)
    values = payload[:end].view(a.dtype)
    np.take(a, changed, out=values, mode="clip")  # positions of `a`'s own elements: "raise" would copy first
    np.bitwise_xor(values, np.take(b, changed, mode="clip"), out=values)
    payload[end:end + 4 * len(long)].view(np.uint32)[:] = long
    payload[end + 4 * len(long):end + 8 * len(long)].view(np.uint32)[:] = gaps[long]
    np.copyto(payload[end + 8 * len(long):], gaps, casting="unsafe")  # a long gap's byte is ignored
    return (bytes([_SPARSE8]) + struct.pack("<QQ", count, len(long))
            + zstd.compress(memoryview(payload), level))


def _changed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The positions where `a` and `b` differ, ascending. Found word by word (8 bytes: 4 bf16 elements) and
    only then element by element in the differing words: with a few percent changed, a quarter of the elements
    to scan (`np.flatnonzero` of the elements took 2/3 of a delta's encoding); each scan of a boolean mask,
    which numpy's `nonzero` runs several times faster than over integers. The two are compared, not XORed: the
    XOR of the whole chunk (a chunk-sized array of fresh memory, written and read again) is never made."""
    per_word = 8 // a.itemsize
    head = len(a) - len(a) % per_word
    if per_word == 1 or head == 0:
        return np.flatnonzero(a != b)
    a64, b64 = a[:head].view(np.uint64), b[:head].view(np.uint64)
    words = np.flatnonzero(np.not_equal(a64, b64, out=buffers.of_thread("delta_mask", len(a64), bool)))
    xor = np.take(a64, words, mode="clip")
    np.bitwise_xor(xor, np.take(b64, words, mode="clip"), out=xor)
    lanes = np.flatnonzero(xor.view(a.dtype) != 0)
    changed = words[lanes // per_word] * per_word + lanes % per_word
    tail = np.flatnonzero(a[head:] != b[head:])
    return np.concatenate((changed, tail + head)) if len(tail) else changed


def apply(base: np.ndarray, delta: bytes, *, in_place: bool = False) -> np.ndarray:
    """`base` with `delta` applied, an array of its shape and dtype: `base` itself, changed, with `in_place`
    where it is writable and contiguous (a buffer the caller owns), else a new array. Called by the reader's
    rebuild threads (`layered`); blocks while it decompresses (without the GIL) and XORs."""
    out = base if in_place and base.flags.writeable and base.flags.c_contiguous else np.array(base, order="C")
    elements = _elements(out)
    frame = memoryview(delta).cast("B")
    kind = frame[0] if len(frame) else None
    if kind == _DENSE:
        xor = _decompressed(frame[1:], elements.nbytes).view(elements.dtype)
        np.bitwise_xor(elements, xor, out=elements)
    elif kind == _SPARSE8 and len(frame) >= 17:
        _apply_sparse8(elements, frame)
    elif kind == _SPARSE and len(frame) >= 9:
        (count,) = struct.unpack_from("<Q", frame, 1)
        if count > len(elements):
            raise ValueError(f"a delta of {count} elements for a chunk of {len(elements)}")
        payload = _decompressed(frame[9:], count * (4 + elements.itemsize))
        steps = payload[:4 * count].view(np.uint32)
        _xor_at(elements, steps, payload[4 * count:].view(elements.dtype), first=0, plus=0)
    else:
        raise ValueError("not a delta of a known kind")
    return out


def _apply_sparse8(elements: np.ndarray, frame: memoryview) -> None:
    count, nlong = struct.unpack_from("<QQ", frame, 1)
    if count > len(elements) or nlong > count:
        raise ValueError(f"a delta of {count} elements ({nlong} long gaps) for a chunk of {len(elements)}")
    if count == 0:  # nothing changed (a save never writes such a delta: the chunk's hash matched)
        return
    values_end = count * elements.itemsize
    payload = _decompressed(frame[17:], values_end + 8 * nlong + count)
    long_at = payload[values_end:values_end + 4 * nlong].view(np.uint32)
    long_gaps = payload[values_end + 4 * nlong:values_end + 8 * nlong].view(np.uint32)
    if nlong and int(long_at.max()) >= count:
        raise ValueError("a delta's long gaps lie past its positions")
    if nlong > 1 and bool(np.any(long_at[1:] <= long_at[:-1])):  # `_xor_at` finds a block's by their order
        raise ValueError("a delta's long gaps are out of order")
    gaps, values = payload[values_end + 8 * nlong:], payload[:values_end]
    if _fused_xor_at is not None:
        _fused_xor_at(elements, gaps, values, long_at, long_gaps, elements.itemsize)
    else:
        _xor_at(elements, gaps, values.view(elements.dtype), first=-1, plus=1, long=(long_at, long_gaps))


def _xor_at(elements: np.ndarray, steps: np.ndarray, values: np.ndarray, *, first: int, plus: int,
            long: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """XOR `values` into `elements` at the positions the `steps` encode: position i is `first` plus the running
    sum of `steps[:i + 1] + plus` (`long` replaces the steps listed: positions in `steps`, ascending, values). In
    this thread's buffers (`buffers.of_thread`, reused from frame to frame: fresh memory costs a page fault per
    4 KiB), block by block of `_BLOCK` positions: one pass widens a block's steps into positions, one adds them up
    (carrying the last position of the block before), then a gather, an XOR and a scatter; no array is allocated.
    A block's positions (512 KiB) stay in the core's cache through its five passes, where a frame's whole
    positions (up to 17 MB for a 2 M-element frame) went to memory and back four times: 7-14 % less CPU per
    restore at 17 M changed elements (docs/incremental.md). Blocks are large, so a frame is few numpy calls: each
    call that releases and takes the GIL back beside the restoring thread costs CPU (blocks of 32 Ki elements
    cost 15-25 % more in a restore of small frames). The positions only grow, so checking each block's last one
    against the chunk's end keeps every write inside it."""
    count = len(steps)
    if count == 0:
        return
    size = min(count, _BLOCK)
    at_all = buffers.of_thread("delta_positions", size, np.intp)
    picked_all = buffers.of_thread("delta_values", size, elements.dtype)
    long_at, long_gaps = long if long is not None else (None, None)
    carry = first
    for start in range(0, count, _BLOCK):
        stop = min(start + _BLOCK, count)
        at, picked = at_all[:stop - start], picked_all[:stop - start]
        np.add(steps[start:stop], plus, out=at, dtype=np.intp)
        if long_at is not None and len(long_at):
            lo, hi = np.searchsorted(long_at, (start, stop))
            if hi > lo:
                where = long_at[lo:hi].astype(np.intp) - start
                at[where] = long_gaps[lo:hi]
                at[where] += plus
        at[0] += carry
        np.cumsum(at, out=at)
        carry = int(at[-1])
        if carry >= len(elements):
            raise ValueError("a delta's positions run past its chunk")
        np.take(elements, at, out=picked, mode="clip")  # checked above; "raise" would copy `picked` first
        np.bitwise_xor(picked, values[start:stop], out=picked)
        elements[at] = picked


def _decompressed(frame: memoryview, size: int) -> np.ndarray:
    """The `size` bytes of zstd frame `frame`, decompressed straight into this thread's buffer
    (`buffers.of_thread`, valid until its next call on this thread). Raises `ValueError` for a damaged frame or
    one of another size."""
    out = buffers.of_thread("delta_frame", size)
    zstd.decompress_into(frame, memoryview(out))
    return out
