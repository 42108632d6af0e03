"""The global plan of a save through DCP (`writer.DCPStorageWriter.prepare_global_plan`): from every rank's write
items, each tensor's global array (its name in the item, zarr dtype and chunk grid) and the rank writing each of
its chunks; each byte-IO item's array and writer. Pure Python over DCP's plan records; every process receives
its own `RankPlan` (in its `SavePlan.storage_data`), the coordinator keeps the `GlobalPlan` for `finish`.

The chunk grid of a tensor is the coarsest grid every saved chunk (every rank's shard) is made of whole chunks of:
per dimension the gcd of the chunks' cut points, as `dtensors` chooses it for DTensors, so that uneven FSDP2
shards (``torch.chunk``'s ceil-sized pieces, an empty last one) land in chunks of their own and no chunk has two
writers. Chunks held by several ranks (the default planner without de-duplication) go to the least loaded
holder (`balancing.balance`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.planner import WriteItemType

from ..core import dtypes, grid, layout
from ..core.errors import ShapeMismatchError, UnsupportedValueError
from ..core.records import ArrayMetadata
from ..formats import v2
from ..formats.dcp import key_path
from ..multihost.balancing import balance

Index = grid.Index


@dataclass(frozen=True)
class ArrayWrite:
    """A tensor's array as one rank writes it: its DCP key, array name, shape, zarr dtype, chunk shape, the
    chunks (regions) this rank writes and whether it creates the array's ``zarr.json``."""

    fqn: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    regions: tuple[Index, ...]
    writes_metadata: bool

    def metadata(self) -> ArrayMetadata:
        return ArrayMetadata(self.name, self.shape, self.dtype, self.chunk_shape)


@dataclass(frozen=True)
class RankPlan:
    """What one rank writes (`SavePlan.storage_data`): the item directory's temporary name (None: the item
    directory itself), its tensors' arrays, its byte-IO items by key, each with its array name, and how many
    processes the save has."""

    temporary: str | None
    arrays: tuple[ArrayWrite, ...]
    byte_items: tuple[tuple[str, str], ...]
    processes: int = 1


@dataclass(frozen=True)
class GlobalPlan:
    """The coordinator's record of a save for `finish`: every key's path in the item's tree, every tensor's
    array, every byte-IO item's array name, and the temporary directory name."""

    paths: dict[str, layout.KeyPath]
    tensors: dict[str, ArrayMetadata]
    byte_names: dict[str, str]
    temporary: str | None


@dataclass
class _Tensor:
    shape: tuple[int, ...]
    dtype: str
    chunks: list[tuple[int, Index]]  # (rank, region)


def plan_global(plans: Sequence[Any], temporary: str | None, where: str) -> tuple[list[RankPlan], GlobalPlan]:
    """Each rank's `RankPlan` (in rank order) and the `GlobalPlan`, from every rank's DCP `SavePlan`. Called by
    the coordinator in `prepare_global_plan`; pure. Raises `ShapeMismatchError` naming the key and `where` when
    ranks disagree on a tensor's shape or dtype or a chunk lies outside it, `UnsupportedValueError` for a chunk
    no rank holds, a dtype the format cannot store or a key that is both a tensor and a byte-IO value."""
    tensors: dict[str, _Tensor] = {}
    byte_holders: dict[str, list[int]] = {}
    mappings: dict[str, Any] = {}
    for rank, plan in enumerate(plans):
        if isinstance(plan.planner_data, dict):
            mappings.update(plan.planner_data)
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                byte_holders.setdefault(fqn, []).append(rank)
            else:
                _add_chunk(tensors, fqn, rank, item.tensor_data, where)
    for fqn in tensors.keys() & byte_holders.keys():
        raise UnsupportedValueError(f"{where}: {fqn!r} is saved both as a tensor and as a byte-IO value")
    fqns = sorted(tensors.keys() | byte_holders.keys())
    paths = {fqn: key_path(fqn, mappings, where) for fqn in fqns}
    names = dict(zip(fqns, v2.array_names([paths[f] for f in fqns])))
    grids = {fqn: _chunk_shape(entry.shape, [region for _, region in entry.chunks]) for fqn, entry in tensors.items()}
    writer = balance([held for fqn in sorted(tensors) for held in _holders(fqn, tensors[fqn], grids[fqn], where)],
                     len(plans))
    by_rank: dict[tuple[str, int], list[Index]] = {}
    for (fqn, region), rank in writer.items():
        by_rank.setdefault((fqn, rank), []).append(region)
    writes: list[list[ArrayWrite]] = [[] for _ in plans]
    metas: dict[str, ArrayMetadata] = {}
    for fqn in sorted(tensors):
        entry, chunk_shape = tensors[fqn], grids[fqn]
        ranks = sorted(rank for f, rank in by_rank if f == fqn)
        creator = ranks[0] if ranks else 0  # an array without data (a zero-length dimension): rank 0 creates it
        for rank in sorted({*ranks, creator}):
            writes[rank].append(ArrayWrite(fqn, names[fqn], entry.shape, entry.dtype, chunk_shape,
                                           tuple(sorted(by_rank.get((fqn, rank), ()))), rank == creator))
        metas[fqn] = ArrayMetadata(names[fqn], entry.shape, entry.dtype, chunk_shape)
    bytes_by_rank: list[list[tuple[str, str]]] = [[] for _ in plans]
    for fqn, holders in sorted(byte_holders.items()):
        bytes_by_rank[min(holders)].append((fqn, names[fqn]))
    rank_plans = [RankPlan(temporary, tuple(w), tuple(b), len(plans)) for w, b in zip(writes, bytes_by_rank)]
    return rank_plans, GlobalPlan(paths, metas, {f: names[f] for f in byte_holders}, temporary)


