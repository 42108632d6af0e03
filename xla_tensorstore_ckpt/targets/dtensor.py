"""The DTensor target: this process's local tensor, one shard of a global array at its index (replicated where
the mesh has `Replicate()` dimensions), saved and restored like a `ShardedArray`'s shards, on any device (CPU,
CUDA, a PrivateUse1 device such as TorchTPU's "tpu"). Its geometry is computed by `dtensors`; this module is the
one that touches DTensor objects. torch_xla is never imported here, so a process that trains with DTensors alone
saves and restores without it. No collectives.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from ..core.records import SavedSharding
from ..core.tensor_layout import LocalShard, TensorLayout
from . import dtensors, holdings
from .base import ReadJob, copy_host, host_clones, host_tensor, whole_size
from .holdings import Holding

NAME = "dtensor"
DEVICE_BOUND = False  # its local tensor is built from host data and moved to its device by torch
SHARDS_ARE_CHUNKS = False  # shards of a mesh may differ in size: the layout's grid is what they are made of
ASSIGNS_IN_PLACE = True
WHOLE_ON_EVERY_PROCESS = False


def claims(value: Any) -> bool:
    """Whether `value` is a DTensor. Cheap, and imports nothing: DTensors exist only once their module is."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def unsaveable(value: Any) -> str | None:
    """Why the DTensor `value` cannot be saved as it is, or None: a `Partial` placement holds unreduced
    summands, not the array (the caller names the key)."""
    partial = [repr(p) for p in value.placements if p.is_partial()]
    if partial:
        return (f"its placements {dtensors.placement_names(value.placements)} include {partial[0]}: it holds "
                "partial sums, not the array; reduce it first "
                "(e.g. `value.redistribute(placements=[Replicate()] * mesh.ndim)`)")
    return None


def layouts(values: Sequence[Any], signatures: Sequence[tuple] | None = None) -> list[TensorLayout]:
    """The layout of each DTensor: the one shard this process holds (its local tensor, at its index in the
    global array; none if this process is not in the mesh), on the coarsest chunk grid that every shard of the
    mesh is made of whole chunks of (the shard shape for even and `torch.chunk`-uneven splits), with the saved
    sharding (mesh shape, dimension names, placements). No device work."""
    out = []
    for value in values:
        mesh = value.device_mesh
        coordinate = mesh.get_coordinate()
        geometry = dtensors.geometry(tuple(value.shape), tuple(mesh.shape), tuple(value.placements),
                             None if coordinate is None else tuple(coordinate))
        chunks, index, replica, sharding = geometry
        device = str(value._local_tensor.device)
        names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
        if names is not None:
            sharding = SavedSharding(sharding.hlo, sharding.tiles, sharding.replicas, sharding.num_devices,
                                     sharding.mesh_shape, names, _named(sharding.partition_spec, names),
                                     sharding.placements)
        shards = () if index is None else (LocalShard(0, device, index, replica),)
        out.append(TensorLayout(tuple(value.shape), NAME, chunks, shards, sharding))
    return out


def signatures(values: Sequence[Any]) -> list[tuple]:
    """What each DTensor's layout depends on besides its shape and dtype (mesh, coordinate, placements, device).
    Each mesh is described once per call: building ``mesh.mesh`` costs ~0.2 ms, at thousands of leaves per step
    a cost every asynchronous save blocks on."""
    meshes: dict[int, tuple] = {}
    out = []
    for value in values:
        mesh = value.device_mesh
        described = meshes.get(id(mesh))
        if described is None:
            coordinate = mesh.get_coordinate()  # a list in torch 2.9: made a tuple, the signature is hashable
            described = meshes[id(mesh)] = (tuple(mesh.shape), tuple(mesh.mesh.reshape(-1).tolist()),
                                            mesh.mesh_dim_names, None if coordinate is None else tuple(coordinate))
        out.append((NAME, tuple(value.shape), value.dtype, tuple(value.placements), *described,
                    value._local_tensor.device))
    return out


