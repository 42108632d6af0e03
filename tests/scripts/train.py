"""A small SPMD training run with checkpointing, used by the manager tests (and as a crash victim).

usage: train.py --root DIR --steps N [--save-every K] [--stop-at S] [--resume latest|none|STEP]
                [--mesh 4x2|2x4] [--out FILE] [--async]
Prints one JSON line per step ({"step": s, "loss": float}) and, with --out, saves the final model weights and
losses as a CPU item for the parent to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

import xla_tensorstore_ckpt as xtc  # noqa: E402

VOCAB, DIM, SEQ, BATCH = 64, 32, 8, 8


class TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.up = torch.nn.Linear(DIM, 4 * DIM)
        self.down = torch.nn.Linear(4 * DIM, DIM)
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.dropout = torch.nn.Dropout(0.1)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.dropout(self.down(torch.nn.functional.gelu(self.up(h))))
        return self.head(self.norm(h))


def batch_at(position: int) -> torch.Tensor:
    """Deterministic synthetic data: the batch depends only on its position in the stream."""
    g = torch.Generator().manual_seed(1000 + position)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def shard_model(model: torch.nn.Module, mesh: xs.Mesh) -> None:
    """FSDP-style 2D sharding: weights split over both mesh axes."""
    xs.mark_sharding(model.embed.weight, mesh, ("fsdp", "model"))
    xs.mark_sharding(model.up.weight, mesh, ("model", "fsdp"))
    xs.mark_sharding(model.down.weight, mesh, ("fsdp", "model"))
    xs.mark_sharding(model.head.weight, mesh, ("model", "fsdp"))
    xs.mark_sharding(model.up.bias, mesh, ("model",))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, default=None)
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--resume", default="none")
    parser.add_argument("--mesh", default="4x2")
    parser.add_argument("--out", default=None)
    parser.add_argument("--async", dest="async_save", action="store_true")
    parser.add_argument("--max-to-keep", type=int, default=None)
    parser.add_argument("--save-on-preemption", action="store_true")
    parser.add_argument("--step-delay", type=float, default=0.0)
    args = parser.parse_args()

    xr.use_spmd()
    n = xr.global_runtime_device_count()
    rows, cols = (int(x) for x in args.mesh.split("x"))
    mesh = xs.Mesh(np.arange(n), (rows, cols), ("fsdp", "model"))
    xs.set_global_mesh(mesh)

    torch.manual_seed(0)
    model = TinyModel().to("xla")
    shard_model(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3) * 0.9 ** s)
    torch_xla.sync()

    options = xtc.CheckpointManagerOptions(save_interval_steps=args.save_every, max_to_keep=args.max_to_keep,
                                           async_save=args.async_save, save_on_preemption=args.save_on_preemption)
    data = {"position": 0}
    start = 0
    with xtc.CheckpointManager(args.root, options) as manager:
        resume = None if args.resume == "none" else ("latest" if args.resume == "latest" else int(args.resume))
        restored = manager.restore(resume, model=model, optimizer=optimizer, lr_scheduler=scheduler, extra=data)
        if restored is not None:
            start = restored
            print(json.dumps({"restored": restored}), flush=True)
        losses = []
        for step in range(start + 1, args.steps + 1):
            batch = batch_at(data["position"]).to("xla")
            xs.mark_sharding(batch, mesh, ("fsdp", None))
            logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            torch_xla.sync()
            data["position"] += 1
            value = float(loss.cpu())
            losses.append(value)
            print(json.dumps({"step": step, "loss": value}), flush=True)
            manager.save(step, model=model, optimizer=optimizer, lr_scheduler=scheduler, extra=data,
                         metrics={"loss": value})
            if manager.reached_preemption(step):
                print(json.dumps({"preempted": step}), flush=True)
                os._exit(0)
            time.sleep(args.step_delay)
            if args.stop_at is not None and step == args.stop_at:
                manager.wait_until_finished()
                print(json.dumps({"stopped": step}), flush=True)
                sys.stdout.flush()
                os._exit(0)  # like a preempted job: no cleanup
    if args.out:
        weights = {k: v.cpu() for k, v in model.state_dict().items()}
        xtc.save(args.out, {"weights": weights, "losses": losses, "start": start}, overwrite=True)


if __name__ == "__main__":
    main()
