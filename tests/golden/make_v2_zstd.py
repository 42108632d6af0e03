"""Writes tests/golden/v2-zstd: a checkpoint root of format version 2 with zstd-compressed chunks
(`SaveOptions(compression="zstd")`), as this library wrote them when compression was added.

It was run once (PJRT_DEVICE=CPU CPU_NUM_DEVICES=8, at the commit that added it); test_golden.py checks that it
keeps restoring bit for bit and verifies, so that a later change of the writer or the readers cannot silently
drop what was written then. Step 1 holds a model whose `w` is sharded on a 4x2 mesh into 3x3 chunks, the
chunks at its edges padded (OCDBT, written by this library's own lanes, zstd level 3, Orbax's default); step 2
a model in one directory per array, written by tensorstore at level 9, `b` in one file (zarr's sharding codec).

usage: python tests/golden/make_v2_zstd.py OUT_DIR
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def model_state(step: int) -> dict:
    """Deterministic values (no RNG involved), some compressible, some not."""
    return {"w": torch.arange(60, dtype=torch.float32).reshape(10, 6) / (7 + step),
            "b": (torch.arange(8, dtype=torch.float32) - 2.5).to(torch.bfloat16) * step,
            "counts": torch.arange(4096, dtype=torch.int64) % 5, "scale": torch.tensor(0.5 * step),
            "hashes": torch.arange(512, dtype=torch.int64) * 2654435761 % (1 << 32) + step}  # in a data file


def main() -> None:
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    import xla_tensorstore_ckpt as xtc

    xr.use_spmd()

    out = sys.argv[1]
    mesh = xs.Mesh(list(range(8)), (4, 2), ("x", "y"))
    model = model_state(1)
    model["w"] = model["w"].to("xla")
    xs.mark_sharding(model["w"], mesh, ("x", "y"))
    torch_xla.sync()
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, async_save=False, max_to_keep=None, save_rng=False,
                                           save_options=xtc.SaveOptions(compression="zstd"))
    with xtc.CheckpointManager(out, options) as manager:
        manager.save(1, model=model, data_loader={"position": 60, "epoch": 1}, metrics={"loss": 0.5})
    model = model_state(2)
    model["b"] = xtc.ShardedArray.from_tensor(model["b"], (4,), xtc.ShardedArray.grid((8,), (4,)))
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, async_save=False, max_to_keep=None, save_rng=False,
                                           save_options=xtc.SaveOptions(use_ocdbt=False, compression="zstd",
                                                                        compression_level=9))
    with xtc.CheckpointManager(out, options) as manager:
        manager.save(2, model=model)


if __name__ == "__main__":
    main()
