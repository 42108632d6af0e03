"""CPU seconds of this library's item save and restore: for comparing two versions of the code on a machine
whose wall times drift (each version in fresh processes, interleaved ABBA, medians compared).

Each fresh process saves the workload (benchmarks/workloads.py) without fsync `per_process` times after one
warm-up, restoring each save onto the workload's target mesh, and answers with its medians: save and restore wall
and CPU seconds, and the minor page faults of a restore. With ``--set trees=/old/checkout,/new/checkout`` the
processes run each checkout's library (PYTHONPATH), alternating ABBA for `--repeats` rounds; one row per tree.

With ``--set mode=resume`` each fresh process is a resumed run instead: the manager's step (saved once, by this
checkout) evicted from the page cache, the workload's target built, and the manager's restore of the step in
place, once; its footprint (wall and CPU seconds, fresh memory, bytes read). The format is the same for every
checkout compared, so they all resume the same files.

    python -m benchmarks item-cpu [--set workload=small] [--scale 0.1] [--repeats 7] [--set per_process=7]
    python -m benchmarks item-cpu --set trees=/old/checkout,/new/checkout [--set mode=resume]
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
RESUME_KEYS = ("wall_s", "user_s", "system_s", "fresh_bytes", "read_bytes")
STEP = 1


def worker(mode: str, workload: str, scale: str, arg: str) -> dict:
    """In a fresh process, `mode`: ``items`` (`arg` saves and restores), ``save`` (the manager's step into the
    root `arg`) or ``resume`` (one resume of it)."""
    import torch_xla.runtime as xr

    xr.use_spmd()
    return {"items": items, "save": manager_save, "resume": resume}[mode](workload, float(scale), arg)


def _manager(root: str):
    import xla_tensorstore_ckpt as xtc

    return xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(save_interval_steps=1, save_rng=False))


def manager_save(workload: str, scale: float, root: str) -> dict:
    import workloads

    with _manager(root) as manager:
        manager.save(STEP, model=workloads.build_state(workload, scale), force=True)
    return {}


def resume(workload: str, scale: float, root: str) -> dict:
    """The step evicted, the target built, the manager's restore in place (as a resumed run does); measured."""
    import footprint
    import fresh_process
    import torch_xla.core.xla_model as xm
    import workloads

    fresh_process.evict(root)
    target = workloads.build_target(workload, scale)
    xm.wait_device_ops()
    with _manager(root) as manager:
        measures, _ = footprint.measure(lambda: (manager.restore(STEP, model=target, restore_rng=False),
                                                 xm.wait_device_ops()))
    return {key: measures[key] for key in RESUME_KEYS}


def items(workload: str, scale_: float, repeats: str) -> dict:
    """In this process: the medians of `repeats` saves and restores."""
    import torch_xla.core.xla_model as xm
    import workloads

    import xla_tensorstore_ckpt as xtc

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
    """The case `item-cpu`: fresh processes per tree, ABBA; one row per tree of the processes' medians (or, with
    ``mode=resume``, of their resumes)."""
    workload, per_process = settings.option("workload", "small"), settings.option("per_process", 7)
    mode = settings.option("mode", "items")
    trees = settings.option("trees", ()) or (os.path.dirname(HERE),)
    root = os.path.join(settings.workdir, "root")
    if mode == "resume":
        harness.fresh(__file__, "save", workload, settings.scale, root, what=f"the {workload} manager save")

    def one(tree: str, _round: int) -> dict:
        path = os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        arg = root if mode == "resume" else per_process
        return harness.fresh(__file__, mode, workload, settings.scale, arg, env={"PYTHONPATH": path},
                             what=f"the {workload} {mode} of {tree}")

    runs = harness.alternated(trees, settings.repeats, one)
    keys, units = (RESUME_KEYS, {"fresh_bytes": "B", "read_bytes": "B"}) if mode == "resume" else (
        KEYS, {"restore_minor_faults": "faults"})
    rows = [harness.Row(tree, {k: harness.series([r[k] for r in runs[tree]], units.get(k, "s")) for k in keys},
                        workload) for tree in trees]
    what = ("a resume per fresh process (the manager's step evicted, the target built, restored in place once)"
            if mode == "resume" else f"{per_process} saves (no fsync) and restores per fresh process")
    return harness.Result(rows, f"{workload} at scale {settings.scale:g}: {what}, {settings.repeats} processes per "
                                "tree, ABBA; each figure is the median of the processes'", raw={"runs": runs})


if __name__ == "__main__":
    harness.worker_main(worker)
