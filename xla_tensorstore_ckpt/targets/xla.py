"""The XLA target, and the only module that touches torch_xla: local shard layouts from a tensor's HLO sharding,
fetching shards to the host, building sharded tensors from host shards, and swapping a tensor's device data.

Everything works on lists of tensors so that torch_xla is called once per batch, not once per tensor. None of
these functions compiles or executes an XLA computation (checked by the tests with torch_xla's metrics),
except `materialize`, which runs pending lazy computations the caller already queued. torch_xla (the `[xla]`
extra) is imported on first use (`load`): claiming a value needs only its device type. XLA's sharding kinds
(unsharded, replicated, tiled) are this module's own: a layout tells them by its saved sharding (`_kind`).
"""

from __future__ import annotations

import itertools
import math
import re
import threading
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from ..core.errors import UsageError
from ..core.records import SavedSharding
from ..core.tensor_layout import LocalShard, TensorLayout, full_index
from . import holdings
from .base import ReadJob, host_tensor, whole_size
from .holdings import Holding

NAME = "xla"
DEVICE_BOUND = True
SHARDS_ARE_CHUNKS = True
ASSIGNS_IN_PLACE = True
WHOLE_ON_EVERY_PROCESS = False

_X: Any = None  # torch_xla._XLAC, and torch_xla's SPMD and runtime modules, once `load` imported them
xs: Any = None
xr: Any = None
_DEVICES_RE = re.compile(r"devices=\[([0-9,]+)\]([^ }]*)")
_IOTA_RE = re.compile(r"<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")


def load() -> None:
    """Import torch_xla, once. Raises `UsageError` (naming the extra to install) where it is not installed."""
    global _X, xs, xr
    if xr is not None:
        return
    try:
        import torch_xla
        import torch_xla.distributed.spmd as spmd
        import torch_xla.runtime as runtime
    except ImportError as error:  # the newest stack: torch_xla is an extra
        raise UsageError("XLA tensors, meshes and partition specs need torch_xla, which is not installed: "
                         "pip install 'xla_tensorstore_ckpt[xla]' (torch 2.9 + torch_xla 2.9)") from error
    _X = _X if _X is not None else torch_xla._XLAC
    xs, xr = spmd, runtime


