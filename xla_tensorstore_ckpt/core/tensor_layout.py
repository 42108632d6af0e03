"""Immutable records describing where a tensor's data lives and which chunks this process writes or reads.

A `TensorLayout` lists a tensor's local shards (one per local device, in the runtime's device order) with their
index in the global array, and names the target (`targets`) whose layout it is, which made it: the checkpointer
never touches a tensor kind itself. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import cached_property

from .records import SavedSharding

Index = tuple[tuple[int, int], ...]  # [start, stop) per dimension, in global coordinates, without padding


@dataclass(frozen=True)
class LocalShard:
    """One addressable shard: its position in the tensor's local shard list, device, index and replica id."""

    position: int
    device: str
    index: Index
    replica_id: int

    # Cached: a save of thousands of small tensors hashes and measures its shards tens of thousands of times
    # while the training loop waits.
    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self)))

    def __getstate__(self) -> dict:
        # Only the fields: a string's hash differs between processes, so a cached one must not travel.
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def region(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.index)

    @cached_property
    def extent(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.index)

    @cached_property
    def size(self) -> int:
        return math.prod(self.extent)


@dataclass(frozen=True)
class TensorLayout:
    """How one tensor is laid out over this process's devices. `shard_shape` is the padded per-device shape
    (the chunk shape on disk, except that chunk dimensions are at least 1); for a DTensor, whose shards may
    differ in size, the chunk grid its shards are made of."""

    shape: tuple[int, ...]
    target: str  # the name of the target (tensor kind) whose layout this is: `targets.named(target)`
    shard_shape: tuple[int, ...]
    shards: tuple[LocalShard, ...]
    sharding: SavedSharding | None = None

    @cached_property
    def chunk_shape(self) -> tuple[int, ...]:
        return tuple(max(1, s) for s in self.shard_shape)

    def distinct_shards(self) -> list[LocalShard]:
        """One shard per distinct non-empty index: the one with the lowest replica id. Empty shards (of a
        zero-length dimension, or past the end of an unevenly split one) hold nothing to write."""
        best: dict[Index, LocalShard] = {}
        for shard in self.shards:
            if shard.size == 0:
                continue
            current = best.get(shard.index)
            if current is None or shard.replica_id < current.replica_id:
                best[shard.index] = shard
        return sorted(best.values(), key=lambda s: s.index)


def full_index(shape: tuple[int, ...]) -> Index:
    return tuple((0, n) for n in shape)
