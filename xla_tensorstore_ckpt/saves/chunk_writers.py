"""Choosing the process that writes each chunk of a save (`assign`, called by `save_plan`): the chunk grid of
every array, who holds each chunk (derived from the shardings by `writer_plans`, or gathered where the layout
does not tell), and the least loaded holder of each. Collective with several processes; blocks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from .. import targets
from ..core import dtypes, grid
from ..core.errors import UnsupportedValueError
from ..core.records import ArrayMetadata
from ..core.tensor_layout import Index, LocalShard, TensorLayout
from ..multihost.balancing import balance
from ..multihost.distributed import Coordinator
from ..options import SaveOptions
from . import writer_plans


@lru_cache(maxsize=4096)
def grid_regions(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> tuple[Index, ...]:
    """`grid.regions`, once per grid: a model's thousands of arrays have a few dozen shapes."""
    return tuple(grid.regions(shape, chunk_shape))


@lru_cache(maxsize=4096)
def grid_sizes(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The elements of each region of `grid_regions`, in its order."""
    return tuple(math.prod(b - a for a, b in region) for region in grid_regions(shape, chunk_shape))


def local_chunks(lay: TensorLayout, chunk_shape: tuple[int, ...]) -> dict[Index, LocalShard]:
    """The chunks whose data this process holds, each with the local shard (lowest replica) holding it."""
    if chunk_shape == lay.chunk_shape and targets.of_layout(lay).SHARDS_ARE_CHUNKS:  # chunks are the shards
        return {shard.index: shard for shard in lay.distinct_shards()}
    out: dict[Index, LocalShard] = {}
    meta_grid = grid_regions(lay.shape, chunk_shape)
    for shard in lay.distinct_shards():
        for region in meta_grid:
            if all(sa <= a and b <= sb for (a, b), (sa, sb) in zip(region, shard.index)) and region not in out:
                out[region] = shard
    return out


def assign(local: list[tuple[ArrayMetadata, TensorLayout]], holdings: list[writer_plans.Holding | None],
                    options: SaveOptions, coordinator: Coordinator
                    ) -> tuple[dict[str, tuple[int, ...]], dict[tuple[str, Index], int]]:
    """The final chunk shape of every array and the process writing each chunk, identical on every process.

    Who holds which chunks comes from the shardings (`holdings`, `writer_plans`: every process derives them
    alike, and one reduction of a digest proves it); only the arrays whose layout does not tell the others'
    chunks (a `ShardedArray`) have their chunk lists gathered, and every array's if the digests differ. The
    chunk grid is the shard grid, except that a large array that every process holds whole (one chunk, held
    everywhere) is cut along its first dimension into one chunk per process, so that all share its writing.
    Collective with several processes."""
    own = [tuple(local_chunks(lay, meta.chunk_shape)) for meta, lay in local]
    derived: list[Any] = []
    for (meta, _), groups, chunks in zip(local, holdings, own):
        held = None if groups is None else writer_plans.chunk_holders(meta.shape, meta.chunk_shape, groups)
        derived.append(held if held is not None and writer_plans.holds_own(held, coordinator.index, chunks) else None)
    digest = 0  # alone, there is no one to agree with
    if coordinator.distributed:
        digest = writer_plans.digest([(meta.path, meta.shape, meta.dtype, meta.chunk_shape,
                                       groups if held is not None else None)
                                      for (meta, _), groups, held in zip(local, holdings, derived)])
    gather, high, low = coordinator.reduce_max([int(any(held is None for held in derived)), digest, -digest],
                                               "agreeing on the writers of the chunks")
    if high != -low:  # the processes derived differently (or save other trees): gather every chunk list
        derived = [None] * len(local)
    if gather or high != -low:
        missing = [i for i, held in enumerate(derived) if held is None]
        mine = [(local[i][0].path, local[i][0].shape, local[i][0].dtype, local[i][0].chunk_shape, own[i])
                for i in missing]
        everyone = coordinator.all_gather(mine, "choosing the writers of the chunks")
        for i, held in zip(missing, gathered_holders(everyone)):
            derived[i] = held
    chunk_shapes: dict[str, tuple[int, ...]] = {}
    chunks: list[tuple[tuple[str, Index], int, Sequence[int]]] = []
    for (meta, _), held in zip(local, derived):
        regions = grid_regions(meta.shape, meta.chunk_shape)
        for region in regions:
            if not held.get(region):
                raise UnsupportedValueError(f"chunk {region} of {meta.path} is held by no process")
        everywhere = len(regions) == 1 and len(held[regions[0]]) == coordinator.count
        if (coordinator.count > 1 and everywhere and meta.shape and meta.shape[0] >= coordinator.count
                and meta.nbytes >= options.split_bytes):
            meta = dataclasses.replace(meta, chunk_shape=(-(-meta.shape[0] // coordinator.count),
                                                          *meta.chunk_shape[1:]))
            regions = grid_regions(meta.shape, meta.chunk_shape)
            held = dict.fromkeys(regions, tuple(range(coordinator.count)))
        chunk_shapes[meta.path] = meta.chunk_shape
        itemsize = dtypes.by_name(meta.dtype).itemsize
        chunks.extend(((meta.path, region), size * itemsize, held[region])
                      for region, size in zip(regions, grid_sizes(meta.shape, meta.chunk_shape)))
    return chunk_shapes, balance(chunks, coordinator.count)


def gathered_holders(everyone: list[list[tuple]]) -> list[dict[Index, list[int]]]:
    """Per array of the gathered chunk lists, the processes holding each chunk. Raises `UnsupportedValueError`
    if the processes save different arrays."""
    reference = [entry[:4] for entry in everyone[0]]
    out: list[dict[Index, list[int]]] = [{} for _ in reference]
    for process, entries in enumerate(everyone):
        if [entry[:4] for entry in entries] != reference:
            raise UnsupportedValueError(
                f"process {process} saves other arrays (keys, shapes, dtypes or chunking) than process 0; "
                "every process must save the same tree")
        for held, (_path, _shape, _dtype, _chunks, regions) in zip(out, entries):
            for region in regions:
                held.setdefault(region, []).append(process)
    return out
