"""The trees the Orbax interop tests exchange, in numpy only: imported by the JAX side (scripts/orbax_tool.py) and
by the torch side (test_orbax_interop.py), so both know the exact values without sharing a process."""

from __future__ import annotations

import ml_dtypes
import numpy as np


def tree() -> dict:
    """An item with every kind of leaf Orbax writes."""
    return {
        "params": {
            "w": (np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 3),
            "b": (np.arange(8, dtype=np.float32) - 4).astype(ml_dtypes.bfloat16),
            "layers": [{"k": np.arange(12, dtype=np.int32).reshape(4, 3) * -2},
                       {"k": np.arange(12, dtype=np.int32).reshape(4, 3) * 5}],
        },
        "step": 7,
        "lr": 0.25,
        "flag": True,
        "name": "run-a",
        "nothing": None,
        "empty": {},
    }


def specs() -> dict:
    """Partition specs on a (4, 2) mesh with axes ("x", "y"), by leaf (None: replicated; scalars: ignored)."""
    return {"params": {"w": ("x", "y"), "b": ("y",), "layers": [{"k": None}, {"k": ("x", None)}]},
            "step": None, "lr": None, "flag": None, "name": None, "nothing": None, "empty": {}}


def model(step: int) -> dict:
    return {"embed": np.arange(32 * 16, dtype=np.float32).reshape(32, 16) * step,
            "head": (np.arange(16 * 4, dtype=np.float32).reshape(16, 4) + step).astype(ml_dtypes.bfloat16)}


def model_specs() -> dict:
    return {"embed": ("x", "y"), "head": (None, "y")}


def large_shapes(gib: float) -> dict:
    """Names and shapes of float32 arrays of 64 MiB (smaller if `gib` is small) adding up to `gib`."""
    rows = max(8, int(gib * (1 << 30) / 4 / 8192 / 16) // 8 * 8)
    count = max(1, round(gib * (1 << 30) / (rows * 8192 * 4)))
    return {f"w{i}": (rows, 8192) for i in range(count)}


def large(gib: float) -> dict:
    return {name: np.full(shape, int(name[1:]), dtype=np.float32) + np.arange(shape[1], dtype=np.float32)
            for name, shape in large_shapes(gib).items()}


def large_specs(gib: float) -> dict:
    return {name: ("x", "y") for name in large_shapes(gib)}
