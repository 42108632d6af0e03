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


def slashed() -> dict:
    """An item whose key holds a ``/``, which Orbax stores as nested directories (``a/b``) and restores."""
    return {"a/b": np.arange(24, dtype=np.float32).reshape(8, 3) - 1.5, "c": {"d": np.arange(4, dtype=np.int32)}}


def slashed_specs() -> dict:
    return {"a/b": ("x", None), "c": {"d": None}}


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
    """Values that do not compress (as trained weights do not): random mantissas, exponents of [1, 2)."""
    return {name: large_block(int(name[1:]), shape, shape) for name, shape in large_shapes(gib).items()}


def large_block(index: int, shape: tuple, block: tuple) -> np.ndarray:
    """The top-left `block` of array `index` of `large`: a hash of the element's position."""
    rows, cols = np.meshgrid(np.arange(block[0], dtype=np.uint64), np.arange(block[1], dtype=np.uint64),
                             indexing="ij")
    position = rows * np.uint64(shape[1]) + cols + np.uint64(index) * np.uint64(1 << 40)
    bits = (position * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(41)  # 23 well-mixed bits
    return (bits.astype(np.uint32) | np.uint32(0x3F800000)).view(np.float32)


def large_specs(gib: float) -> dict:
    return {name: ("x", "y") for name in large_shapes(gib)}
