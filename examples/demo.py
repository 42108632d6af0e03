"""The main job (until the training demo lands): save SPMD-sharded state from one mesh, restore it onto another
mesh, onto CPU, and read it back with plain zarr. Prints what it did at each step.

run: make demo   (PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 .venv/bin/python examples/demo.py [--checkpoint-dir DIR])
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
import zarr  # noqa: E402

import xla_tensorstore_ckpt as xtc  # noqa: E402


def section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 70 - len(title)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint-dir", default="./checkpoints/demo")
    args = parser.parse_args()

    xr.use_spmd()
    n = xr.global_runtime_device_count()
    section(f"state on {n} devices, mesh (4, 2) ('data', 'model')")
    mesh = xs.Mesh(np.arange(n), (n // 2, 2), ("data", "model"))
    xs.set_global_mesh(mesh)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).to("xla")
    xs.mark_sharding(model[0].weight, mesh, ("data", "model"))
    xs.mark_sharding(model[2].weight, mesh, ("model", "data"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        loss = model(torch.randn(16, 256).to("xla")).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 2}
    reference = {k: v.cpu() for k, v in model.state_dict().items()}
    for key, value in model.state_dict().items():
        spec = torch_xla._XLAC._get_xla_sharding_spec(value) or "unsharded"
        print(f"  model/{key:10} {tuple(value.shape)!s:12} {spec}")

    section(f"save to {args.checkpoint_dir}")
    shutil.rmtree(args.checkpoint_dir, ignore_errors=True)
    start = time.perf_counter()
    xtc.save(args.checkpoint_dir, state)
    print(f"  saved in {time.perf_counter() - start:.3f} s")
    info = xtc.metadata(args.checkpoint_dir)
    for key, meta in info["model"].items():
        sharding = meta.sharding.describe() if meta.sharding else "unsharded"
        print(f"  model/{key:10} chunks {meta.chunk_shape!s:10} saved with {sharding}")

    section("restore onto another mesh: (2, 4) with transposed partition specs")
    other = xs.Mesh(np.arange(n), (2, n // 2), ("x", "y"))
    target = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    torch_xla.sync()
    xs.mark_sharding(target["0.weight"], other, ("y", "x"))
    xs.mark_sharding(target["2.weight"], other, (None, "y"))
    start = time.perf_counter()
    restored = xtc.restore(args.checkpoint_dir, {"model": target}, strict=False)["model"]
    print(f"  restored in {time.perf_counter() - start:.3f} s")
    for key, value in restored.items():
        same = torch.equal(value.cpu(), reference[key])
        spec = torch_xla._XLAC._get_xla_sharding_spec(value) or "unsharded"
        print(f"  model/{key:10} now {spec:40} equal to saved: {same}")
        assert same

    section("restore onto CPU, without a target")
    cpu = xtc.restore(args.checkpoint_dir)
    print(f"  step {cpu['step']}, optimizer state keys {sorted(cpu['optimizer']['state'][0])}, "
          f"betas {cpu['optimizer']['param_groups'][0]['betas']}")
    assert all(torch.equal(cpu["model"][k], reference[k]) for k in reference)

    section("read one array with plain zarr-python")
    z = zarr.open_array(os.path.join(args.checkpoint_dir, "model", "0.weight"), mode="r")
    print(f"  zarr: shape {z.shape}, chunks {z.chunks}, dtype {z.dtype}; [0, :4] = {np.round(z[0, :4], 4)}")
    print("\nall checks passed")


if __name__ == "__main__":
    main()
