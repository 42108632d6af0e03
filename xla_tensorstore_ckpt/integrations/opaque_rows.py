"""Per-process opaque byte states (a data loader's position, which torchtitan hands over already serialised) as
one global uint8 array with a row per process: process ``i`` writes row ``i``, holding its key and its bytes,
so a save of several processes writes each state once, by its owner, and every process can read every row
back. Called by the torchtitan manager (`integrations.torchtitan`); `encode` is collective; nothing here runs or
unpickles what it stores.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

import torch

from ..core.errors import CheckpointError
from ..core.sharded_array import ShardedArray
from ..multihost.distributed import Coordinator

_HEADER = struct.Struct("<II")  # key length, value length
LAYOUT = "opaque rows per process"


def encode(entries: Mapping[str, bytes], coordinator: Coordinator) -> dict:
    """This process's `entries` (key -> bytes) as its row of a global array agreed with every process of
    `coordinator` (collective: one gather of the row widths). Blocks."""
    row = b"".join(_HEADER.pack(len(k.encode()), len(v)) + k.encode() + bytes(v) for k, v in entries.items())
    width = max(1, *coordinator.all_gather(len(row)))
    data = torch.zeros((1, width), dtype=torch.uint8)
    if row:
        data[0, :len(row)] = torch.frombuffer(bytearray(row), dtype=torch.uint8)
    index, count = coordinator.index, coordinator.count
    return {"layout": LAYOUT, "lengths": _lengths(len(row), index, count),
            "rows": ShardedArray((count, width), torch.uint8, (1, width), ((((index, index + 1), (0, width)), data),),
                                 mesh=((count,), (0,)))}


def _lengths(length: int, index: int, count: int) -> ShardedArray:
    value = torch.tensor([[length]], dtype=torch.int64)
    return ShardedArray((count, 1), torch.int64, (1, 1), ((((index, index + 1), (0, 1)), value),),
                        mesh=((count,), (0,)))


def decode(saved: object, *, where: str) -> dict[str, bytes]:
    """Every process's entries, merged (key -> bytes), from a tree `encode` wrote, read back as CPU tensors.
    Raises `CheckpointError` naming `where` if the tree is malformed or two processes saved the same key with
    different bytes."""
    if not isinstance(saved, dict) or saved.get("layout") != LAYOUT:
        raise CheckpointError(f"the data loader state at {where} is not {LAYOUT!r}")
    rows, lengths = saved["rows"], saved["lengths"]
    out: dict[str, bytes] = {}
    for i in range(rows.shape[0]):
        row = rows[i, :int(lengths[i, 0])].numpy().tobytes()
        at = 0
        while at < len(row):
            if at + _HEADER.size > len(row):
                raise CheckpointError(f"the data loader state at {where} has a truncated row {i}")
            key_len, value_len = _HEADER.unpack_from(row, at)
            at += _HEADER.size
            if at + key_len + value_len > len(row):
                raise CheckpointError(f"the data loader state at {where} has a truncated row {i}")
            key = row[at:at + key_len].decode()
            value = row[at + key_len:at + key_len + value_len]
            at += key_len + value_len
            if out.get(key, value) != value:
                raise CheckpointError(f"the data loader state at {where} holds two states for {key!r}")
            out[key] = value
    return out
