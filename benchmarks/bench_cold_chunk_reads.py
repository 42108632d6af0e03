"""Cold restores of this library's own chunks read around the page cache (O_DIRECT, the default) or through it,
side by side (issue 36, item 2: "measure both ways and keep what wins").

The `large` workload (benchmarks/workloads.py) is saved once on 8 CPU devices (mesh 4x2); then each mode restores
it onto mesh 2x4 in a fresh process, after the files are evicted from the page cache, `--repeats` rounds ABBA:

- direct: as the library reads (`arrays/local_reads.py`: O_DIRECT through each reading thread's aligned window
  where a RWF_NOWAIT probe finds the bytes uncached);
- buffered: the same reads with the probe answering "cached", so every read goes through the page cache.

Each reports (benchmarks/footprint.py) the restore call's wall time, user and system CPU, and the fresh memory it
touched (peak resident growth plus page cache growth); medians are printed per byte restored.

    python benchmarks/bench_cold_chunk_reads.py [--scale 1.0] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fresh_process import evict, run_json  # noqa: E402

MODES = ("direct", "buffered")
ENV = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "TF_CPP_MIN_LOG_LEVEL": "3"}


def worker(mode: str, scale: float, path: str) -> dict:
    import torch_xla.runtime as xr

    xr.use_spmd()
    import footprint
    import workloads

    import xla_tensorstore_ckpt as xtc
    from xla_tensorstore_ckpt.arrays import local_reads

    if mode == "save":
        state = workloads.build_state("large", scale)
        xtc.save(path, state)
        return {"bytes": workloads.state_bytes(state)}
    if mode == "buffered":
        local_reads._cached = lambda *_: True
    target = workloads.build_target("large", scale)
    measures, _ = footprint.measure(lambda: xtc.restore(path, target))
    return measures


def _run(*args: str) -> dict:
    return run_json([sys.executable, os.path.abspath(__file__), "--worker", *args], dict(os.environ, **ENV),
                    f"the {args[0]} process")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import json

        mode, scale, path = args.worker
        print(json.dumps(worker(mode, float(scale), path)))
        return
    with tempfile.TemporaryDirectory(prefix="xtc-cold-chunks-") as workdir:
        path = os.path.join(workdir, "item")
        nbytes = _run("save", str(args.scale), path)["bytes"]
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for i in range(args.repeats):
            for mode in MODES if i % 2 == 0 else reversed(MODES):
                evict(path)
                runs[mode].append(_run(mode, str(args.scale), path))
    print(f"cold restore of {nbytes / 2**30:.2f} GiB (mesh 4x2 saved, 2x4 restored, fresh processes, evicted), "
          f"medians of {args.repeats} ABBA:")
    for mode in MODES:
        def med(key, mode=mode):
            return statistics.median(r[key] for r in runs[mode])

        print(f"  {mode:8} wall {med('wall_s'):.3f} s  CPU {med('user_s'):.2f}+{med('system_s'):.2f} s  fresh "
              f"{med('fresh_bytes') / nbytes:.2f} B/B (page cache {med('page_cache_growth_bytes') / nbytes:.2f})")


if __name__ == "__main__":
    main()
