"""Multi-host saves (issue: multi-host): save throughput of the same global state from 1 process and from 4
processes on this machine (gloo on 127.0.0.1, each process holding a disjoint part of the shards; large tensors
that every process holds whole are shared among the writers), and the bytes each process writes.

usage: python benchmarks/bench_multihost.py [--gib 1.0] [--repeats 3] [--processes 1,4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jobs  # noqa: E402

CHILD = r"""
import json, os, sys, time, torch
import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import arrays
rank, world = int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", "1"))
root, gib, repeats = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
rows = max(64, int(gib * 2**30 / 4 / 8192 / 8) // 64 * 64)  # 8 tiled tensors + 1 replicated of 1/8 each
state = {}
for i in range(8):
    g = torch.Generator().manual_seed(i)
    full = torch.randn(rows, 8192, generator=g)
    grid = xtc.ShardedArray.grid(full.shape, (rows // 8, 4096))
    state[f"tiled{i}"] = xtc.ShardedArray.from_tensor(full, (rows // 8, 4096), grid[rank::world])
g = torch.Generator().manual_seed(99)
state["replicated"] = torch.randn(rows, 8192, generator=g)  # held whole by every process
written = {"bytes": 0}
real = arrays.write
def counting(store, loc, chunks, **kwargs):
    written["bytes"] += sum(d.nbytes for _, d in chunks)
    return real(store, loc, chunks, **kwargs)
arrays.write = counting
xtc.save(f"{root}/warm", state)  # warm-up: lazy initialisation, first-touch memory
times = []
for r in range(repeats):
    written["bytes"] = 0
    start = time.perf_counter()
    xtc.save(f"{root}/{r}", state)  # returns once every process's chunks and the manifest are durable
    times.append(time.perf_counter() - start)
print(json.dumps({"rank": rank, "seconds": times, "bytes": written["bytes"],
                             "state_bytes": 9 * rows * 8192 * 4}), flush=True)
"""


def run(processes: int, gib: float, repeats: int, root: str) -> list[dict]:
    return jobs.run_job(["-c", CHILD, root, str(gib), str(repeats)], processes)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--processes", default="1,4")
    args = parser.parse_args()
    summary = {}
    with tempfile.TemporaryDirectory(prefix="xtc-bench-multihost-") as tmp:
        for n in (int(x) for x in args.processes.split(",")):
            results = run(n, args.gib, args.repeats, os.path.join(tmp, str(n)))
            # A save ends when the last process returns (they finish together: the commit is collective).
            seconds = [max(r["seconds"][i] for r in results) for i in range(args.repeats)]
            nbytes = results[0]["state_bytes"]
            per_process = [r["bytes"] for r in results]
            summary[n] = statistics.median(seconds)
            print(f"{n} process(es): save {statistics.median(seconds):.3f} s (runs {[round(s, 3) for s in seconds]}), "
                  f"{nbytes / 2**30 / statistics.median(seconds):.2f} GiB/s; bytes written per process "
                  f"{[round(b / 2**20, 1) for b in per_process]} MiB, busiest / average = "
                  f"{max(per_process) / (sum(per_process) / len(per_process)):.3f} (goal <= 1.25)")
    if 1 in summary and len(summary) > 1:
        for n, seconds in summary.items():
            if n != 1:
                print(f"throughput with {n} processes / with 1 process: {summary[1] / seconds:.2f} (goal >= 1)")


if __name__ == "__main__":
    main()
