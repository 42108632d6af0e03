"""Saves that write their chunk data around the page cache (O_DIRECT, `SaveOptions(direct_io=True)`, the default)
or through it (tensorstore's file writes), side by side (issue 36, item 2: "same question for saves ... measure
both ways and keep what wins").

Each workload (benchmarks/workloads.py: `large` 1 GiB and `model` 2.42 GiB, sharded on 8 CPU devices, mesh 4x2) is
built in a fresh process that then times one `xtc.save` (fsync on, as by default) into a new directory; the
contenders alternate ABBA for `--repeats` rounds, and the saved directory is removed before the next process
starts. Each reports (benchmarks/footprint.py) wall time, user and system CPU, the fresh memory the save touched
(peak resident growth plus page cache growth) and the bytes it wrote; medians per byte saved are printed. The
first save of each contender is restored in its process and compared bit for bit.

    python benchmarks/bench_direct_writes.py [--scale 1.0] [--repeats 7] [--workloads large,model]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fresh_process import run_json  # noqa: E402

MODES = ("direct", "buffered")
ENV = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "TF_CPP_MIN_LOG_LEVEL": "3"}


def worker(mode: str, workload: str, scale: float, path: str, check: bool) -> dict:
    import torch
    import torch_xla.runtime as xr

    xr.use_spmd()
    import footprint
    import workloads

    import xla_tensorstore_ckpt as xtc

    state = workloads.build_state(workload, scale)
    options = xtc.SaveOptions(direct_io=mode == "direct")
    measures, _ = footprint.measure(lambda: xtc.save(path, state, options=options))
    measures["bytes"] = workloads.state_bytes(state)
    if check:
        restored = xtc.restore(path)
        measures["bit_exact"] = all(torch.equal(restored[k].cpu(), v.cpu()) for k, v in state.items())
    return measures


def _run(*args: str) -> dict:
    return run_json([sys.executable, os.path.abspath(__file__), "--worker", *args], dict(os.environ, **ENV),
                    f"the {args[0]} save of {args[1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--workloads", default="large,model")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import json

        mode, workload, scale, path, check = args.worker
        print(json.dumps(worker(mode, workload, float(scale), path, check == "1")))
        return
    for workload in args.workloads.split(","):
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        with tempfile.TemporaryDirectory(prefix="xtc-direct-writes-") as workdir:
            path = os.path.join(workdir, "item")
            for i in range(args.repeats):
                for mode in MODES if i % 2 == 0 else reversed(MODES):
                    runs[mode].append(_run(mode, workload, str(args.scale), path, "1" if i < 2 else "0"))
                    shutil.rmtree(path)
        nbytes = runs[MODES[0]][0]["bytes"]
        exact = {m: all(r.get("bit_exact", True) for r in runs[m]) for m in MODES}
        print(f"save of {workload} ({nbytes / 2**30:.2f} GiB, 8 CPU devices, fsync), fresh processes, medians of "
              f"{args.repeats} ABBA; bit-exact restores: {exact}")
        for mode in MODES:
            def med(key, mode=mode, runs=runs):
                return statistics.median(r[key] for r in runs[mode])

            print(f"  {mode:8} wall {med('wall_s'):.3f} s  CPU {med('user_s'):.2f}+{med('system_s'):.2f} s  fresh "
                  f"{med('fresh_bytes') / nbytes:.2f} B/B (page cache {med('page_cache_growth_bytes') / nbytes:.2f})"
                  f"  written {med('written_bytes') / nbytes:.2f} B/B")
        walls = {m: statistics.median(r["wall_s"] for r in runs[m]) for m in MODES}
        print(f"  direct is {walls['buffered'] / walls['direct']:.2f}x as fast as buffered")


if __name__ == "__main__":
    main()
