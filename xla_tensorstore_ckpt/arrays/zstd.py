"""zstd, the compression a save may choose (`SaveOptions.compression`): the zarr v3 ``zstd`` codec exactly as
Orbax writes it (TensorStore's default level 3, no zstd checksum), and the compression of one chunk for the
stores this library writes itself (`direct_ocdbt`). The only module that imports ``numcodecs`` (a dependency of
zarr-python; its zstd releases the GIL while it compresses, so the writing lanes compress in parallel).

A compressed chunk is stored as zarr's codecs make it: the chunk's little-endian bytes, compressed into one zstd
frame, then the CRC32C of that frame (the ``crc32c`` codec comes after ``zstd``, so the checksum covers the stored,
compressed bytes, which is what zarr's codec order means and what tensorstore and zarr-python check: tensorstore
checks it as the frame streams through its decoder, so damage is reported by the checksum, or by the decoder
where it breaks the frame itself; either way an error naming the chunk, never other values).
"""

from __future__ import annotations

import functools
import struct

from numcodecs import Zstd
from numcodecs import zstd as _zstd

NAME = "zstd"
DEFAULT_LEVEL = 3  # TensorStore's default, which Orbax writes
LEVELS = range(1, 23)  # zstd's ordinary levels (negative, "fast" levels are not offered)


def codec(level: int) -> dict:
    """The zarr v3 codec entry of zstd at `level` (between ``bytes`` and ``crc32c`` in an array's codecs)."""
    return {"name": NAME, "configuration": {"level": level, "checksum": False}}


def compress(raw: memoryview, level: int) -> bytes:
    """One zstd frame of `raw` at `level` (its content size in the frame header). Called on a writing lane's
    thread; blocks while it compresses, without the GIL."""
    return _compressor(level).encode(raw)


@functools.lru_cache(maxsize=len(LEVELS))
def _compressor(level: int) -> Zstd:
    return Zstd(level=level)


_MAGIC = 0xFD2FB528


def content_size(frame) -> int | None:
    """The decompressed size a zstd frame's header declares, None if it declares none (or `frame` is not one)."""
    head = bytes(frame[:18])
    if len(head) < 5 or struct.unpack_from("<I", head)[0] != _MAGIC:
        return None
    descriptor = head[4]
    single_segment, fcs_flag = (descriptor >> 5) & 1, descriptor >> 6
    at = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[descriptor & 3]  # window descriptor, dictionary id
    width = (1 if single_segment else 0, 2, 4, 8)[fcs_flag]
    if width == 0 or len(head) < at + width:
        return None
    value = int.from_bytes(head[at:at + width], "little")
    return value + 256 if width == 2 else value


def decompress_into(frame, out: memoryview) -> None:
    """Decompress one zstd frame into `out` (a writable byte buffer), which it must fill exactly: a chunk read
    straight into its destination (`local_chunks`). Never decodes more than `out` holds, whatever the frame
    declares (a hostile frame may expand a thousandfold). Raises `ValueError` if the frame is damaged or of
    another size. Blocks while it decompresses, without the GIL."""
    declared = content_size(frame)
    if declared is not None and declared != len(out):
        raise ValueError(f"a zstd frame of {declared} bytes where {len(out)} were expected")
    if len(out) == 0:  # numcodecs refuses an empty frame; an empty one has nothing to decompress
        if declared == 0:
            return
        raise ValueError("a zstd frame where no bytes were expected")
    try:
        _zstd.decompress(frame, out)  # bounded by `out`: "too small" or "expected ..., got ..." otherwise
    except (RuntimeError, ValueError) as exc:  # numcodecs' errors for a broken frame or another size
        raise ValueError(f"broken zstd frame ({exc})") from None

