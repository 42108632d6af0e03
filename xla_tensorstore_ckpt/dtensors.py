"""The only module that touches `torch.distributed.tensor`: which region of the global array a DTensor's local
tensor holds, the chunk grid its shards tile, its saved sharding, its local data, and DTensors built from host
data on a reference's mesh and placements.

A DTensor is to this library what a process's addressable shards of an SPMD tensor are: one shard per process
(its local tensor) at an index in the global array, replicated where the mesh has `Replicate()` dimensions. The
save and restore paths treat it like a `ShardedArray` (`tensor_layout.Placement.DTENSOR`). torch_xla is never
imported here, so a process that trains with DTensors alone saves and restores without it. Pure functions over
metadata except `host_copies` and `build`; no collectives (the mesh's coordinates are computed, not
exchanged).
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch

from .errors import UsageError
from .records import SavedSharding
from .tensor_layout import Index, LocalShard, Placement, TensorLayout


def is_dtensor(value: Any) -> bool:
    """Whether `value` is a DTensor. Cheap, and imports nothing: DTensors exist only once their module is."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def unsaveable(value: Any) -> str | None:
    """Why the DTensor `value` cannot be saved as it is, or None: a `Partial` placement holds unreduced
    summands, not the array (the caller names the key)."""
    partial = [repr(p) for p in value.placements if p.is_partial()]
    if partial:
        return (f"its placements {_names(value.placements)} include {partial[0]}: it holds partial sums, not the "
                "array; reduce it first (e.g. `value.redistribute(placements=[Replicate()] * mesh.ndim)`)")
    return None


def layouts(values: Sequence[Any]) -> list[TensorLayout]:
    """The layout of each DTensor: the one shard this process holds (its local tensor, at its index in the
    global array; none if this process is not in the mesh), on the coarsest chunk grid that every shard of the
    mesh is made of whole chunks of (the shard shape for even and `torch.chunk`-uneven splits), with the saved
    sharding (mesh shape, dimension names, placements). No device work."""
    out = []
    for value in values:
        mesh = value.device_mesh
        coordinate = mesh.get_coordinate()
        geometry = _geometry(tuple(value.shape), tuple(mesh.shape), tuple(value.placements),
                             None if coordinate is None else tuple(coordinate))
        chunks, index, replica, sharding = geometry
        device = str(value._local_tensor.device)
        names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
        if names is not None:
            sharding = SavedSharding(sharding.hlo, sharding.tiles, sharding.replicas, sharding.num_devices,
                                     sharding.mesh_shape, names, _named(sharding.partition_spec, names),
                                     sharding.placements)
        shards = () if index is None else (LocalShard(0, device, index, replica),)
        out.append(TensorLayout(tuple(value.shape), Placement.DTENSOR, chunks, shards, sharding))
    return out


