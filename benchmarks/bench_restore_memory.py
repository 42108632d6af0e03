"""The restore plan's peak host memory (`xtc.plan_restore(...).peak_host_bytes`) against the peak a restore then
takes, on the benchmark workloads (benchmarks/workloads.py), each in a fresh process with 8 devices.

Per workload: save it, restore it once (lazy initialisation, buffers a reader keeps), then `--repeats` times
onto a fresh target each: plan the restore, restore it, and measure the process's resident memory at its peak
during the restore (Linux's high-water mark, reset before) above the resident memory after it, with the freed
memory returned to the OS (``malloc_trim``) before and after. That is what the restore held beyond its results:
on CPU devices the devices' buffers are host memory too, and they (with what torch_xla keeps beside them) are
what is left. Reported: the median measured and predicted peak, and their ratio (issue 33: within 10 %).

    python benchmarks/bench_restore_memory.py [--scale 1.0] [--repeats 7] [--workloads large,small,model]
        [--max-host-mib N]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fresh_process import run_json  # noqa: E402


def measure(workload: str, scale: float, repeats: int, budget: int | None, workdir: str) -> dict:
    """In this process (8 CPU devices): the measured and predicted peaks of `repeats` restores."""
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    xr.use_spmd()
    import memory
    import workloads

    import xla_tensorstore_ckpt as xtc
    from xla_tensorstore_ckpt import host_memory

    def settled() -> int:
        gc.collect()
        xm.wait_device_ops()
        host_memory.return_free_memory()
        return host_memory.resident_bytes()

    path = os.path.join(workdir, workload)
    xtc.save(path, workloads.build_state(workload, scale))
    options = xtc.RestoreOptions(max_host_bytes=budget)
    restored = xtc.restore(path, workloads.build_target(workload, scale), options=options)
    measured, predicted = [], []
    for _ in range(repeats):
        target = workloads.build_target(workload, scale)
        del restored
        settled()
        predicted.append(xtc.plan_restore(path, target, options=options).peak_host_bytes)
        before = host_memory.resident_bytes()
        _, above_before, restored = memory.measure(lambda target=target: xtc.restore(path, target, options=options))
        measured.append(before + above_before - settled())
    return {"workload": workload, "scale": scale, "max_host_bytes": budget, "measured": measured,
            "predicted": predicted}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--workloads", default="large,small,model")
    parser.add_argument("--max-host-mib", type=int, default=None, help="RestoreOptions.max_host_bytes, in MiB")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a workload, measured in this process
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    budget = args.max_host_mib << 20 if args.max_host_mib else None
    if args.one:
        print(json.dumps(measure(args.one, args.scale, args.repeats, budget, args.dir)), flush=True)
        return
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8", TF_CPP_MIN_LOG_LEVEL="3")
    rows = []
    for workload in args.workloads.split(","):
        with tempfile.TemporaryDirectory() as workdir:
            cmd = [sys.executable, __file__, "--one", workload, "--dir", workdir, "--scale", str(args.scale),
                   "--repeats", str(args.repeats)] + (["--max-host-mib", str(args.max_host_mib)] if budget else [])
            rows.append(run_json(cmd, env, workload))
    for row in rows:
        measured, predicted = statistics.median(row["measured"]), statistics.median(row["predicted"])
        row["ratio"] = measured / predicted if predicted else None
        print(f"{row['workload']:>6} scale {row['scale']:g}: measured {measured / 2**20:8.1f} MiB, predicted "
              f"{predicted / 2**20:8.1f} MiB, measured/predicted {row['ratio']:.3f}", file=sys.stderr)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
