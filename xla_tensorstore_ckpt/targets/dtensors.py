"""The geometry of DTensor shardings, pure functions over metadata: which region of the global array each mesh
coordinate's local tensor holds (as DTensor computes it, from public placement attributes, for torch 2.9 and
newer), the chunk grid every shard of a mesh tiles, and the saved sharding. The DTensor target
(`targets/dtensor.py`) decides with them; single-replica reads compute every process's region from them. No
collectives (the mesh's coordinates are computed, not exchanged), no device work, no torch_xla.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from ..core.errors import UsageError
from ..core.records import SavedSharding
from ..core.tensor_layout import Index


@lru_cache(maxsize=4096)
def geometry(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple,
              coordinate: tuple[int, ...] | None) -> tuple[tuple[int, ...], Index | None, int, SavedSharding]:
    """(chunk shape, this coordinate's index, its replica id, saved sharding) of a DTensor's geometry; the
    index of every mesh coordinate is computed as DTensor computes its own (`_box`)."""
    boxes = {point: _box(shape, mesh_shape, placements, point)
             for point in itertools.product(*(range(n) for n in mesh_shape))}
    chunks = []
    for d, n in enumerate(shape):
        cuts = {c for box in boxes.values() if box[d][0] < box[d][1] for c in box[d] if 0 < c < n}
        chunks.append(math.gcd(*cuts) if cuts else n)
    index = None if coordinate is None else boxes[coordinate]
    replica = 0 if index is None else sorted(p for p, box in boxes.items() if box == index).index(coordinate)
    return tuple(chunks), index, replica, _saved_sharding(len(shape), mesh_shape, placements)


def _split_factor(placement: Any) -> int | None:
    """A strided shard's split factor (FSDP2 over tensor parallelism makes them), None for any other placement.
    Read by attribute: the strided placement's class is private to torch and has changed between releases (in
    2.9 a `Shard`, in 2.14 not even `is_shard()`)."""
    factor = getattr(placement, "split_factor", None)
    return None if factor is None else int(factor)


def _is_split(placement: Any) -> bool:
    return placement.is_shard() or _split_factor(placement) is not None


def _chunked(indices: list[int], parts: int, part: int) -> list[int]:
    """The `part`-th of `parts` pieces of `indices` as `torch.chunk` cuts them (ceil-sized; the last ones may be
    short or empty): the rule `Shard` splits a dimension by."""
    size = -(-len(indices) // parts) if indices else 0
    return indices[size * part:size * (part + 1)]


def _box(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple,
         point: tuple[int, ...]) -> Index:
    """The region of the global array the mesh coordinate `point` holds: in arithmetic where no shard is strided
    (a 1,024-rank mesh in milliseconds), else by the index lists strided shards need."""
    strided = any(_split_factor(p) is not None for p in placements)
    return (_indexed_box if strided else _plain_box)(shape, mesh_shape, placements, point)


def _indexed_box(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple,
                 point: tuple[int, ...]) -> Index:
    """The region of the global array the mesh coordinate `point` holds, by DTensor's semantics over public
    placement attributes (torch's functions for this are private and have changed between releases). Each split
    takes its `torch.chunk` piece of the indices its tensor dimension still has. Strided shards differ by
    release: torch 2.9 nests their split inside the later mesh dimensions' (`_split_order`), as a plain chunk;
    newer torch (whose strided placements compute their own offsets) splits left to right, a strided shard with
    split factor f first cutting the indices into f pieces and taking its piece of each. Empty regions are
    `(n, n)`; a region that is not contiguous is refused."""
    held = [list(range(n)) for n in shape]
    nested = any(_split_factor(p) is not None and not hasattr(p, "local_shard_size_and_offset") for p in placements)
    splits = _split_order(placements) if nested else [(m, p) for m, p in enumerate(placements) if _is_split(p)]
    for mesh_dim, placement in splits:
        dim, parts, part = placement.dim, mesh_shape[mesh_dim], point[mesh_dim]
        factor = None if nested else _split_factor(placement)
        if factor is None:
            held[dim] = _chunked(held[dim], parts, part)
        else:
            pieces = (_chunked(held[dim], factor, piece) for piece in range(factor))
            held[dim] = [i for piece in pieces for i in _chunked(piece, parts, part)]
    box = []
    for indices, n in zip(held, shape):
        if not indices:
            box.append((n, n))
        elif indices[-1] - indices[0] + 1 != len(indices):
            raise UsageError(f"a DTensor of shape {shape} with placements {placement_names(placements)} on a "
                             f"mesh of shape {mesh_shape} holds a non-contiguous region at mesh coordinate {point}: "
                             "it cannot be stored as chunks of a global array; redistribute it first")
        else:
            box.append((indices[0], indices[-1] + 1))
    return tuple(box)


def _saved_sharding(rank: int, mesh_shape: tuple[int, ...], placements: tuple) -> SavedSharding:
    """The record of a DTensor's sharding: tiles per tensor dimension, replication, the mesh, a partition spec
    over mesh dimensions (by position; `targets.dtensor.layouts` puts in names) in the order the splits nest,
    the placements."""
    axes: list[list[int]] = [[] for _ in range(rank)]
    for mesh_dim, placement in _split_order(placements):
        axes[placement.dim].append(mesh_dim)
    tiles = tuple(math.prod(mesh_shape[a] for a in dims) for dims in axes)
    replicas = math.prod(n for n, p in zip(mesh_shape, placements) if p.is_replicate())
    spec = tuple(None if not dims else dims[0] if len(dims) == 1 else tuple(dims) for dims in axes)
    return SavedSharding("", tiles, replicas, math.prod(mesh_shape), mesh_shape, None, spec,
                         placement_names(placements))


def _split_order(placements: tuple) -> list[tuple[int, Any]]:
    """The sharded mesh dimensions in the order their splits nest, outermost first: left to right, except that
    a strided shard's split is nested inside those of the later mesh dimensions sharding the same tensor
    dimension (its split factor counts the pieces they cut)."""
    strided: dict[int, list[tuple[int, Any]]] = {}
    order = []
    for mesh_dim, placement in enumerate(placements):
        if not _is_split(placement):
            continue
        if _split_factor(placement) is not None:
            strided.setdefault(placement.dim, []).append((mesh_dim, placement))
            continue
        order.append((mesh_dim, placement))
        order.extend(reversed(strided.pop(placement.dim, [])))
    for pending in strided.values():
        order.extend(pending)
    return order


def placement_names(placements: Sequence[Any]) -> tuple[str, ...]:
    return tuple(repr(p) for p in placements)


@lru_cache(maxsize=1024)
def rank_regions(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple,
                 ranks: tuple[int, ...]) -> tuple[tuple[int, Index], ...]:
    """(global rank, the region of the global array it holds) for every rank of a mesh
    (`targets.dtensor.mesh_sharding`): the regions of every process, computed (not exchanged) the way each
    computes its own (`targets.dtensor.layouts`). Single-replica reads plan from them."""
    points = itertools.product(*(range(n) for n in mesh_shape))
    return tuple((rank, _box(shape, mesh_shape, placements, point)) for rank, point in zip(ranks, points))


def _plain_box(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple,
               point: tuple[int, ...]) -> Index:
    """`_indexed_box` for placements without strided shards, on (start, length) instead of index lists."""
    held = [(0, n) for n in shape]
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():
            start, length = held[placement.dim]
            size = -(-length // mesh_shape[mesh_dim]) if length else 0
            offset = size * point[mesh_dim]
            held[placement.dim] = (start + offset, max(0, min(size, length - offset)))
    return tuple((start, start + length) if length else (n, n) for (start, length), n in zip(held, shape))
