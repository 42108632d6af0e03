"""Writes tests/golden/v1: a checkpoint root of format version 1, as this library wrote it before format 2.

It was run once (PJRT_DEVICE=CPU CPU_NUM_DEVICES=8, at the commit that added it); test_golden.py checks that it
keeps restoring bit for bit. Do not run it again after the writer's format changes: the point of the fixture
is that it was written by the old writer. Step 1 holds RNG states in the layout of the first releases (one
unsharded state); step 2 in per-process rows.

usage: python tests/golden/make_v1.py OUT_DIR
"""

from __future__ import annotations

import math
import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")

import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def model_state() -> dict:
    """Deterministic values of every kind the format stores (no RNG involved)."""
    return {
        "w": torch.arange(48, dtype=torch.float32).reshape(8, 6) / 7,
        "b": (torch.arange(5, dtype=torch.float32) - 2.5).to(torch.bfloat16),
        "i": torch.arange(6, dtype=torch.int64).reshape(3, 2) * -3,
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "h": torch.arange(4, dtype=torch.float16) / 3,
    }


def extra_state() -> dict:
    return {"position": 17, "name": "run-a", "pair": (1, 2.5), "none": None, "flag": True, "nan": math.nan,
            "inf": -math.inf, "nested": [[], {}, [3, {"k": "v"}]], 7: "integer key", "t": torch.ones(2, 3)}


def optimizer_state() -> dict:
    return {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.full((8, 6), 0.5)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}]}


def legacy_rng() -> dict:
    """The RNG item of the first releases: one state, unsharded."""
    torch.manual_seed(11)
    np.random.seed(12)
    import random
    random.seed(13)
    numpy_state = np.random.get_state(legacy=False)
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": {"bit_generator": numpy_state["bit_generator"],
                      "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.uint32).copy()),
                      "pos": int(numpy_state["state"]["pos"]), "has_gauss": int(numpy_state["has_gauss"]),
                      "gauss": float(numpy_state["gauss"])}}


def main() -> None:
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    import xla_tensorstore_ckpt as xtc

    xr.use_spmd()
    out = sys.argv[1]
    mesh = xs.Mesh(np.arange(8), (4, 2), ("x", "y"))
    xs.set_global_mesh(mesh)  # so that the saved sharding records mesh and partition spec
    state = model_state()
    w = state["w"].to("xla")
    xs.mark_sharding(w, mesh, ("x", "y"))
    torch_xla.sync()
    model = dict(state, w=w)
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, async_save=False, save_rng=False)
    with xtc.CheckpointManager(out, options) as manager:
        manager.save(1, model=model, optimizer=optimizer_state(), extra=extra_state(), metrics={"loss": 0.25})
    xtc.save(os.path.join(out, "1", "rng"), legacy_rng())  # added to step 1 by hand, as the old manager wrote it
    marker_path = os.path.join(out, "1", "_CHECKPOINT_METADATA")
    with open(marker_path) as f:
        marker = f.read()
    with open(marker_path, "w") as f:
        f.write(marker.replace('"extra"\n ]', '"extra",\n  "rng"\n ]'))
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, async_save=False, max_to_keep=None)
    torch.manual_seed(21)
    with xtc.CheckpointManager(out, options) as manager:
        manager.save(2, model=model, extra={"position": 18})


if __name__ == "__main__":
    main()
