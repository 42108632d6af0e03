"""One process of a job saving and loading through torch.distributed.checkpoint with this library's storage
writer and reader (gloo on 127.0.0.1; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment). Never
imports torch_xla.

usage: dcp_storage_job.py save ROOT        -> an FSDP2 model + AdamW trained two steps, its state (get_state_dict)
                                              saved with dcp.save through DCPStorageWriter to ROOT/ours, with
                                              dcp.async_save to ROOT/async, with FileSystemWriter to ROOT/fs;
                                              then an overwrite of ROOT/ours that fails on the last rank
       dcp_storage_job.py load ROOT ORBAX  -> a fresh FSDP2 model + AdamW loads ROOT/ours, ROOT/async and
                                              ROOT/converted through DCPStorageReader (set_state_dict); plain
                                              tensors load ROOT/ours with single-replica reads; DTensors sharded
                                              by rows load the Orbax item ORBAX
Prints JSON lines: {"rank": r, ...}: digests of the full state (keys as DCP flattens them), the param groups.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dtensor_job import batch_at, digest, emit, fsdp_model, leaves  # noqa: E402

import xla_tensorstore_ckpt as xtc  # noqa: E402


def trained(world: int):
    model, optimizer, _ = fsdp_model(world, "fsdp")
    for position in range(2):
        tokens = batch_at(position)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def state(model, optimizer) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def report(rank: int, tree: dict, **fields) -> None:
    flat = dict(leaves(tree))
    emit(rank, digests={k: digest(v) for k, v in flat.items() if isinstance(v, torch.Tensor)},
         param_groups=[{k: v for k, v in group.items() if k != "params"} for group in tree["optim"]["param_groups"]],
         **fields)


def save(root: str, rank: int, world: int) -> None:
    model, optimizer = trained(world)
    tree = state(model, optimizer)
    dcp.save(tree, storage_writer=xtc.DCPStorageWriter(f"{root}/ours"))
    dcp.async_save(tree, storage_writer=xtc.DCPStorageWriter(f"{root}/async")).result()
    dcp.save(tree, storage_writer=dcp.FileSystemWriter(f"{root}/fs"))
    try:
        dcp.save(tree, storage_writer=xtc.DCPStorageWriter(f"{root}/ours", overwrite=True),
                 planner=FailingPlanner(world - 1))
        failed = None
    except dcp.api.CheckpointException as exc:
        failed = sorted(exc.failures)
    report(rank, tree, failed=failed)


class FailingPlanner(dcp.DefaultSavePlanner):
    """DCP's default planner, except that rank `rank` fails resolving its data (a write that fails)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.failing = rank

    def resolve_data(self, write_item):
        if dist.get_rank() == self.failing:
            raise OSError(f"injected failure writing {write_item.index.fqn}")
        return super().resolve_data(write_item)


def load(root: str, orbax_item: str, rank: int, world: int) -> None:
    for name in ("ours", "async", "converted"):
        model, optimizer, _ = fsdp_model(world, "fsdp")
        tree = state(model, optimizer)
        dcp.load(tree, storage_reader=xtc.DCPStorageReader(f"{root}/{name}"))
        set_state_dict(model, optimizer, model_state_dict=tree["model"], optim_state_dict=tree["optim"])
        report(rank, state(model, optimizer), source=name)
    # Plain tensors are whole on every rank: with single-replica reads each stored region is read by one rank.
    stored = xtc.metadata(f"{root}/ours")["model"]
    plain = {"model": {k: torch.zeros(v.shape, dtype=v.torch_dtype) for k, v in stored.items()}}
    reader = xtc.DCPStorageReader(f"{root}/ours", options=xtc.RestoreOptions(single_replica_reads=True))
    dcp.load(plain, storage_reader=reader)
    emit(rank, source="replicated", digests={f"model.{k}": digest(v) for k, v in plain["model"].items()},
         read_bytes=reader.read_bytes)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))

    def placed(shape, dtype):
        rows = shape[0] if shape else 0
        return distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, [Shard(0) if rows > 1 else Replicate()])

    target = {"params": {"w": placed((16, 8), torch.float32), "b": placed((8,), torch.bfloat16),
                         "layers": [{"k": placed((4, 3), torch.int32)}, {"k": placed((4, 3), torch.int32)}]},
              "step": 0, "lr": 0.0, "name": ""}
    dcp.load(target, storage_reader=xtc.DCPStorageReader(orbax_item))
    flat = dict(leaves(target))
    emit(rank, source="orbax", digests={k: digest(v) if isinstance(v, torch.Tensor) else v for k, v in flat.items()},
         sharded=sorted(k for k, v in flat.items() if isinstance(v, torch.Tensor) and v.placements[0].is_shard()))


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "save":
        save(root, rank, world)
    elif mode == "load":
        load(root, sys.argv[3], rank, world)
    else:
        raise SystemExit(f"unknown mode {mode}")
    emit(rank, torch_xla="torch_xla" in sys.modules)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
