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

usage: python -m benchmarks multihost [--scale 1.0 (GiB)] [--repeats 7] [--set processes=1,4]
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402
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



def one_job(processes: int, gib: float, root: str) -> list[dict]:
    """One fresh job of `processes` processes: each process's measures of the measured save, in rank order."""
    return jobs.run_job(["-c", CHILD, root, str(gib), HERE], processes)


def report(n: int, jobs_of_n: list[list[dict]], nbytes: int) -> float:
    """Print one configuration's medians over the rounds; return its median wall time."""
    rounds = [jobs.aggregate(job) for job in jobs_of_n]

    def med(key: str, runs: list[dict] = rounds) -> float:
        return harness.median(r[key] for r in runs)

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
        return ", ".join(f"{harness.median(r[key] for r in runs) / scale:.{digits}f}" for runs in by_rank)

    written = [harness.median(r["written_bytes"] for r in runs) for runs in by_rank]
    split = max(written) / statistics.mean(written)
    print(f"  {n} process(es): CPU user {per_rank('user_s')} s, sys {per_rank('system_s')} s; resident growth "
          f"{per_rank('rss_growth_bytes', nbytes)} B/B; written {per_rank('written_bytes', nbytes)} B/B "
          f"({per_rank('written_bytes', 2**20, 0)} MiB), busiest / average {split:.3f} (goal <= 1.25)")


def run(settings: harness.Settings) -> harness.Result:
    """The case `multihost`: a fresh job per configuration and round, ABBA (`--repeats` rounds)."""
    configurations = [int(x) for x in settings.option("processes", ("1", "4"))]

    def save(n: int, i: int) -> list[dict]:
        root = os.path.join(settings.workdir, f"{n}-{i}")
        answers = one_job(n, settings.scale, root)
        shutil.rmtree(root)
        return answers

    results = harness.alternated(configurations, settings.repeats, save)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):  # the report's lines, as the script printed them
        walls = _print_report(configurations, results, settings.repeats)
    nbytes = results[configurations[0]][0][0]["state_bytes"]
    rows = [harness.footprint_row(f"{n} process(es)", [jobs.aggregate(job) for job in results[n]], nbytes)
            for n in configurations]
    return harness.Result(rows, text.getvalue(), {"walls": walls, "results": results})


def _print_report(configurations: list[int], results: dict, repeats: int) -> dict:
    nbytes = results[configurations[0]][0][0]["state_bytes"]
    print(f"multihost: the same global state ({nbytes / 2**30:.2f} GiB: 8 tensors tiled over the processes + 1 "
          f"that every process holds whole) saved by {' and by '.join(map(str, configurations))} processes (gloo "
          f"on 127.0.0.1, {os.cpu_count()} cores), a fresh job per configuration and round, ABBA, medians of "
          f"{repeats} rounds; wall: the slowest process; CPU, resident growth, bytes: summed over the "
          "processes; page cache growth: machine-wide; B/B: per byte of the global state")
    print(f"  {'processes':>9}  {'wall s':>6}  {'GiB/s':>5}  {'CPU s (user+sys)':16}  {'fresh B/B (res+cache)':21}  "
          f"{'written B/B':>11}  {'read B/B':>8}")
    walls = {n: report(n, results[n], nbytes) for n in configurations}
    print("  per process, medians in rank order:")
    for n in configurations:
        report_per_process(n, results[n], nbytes)
    for n in configurations:
        seconds = [round(jobs.aggregate(job)["wall_s"], 3) for job in results[n]]
        print(f"  {n} process(es), wall s per round: {seconds}")
    if 1 in walls:
        for n, wall in walls.items():
            if n != 1:
                print(f"  throughput with {n} processes / with 1 process: {walls[1] / wall:.2f} (goal >= 1)")
    return walls


if __name__ == "__main__":
    harness.worker_main()