def host_copies(values: Sequence[Any], *, copy: bool) -> list[torch.Tensor]:
    """Each DTensor's local tensor on the host, detached, for a batch of a save: device-agnostic (CPU, CUDA, a
    PrivateUse1 device such as TorchTPU's "tpu"). Local tensors on an accelerator are copied with non-blocking
    copies, into pinned host memory when `copy` (an asynchronous save keeps the copies while training goes on)
    and the accelerator pins, then each device is synchronized once for the batch, not once per tensor. CPU
    local tensors are views unless `copy` (a caller that returns before writing them must not see the training
    loop change them). Blocks until the copies are done."""
    out: list[Any] = []
    on_cpu: list[int] = []  # copied in one batch (`host_clones`)
    devices: dict[str, torch.device] = {}
    with torch.no_grad():
        for value in values:
            local = value._local_tensor.detach()  # what to_local() returns, without its autograd function
            if local.device.type == "cpu":
                on_cpu.append(len(out))
                out.append(local)
                continue
            host = torch.empty(local.shape, dtype=local.dtype, pin_memory=copy and _pins(local.device))
            out.append(host.copy_(local, non_blocking=True))
            devices.setdefault(str(local.device), local.device)
    if copy:
        for i, clone in zip(on_cpu, host_clones([out[i] for i in on_cpu])):
            out[i] = clone
    for device in devices.values():
        _synchronize(device)
    return out


def fetch(values: Sequence[Any], layouts: Sequence[TensorLayout], wanted: Sequence[Sequence[LocalShard]], *,
          copy: bool) -> list[list[torch.Tensor]]:
    """The local tensor of each DTensor with a wanted shard (its only one) on the host (`host_copies`)."""
    some = [i for i, shards in enumerate(wanted) if shards]
    out: list[list[torch.Tensor]] = [[] for _ in values]
    for i, data in zip(some, host_copies([values[i] for i in some], copy=copy)):
        out[i] = [data]
    return out


def fetched_elements(layout: TensorLayout, wanted: Sequence[LocalShard]) -> int:
    return whole_size(wanted)


def placing_elements(layout: TensorLayout) -> int:
    return 0


def build(job: ReadJob, regions: dict, *, release: bool) -> Any:
    """A DTensor on the reference's mesh and placements, of its global shape and stride, whose local tensor is
    this process's region, moved to the reference's local device. No communication."""
    from torch.distributed.tensor import DTensor

    lay, reference = job.layout, job.reference
    data = host_tensor(job, lay.shards[0].index if lay.shards else ((0, 0),) * len(lay.shape), regions)
    device = reference._local_tensor.device
    return DTensor.from_local(data if data.device == device else data.to(device), reference.device_mesh,
                              reference.placements, run_check=False, shape=reference.shape,
                              stride=reference.stride())


def settle(value: Any) -> None:
    return None


def local_memory(value: Any) -> torch.Tensor:
    """The DTensor's local tensor itself (its memory, not a copy): what a restore in place reads into or copies
    into, so that the DTensor keeps its identity (an FSDP2 parameter stays its optimizer's and its module's)."""
    return value._local_tensor


def assign(targets: Sequence[Any], values: Sequence[Any]) -> None:
    """Copy each restored DTensor's local data into its target's (same mesh and placements)."""
    for target, value in zip(targets, values):
        copy_host(target._local_tensor, value._local_tensor)


def is_global(layout: TensorLayout) -> bool:
    return True


def mesh_sharding(value: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple, tuple[int, ...]]:
    """(shape, mesh shape, placements, global rank of each mesh coordinate in C order) of the DTensor `value`:
    what `dtensors.rank_regions` computes every process's region from. No device work, no collectives."""
    mesh = value.device_mesh
    return (tuple(value.shape), tuple(mesh.shape), tuple(value.placements),
            tuple(int(r) for r in mesh.mesh.flatten().tolist()))


def holding(value: Any, layout: TensorLayout, count: int) -> Holding:
    return holdings.dtensor_groups(*mesh_sharding(value), count)


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


def _named(spec: tuple | None, names: tuple[str, ...]) -> tuple | None:
    if spec is None:
        return None
    return tuple(None if s is None else names[s] if isinstance(s, int) else tuple(names[a] for a in s) for s in spec)