def _add_chunk(tensors: dict[str, _Tensor], fqn: str, rank: int, data: Any, where: str) -> None:
    shape = tuple(int(n) for n in data.size)
    try:
        dtype = dtypes.by_torch(data.properties.dtype).name
    except UnsupportedValueError as exc:
        raise UnsupportedValueError(f"{where}: cannot save {fqn!r}: {exc}") from None
    offsets, sizes = tuple(int(n) for n in data.chunk.offsets), tuple(int(n) for n in data.chunk.sizes)
    if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
            o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape)):
        raise ShapeMismatchError(f"{where}: {fqn!r}: rank {rank} saves a chunk at {offsets} of size {sizes}, outside "
                                 f"the tensor's shape {shape}", key=fqn, saved_shape=shape,
                                 target_shape=tuple(o + n for o, n in zip(offsets, sizes)))
    entry = tensors.setdefault(fqn, _Tensor(shape, dtype, []))
    if (entry.shape, entry.dtype) != (shape, dtype):
        raise ShapeMismatchError(f"{where}: {fqn!r}: rank {rank} saves shape {shape} {dtype}, another rank "
                                 f"{entry.shape} {entry.dtype}", key=fqn, saved_shape=entry.shape,
                                 target_shape=shape)
    entry.chunks.append((rank, tuple((o, o + n) for o, n in zip(offsets, sizes))))


def _chunk_shape(shape: tuple[int, ...], regions: list[Index]) -> tuple[int, ...]:
    """The coarsest grid every non-empty region is made of whole chunks of (chunk dimensions at least 1)."""
    out = []
    for d, n in enumerate(shape):
        cuts = {c for region in regions if all(b > a for a, b in region) for c in region[d] if 0 < c < n}
        out.append(math.gcd(*cuts) if cuts else max(n, 1))
    return tuple(out)


def _holders(fqn: str, entry: _Tensor, chunk_shape: tuple[int, ...],
             where: str) -> list[tuple[tuple[str, Index], int, list[int]]]:
    """((key, chunk region), bytes, ranks holding it) of every chunk of the grid, for `balancing.balance`."""
    itemsize = dtypes.by_name(entry.dtype).itemsize
    out = []
    for _, region in grid.chunks(entry.shape, chunk_shape):
        procs = sorted({rank for rank, chunk in entry.chunks if grid.contains(chunk, region)})
        if not procs:
            held = [chunk for _, chunk in entry.chunks if all(b > a for a, b in chunk)]
            raise UnsupportedValueError(f"{where}: {fqn!r}: no rank saves the region {region} of shape "
                                        f"{entry.shape} (saved: {held[:4]}{' ...' if len(held) > 4 else ''})")
        out.append(((fqn, region), math.prod(b - a for a, b in region) * itemsize, procs))
    return out
