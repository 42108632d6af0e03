"""One process of a job that saves a DCP checkpoint with torch.distributed.checkpoint itself (gloo, CPU): DTensors
sharded over the job (uneven rows, columns, replicated), a plain tensor and values; then says what it saved.

Usage: dcp_save.py DIRECTORY. Prints one JSON line {"rank": r}. No torch_xla."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def expected() -> dict[str, torch.Tensor]:
    """The global values every process saves a part of (the test compares against the same function)."""
    g = torch.Generator().manual_seed(5)
    return {"rows": torch.randn(11, 6, generator=g), "cols": torch.randn(4, 10, generator=g).to(torch.bfloat16),
            "rep": torch.arange(7, dtype=torch.int64), "plain": torch.randn(3, 3, generator=g)}


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    values = expected()
    state = {"model": {"rows": distribute_tensor(values["rows"], mesh, [Shard(0)]),
                       "cols": distribute_tensor(values["cols"], mesh, [Shard(1)]),
                       "rep": distribute_tensor(values["rep"], mesh, [Replicate()])},
             "plain": values["plain"], "step": 12, "lr": [0.5, 0.25]}
    dcp.save(state, checkpoint_id=sys.argv[1])
    dist.barrier()
    print(json.dumps({"rank": dist.get_rank()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
