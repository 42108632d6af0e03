"""The torch_xla SPMD job of the chaos harness (tests/chaos.py --xla): one process, 8 CPU devices, a model sharded
on a 4x2 mesh with AdamW and a scheduler, the manager with asynchronous saves, a local tier and the persistent tier
(behind the harness's fault proxy). A fresh interpreter each run: torch_xla does not survive a fork.

usage: chaos_xla_job.py run PLAN         -> resume, train PLAN["steps"] steps saving each, exit; PLAN["trigger"]
                                            kills this process (SIGKILL) at the nth event of a kind
       chaos_xla_job.py reference STEPS  -> the same training without any checkpoint: the digests after each step
Prints the JSON lines tests/scripts/chaos_job.py prints.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

import xla_tensorstore_ckpt as xtc  # noqa: E402


def emit(**fields) -> None:
    print(json.dumps(fields, default=str), flush=True)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def build():
    mesh = xs.Mesh(np.arange(8), (4, 2), ("x", "y"))
    torch.manual_seed(0)
    net = Net().to("xla")
    xs.mark_sharding(net.a.weight, mesh, ("x", "y"))
    xs.mark_sharding(net.b.weight, mesh, ("y", "x"))
    torch_xla.sync()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    return net, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def train_step(net, optimizer, scheduler, data: dict) -> None:
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1000 + data["position"])).to("xla")
    net(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    torch_xla.sync()
    data["position"] += 1


def digest(net, optimizer, scheduler, data: dict) -> str:
    h = hashlib.sha256()
    for name, value in net.state_dict().items():
        h.update(name.encode() + value.cpu().numpy().tobytes())
    for index, entries in sorted(optimizer.state_dict()["state"].items()):
        for name, value in sorted(entries.items()):
            h.update(f"{index}.{name}".encode() + value.cpu().numpy().tobytes())
    h.update(json.dumps(scheduler.state_dict(), sort_keys=True, default=str).encode())
    h.update(str(data["position"]).encode() + torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()[:20]


def run(plan: dict) -> None:
    trigger, seen = plan.get("trigger"), [0]

    def listen(event) -> None:
        emit(event=event.kind, tier=event.tier, step=event.step, details=event.details)
        if trigger and event.kind == trigger["kind"] and trigger.get("tier") in (None, event.tier):
            seen[0] += 1
            if seen[0] == trigger["nth"]:
                emit(fault="kill", at=event.kind, tier=event.tier, step=event.step)
                os.kill(os.getpid(), signal.SIGKILL)

    net, optimizer, scheduler = build()
    data = {"position": 0}
    options = xtc.CheckpointManagerOptions(
        save_interval_steps=2, max_to_keep=2, local_directory=os.path.join(plan["local_base"], "host0"),
        local_save_interval_steps=1, local_max_to_keep=2, async_save=True, listeners=(listen,))
    try:
        manager = xtc.CheckpointManager(plan["root"], options)
        start = manager.restore("latest", model=net, optimizer=optimizer, lr_scheduler=scheduler, extra=data)
        emit(resumed=start, digest=digest(net, optimizer, scheduler, data))
        for step in range((start or 0) + 1, (start or 0) + 1 + plan["steps"]):
            train_step(net, optimizer, scheduler, data)
            emit(step=step, digest=digest(net, optimizer, scheduler, data))
            manager.save(step, model=net, optimizer=optimizer, lr_scheduler=scheduler, extra=data)
        manager.close()
    except xtc.CheckpointError as exc:
        emit(error=str(exc), type=type(exc).__name__, library=True)
        os._exit(2)
    emit(done=True)
    os._exit(0)


def reference(steps: int) -> None:
    net, optimizer, scheduler = build()
    data = {"position": 0}
    digests = [digest(net, optimizer, scheduler, data)]
    for _ in range(steps):
        train_step(net, optimizer, scheduler, data)
        digests.append(digest(net, optimizer, scheduler, data))
    emit(rank=0, digests=digests)
    os._exit(0)


def main() -> None:
    xr.use_spmd()
    if sys.argv[1] == "run":
        with open(sys.argv[2]) as f:
            run(json.load(f))
    else:
        reference(int(sys.argv[2]))


if __name__ == "__main__":
    main()
