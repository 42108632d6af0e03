"""Who holds which regions of a global array, computed alike on every process from a sharding, without asking
the others: the common language of the targets (`Target.holding`), the writers of a save (`writer_plans`) and
the single-replica reads of a restore (`replica_plans`).

A holding is a tuple of groups ``(regions, processes)``, sorted: the processes of a group hold exactly those
regions. The functions are cached: the arrays of a model share a few shapes and shardings, and the same object
stands for each (the plans' digests hash each distinct object once). Pure; no collectives.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from functools import lru_cache

import numpy as np

from ..core.tensor_layout import Index, full_index
from . import dtensors

Group = tuple[tuple[Index, ...], tuple[int, ...]]  # (regions; processes holding exactly those)
Holding = tuple[Group, ...]


@lru_cache(maxsize=1024)
def everywhere(shape: tuple[int, ...], count: int) -> Holding:
    """The whole array held by each of `count` processes."""
    return (((full_index(shape),), tuple(range(count))),)


@lru_cache(maxsize=1024)
def dtensor_groups(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple, ranks: tuple[int, ...],
                   count: int) -> Holding:
    """A DTensor sharding (`targets.dtensor.mesh_sharding`'s arguments) among `count` processes."""
    by_region: dict[Index, list[int]] = {}
    for rank, region in dtensors.rank_regions(shape, mesh_shape, placements, ranks):
        if rank < count and math.prod(b - a for a, b in region):
            by_region.setdefault(region, []).append(rank)
    return tuple(sorted(((region,), tuple(sorted(procs))) for region, procs in by_region.items()))


@lru_cache(maxsize=1024)
def mesh_groups(shape: tuple[int, ...], shard_shape: tuple[int, ...], mesh_shape: tuple[int, ...],
                dims: tuple[int | None, ...], count: int) -> Holding:
    """A `ShardedArray`'s `mesh` (mesh shape, the array dimension each mesh axis splits) among `count`
    processes: process r, at point r of the mesh in C order, holds along dimension d the grid's shard k, k its
    coordinates on the axes splitting d (C order); the whole dimension where none does."""
    by_region: dict[Index, list[int]] = {}
    points = itertools.product(*(range(n) for n in mesh_shape))
    for rank, point in zip(range(count), points):
        region = []
        for d, (n, s) in enumerate(zip(shape, shard_shape)):
            axes = [i for i, dim in enumerate(dims) if dim == d]
            k = 0
            for i in axes:
                k = k * mesh_shape[i] + point[i]
            region.append((min(k * s, n), min((k + 1) * s, n)) if axes else (0, n))
        if math.prod(b - a for a, b in region):
            by_region.setdefault(tuple(region), []).append(rank)
    return tuple(sorted(((region,), tuple(procs)) for region, procs in by_region.items()))


@lru_cache(maxsize=1024)
def tiled_groups(shape: tuple[int, ...], tiles: tuple[int, ...], order: tuple[int, ...], replicas: int,
                 processes: tuple[int, ...]) -> Holding:
    """An HLO tiled sharding: device `order[k]` holds the tile at position k of the tile assignment (tiles,
    then replicas, in C order); `processes[d]` is device d's process. A process may hold several tiles."""
    by_region: dict[Index, set[int]] = {}
    sizes = [-(-n // t) for n, t in zip(shape, tiles)]
    for k, device in enumerate(order):
        point = np.unravel_index(k, (*tiles, replicas))[:len(tiles)]
        region = tuple((min(int(c) * s, n), min((int(c) + 1) * s, n)) for c, s, n in zip(point, sizes, shape))
        if math.prod(b - a for a, b in region):
            by_region.setdefault(region, set()).add(processes[device])
    return tuple(sorted(((region,), tuple(sorted(procs))) for region, procs in by_region.items()))


@lru_cache(maxsize=1024)
def by_process(groups: Holding) -> Holding:
    """The same holding with one group per distinct set of regions a process holds (its regions sorted):
    a process holding several tiles is in one group, not several."""
    held: dict[int, set[Index]] = {}
    for regions, procs in groups:
        for process in procs:
            held.setdefault(process, set()).update(regions)
    if all(len(regions) == 1 for regions in held.values()):
        return groups
    out: dict[tuple[Index, ...], list[int]] = {}
    for process in sorted(held):
        out.setdefault(tuple(sorted(held[process])), []).append(process)
    return tuple(sorted((regions, tuple(procs)) for regions, procs in out.items()))


def fingerprint(groups: Holding) -> bytes:
    """16 bytes standing for `groups` (their regions and processes) in the digests the processes agree on
    (`saves.writer_plans.digest`, `restores.replica_plans.digest`); callers hash each distinct object once."""
    part = hashlib.blake2b(digest_size=16)
    for regions, procs in groups:
        part.update(repr(regions).encode())
        part.update(np.asarray(procs, dtype=np.int32).tobytes())
    return part.digest()