def claims(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "xla"


def unsaveable(value: torch.Tensor) -> str | None:
    if value.layout != torch.strided:
        return f"{value.layout} tensors are not supported; convert to dense first"
    return None


def signatures(values: Sequence[torch.Tensor]) -> list[tuple]:
    """Runs the pending computations of `values` first (`materialize`), so that their shardings and data exist."""
    materialize(values)
    mesh = mesh_key()  # once: it is the same for every tensor
    return [(NAME, tuple(v.shape), v.dtype, spec, v.device, mesh) for v, spec in zip(values, specs(values))]


def _kind(layout: TensorLayout) -> str:
    """XLA's sharding kind of a layout: "unsharded" (no annotation), "replicated" on every device, or "tiled"
    (split into tiles, possibly partially replicated)."""
    if layout.sharding is None:
        return "unsharded"
    return "tiled" if _is_tiled(layout.sharding.hlo) else "replicated"


def fetched_elements(layout: TensorLayout, wanted: Sequence[LocalShard]) -> int:
    """torch_xla fetches every local shard of a tiled tensor, padded."""
    if _kind(layout) == "tiled":
        return math.prod(layout.shard_shape) * len(layout.shards)
    return whole_size(wanted)


def placing_elements(layout: TensorLayout) -> int:
    """A padded shard per local device (a replicated tensor's data once per device), or the whole tensor for an
    unsharded one."""
    if _kind(layout) == "unsharded":
        return math.prod(layout.shape)
    return len(layout.shards) * math.prod(layout.shard_shape)


def build(job: ReadJob, regions: dict, *, release: bool) -> torch.Tensor:
    """`place`s the read regions of each local shard, padded to the shard shape (XLA wants padding)."""
    lay = job.layout
    if _kind(lay) == "unsharded":
        return place(job.reference, lay, [host_tensor(job, lay.shards[0].index, regions)], release_target=release)
    padded: dict[Any, torch.Tensor] = {}
    shards = []
    for shard in lay.shards:
        if shard.index not in padded:
            padded[shard.index] = _pad(job, shard, regions)
        shards.append(padded[shard.index])
    return place(job.reference, lay, shards, release_target=release)


def _pad(job: ReadJob, shard: LocalShard, regions: dict) -> torch.Tensor:
    """The shard's data in a buffer of the padded shard shape (its padding's value is irrelevant)."""
    data = host_tensor(job, shard.index, regions)
    shard_shape = job.layout.shard_shape
    if tuple(data.shape) == shard_shape:
        return data
    out = torch.zeros(shard_shape, dtype=job.dtype)
    out[tuple(slice(0, e) for e in shard.extent)] = data
    return out


def settle(value: torch.Tensor) -> None:
    wait_transferred(value)


def local_memory(value: Any) -> None:
    return None  # device memory: read into host buffers, then placed


def is_global(layout: TensorLayout) -> bool:
    return layout.sharding is not None  # an unsharded tensor is this process's own


def holding(value: Any, layout: TensorLayout, count: int) -> Holding | None:
    """An unsharded or replicated tensor is whole on every process; a tiled one's tiles are held by their
    devices' processes (`device_processes`). None where the device counts do not tell them."""
    if _kind(layout) != "tiled":
        return holdings.everywhere(layout.shape, count)
    processes = device_processes()
    if processes is None or len(processes) != layout.sharding.num_devices:
        return None
    tiles, order, replicas = parse_hlo_sharding(layout.sharding.hlo, len(layout.shape))
    return holdings.tiled_groups(layout.shape, tiles, order, replicas, processes)


def unwrap(tensor: torch.Tensor) -> torch.Tensor:
    """The underlying XLA tensor of an `XLAShardedTensor` wrapper (others unchanged)."""
    load()
    return tensor.global_tensor if isinstance(tensor, xs.XLAShardedTensor) else tensor


def materialize(tensors: Sequence[torch.Tensor]) -> None:
    """Run the pending lazy computations of `tensors` (if any) and wait for executions still in flight (an
    asynchronous `torch_xla.sync()` returns before its results exist), so their device data exists. Blocks."""
    load()
    tensors = [unwrap(t) for t in tensors]
    pending = [t for t, need in zip(tensors, _X._check_tensor_need_materialization(tensors)) if need]
    if pending:
        _X._xla_sync_multi(pending, devices=[], wait=True)
    _X._xla_wait_device_ops(devices=[])


def specs(tensors: Sequence[torch.Tensor]) -> list[str]:
    """The HLO sharding string of each XLA tensor ("" for an unsharded one). No device work."""
    load()
    tensors = [unwrap(t) for t in tensors]
    return list(_X._get_xla_sharding_specs(tensors)) if tensors else []


def mesh_key() -> tuple | None:
    """The global mesh (device ids, shape, axis names), which the saved sharding records; None without one."""
    load()
    mesh = xs.get_global_mesh()
    if mesh is None:
        return None
    return (tuple(int(d) for d in np.asarray(mesh.device_ids).reshape(-1)), tuple(mesh.mesh_shape),
            tuple(mesh.axis_names) if mesh.axis_names else None)


def device_processes() -> tuple[int, ...] | None:
    """The process of each global device, by id: PJRT numbers a job's devices process by process, each process
    holding as many (device d belongs to process d // addressable count). None if the counts do not divide. A
    plan derived from it is checked against the shards each process holds (`writer_plans`)."""
    load()
    return _device_processes(xr.global_runtime_device_count(), xr.addressable_runtime_device_count())


@lru_cache(maxsize=16)
def _device_processes(total: int, local: int) -> tuple[int, ...] | None:
    if not local or total % local:
        return None
    return tuple(d // local for d in range(total))


def layouts(tensors: Sequence[torch.Tensor], signatures: Sequence[tuple] | None = None) -> list[TensorLayout]:
    """The local shard layout of each XLA tensor (no device work, no data transfer); `signatures` (which hold
    their sharding specs) from `signatures` if the caller has them."""
    load()
    tensors = [unwrap(t) for t in tensors]
    hlo = [sig[3] for sig in signatures] if signatures is not None else specs(tensors)
    tiled = [i for i, spec in enumerate(hlo) if _is_tiled(spec)]
    replica_indices = _X._get_local_shard_replica_and_indices([tensors[i] for i in tiled]) if tiled else []
    by_tensor = dict(zip(tiled, replica_indices))
    devices = _X._xla_get_runtime_devices()
    num_devices = xr.global_runtime_device_count()
    mesh = mesh_key() if tiled else None  # once: it is the same for every tensor
    out = []
    for i, (tensor, spec) in enumerate(zip(tensors, hlo)):
        shape = tuple(tensor.shape)
        if i in by_tensor:
            tiles, order, replicas = parse_hlo_sharding(spec, len(shape))
            shard_shape = tuple(-(-n // t) for n, t in zip(shape, tiles))
            shards = tuple(
                LocalShard(pos, devices[pos], tuple((s.start, s.stop) for s in index), replica)
                for pos, (replica, index) in enumerate(by_tensor[i]))
            sharding = _saved_sharding(spec, tiles, order, replicas, num_devices, len(shape), mesh)
            out.append(TensorLayout(shape, NAME, shard_shape, shards, sharding))
        elif spec:
            shards = tuple(LocalShard(pos, dev, full_index(shape), pos) for pos, dev in enumerate(devices))
            sharding = SavedSharding(spec, (1,) * len(shape), num_devices, num_devices)
            out.append(TensorLayout(shape, NAME, shape, shards, sharding))
        else:
            shards = (LocalShard(0, str(tensor.device), full_index(shape), 0),)
            out.append(TensorLayout(shape, NAME, shape, shards))
    return out


def _is_tiled(spec: str) -> bool:
    return bool(spec) and "devices=[" in spec


def fetch(tensors: Sequence[torch.Tensor], tensor_layouts: Sequence[TensorLayout],
          wanted: Sequence[Sequence[LocalShard]], *, copy: bool = True) -> list[list[torch.Tensor]]:
    """Copy the `wanted` shards of each tensor to host memory, without padding (always copies: `copy` is
    moot). One torch_xla call per sharding kind for the whole batch. Blocks until the copies are done."""
    load()
    tensors = [unwrap(t) for t in tensors]
    out: list[list[torch.Tensor]] = [[] for _ in tensors]
    tiled = [i for i, lay in enumerate(tensor_layouts) if _kind(lay) == "tiled" and wanted[i]]
    whole = [i for i, lay in enumerate(tensor_layouts) if _kind(lay) != "tiled" and wanted[i]]
    if tiled:
        for i, shard_list in zip(tiled, _X._get_local_shards([tensors[i] for i in tiled])):
            for shard in wanted[i]:
                data = shard_list[shard.position][0]
                if data.shape != shard.extent:  # padded (views cost microseconds: thousands of small tensors)
                    data = data[tuple(slice(0, e) for e in shard.extent)]
                out[i].append(data)
    if whole:
        for i, data in zip(whole, _X._xla_get_cpu_tensors([tensors[i] for i in whole])):
            out[i].append(data)
    return out


def place(target: torch.Tensor, layout: TensorLayout, shards: Sequence[torch.Tensor], *,
          release_target: bool = False) -> torch.Tensor:
    """A new XLA tensor with `target`'s sharding and device from host `shards` (one per local shard of
    `layout`, padded to `layout.shard_shape`). With `release_target`, `target`'s own device data is dropped
    first (it holds a lazy placeholder until the caller puts the new tensor in its place), so that its memory
    can hold the new one. Transfers data; runs no computation."""
    target = unwrap(target)
    if _kind(layout) == "unsharded":
        if release_target:
            _release(target)
        placed = shards[0].to(target.device)
        # Under SPMD torch_xla defers a new tensor's transfer to the next sync, holding a host copy until then
        # (a `mark_sharding` could still shard it): start it now. A transfer only, no computation.
        _X._xla_sync_multi([placed], devices=[], wait=False)
        return placed
    op_sharding = _X._get_xla_op_sharding(target)
    if release_target:
        _release(target)
    return _X._global_tensor_from_cpu_shards(list(shards), op_sharding, list(layout.shape))


def wait_transferred(tensor: torch.Tensor) -> None:
    """Block until the host-to-device copy of `tensor` (made by `place`) has finished. torch_xla copies the
    host data before it hands it to PJRT, and that copy lives until PJRT's asynchronous transfer completes: a
    restore that keeps placing tensors meanwhile holds the copies of every transfer still queued (on CPU
    devices, 2.4 GiB onto 8 devices under a 256 MiB budget peaked at +290 to +404 MiB that way;
    benchmarks/bench_hf_import.py's files). torch_xla signals only the first shard of a sharded tensor; the
    other shards' copies were queued with it, so at most the transfers PJRT's threads are running can still be
    in flight. Called by restores under a host budget; raises nothing of its own."""
    done = threading.Event()
    _X._on_ready_callback(unwrap(tensor), done.set)
    done.wait()


def _release(tensor: torch.Tensor) -> None:
    """Drop `tensor`'s device data: it holds an uncomputed (lazy) empty tensor instead, which allocates nothing
    unless it is computed."""
    with torch.no_grad():
        _X._replace_xla_tensor(tensor, torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device))


@lru_cache(maxsize=4096)  # a layout and a holding ask for each tensor's; a model has a few shardings
def parse_hlo_sharding(spec: str, rank: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Tiles per tensor dimension, the device order of the tile assignment, and the replication factor of an
    HLO sharding string such as ``{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}``."""
    match = _DEVICES_RE.search(spec)
    if match is None:
        raise ValueError(f"unrecognised sharding {spec!r}")
    dims = tuple(int(d) for d in match.group(1).split(","))
    iota = _IOTA_RE.search(spec)
    if iota is not None:
        reshape = [int(d) for d in iota.group(1).split(",")]
        ids = np.arange(math.prod(reshape)).reshape(reshape)
        if iota.group(2):
            ids = ids.transpose([int(p) for p in iota.group(2).split(",")])
        order = tuple(int(d) for d in ids.reshape(-1))
    else:
        order = tuple(int(d) for d in match.group(2).split(",") if d)
    tiles = dims[:rank]
    return tiles, order, math.prod(dims[rank:])


def _saved_sharding(spec: str, tiles: tuple[int, ...], order: tuple[int, ...], replicas: int,
                    num_devices: int, rank: int, mesh: tuple | None) -> SavedSharding:
    """`mesh`: the global mesh's `mesh_key`."""
    partition_spec = None
    if mesh is not None and len(mesh[0]) == num_devices:
        partition_spec = _match_partition_spec(*mesh, tiles, order, replicas, rank)
    if partition_spec is None:
        return SavedSharding(spec, tiles, replicas, num_devices)
    return SavedSharding(spec, tiles, replicas, num_devices, mesh[1], mesh[2], partition_spec)


@lru_cache(maxsize=4096)
def _match_partition_spec(device_ids: tuple[int, ...], mesh_shape: tuple[int, ...],
                          axis_names: tuple[str, ...] | None, tiles: tuple[int, ...], order: tuple[int, ...],
                          replicas: int, rank: int) -> tuple | None:
    """The partition spec over the global mesh that yields this tile assignment, or None. Tries each tensor
    dimension unsharded, on one mesh axis, or on an ordered pair of axes."""
    axes = range(len(mesh_shape))
    choices: list = [None, *[(a,) for a in axes], *itertools.permutations(axes, 2)]
    mesh = np.array(device_ids).reshape(mesh_shape)
    for candidate in itertools.product(choices, repeat=rank):
        used = [a for c in candidate if c for a in c]
        if len(used) != len(set(used)):
            continue
        cand_tiles = tuple(math.prod(mesh_shape[a] for a in c) if c else 1 for c in candidate)
        if cand_tiles != tiles:
            continue
        rest = [a for a in axes if a not in used]
        if math.prod(mesh_shape[a] for a in rest) != replicas:
            continue
        cand_order = tuple(int(d) for d in mesh.transpose(used + rest).reshape(-1))
        if cand_order == order:
            def name(a: int) -> str | int:
                return axis_names[a] if axis_names else a
            return tuple(None if c is None else (name(c[0]) if len(c) == 1 else tuple(name(a) for a in c))
                         for c in candidate)
    return None


def assign(targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """Swap each target's device data for that of the matching new tensor (same shape, sharding and dtype),
    keeping the target's Python identity (parameters stay the optimizer's). Runs no computation."""
    load()
    with torch.no_grad():
        for target, value in zip(targets, values):
            _X._replace_xla_tensor(unwrap(target), unwrap(value))
