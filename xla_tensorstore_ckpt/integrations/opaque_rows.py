"""Per-process opaque byte states (a data loader's position, which torchtitan hands over already serialised) as
one global uint8 array with a row per process: process ``i`` writes row ``i``, holding its key and its bytes,
so a save of several processes writes each state once, by its owner, and every process can read every row
back. Called by the torchtitan manager (`integrations.torchtitan`), whose data loader's state travels through
`loader_rows` and comes back through `LoaderTarget`; `encode` is collective; nothing here runs or unpickles
what it stores.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import torch

from ..core.errors import CheckpointError
from ..core.sharded_array import ShardedArray
from ..multihost.distributed import Coordinator

_HEADER = struct.Struct("<II")  # key length, value length
LAYOUT = "opaque rows per process"


def encode(entries: Mapping[str, bytes], coordinator: Coordinator) -> dict:
    """This process's `entries` (key -> bytes) as its row of a global array agreed with every process of
    `coordinator` (collective: one reduction of the row widths, of which only the widest matters). Blocks."""
    row = b"".join(_HEADER.pack(len(k.encode()), len(v)) + k.encode() + bytes(v) for k, v in entries.items())
    width = max(1, *coordinator.reduce_max([len(row)], "agreeing on the data loader rows' width"))
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


class LoaderTarget:
    """The data loader as a restore target: the saved rows decoded into torchtitan's state dict
    (``{"dp_rank_<r>": bytes, "world_size": n}``) and handed to its ``load_state_dict``."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def load_state_dict(self, saved: Any) -> None:
        entries = decode(saved.get("rows") if isinstance(saved, dict) else None, where="data_loader")
        state: dict[str, Any] = dict(entries)
        state["world_size"] = saved["world_size"]
        self.loader.load_state_dict(state)


def loader_rows(state: dict[str, Any], coordinator: Coordinator) -> dict[str, Any]:
    """torchtitan's data loader state (its rank's serialised position under ``dp_rank_<r>``, and the data-parallel
    world size) as rows per process (`encode`; collective)."""
    entries = {key: value for key, value in state.items() if isinstance(value, bytes)}
    return {"rows": encode(entries, coordinator), "world_size": state.get("world_size")}
