"""Benchmark workloads: state trees on 8 CPU devices, and restore targets on another mesh.

(a) `large`: 1 GiB of 2D-sharded float32 and bfloat16 matrices (mesh 4x2), restored onto mesh 2x4.
(b) `small`: 2,000 tensors of 4 KiB-256 KiB, mixed sharded and replicated, restored onto another mesh.
(c) `model`: a ~200M-parameter decoder's parameters and AdamW moments (about 2.4 GiB), FSDP-sharded;
    restored onto a 2D mesh, and (by the runner) onto 4 devices.
    No tensor is partially replicated: torch_xla's CheckpointManager silently drops such tensors from its
    checkpoints (seen with torch_xla 2.9), which would make the comparison meaningless.
`scale` shrinks every workload for quick runs (0.1 = a tenth of the bytes).
"""

from __future__ import annotations

import math

import numpy as np
import torch

WORKLOADS = ("large", "small", "model")


def _mesh(shape, names):
    import torch_xla.distributed.spmd as xs

    return xs.Mesh(np.arange(int(np.prod(shape))), shape, names)


def _place(cpu: torch.Tensor, mesh, spec) -> torch.Tensor:
    import torch_xla.distributed.spmd as xs

    t = cpu.to("xla")
    if mesh is not None:
        xs.mark_sharding(t, mesh, spec)
    return t


def _large(scale: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    rows = max(8, int(4096 * scale) // 8 * 8)
    specs = [(f"layers.{i}.w_f32", torch.float32) for i in range(6)]
    specs += [(f"layers.{i}.w_bf16", torch.bfloat16) for i in range(4)]
    return [(name, (rows, 8192), dtype, ("x", "y"), ("a", "b")) for name, dtype in specs], g


def _small(scale: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    count = max(20, int(2000 * scale))
    out = []
    for i in range(count):
        nbytes = int(rng.integers(4096, 256 * 1024))
        cols = 64
        rows = max(8, nbytes // (4 * cols) // 8 * 8)
        kind = i % 4
        if kind == 0:  # sharded over the whole mesh, like an FSDP weight shard
            out.append((f"p{i}.weight", (rows, cols), torch.float32, (("x", "y"), None), (None, ("a", "b"))))
        elif kind == 1:  # 2D sharded
            out.append((f"p{i}.moment", (rows, cols), torch.float32, ("x", "y"), ("b", "a")))
        elif kind == 2:  # replicated bias / norm
            out.append((f"p{i}.bias", (rows * cols,), torch.float32, None, None))
        else:  # bf16, replicated on every device
            out.append((f"p{i}.norm", (rows, cols), torch.bfloat16, (None, None), ("a", "b")))
    return out, g


def _model(scale: float, seed: int):
    """A ~200M-parameter decoder (d=1024, 12 layers, 32k vocabulary) and its AdamW moments, FSDP-sharded over
    the first mesh axis; restored onto a 2D spec. `scale` shrinks the width."""
    g = torch.Generator().manual_seed(seed)
    d = max(64, int(1024 * math.sqrt(scale)) // 64 * 64)
    vocab = max(512, int(32000 * math.sqrt(scale)) // 64 * 64)
    shapes = [("embed", (vocab, d))]
    for i in range(12):
        shapes += [(f"layers.{i}.attn.qkv", (3 * d, d)), (f"layers.{i}.attn.out", (d, d)),
                   (f"layers.{i}.mlp.up", (4 * d, d)), (f"layers.{i}.mlp.down", (d, 4 * d)),
                   (f"layers.{i}.norm", (d,))]
    shapes.append(("head", (vocab, d)))
    out = []
    for prefix in ("params", "exp_avg", "exp_avg_sq"):
        for name, shape in shapes:
            saved = (("x", "y"),) + (None,) * (len(shape) - 1)
            restored = ("a", "b") if len(shape) == 2 else (None,)
            out.append((f"{prefix}/{name}", shape, torch.float32, saved, restored))
    return out, g


def specs(workload: str, scale: float, seed: int = 0):
    """(name, shape, dtype, saved spec, restore spec) for every tensor of the workload, and a generator."""
    return {"large": _large, "small": _small, "model": _model}[workload](scale, seed)


def build_state(workload: str, scale: float) -> dict[str, torch.Tensor]:
    """The state to save: sharded on mesh 4x2 ('x', 'y'); specs of None mean unsharded/replicated."""
    entries, g = specs(workload, scale)
    mesh = _mesh((4, 2), ("x", "y"))
    state = {}
    for name, shape, dtype, spec, _ in entries:
        cpu = torch.randn(shape, generator=g).to(dtype)
        state[name] = _place(cpu, mesh if spec is not None else None, spec)
        del cpu
    import torch_xla

    torch_xla.sync()
    return state


def restore_mesh():
    """The mesh restores reshard onto: 2 x n/2 over every device, axes ('a', 'b')."""
    import torch_xla.runtime as xr

    n = xr.global_runtime_device_count()
    return _mesh((2, n // 2), ("a", "b"))


def build_target(workload: str, scale: float) -> dict[str, torch.Tensor]:
    """Zeros of the same shapes sharded on another mesh with other specs: a resharding restore (mesh 2x4 on
    8 devices, 2x2 on 4; `restore_mesh`)."""
    entries, _ = specs(workload, scale)
    mesh = restore_mesh()
    target = {}
    for name, shape, dtype, _, spec in entries:
        target[name] = _place(torch.zeros(shape, dtype=dtype), mesh if spec is not None else None, spec)
    import torch_xla

    torch_xla.sync()
    return target


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def spec_bytes(workload: str, scale: float) -> int:
    entries, _ = specs(workload, scale)
    return sum(math.prod(shape) * torch.empty(0, dtype=dtype).element_size() for _, shape, dtype, _, _ in entries)


def specs_json(workload: str, scale: float) -> list:
    """The workload's specs as JSON (for the Orbax worker, which has no torch)."""
    entries, _ = specs(workload, scale)
    return [[name, list(shape), str(dtype), spec, restore] for name, shape, dtype, spec, restore in entries]