@lru_cache(maxsize=4096)
def _geometry(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple,
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
            raise UsageError(f"a DTensor of shape {shape} with placements {_names(placements)} on a mesh of shape "
                             f"{mesh_shape} holds a non-contiguous region at mesh coordinate {point}: it cannot be "
                             "stored as chunks of a global array; redistribute it first")
        else:
            box.append((indices[0], indices[-1] + 1))
    return tuple(box)


def _saved_sharding(rank: int, mesh_shape: tuple[int, ...], placements: tuple) -> SavedSharding:
    """The record of a DTensor's sharding: tiles per tensor dimension, replication, the mesh, a partition spec
    over mesh dimensions (by position; `layouts` puts in names) in the order the splits nest, the placements."""
    axes: list[list[int]] = [[] for _ in range(rank)]
    for mesh_dim, placement in _split_order(placements):
        axes[placement.dim].append(mesh_dim)
    tiles = tuple(math.prod(mesh_shape[a] for a in dims) for dims in axes)
    replicas = math.prod(n for n, p in zip(mesh_shape, placements) if p.is_replicate())
    spec = tuple(None if not dims else dims[0] if len(dims) == 1 else tuple(dims) for dims in axes)
    return SavedSharding("", tiles, replicas, math.prod(mesh_shape), mesh_shape, None, spec, _names(placements))


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


def _named(spec: tuple | None, names: tuple[str, ...]) -> tuple | None:
    if spec is None:
        return None
    return tuple(None if s is None else names[s] if isinstance(s, int) else tuple(names[a] for a in s) for s in spec)


def _names(placements: Sequence[Any]) -> tuple[str, ...]:
    return tuple(repr(p) for p in placements)


def signature(value: Any, meshes: dict[int, tuple] | None = None) -> tuple:
    """What a DTensor's layout depends on besides its shape and dtype (mesh, coordinate, placements, device):
    a save plan made for one DTensor serves another of the same signature. `meshes` (by ``id``, for a caller
    keeping the meshes alive meanwhile) describes each mesh once: building ``mesh.mesh`` costs ~0.2 ms."""
    mesh = value.device_mesh
    described = None if meshes is None else meshes.get(id(mesh))
    if described is None:
        described = (tuple(mesh.shape), tuple(mesh.mesh.reshape(-1).tolist()), mesh.mesh_dim_names,
                     mesh.get_coordinate())
        if meshes is not None:
            meshes[id(mesh)] = described
    return (tuple(value.placements), *described, value._local_tensor.device)


def host_copies(values: Sequence[Any], *, copy: bool) -> list[torch.Tensor]:
    """Each DTensor's local tensor on the host, detached, for a batch of a save: device-agnostic (CPU, CUDA, a
    PrivateUse1 device such as TorchTPU's "tpu"). Local tensors on an accelerator are copied with non-blocking
    copies, into pinned host memory when `copy` (an asynchronous save keeps the copies while training goes on)
    and the accelerator pins, then each device is synchronized once for the batch, not once per tensor. CPU
    local tensors are views unless `copy` (a caller that returns before writing them must not see the training
    loop change them). Blocks until the copies are done."""
    out: list[torch.Tensor] = []
    devices: dict[str, torch.device] = {}
    with torch.no_grad():
        for value in values:
            local = value.to_local().detach()
            if local.device.type == "cpu":
                out.append(local.clone() if copy else local)
                continue
            host = torch.empty(local.shape, dtype=local.dtype, pin_memory=copy and _pins(local.device))
            out.append(host.copy_(local, non_blocking=True))
            devices.setdefault(str(local.device), local.device)
    for device in devices.values():
        _synchronize(device)
    return out


def _pins(device: torch.device) -> bool:
    """Whether host memory can be pinned for copies off `device`: the current accelerator's type (torch pins for
    that one only), where the public accelerator API exists."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return False
    current = accelerator.current_accelerator()
    return current is not None and current.type == device.type


def _synchronize(device: torch.device) -> None:
    """Wait for the copies queued on `device`: through torch's device-generic accelerator API where it knows the
    device, else through the device's own module (`torch.cuda`, `torch.tpu`: PrivateUse1 backends register one)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        current = accelerator.current_accelerator()
        if current is not None and current.type == device.type:
            accelerator.synchronize(device)
            return
    module = getattr(torch, device.type, None)
    if module is not None and hasattr(module, "synchronize"):
        module.synchronize()


def build(reference: Any, data: torch.Tensor) -> Any:
    """A DTensor on `reference`'s mesh and placements, of its global shape and stride, whose local tensor is
    `data` (this process's region of it) moved to the reference's local device. No communication."""
    from torch.distributed.tensor import DTensor

    device = reference._local_tensor.device
    return DTensor.from_local(data if data.device == device else data.to(device), reference.device_mesh,
                              reference.placements, run_check=False, shape=reference.shape,
                              stride=reference.stride())


def local_tensor(value: Any) -> torch.Tensor:
    """The DTensor's local tensor itself (its memory, not a copy): what a restore in place reads into or copies
    into, so that the DTensor keeps its identity (an FSDP2 parameter stays its optimizer's and its module's)."""
    return value._local_tensor


def mesh_sharding(value: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple, tuple[int, ...]]:
    """(shape, mesh shape, placements, global rank of each mesh coordinate in C order) of the DTensor `value`:
    what `rank_regions` computes every process's region from. No device work, no collectives."""
    mesh = value.device_mesh
    return (tuple(value.shape), tuple(mesh.shape), tuple(value.placements),
            tuple(int(r) for r in mesh.mesh.flatten().tolist()))


@lru_cache(maxsize=1024)
def rank_regions(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple,
                 ranks: tuple[int, ...]) -> tuple[tuple[int, Index], ...]:
    """(global rank, the region of the global array it holds) for every rank of a mesh (`mesh_sharding`): the
    regions of every process, computed (not exchanged) the way each computes its own (`layouts`). Single-replica
    reads plan from them."""
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
