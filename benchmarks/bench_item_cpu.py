"""CPU seconds of this library's item save and restore in one process: for comparing two versions of the code
on a machine whose wall times drift (run each version in fresh processes, interleaved, and compare medians).

Saves the workload (benchmarks/workloads.py) without fsync `--repeats` times after one warm-up, restoring each
save onto the workload's target mesh; prints one JSON line of medians: save and restore wall and CPU seconds,
and the minor page faults of a restore.

    python benchmarks/bench_item_cpu.py small --scale 0.1
    # two versions, interleaved:
    for i in 1 2 3 4 5 6 7 8; do for tree in /old/checkout /new/checkout; do
        PYTHONPATH=$tree python benchmarks/bench_item_cpu.py small --scale 0.1; done; done
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", choices=("large", "small", "model"))
    parser.add_argument("--scale", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    xr.use_spmd()
    import workloads

    import xla_tensorstore_ckpt as xtc

    root = tempfile.mkdtemp(prefix="xtc-item-cpu-")
    try:
        state = workloads.build_state(args.workload, args.scale)
        xtc.save(f"{root}/warm", state)
        # The last restore's tensors live until the next restore's target is built, then are freed before it.
        held = [xtc.restore(f"{root}/warm", workloads.build_target(args.workload, args.scale))]
        out: dict[str, list[float]] = {"save_wall": [], "save_cpu": [], "restore_wall": [], "restore_cpu": [],
                                       "restore_minor_faults": []}
        for i in range(args.repeats):
            path = f"{root}/{i}"
            cpu, wall = time.process_time(), time.perf_counter()
            xtc.save(path, state, options=xtc.SaveOptions(fsync=False))
            out["save_wall"].append(time.perf_counter() - wall)
            out["save_cpu"].append(time.process_time() - cpu)
            target = workloads.build_target(args.workload, args.scale)
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
        print(json.dumps({"workload": args.workload, "scale": args.scale,
                          **{k: statistics.median(v) for k, v in out.items()}}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
