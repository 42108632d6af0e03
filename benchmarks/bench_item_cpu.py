"""CPU seconds of this library's item save and restore: for comparing two versions of the code on a machine
whose wall times drift (each version in fresh processes, interleaved ABBA, medians compared).

Each fresh process saves the workload (benchmarks/workloads.py) without fsync `per_process` times after one
warm-up, restoring each save onto the workload's target mesh, and answers with its medians: save and restore wall
and CPU seconds, and the minor page faults of a restore. With ``--set trees=/old/checkout,/new/checkout`` the
processes run each checkout's library (PYTHONPATH), alternating ABBA for `--repeats` rounds; one row per tree.

    python -m benchmarks item-cpu [--set workload=small] [--scale 0.1] [--repeats 7] [--set per_process=7]
    python -m benchmarks item-cpu --set trees=/old/checkout,/new/checkout
"""

from __future__ import annotations

import gc
import os
import resource
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402

KEYS = ("save_wall", "save_cpu", "restore_wall", "restore_cpu", "restore_minor_faults")


def worker(workload: str, scale: str, repeats: str) -> dict:
    """In this process: the medians of `repeats` saves and restores."""
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    xr.use_spmd()
    import workloads

    import xla_tensorstore_ckpt as xtc

    scale_ = float(scale)
    root = tempfile.mkdtemp(prefix="xtc-item-cpu-")
    try:
        state = workloads.build_state(workload, scale_)
        xtc.save(f"{root}/warm", state)
        # The last restore's tensors live until the next restore's target is built, then are freed before it.
        held = [xtc.restore(f"{root}/warm", workloads.build_target(workload, scale_))]
        out: dict[str, list[float]] = {k: [] for k in KEYS}
        for i in range(int(repeats)):
            path = f"{root}/{i}"
            cpu, wall = time.process_time(), time.perf_counter()
            xtc.save(path, state, options=xtc.SaveOptions(fsync=False))
            out["save_wall"].append(time.perf_counter() - wall)
            out["save_cpu"].append(time.process_time() - cpu)
            target = workloads.build_target(workload, scale_)
            held.clear()
            gc.collect()
            xm.wait_device_ops()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            cpu, wall = time.process_time(), time.perf_counter()
            held.append(xtc.restore(path, target))
            xm.wait_device_ops()
            out["restore_wall"].append(time.perf_counter() - wall)
            out["restore_cpu"].append(time.process_time() - cpu)
            out["restore_minor_faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
            shutil.rmtree(path)
        return {"workload": workload, "scale": scale_, **{k: harness.median(v) for k, v in out.items()}}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(settings: harness.Settings) -> harness.Result:
    """The case `item-cpu`: fresh processes per tree, ABBA; one row per tree of the processes' medians."""
    workload, per_process = settings.option("workload", "small"), settings.option("per_process", 7)
    trees = settings.option("trees", ()) or (os.path.dirname(HERE),)

    def one(tree: str, _round: int) -> dict:
        path = os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return harness.fresh(__file__, workload, settings.scale, per_process, env={"PYTHONPATH": path},
                             what=f"the {workload} saves and restores of {tree}")

    runs = harness.alternated(trees, settings.repeats, one)
    units = {"restore_minor_faults": "faults"}
    rows = [harness.Row(tree, {k: harness.series([r[k] for r in runs[tree]], units.get(k, "s")) for k in KEYS},
                        workload) for tree in trees]
    return harness.Result(rows, f"{workload} at scale {settings.scale:g}: {per_process} saves (no fsync) and "
                                f"restores per fresh process, {settings.repeats} processes per tree, ABBA; each "
                                "figure is the median of the processes' medians", raw={"runs": runs})


if __name__ == "__main__":
    harness.worker_main(worker)
