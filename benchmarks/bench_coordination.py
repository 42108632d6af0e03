"""The cost of agreeing: latency of the manager's collectives (`distributed.Coordinator`, gloo on 127.0.0.1) at
2-8 processes, for extrapolating what coordination costs a save or restore at pod scale (issue 34, item 6).

Per process count, every process runs `--repeats` rounds of each collective a save or restore uses after one warm-up
round: `everywhere` (every process's status gathered: the agreement after each phase), `on_primary` (the
primary acts, every process learns the outcome), `statuses` (the point-to-point all-is-well flags a
single-replica restore exchanges after each batch's reads), `all_gather` of a small record (a plan's per-process
summary, ~1 KiB encoded), `broadcast` and, where the code has it, `reduce_max` of 4 integers (the digest
agreement of a derived restore plan). Run from an older tree's directory with PYTHONPATH pointing at it, it
measures that one (the children run `python -c`, which imports from the working directory first): the
before/after comparison of issue 66 ran both one after the other in the same session. Reported: the median and
90th percentile of the slowest process per round. On this 2-core machine, 8 processes share 2 cores: figures
above 2 processes include scheduling delay, so they bound the cost from above.

    python -m benchmarks coordination [--set processes=1,2,4,8] [--repeats 200] [--output F.json]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import jobs  # noqa: E402

CHILD = r"""
import json, sys, time
from xla_tensorstore_ckpt.multihost.distributed import Coordinator
repeats = int(sys.argv[1])
c = Coordinator.from_environment()
record = {"arrays": list(range(100)), "bytes": 1 << 30, "name": "model"}
cases = {
    "everywhere": lambda: c.everywhere("bench", lambda: None),
    "on_primary": lambda: c.on_primary("bench", lambda: None),
    "statuses": lambda: c.statuses(None),
    "all_gather_1k": lambda: c.all_gather(record),
    "broadcast": lambda: c.broadcast(record),
    **({"reduce_max_4": lambda: c.reduce_max([0, 1, 2, 3])} if hasattr(c, "reduce_max") else {}),
}
out = {}
for name, fn in cases.items():
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        c.everywhere("align", lambda: None)  # start every round together
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    out[name] = times
c.close()
print(json.dumps({"index": c.index, "times": out}))
"""


def rounds(processes: int, repeats: int) -> dict[str, list[float]]:
    """Per collective, the slowest process's seconds in each round."""
    results = jobs.run_job(["-c", CHILD, str(repeats)], processes, timeout_s=600)
    names = results[0]["times"]
    return {name: [max(r["times"][name][i] for r in results) for i in range(repeats)] for name in names}


def run(settings: harness.Settings) -> harness.Result:
    """The case `coordination`: one job per process count, every collective `repeats` rounds."""
    rows, raw = [], []
    for n in settings.option("processes", ("1", "2", "4", "8")):
        for name, times in rounds(int(n), settings.repeats).items():
            ordered = sorted(times)
            raw.append({"processes": int(n), "collective": name, "median_ms": harness.median(times) * 1e3,
                        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3})
            rows.append(harness.Row(name, {"seconds": harness.series(times, "s")}, f"{n} processes",
                                    {"processes": int(n), "p90_ms": raw[-1]["p90_ms"]}))
    text = (f"Coordinator collectives, gloo on 127.0.0.1, 2 cores ({max(r['processes'] for r in raw)} processes "
            f"share them): slowest process per round, {settings.repeats} rounds\n\n"
            "processes  collective      median ms   p90 ms\n"
            + "".join(f"{r['processes']:9d}  {r['collective']:14} {r['median_ms']:9.3f} {r['p90_ms']:8.3f}\n"
                      for r in raw))
    return harness.Result(rows, text, {"rows": raw})


if __name__ == "__main__":
    harness.worker_main()
