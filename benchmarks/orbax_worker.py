"""The Orbax contender: orbax-checkpoint with JAX on 8 CPU devices, the same shapes and shardings as the torch
workloads, in its own virtual environment (JAX and torch_xla do not share one). Run by run.py
(`harness.fresh` with that environment's python); answers like worker.py, one JSON line.

usage: orbax_worker.py --worker orbax WORKLOAD SCALE REPEATS DIR FLAGS    (FLAGS as worker.py's; XTC_ORBAX_DEVICES)
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
import types

DEVICES = int(os.environ.get("XTC_ORBAX_DEVICES", "8"))
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import footprint  # noqa: E402
import fresh_process  # noqa: E402
import harness  # noqa: E402
import memory  # noqa: E402

DTYPES = {"torch.float32": jnp.float32, "torch.bfloat16": jnp.bfloat16}


def specs(workload: str, scale: float) -> list:
    """The workload's (name, shape, dtype, saved spec, restore spec), read from workloads.py's output (the
    runner passes it as JSON: this process has no torch)."""
    with open(os.environ["XTC_ORBAX_SPECS"]) as f:
        return json.load(f)


def to_spec(spec):
    if spec is None:
        return P()
    return P(*[tuple(s) if isinstance(s, list) else s for s in spec])


def build(entries, mesh_axes, which: int, zeros: bool):
    mesh = Mesh(np.array(jax.devices()).reshape(mesh_axes[0]), mesh_axes[1])
    rng = np.random.default_rng(0)
    out = {}
    for name, shape, dtype, saved, restored in entries:
        spec = to_spec(saved if which == 0 else restored)
        sharding = NamedSharding(mesh, spec)
        if zeros:
            value = jnp.zeros(shape, DTYPES[dtype])
        else:
            value = jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(DTYPES[dtype])
        out[name.replace("/", "__")] = jax.device_put(value, sharding)
    jax.block_until_ready(out)
    return out


def worker(contender: str, workload: str, scale: str, repeats: str, directory: str, flags: str) -> dict:
    """Orbax (`contender` is ``orbax``) on one workload in this process; its answer."""
    given = set(flags.split(",")) - {""}
    unknown = given - {"keep", "warm_restore", "restore_only", "resume"}
    if contender != "orbax" or unknown:
        raise ValueError(f"the Orbax worker runs the contender orbax with flags keep, warm_restore, restore_only, "
                         f"resume; not {contender!r} with {sorted(unknown)}")
    args = types.SimpleNamespace(workload=workload, scale=float(scale), repeats=int(repeats), dir=directory,
                                 **{flag: flag in given for flag in ("keep", "warm_restore", "restore_only",
                                                                     "resume")})
    return _run(args)


def _run(args: types.SimpleNamespace) -> dict:
    entries = specs(args.workload, args.scale)
    save_mesh = ((4, 2), ("x", "y"))
    restore_mesh = ((2, DEVICES // 2), ("a", "b"))
    root = os.path.join(args.dir, "root")
    manager_options = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=True)
    if args.resume:
        fresh_process.evict(args.dir)
        manager = ocp.CheckpointManager(root, options=manager_options)
        target = build(entries, restore_mesh, 1, zeros=True)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        measures, _ = footprint.measure(lambda: jax.block_until_ready(
            manager.restore(args.repeats, args=ocp.args.StandardRestore(abstract))))
        result = {"contender": "orbax", "workload": args.workload, "restore_s": [measures["wall_s"]],
                  "footprint": measures}
        manager.close()
        return result
    if args.restore_only:
        manager = ocp.CheckpointManager(root, options=manager_options)
        result = {"contender": "orbax", "workload": args.workload, "devices": DEVICES, "restore_s": []}
        for _ in range(args.repeats):
            target = build(entries, restore_mesh, 1, zeros=True)
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
            os.sync()
            seconds, _, restored = memory.measure(lambda abstract=abstract: jax.block_until_ready(
                manager.restore(args.repeats, args=ocp.args.StandardRestore(abstract))))
            result["restore_s"].append(seconds)
            del restored, target
        manager.close()
        shutil.rmtree(args.dir, ignore_errors=True)
        return result

    shutil.rmtree(args.dir, ignore_errors=True)
    state = build(entries, save_mesh, 0, zeros=False)
    nbytes = sum(math.prod(v.shape) * v.dtype.itemsize for v in state.values())
    manager = ocp.CheckpointManager(root, options=manager_options)
    result = {"contender": "orbax", "workload": args.workload, "scale": args.scale, "devices": DEVICES,
              "fsync": True, "state_bytes": nbytes, "distinct_shard_bytes": nbytes, "save_s": [], "blocked_s": [],
              "restore_s": [], "restore_peak_extra_bytes": []}

    def save(step: int) -> float:
        start = time.perf_counter()
        manager.save(step, args=ocp.args.StandardSave(state))
        blocked = time.perf_counter() - start
        manager.wait_until_finished()
        return blocked

    _, peak, _ = memory.measure(lambda: save(0))
    result["save_peak_extra_bytes"] = peak
    step0 = os.path.join(root, "0")
    result["files"] = sum(len(f) for _, _, f in os.walk(step0))
    result["bytes_written"] = sum(os.path.getsize(os.path.join(r, n)) for r, _, fs in os.walk(step0) for n in fs)
    for step in range(1, args.repeats + 1):
        shutil.rmtree(os.path.join(root, str(step - 1)), ignore_errors=True)
        manager.reload()
        os.sync()
        seconds, _, blocked = memory.measure(lambda step=step: save(step))
        result["save_s"].append(seconds)
        result["blocked_s"].append(blocked)
    restored = None
    if args.warm_restore:  # like the first save: not counted
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, build(entries, restore_mesh, 1, zeros=True))
        restored = jax.block_until_ready(manager.restore(args.repeats, args=ocp.args.StandardRestore(abstract)))
    for _ in range(args.repeats):
        target = build(entries, restore_mesh, 1, zeros=True)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        del restored
        os.sync()
        seconds, peak, restored = memory.measure(lambda abstract=abstract: jax.block_until_ready(
            manager.restore(args.repeats, args=ocp.args.StandardRestore(abstract))))
        result["restore_s"].append(seconds)
        result["restore_peak_extra_bytes"].append(peak)
        del target
    keys = list(state)[:: max(1, len(state) // 8)]
    result["restore_exact"] = all(bool(jnp.array_equal(restored[k], state[k])) for k in keys)
    manager.close()
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)
    return result


if __name__ == "__main__":
    harness.worker_main(worker)
