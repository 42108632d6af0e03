"""Multi-host saves (issue: multi-host; issue 36): the same global state saved from 1 process and from 4
processes on this machine (gloo on 127.0.0.1, each process holding a disjoint part of the shards; the large
tensor that every process holds whole is shared among the writers).

Each round runs every configuration as a fresh job, the configurations alternating ABBA (1, 4 / 4, 1 / ...), for
`--repeats` rounds (at least 7 for a measurement). In a job every process builds its part of the state, saves it
once to warm up (lazy initialisation, first-touch memory), then measures one `xtc.save` (returns once every
process's chunks and the manifest are durable) with benchmarks/footprint.py, between barriers. Reported, medians
over the rounds: wall time (the slowest process) and throughput; user and system CPU seconds, resident growth
and bytes written to / read from storage, summed over the processes and per process; the fresh memory touched
(summed resident growth + page cache growth; page cache growth is machine-wide: the largest any process saw).
Per byte of state (B/B) means per byte of the global state. The split of the writes: busiest / average bytes
written per process (goal <= 1.25).

usage: python benchmarks/bench_multihost.py [--gib 1.0] [--repeats 7] [--processes 1,4]
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
import jobs  # noqa: E402

CHILD = r"""
import json, os, sys, torch
root, gib, here = sys.argv[1], float(sys.argv[2]), sys.argv[3]
sys.path.insert(0, here)
import footprint
import xla_tensorstore_ckpt as xtc
rank, world = int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    torch.distributed.init_process_group("gloo")
rows = max(64, int(gib * 2**30 / 4 / 8192 / 8) // 64 * 64)  # 8 tiled tensors + 1 replicated of 1/8 each
state = {}
for i in range(8):
    g = torch.Generator().manual_seed(i)
    full = torch.randn(rows, 8192, generator=g)
    grid = xtc.ShardedArray.grid(full.shape, (rows // 8, 4096))
    state[f"tiled{i}"] = xtc.ShardedArray.from_tensor(full, (rows // 8, 4096), grid[rank::world])
g = torch.Generator().manual_seed(99)
state["replicated"] = torch.randn(rows, 8192, generator=g)  # held whole by every process
xtc.save(f"{root}/warm", state)  # warm-up: lazy initialisation, first-touch memory
if world > 1:
    torch.distributed.barrier()
measures, _ = footprint.measure(lambda: xtc.save(f"{root}/measured", state))
if world > 1:
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
print(json.dumps({"rank": rank, **measures, "state_bytes": 9 * rows * 8192 * 4}), flush=True)
"""

SUMMED = ("user_s", "system_s", "rss_growth_bytes", "written_bytes", "read_bytes")


def run(processes: int, gib: float, root: str) -> list[dict]:
    """One fresh job of `processes` processes: each process's measures of the measured save, in rank order."""
    return jobs.run_job(["-c", CHILD, root, str(gib), HERE], processes)


def aggregate(per_process: list[dict]) -> dict:
    """One job's save over its processes: the slowest process's wall time, summed CPU, resident growth and
    bytes, the machine-wide page cache growth (the largest any process saw) and fresh memory (their sum)."""
    out = {key: sum(r[key] for r in per_process) for key in SUMMED}
    out["wall_s"] = max(r["wall_s"] for r in per_process)
    out["page_cache_growth_bytes"] = max(r["page_cache_growth_bytes"] for r in per_process)
    out["fresh_bytes"] = out["rss_growth_bytes"] + out["page_cache_growth_bytes"]
    return out


def report(n: int, jobs_of_n: list[list[dict]], nbytes: int) -> float:
    """Print one configuration's medians over the rounds; return its median wall time."""
    rounds = [aggregate(job) for job in jobs_of_n]

    def med(key: str, runs: list[dict] = rounds) -> float:
        return statistics.median(r[key] for r in runs)

    wall = med("wall_s")
    print(f"  {n:>9}  {wall:6.3f}  {nbytes / 2**30 / wall:5.2f}  {med('user_s') + med('system_s'):5.2f} "
          f"({med('user_s'):.2f}+{med('system_s'):.2f})  {med('fresh_bytes') / nbytes:9.2f} "
          f"({med('rss_growth_bytes') / nbytes:.2f}+{med('page_cache_growth_bytes') / nbytes:.2f})  "
          f"{med('written_bytes') / nbytes:11.2f}  {med('read_bytes') / nbytes:8.2f}")
    return wall


def report_per_process(n: int, jobs_of_n: list[list[dict]], nbytes: int) -> None:
    """Print one configuration's per-process medians over the rounds (rank order) and the split of the writes."""
    by_rank = [[job[rank] for job in jobs_of_n] for rank in range(n)]

    def per_rank(key: str, scale: float = 1.0, digits: int = 2) -> str:
        return ", ".join(f"{statistics.median(r[key] for r in runs) / scale:.{digits}f}" for runs in by_rank)

    written = [statistics.median(r["written_bytes"] for r in runs) for runs in by_rank]
    split = max(written) / statistics.mean(written)
    print(f"  {n} process(es): CPU user {per_rank('user_s')} s, sys {per_rank('system_s')} s; resident growth "
          f"{per_rank('rss_growth_bytes', nbytes)} B/B; written {per_rank('written_bytes', nbytes)} B/B "
          f"({per_rank('written_bytes', 2**20, 0)} MiB), busiest / average {split:.3f} (goal <= 1.25)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=7, help="rounds: fresh jobs per configuration, ABBA")
    parser.add_argument("--processes", default="1,4")
    args = parser.parse_args()
    configurations = [int(x) for x in args.processes.split(",")]
    results: dict[int, list[list[dict]]] = {n: [] for n in configurations}
    with tempfile.TemporaryDirectory(prefix="xtc-bench-multihost-") as tmp:
        for i in range(args.repeats):
            for n in configurations if i % 2 == 0 else reversed(configurations):
                root = os.path.join(tmp, f"{n}-{i}")
                results[n].append(run(n, args.gib, root))
                shutil.rmtree(root)
    nbytes = results[configurations[0]][0][0]["state_bytes"]
    print(f"multihost: the same global state ({nbytes / 2**30:.2f} GiB: 8 tensors tiled over the processes + 1 "
          f"that every process holds whole) saved by {' and by '.join(map(str, configurations))} processes (gloo "
          f"on 127.0.0.1, {os.cpu_count()} cores), a fresh job per configuration and round, ABBA, medians of "
          f"{args.repeats} rounds; wall: the slowest process; CPU, resident growth, bytes: summed over the "
          "processes; page cache growth: machine-wide; B/B: per byte of the global state")
    print(f"  {'processes':>9}  {'wall s':>6}  {'GiB/s':>5}  {'CPU s (user+sys)':16}  {'fresh B/B (res+cache)':21}  "
          f"{'written B/B':>11}  {'read B/B':>8}")
    walls = {n: report(n, results[n], nbytes) for n in configurations}
    print("  per process, medians in rank order:")
    for n in configurations:
        report_per_process(n, results[n], nbytes)
    for n in configurations:
        seconds = [round(aggregate(job)["wall_s"], 3) for job in results[n]]
        print(f"  {n} process(es), wall s per round: {seconds}")
    if 1 in walls:
        for n, wall in walls.items():
            if n != 1:
                print(f"  throughput with {n} processes / with 1 process: {walls[1] / wall:.2f} (goal >= 1)")


if __name__ == "__main__":
    main()
