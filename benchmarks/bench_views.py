"""`xtckpt stats` and `xtckpt report` over a large checkpoint, against the cold-read floor, same files, same run.

The `model` workload (a decoder with its AdamW moments, float32; ~1 GiB at the default scale 0.4, 2.4 GiB at 1)
is saved as an item of ours, every tensor in the 8 chunks of a 4x2 grid (as an FSDP/2-D sharded save stores it;
no torch_xla needed: host shards). Each contender runs in a fresh process after the item's files were evicted
from the page cache:

- floor: read every file of the item once, sequentially in 8 MiB blocks, and nothing else (the disk's cold
  read time for these bytes through the page cache);
- read: every chunk of every array read once through the library's reader, into the buffers `stats` reads
  into (`views.histogram.Recycled`), and nothing computed (the cold-read floor of the views: what
  `scans.iter_chunks` costs);
- stats: `views.stats_view` over every array (the work of ``xtckpt stats``: count, min/max/mean/std, zeros,
  NaN/Inf, quantiles from the bfloat16-bin sketch, a histogram), chunk by chunk;
- report: `views.write_report` of the item (tree, layouts, statistics with histograms; one item: no diff).

Reported per contender (medians over the rounds, taken ABBA): wall seconds and their ratio to the faster of
floor and read (``vs_floor``), and to read (``wall_vs_read``: the issue's goal is 1.5x), CPU seconds (every
thread) and their ratio to read's, bytes read from the disk per byte of the item, the peak growth of the
resident set during the call and its ratio to read's, the fresh memory (that growth plus the page cache's,
machine-wide) and the process's peak resident set (torch and the library imported); with the load average
before and after and the niceness the contenders ran at. Prints one JSON line.

    python -m benchmarks views [--scale 0.4] [--repeats 7] [--set dir=DIR]
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import footprint  # noqa: E402
import harness  # noqa: E402
from fresh_process import evict  # noqa: E402

CONTENDERS = ("floor", "read", "stats", "report")


def build(path: str, scale: float) -> int:
    """Save the workload's tensors as host shards on a 4x2 grid at `path`; returns the item's bytes."""
    import numpy as np
    import torch
    from workloads import specs

    import xla_tensorstore_ckpt as xtc

    entries, _ = specs("model", scale)
    rng = np.random.default_rng(0)
    state, total = {}, 0
    for name, shape, _, _, _ in entries:
        full = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))
        shard = tuple(-(-n // p) for n, p in zip(shape, (4, 2)))
        state[name] = xtc.ShardedArray.from_tensor(full, shard, xtc.ShardedArray.grid(shape, shard))
        total += full.numel() * 4
    xtc.save(path, state)
    return total


def floor(path: str) -> None:
    for root, _, names in os.walk(path):
        for name in sorted(names):
            with open(os.path.join(root, name), "rb", buffering=0) as f:
                while f.read(8 << 20):
                    pass


def read(path: str) -> None:
    from xla_tensorstore_ckpt.tools import inspection, scans
    from xla_tensorstore_ckpt.views import histogram

    checkpoint = inspection.open_checkpoint(path)
    recycled = histogram.Recycled(histogram.DEFAULT_MAX_BYTES)  # the buffers stats reads into, as fast to read into
    for row in inspection.tree_rows(checkpoint):
        if row.meta is not None:
            for _, data in scans.iter_chunks(checkpoint, inspection.split_key(row.key, checkpoint)[0], row.meta,
                                             empty=recycled.empty):
                if isinstance(data, Exception):
                    raise data
                recycled.give(data)


def worker(contender: str, path: str, out: str) -> dict:
    from xla_tensorstore_ckpt import views

    work = {"floor": lambda: floor(path), "read": lambda: read(path), "stats": lambda: views.stats_view(path),
            "report": lambda: views.write_report(path, out, overwrite=True)}[contender]
    measured, _ = footprint.measure(work)
    measured["peak_rss_bytes"] = footprint.memory._status_kib("VmHWM") * 1024
    return measured


def run(settings: harness.Settings) -> harness.Result:
    """The case `views`: the item built once (or reused from ``--set dir``), each contender evicted and fresh, ABBA."""
    base = settings.option("dir", "") or settings.workdir
    item = os.path.join(base, "item")
    nbytes = build(item, settings.scale) if not os.path.exists(item) else None
    if nbytes is None:
        from xla_tensorstore_ckpt.tools import inspection
        nbytes = sum(r.meta.nbytes for r in inspection.tree_rows(inspection.open_checkpoint(item)) if r.meta)
    load_before = os.getloadavg()


    def one(contender: str, _round: int) -> dict:
        evict(item)
        return harness.fresh(__file__, contender, item, os.path.join(base, "report.html"), env=dict(os.environ),
                             what=contender)

    runs = harness.alternated(CONTENDERS, settings.repeats, one)

    def med(contender: str, key: str) -> float:
        return harness.median(r[key] for r in runs[contender])

    result = {"bytes": nbytes, "rounds": settings.repeats, "scale": settings.scale, "nice": os.nice(0),
              "load_before": load_before, "load_after": os.getloadavg()}
    fastest = min(med("floor", "wall_s"), med("read", "wall_s"))
    cpu = {c: harness.median(r["user_s"] + r["system_s"] for r in runs[c]) for c in CONTENDERS}
    rows = []
    for c in CONTENDERS:
        result[c] = {"wall_s": med(c, "wall_s"), "vs_floor": med(c, "wall_s") / fastest,
                     "wall_vs_read": med(c, "wall_s") / med("read", "wall_s"),
                     "cpu_s": cpu[c], "cpu_vs_read": cpu[c] / cpu["read"],
                     "read_per_byte": med(c, "read_bytes") / nbytes,
                     "rss_growth_mib": med(c, "rss_growth_bytes") / 2**20,
                     "rss_growth_vs_read": med(c, "rss_growth_bytes") / med("read", "rss_growth_bytes"),
                     "fresh_mib": med(c, "fresh_bytes") / 2**20,
                     "peak_rss_mib": med(c, "peak_rss_bytes") / 2**20}
        metrics = harness.footprint_metrics(runs[c], nbytes, ("wall_s", "cpu_s", "read_bytes"))
        metrics.update(harness.footprint_metrics(runs[c], None, ("rss_growth_bytes", "peak_rss_bytes")))
        rows.append(harness.Row(c, metrics, params={key: result[c][key] for key in ("vs_floor", "wall_vs_read",
                                                                                      "cpu_vs_read",
                                                                                      "rss_growth_vs_read")}))
    text = (f"{nbytes / 2**30:.2f} GiB item, {settings.repeats} rounds ABBA, evicted; wall vs the faster of floor "
            "and read: " + ", ".join(f"{c} {result[c]['vs_floor']:.2f}x" for c in CONTENDERS))
    return harness.Result(rows, text, result)


if __name__ == "__main__":
    harness.worker_main(worker)
