"""Incremental and delta steps against full steps (issue 65, item 5): bytes written per step, save wall and CPU
seconds, and restore time, on two real training workloads at small scale (CPU tensors, no torch_xla):

(a) LoRA: a decoder (frozen) with rank-8 adapters on its fused q/k/v projections, AdamW on the adapters only;
    each step saves model + optimizer. Goal: an incremental step writes <= 2 % of a full step's bytes.
(b) RL: a bf16 decoder trained at a small learning rate (AdamW, bf16 parameters, as RL post-training runs);
    the fraction of weight elements that changed is measured at every step; each step saves the model.
    Goal: a delta step writes <= 10 % of a full step's bytes, and a restore through 4 deltas costs <= 1.5x a
    full restore (chains 0/1/4/8 are measured).

Each variant (full, incremental, incremental + delta) runs the same training from the same seed with a
CheckpointManager of its own (synchronous saves, fsync on: the library's defaults otherwise); figures are medians
over the steps after the first (>= 7 with the default --steps). Restores read the step into new CPU tensors
(`xtc.restore`), medians of --repeats, with the page cache warm, then cold (every step of the run evicted from it
before each restore: a restart on a fresh host). Local disk only.

    python benchmarks/bench_incremental.py [--steps 9] [--repeats 7] [--rl-dim 512] [--dir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

import xla_tensorstore_ckpt as xtc

VOCAB = 256
RL_LR = 5e-6  # RL post-training learning rates are 1e-6 to 1e-5


class Block(torch.nn.Module):
    def __init__(self, dim: int, rank: int | None):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.up, self.down = torch.nn.Linear(dim, 4 * dim, bias=False), torch.nn.Linear(4 * dim, dim, bias=False)
        self.lora = None
        if rank is not None:  # LoRA on the q/k/v projection: B starts at zero, as LoRA does
            self.lora = torch.nn.ParameterDict({
                "qkv_a": torch.nn.Parameter(torch.randn(rank, dim) * 0.01),
                "qkv_b": torch.nn.Parameter(torch.zeros(3 * dim, rank))})

    def _lin(self, layer: torch.nn.Linear, name: str, x: torch.Tensor) -> torch.Tensor:
        out = layer(x)
        if self.lora is not None and f"{name}_a" in self.lora:
            out = out + (x @ self.lora[f"{name}_a"].T) @ self.lora[f"{name}_b"].T
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self._lin(self.qkv, "qkv", self.norm1(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, 4, d // 4).transpose(1, 2) for y in (q, k, v))
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self._lin(self.proj, "proj", attn.transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class Decoder(torch.nn.Module):
    def __init__(self, dim: int, layers: int, rank: int | None = None):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, rank) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (8, 65), generator=torch.Generator().manual_seed(step))


def _train_step(model: Decoder, optimizer: torch.optim.Optimizer, step: int) -> None:
    tokens = _tokens(step)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _evict(root: str) -> None:
    """Drop every file under `root` from the page cache (clean pages: the saves synced them), as on a fresh host."""
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _restore_seconds(path: str, repeats: int, root: str) -> dict:
    """Medians of `repeats` restores of `path` into new tensors, page cache warm, and as many with every step
    under `root` evicted first (cold: the restore of a restart on a fresh host); wall and CPU seconds (this
    process, all its threads: under a loaded machine CPU is the steadier)."""
    out = {}
    for mode in ("warm", "cold"):
        walls, cpus = [], []
        for _ in range(repeats):
            if mode == "cold":
                _evict(root)
            begun, cpu = time.perf_counter(), time.process_time()
            xtc.restore(path)
            walls.append(time.perf_counter() - begun)
            cpus.append(time.process_time() - cpu)
        out[mode] = {"wall": statistics.median(walls), "cpu": statistics.median(cpus)}
    return out


def run(workload: str, variant: str, root: str, steps: int, rl_dim: int = 512) -> dict:
    """Train `steps` steps, saving every step; per-step bytes, wall and CPU seconds (and for RL the fraction
    of weight elements changed)."""
    torch.manual_seed(0)
    if workload == "lora":
        model = Decoder(512, 4, rank=8)
        for name, p in model.named_parameters():
            p.requires_grad_("lora" in name)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    else:
        model = Decoder(rl_dim, 4).to(torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=RL_LR, weight_decay=0.0)
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=None, async_save=False,
                                           save_rng=False, incremental=variant != "full", delta=variant == "delta",
                                           max_chain=8)
    rows = []
    with xtc.CheckpointManager(root, options) as mgr:
        for step in range(1, steps + 1):
            before = {k: v.clone() for k, v in model.state_dict().items()} if workload == "rl" else None
            _train_step(model, optimizer, step)
            changed = None
            if before is not None:
                after = model.state_dict()
                changed = sum(int((before[k].view(torch.int16) != after[k].view(torch.int16)).sum())
                              for k in before) / sum(v.numel() for v in before.values())
            objects = {"model": model} if workload == "rl" else {"model": model, "optimizer": optimizer}
            wall, cpu = time.perf_counter(), time.process_time()
            mgr.save(step, **objects)
            rows.append({"step": step, "bytes": _dir_bytes(os.path.join(root, str(step))),
                         "save_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                         "changed": changed})
    return {"rows": rows}


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--rl-dim", type=int, default=512, help="the RL decoder's width (512: 26 MB of bf16)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="bench-incr-", dir=args.dir)
    results = {}
    try:
        for workload, variants in (("lora", ("full", "incremental")), ("rl", ("full", "incremental", "delta"))):
            for variant in variants:
                root = os.path.join(base, workload, variant)
                out = run(workload, variant, root, args.steps, args.rl_dim)
                if workload == "rl":  # restore cost by chain length: step k+1 of the delta run has chain k
                    out["restore_s"] = {chain: _restore_seconds(os.path.join(root, str(chain + 1), "model"),
                                                                args.repeats, root)
                                        for chain in (0, 1, 4, 8) if chain + 1 <= args.steps}
                else:
                    out["restore_s"] = {"last": _restore_seconds(os.path.join(root, str(args.steps), "model"),
                                                                 args.repeats, root)}
                results[f"{workload}/{variant}"] = out
                shutil.rmtree(root)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    _print(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def _print(results: dict) -> None:
    print(f"{'workload/variant':22} {'bytes/step':>12} {'vs full':>8} {'save s':>8} {'CPU s':>7} "
          f"{'changed':>8}  restore (chain: warm wall s, CPU s, CPU x full; cold wall s, x full)")
    for name, out in results.items():
        workload = name.split("/")[0]
        full = results[f"{workload}/full"]
        rows = out["rows"]
        changed = [r["changed"] for r in rows[1:] if r["changed"] is not None]
        restore = ", ".join(
            f"{k}: {v['warm']['wall']:.4f} {v['warm']['cpu']:.4f} ({v['warm']['cpu'] / f[k]['warm']['cpu']:.2f}x); "
            f"{v['cold']['wall']:.4f} ({v['cold']['wall'] / f[k]['cold']['wall']:.2f}x)"
            for k, v in out["restore_s"].items() for f in [full["restore_s"]])
        share = _median(rows, "bytes") / _median(full["rows"], "bytes")
        print(f"{name:22} {_median(rows, 'bytes'):>12,.0f} {share:>8.4f} "
              f"{_median(rows, 'save_s'):>8.4f} {_median(rows, 'cpu_s'):>7.4f} "
              f"{(f'{statistics.median(changed):.4f}' if changed else '-'):>8}  {restore}")


if __name__ == "__main__":
    main()
