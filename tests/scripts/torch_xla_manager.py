"""A training run checkpointed by torch_xla's own CheckpointManager (one process, gloo, CPU devices in a 2D mesh):
the source the migration tests resume from through this library.

usage: torch_xla_manager.py ROOT EXPECTED [--fqn] [--devices N]
Trains 8 steps of a 2D-sharded model (a (N/2)x2 mesh of the N CPU devices, 8 unless given: a mesh of 2 keeps
the golden root small) with AdamW and a StepLR schedule; torch_xla's manager saves step 2 with
`save` and steps 4 and 6 with `save_async`. The state saved is ``{"model", "optim", "scheduler", "step"}``; with
--fqn, ``{"model", "optimizer", "lr_scheduler"}`` with the optimizer state keyed by parameter name, as
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` keys it. Writes the model and optimizer state
after step 6 (CPU tensors) to EXPECTED with xtc.save, and prints one JSON line {"losses": {step: loss}}.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
from torch_xla.experimental.distributed_checkpoint import CheckpointManager  # noqa: E402

import xla_tensorstore_ckpt as xtc  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def build(mesh):
    """The model (weights sharded on both mesh axes), its AdamW and StepLR: the test builds the same."""
    torch.manual_seed(0)
    net = Net().to("xla")
    first, second = mesh.axis_names
    xs.mark_sharding(net.a.weight, mesh, (first, second))
    xs.mark_sharding(net.b.weight, mesh, (second, first))
    # Biases sharded over the whole mesh: torch_xla 2.9 drops a partially replicated tensor (the sharding
    # GSPMD gives an unmarked bias) from a one-process checkpoint, see the migration docs.
    xs.mark_sharding(net.a.bias, mesh, ((first, second),))
    xs.mark_sharding(net.b.bias, mesh, ((first, second),))
    torch_xla.sync()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    return net, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def train_step(net, opt, sched, step: int) -> float:
    """One step on the batch of `step` (the same batch whichever process runs it)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 8, generator=g).to("xla")
    loss = net(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    torch_xla.sync()
    return loss.item()


def fqn_keyed(net, optimizer_state: dict) -> dict:
    """The optimizer state keyed by parameter name, as DCP's get_optimizer_state_dict writes it."""
    names = [name for name, _ in net.named_parameters()]
    return {"state": {names[i]: v for i, v in optimizer_state["state"].items()},
            "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in optimizer_state["param_groups"]]}


def main() -> None:
    root, expected_path = sys.argv[1:3]
    fqn = "--fqn" in sys.argv[3:]
    devices = int(sys.argv[sys.argv.index("--devices") + 1]) if "--devices" in sys.argv else 8
    xr.use_spmd()
    dist.init_process_group("gloo")
    mesh = xs.Mesh(np.arange(devices), (devices // 2, 2), ("x", "y"))
    net, opt, sched = build(mesh)
    manager = CheckpointManager(root, save_interval=2, chkpt_on_preemption=False)  # no coordinator on CPU
    losses = {}
    for step in range(1, 9):
        losses[step] = train_step(net, opt, sched, step)
        if step in (2, 4, 6):
            if fqn:
                state = {"model": net.state_dict(), "optimizer": fqn_keyed(net, opt.state_dict()),
                         "lr_scheduler": sched.state_dict()}
            else:
                state = {"model": net.state_dict(), "optim": opt.state_dict(), "scheduler": sched.state_dict(),
                         "step": step}
            (manager.save if step == 2 else manager.save_async)(step, state)
        if step == 6:
            cpu = {"model": {k: v.cpu() for k, v in net.state_dict().items()},
                   "optim": {str(i): {k: v.cpu() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}}
            xtc.save(expected_path, cpu)
    manager.join()
    print(json.dumps({"losses": losses}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
