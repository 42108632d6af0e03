"""Who holds which chunks of a save, derived alike on every process from the shardings (`save_plan` chooses the
writers from it): no process needs the others' chunk lists where the layout of a value tells every process's
shards.

A holding is a tuple of groups ``(regions, processes)``: the processes of a group hold exactly those regions of
the global array (the format of `replica_plans.Group`). Derivable: a CPU tensor, an unsharded or replicated XLA
tensor (every process holds it whole), a scalar leaf (the primary holds it), a DTensor (each rank's region of its
mesh: `replica_plans.dtensor_groups`), a tiled XLA tensor (each device's tile, its process the device's over the
addressable device count: `sharding.device_processes`), a `ShardedArray` with a `mesh`
(`replica_plans.mesh_groups`). Not derivable: a `ShardedArray` without one (it tells only its own shards). A
process checks that what it derives for itself is what it holds; the processes agree on a `digest` of what they
derived; what is not derivable, or not agreed, is gathered. Pure functions; no collectives.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from . import dtensors, grid, replica_plans
from .tensor_layout import Index, Placement, TensorLayout, full_index

Holding = tuple[tuple[tuple[Index, ...], tuple[int, ...]], ...]


def holding(value: Any, lay: TensorLayout, count: int, *, scalar: bool = False) -> Holding | None:
    """Every process's regions of `value` (laid out as `lay` on this process) among `count` processes, or None
    where its layout does not tell them. `scalar`: a JSON scalar leaf, written by the primary."""
    whole = (full_index(lay.shape),)
    if scalar:
        return ((whole, (0,)),)
    if lay.placement in (Placement.CPU, Placement.UNSHARDED, Placement.REPLICATED):
        return ((whole, tuple(range(count))),)
    if lay.placement is Placement.DTENSOR:
        return replica_plans.dtensor_groups(*dtensors.mesh_sharding(value), count)
    if lay.placement is Placement.HOST and value.mesh is not None:
        return replica_plans.mesh_groups(lay.shape, lay.shard_shape, *value.mesh, count)
    if lay.placement is Placement.TILED and lay.sharding is not None:
        from . import sharding  # an XLA tensor: torch_xla is there

        processes = sharding.device_processes()
        if processes is None or len(processes) != lay.sharding.num_devices:
            return None
        tiles, order, replicas = sharding.parse_hlo_sharding(lay.sharding.hlo, len(lay.shape))
        return tiled_groups(lay.shape, tiles, order, replicas, processes)
    return None


@lru_cache(maxsize=1024)
def tiled_groups(shape: tuple[int, ...], tiles: tuple[int, ...], order: tuple[int, ...], replicas: int,
                 processes: tuple[int, ...]) -> Holding:
    """The groups of an HLO tiled sharding: device `order[k]` holds the tile at position k of the tile
    assignment (tiles, then replicas, in C order); `processes[d]` is device d's process."""
    by_region: dict[Index, set[int]] = {}
    sizes = [-(-n // t) for n, t in zip(shape, tiles)]
    for k, device in enumerate(order):
        point = np.unravel_index(k, (*tiles, replicas))[:len(tiles)]
        region = tuple((min(int(c) * s, n), min((int(c) + 1) * s, n)) for c, s, n in zip(point, sizes, shape))
        if math.prod(b - a for a, b in region):
            by_region.setdefault(region, set()).add(processes[device])
    return tuple(sorted(((region,), tuple(sorted(procs))) for region, procs in by_region.items()))


@lru_cache(maxsize=4096)
def chunk_holders(shape: tuple[int, ...], chunk_shape: tuple[int, ...],
                  groups: Holding) -> Mapping[Index, tuple[int, ...]] | None:
    """The processes holding each chunk of the grid (a chunk lies inside a region of theirs), or None if a
    chunk would have no holder (then the holding is not what the processes hold: it is gathered). Cached: the
    arrays of a model share a few shapes and shardings. Do not modify the result."""
    held: dict[Index, set[int]] = {}
    for regions, procs in groups:
        for region in regions:
            for _, chunk in grid.chunks_in(region, chunk_shape, shape):
                if grid.contains(region, chunk):
                    held.setdefault(chunk, set()).update(procs)
    if not shape:  # a 0-d array: one chunk, the empty index
        held = {(): {p for _, procs in groups for p in procs}}
    chunks = grid.regions(shape, chunk_shape)
    if any(chunk not in held for chunk in chunks):
        return None
    return {chunk: tuple(sorted(held[chunk])) for chunk in chunks}


def holds_own(holders: Mapping[Index, tuple[int, ...]], me: int, own: Sequence[Index]) -> bool:
    """Whether the chunks `holders` gives process `me` are exactly `own` (the chunks it holds)."""
    mine = {chunk for chunk, procs in holders.items() if me in procs}
    return mine == set(own)


def digest(entries: Sequence[tuple[str, tuple[int, ...], str, tuple[int, ...], Holding | None]]) -> int:
    """A 62-bit digest of what a process derived: per array its name, shape, dtype, chunk shape and holding (None:
    to be gathered). Equal on two processes iff, but for a collision, they derived alike. Each distinct holding
    object is hashed once."""
    hasher = hashlib.blake2b(digest_size=8)
    seen: dict[int, bytes] = {}
    for path, shape, dtype, chunk_shape, groups in entries:
        hasher.update(repr((path, shape, dtype, chunk_shape)).encode())
        if groups is None:
            hasher.update(b"\0gathered")
            continue
        if id(groups) not in seen:
            part = hashlib.blake2b(digest_size=16)
            for regions, procs in groups:
                part.update(repr(regions).encode())
                part.update(np.asarray(procs, dtype=np.int32).tobytes())
            seen[id(groups)] = part.digest()
        hasher.update(seen[id(groups)])
    return int.from_bytes(hasher.digest(), "little") >> 2
