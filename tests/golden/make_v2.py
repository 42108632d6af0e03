"""Writes a checkpoint root of format version 2 for test_golden.py, in one of two variants:

- ``unchecked`` (tests/golden/v2-unchecked): as this library wrote it before its JSON metadata files carried
  checksums (the writer of commit 86fd0f6). test_golden.py checks that it keeps restoring bit for bit, with
  nothing to verify. Step 1 holds a model (OCDBT), a data loader position, `extra` values with string leaves (so
  `_strings.json`) and the RNG states; step 2 a model in one directory per array.
- ``zstd`` (tests/golden/v2-zstd): zstd-compressed chunks (`SaveOptions(compression="zstd")`), as this library
  wrote them when compression was added. test_golden.py checks that it keeps restoring bit for bit and verifies.
  Step 1 holds a model whose `w` is sharded on a 4x2 mesh into 3x3 chunks, the chunks at its edges padded (OCDBT,
  written by this library's own lanes, zstd level 3, Orbax's default); step 2 a model in one directory per array,
  written by tensorstore at level 9, `b` in one file (zarr's sharding codec).

Each was run once (PJRT_DEVICE=CPU CPU_NUM_DEVICES=8, at the commit that added it). Do not run it again: the point
of a fixture is that it was written by the writer of its time, so that a later change of the writer or the
readers cannot silently drop what was written then.

usage: python tests/golden/make_v2.py unchecked|zstd OUT_DIR
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("unchecked", "zstd")


def model_state(variant: str, step: int) -> dict:
    """Deterministic values (no RNG involved); for ``zstd`` some compressible, some not."""
    if variant == "unchecked":
        return {"w": torch.arange(48, dtype=torch.float32).reshape(8, 6) / (7 + step),
                "b": (torch.arange(5, dtype=torch.float32) - 2.5).to(torch.bfloat16) * step}
    return {"w": torch.arange(60, dtype=torch.float32).reshape(10, 6) / (7 + step),
            "b": (torch.arange(8, dtype=torch.float32) - 2.5).to(torch.bfloat16) * step,
            "counts": torch.arange(4096, dtype=torch.int64) % 5, "scale": torch.tensor(0.5 * step),
            "hashes": torch.arange(512, dtype=torch.int64) * 2654435761 % (1 << 32) + step}  # in a data file


def extra_state() -> dict:
    return {"name": "run-a", "tokens": 1234567, "lr": 0.001, "pair": (1, "two")}


def loader_state(step: int) -> dict:
    return {"position": 60 * step, "epoch": step}


def _write_unchecked(xtc, out: str) -> None:
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, async_save=False, max_to_keep=None)
    torch.manual_seed(31)
    with xtc.CheckpointManager(out, options) as manager:
        manager.save(1, model=model_state("unchecked", 1), extra=extra_state(), data_loader=loader_state(1),
                     metrics={"loss": 0.5})
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, async_save=False, max_to_keep=None,
                                           save_rng=False, save_options=xtc.SaveOptions(use_ocdbt=False))
    with xtc.CheckpointManager(out, options) as manager:
        manager.save(2, model=model_state("unchecked", 2), data_loader=loader_state(2))


def _write_zstd(xtc, out: str) -> None:
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    mesh = xs.Mesh(list(range(8)), (4, 2), ("x", "y"))
    model = model_state("zstd", 1)
    model["w"] = model["w"].to("xla")
    xs.mark_sharding(model["w"], mesh, ("x", "y"))
    torch_xla.sync()
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, async_save=False, max_to_keep=None, save_rng=False,
                                           save_options=xtc.SaveOptions(compression="zstd"))
    with xtc.CheckpointManager(out, options) as manager:
        manager.save(1, model=model, data_loader={"position": 60, "epoch": 1}, metrics={"loss": 0.5})
    model = model_state("zstd", 2)
    model["b"] = xtc.ShardedArray.from_tensor(model["b"], (4,), xtc.ShardedArray.grid((8,), (4,)))
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, async_save=False, max_to_keep=None, save_rng=False,
                                           save_options=xtc.SaveOptions(use_ocdbt=False, compression="zstd",
                                                                        compression_level=9))
    with xtc.CheckpointManager(out, options) as manager:
        manager.save(2, model=model)


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in VARIANTS:
        sys.exit(f"usage: python {sys.argv[0]} {'|'.join(VARIANTS)} OUT_DIR")
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    import xla_tensorstore_ckpt as xtc

    (_write_unchecked if sys.argv[1] == "unchecked" else _write_zstd)(xtc, sys.argv[2])


if __name__ == "__main__":
    main()
