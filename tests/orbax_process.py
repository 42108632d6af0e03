"""Talking to real Orbax from a torch_xla test process: the Orbax tool (tests/scripts/orbax_tool.py) runs in a JAX
process of its own, and its JSON dumps are turned back into torch values here. Shared by the interop and the
convert tests."""

from __future__ import annotations

import base64
import json
import math
import os

import ml_dtypes
import numpy as np
import torch
from forked import run_forked

from xla_tensorstore_ckpt.core import dtypes

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "orbax_tool.py")


def orbax(*args) -> dict:
    """Run the Orbax tool with `args` in a JAX process of its own (`orbax_all`); its JSON answer."""
    return orbax_all([args], parallel=1)[0]


def orbax_all(calls: list[tuple], parallel: int = 2) -> list[dict]:
    """Run the Orbax tool once per entry of `calls` (its arguments), `parallel` at once, each in a JAX process of
    its own forked from one that imported JAX and Orbax once (tests/forked.py); their JSON answers, in order."""
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS")}
    procs = run_forked(TOOL, [list(map(str, args)) for args in calls], parallel=parallel, env=env, timeout=600)
    for args, proc in zip(calls, procs):
        assert proc.returncode == 0, f"orbax_tool.py {' '.join(map(str, args))}: {proc.stderr[-4000:]}"
    return [json.loads(proc.stdout.strip().splitlines()[-1]) for proc in procs]


def leaf(entry: dict):
    """A leaf of the tool's dump: a CPU tensor, or the Python value."""
    if "value" in entry:
        return entry["value"]
    dtype = np.dtype(getattr(ml_dtypes, entry["dtype"])) if hasattr(ml_dtypes, entry["dtype"]) else \
        np.dtype(entry["dtype"])
    array = np.frombuffer(base64.b64decode(entry["data"]), dtype=dtype).reshape(entry["shape"])
    return dtypes.numpy_to_tensor(array.copy())


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = (torch.as_tensor(x) if not isinstance(x, torch.Tensor) else x for x in (a, b))
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return a == b
