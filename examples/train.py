"""A small decoder-only transformer trained with torch_xla SPMD (FSDP-style 2D sharding), AdamW and a cosine LR
schedule, checkpointed asynchronously with xla_tensorstore_ckpt. Options mirror a trainer's config.

    python examples/train.py --steps 60 --save-steps 10 --checkpoint-dir ./checkpoints
    python examples/train.py --resume-from-checkpoint latest ...      # null | a step | latest
    python examples/train.py --eval-only --mesh 2x2 ...                # restore onto another mesh, evaluate

Needs PJRT_DEVICE=CPU and CPU_NUM_DEVICES (8 by default) on a machine without accelerators. The data is synthetic
(a fixed random Markov chain over a 256-token vocabulary), generated from the batch index: nothing is downloaded.
With --json every step prints one JSON line (the demo parses them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
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

VOCAB = 256


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim, bias=False)
        self.down = torch.nn.Linear(4 * dim, dim, bias=False)
        self.dropout = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(attn.transpose(1, 2).reshape(b, t, d)))
        return x + self.dropout(self.down(torch.nn.functional.gelu(self.up(self.norm2(x)))))


class Decoder(torch.nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.pos = torch.nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def shard(model: Decoder, mesh: xs.Mesh, swap: bool) -> None:
    """FSDP-style 2D sharding: every weight matrix split over both mesh axes (their roles swapped by `swap`,
    to restore onto another partition spec)."""
    a, b = ("fsdp", "tensor") if not swap else ("tensor", "fsdp")
    xs.mark_sharding(model.embed.weight, mesh, (a, b))
    xs.mark_sharding(model.pos, mesh, (None, b))
    xs.mark_sharding(model.head.weight, mesh, (b, a))
    for block in model.blocks:
        xs.mark_sharding(block.qkv.weight, mesh, (b, a))
        xs.mark_sharding(block.proj.weight, mesh, (a, b))
        xs.mark_sharding(block.up.weight, mesh, (b, a))
        xs.mark_sharding(block.down.weight, mesh, (a, b))


def transition_matrix() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    logits = torch.randn(VOCAB, VOCAB, generator=g) * 3
    return torch.softmax(logits, dim=-1)


def batch_at(position: int, batch: int, seq: int, chain: torch.Tensor) -> torch.Tensor:
    """Batch number `position` of the synthetic stream: sequences from a fixed Markov chain."""
    g = torch.Generator().manual_seed(10_000 + position)
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (batch,), generator=g)
    for t in range(seq):
        tokens[:, t + 1] = torch.multinomial(chain[tokens[:, t]], 1, generator=g).squeeze(1)
    return tokens


def cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def parse_resume(text: str) -> int | str | None:
    if text in ("null", "none", "None", ""):
        return None
    return "latest" if text == "latest" else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-dir", default="./checkpoints")
    parser.add_argument("--resume-from-checkpoint", default="latest", help="null | a step | latest")
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--max-to-keep", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--mesh", default="4x2", help="fsdp x tensor, e.g. 4x2 on 8 devices, 2x2 on 4")
    parser.add_argument("--swap-spec", action="store_true", help="shard with the mesh axes' roles swapped")
    parser.add_argument("--eval-only", action="store_true", help="restore the checkpoint and evaluate, no training")
    parser.add_argument("--json", action="store_true", help="one JSON line per event")
    args = parser.parse_args()

    xr.use_spmd()
    devices = xr.global_runtime_device_count()
    fsdp, tensor = (int(x) for x in args.mesh.split("x"))
    if fsdp * tensor != devices:
        raise SystemExit(f"mesh {args.mesh} does not fit {devices} devices")
    mesh = xs.Mesh(np.arange(devices), (fsdp, tensor), ("fsdp", "tensor"))
    xs.set_global_mesh(mesh)

    torch.manual_seed(0)
    model = Decoder(args.dim, args.layers, args.heads, args.seq).to("xla")
    shard(model, mesh, args.swap_spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine(max(1, args.steps // 10), args.steps))
    chain = transition_matrix()
    data = {"position": 0}

    printing = threading.Lock()  # commits are reported from the manager's background thread

    def emit(event: dict, text: str) -> None:
        with printing:
            print(json.dumps(event) if args.json else text, flush=True)

    def committed(step: int) -> None:
        emit({"committed": step}, f"step {step} committed to {args.checkpoint_dir}")

    options = xtc.CheckpointManagerOptions(save_interval_steps=args.save_steps, max_to_keep=args.max_to_keep,
                                           save_on_preemption=True, on_commit=committed)
    with xtc.CheckpointManager(args.checkpoint_dir, options) as manager:
        start = time.perf_counter()
        resumed = manager.restore(parse_resume(args.resume_from_checkpoint), model=model, optimizer=optimizer,
                                  lr_scheduler=scheduler, extra=data)
        if resumed is not None:
            emit({"restored": resumed, "seconds": time.perf_counter() - start},
                 f"restored step {resumed} from {args.checkpoint_dir} in {time.perf_counter() - start:.2f} s")
        first = (resumed or 0) + 1

        def loss_of(tokens: torch.Tensor) -> torch.Tensor:
            tokens = tokens.to("xla")
            xs.mark_sharding(tokens, mesh, ("fsdp", None))
            logits = model(tokens[:, :-1])
            return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

        if args.eval_only:
            model.eval()
            with torch.no_grad():
                value = float(loss_of(batch_at(-1, args.batch, args.seq, chain)).cpu())
            emit({"eval_loss": value, "step": resumed, "devices": devices, "mesh": args.mesh},
                 f"eval loss at step {resumed} on {devices} devices (mesh {args.mesh}): {value:.6f}")
            return

        for step in range(first, args.steps + 1):
            started = time.perf_counter()
            loss = loss_of(batch_at(data["position"], args.batch, args.seq, chain))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            torch_xla.sync()
            data["position"] += 1
            value = float(loss.detach().cpu())
            computed = time.perf_counter()
            saved = manager.save(step, model=model, optimizer=optimizer, lr_scheduler=scheduler, extra=data,
                                 metrics={"loss": value}, force=step == args.steps)  # always save the end
            stall = time.perf_counter() - computed
            emit({"step": step, "loss": value, "step_s": computed - started, "stall_s": stall, "saved": saved},
                 f"step {step:4d}  loss {value:.4f}  step {1000 * (computed - started):6.0f} ms  "
                 f"checkpoint stall {1000 * stall:5.0f} ms{'  saved' if saved else ''}")
            if manager.reached_preemption(step):
                emit({"preempted": step}, f"preempted: step {step} committed, exiting")
                return
        model.eval()
        with torch.no_grad():
            value = float(loss_of(batch_at(-1, args.batch, args.seq, chain)).cpu())
        emit({"eval_loss": value, "step": args.steps, "devices": devices, "mesh": args.mesh},
             f"eval loss at step {args.steps}: {value:.6f}")


if __name__ == "__main__":
    sys.exit(main())
