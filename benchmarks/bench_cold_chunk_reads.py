"""Cold restores of this library's own chunks read around the page cache (O_DIRECT, the default) or through it,
side by side (issue 36, item 2: "measure both ways and keep what wins").

The `large` workload (benchmarks/workloads.py) is saved once on 8 CPU devices (mesh 4x2); then each mode restores
it onto mesh 2x4 in a fresh process, after the files are evicted from the page cache, `--repeats` rounds ABBA:

- direct: as the library reads (`arrays/local_reads.py`: O_DIRECT through each reading thread's aligned window
  where a RWF_NOWAIT probe finds the bytes uncached);
- buffered: the same reads with the probe answering "cached", so every read goes through the page cache.

Each reports (benchmarks/footprint.py) the restore call's wall time, user and system CPU, and the fresh memory it
touched (peak resident growth plus page cache growth); medians are printed per byte restored.

    python -m benchmarks cold-chunk-reads [--scale 1.0] [--repeats 7]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from fresh_process import evict  # noqa: E402

MODES = ("direct", "buffered")


def worker(mode: str, scale: str, path: str) -> dict:
    import torch_xla.runtime as xr

    xr.use_spmd()
    import footprint
    import workloads

    import xla_tensorstore_ckpt as xtc
    from xla_tensorstore_ckpt.arrays import local_reads

    if mode == "save":
        state = workloads.build_state("large", float(scale))
        xtc.save(path, state)
        return {"bytes": workloads.state_bytes(state)}
    if mode == "buffered":
        local_reads._cached = lambda *_: True
    target = workloads.build_target("large", float(scale))
    measures, _ = footprint.measure(lambda: xtc.restore(path, target))
    return measures


def run(settings: harness.Settings) -> harness.Result:
    """The case `cold-chunk-reads`: one save, then evicted restores direct and buffered, ABBA, fresh processes."""
    path = os.path.join(settings.workdir, "item")
    nbytes = harness.fresh(__file__, "save", settings.scale, path, what="the save")["bytes"]

    def restore(mode: str, _round: int) -> dict:
        evict(path)
        return harness.fresh(__file__, mode, settings.scale, path, what=f"the {mode} restore")

    runs = harness.alternated(MODES, settings.repeats, restore)
    rows = [harness.footprint_row(mode, runs[mode], nbytes) for mode in MODES]
    return harness.Result(rows, f"cold restore of {nbytes / 2**30:.2f} GiB (mesh 4x2 saved, 2x4 restored, fresh "
                                f"processes, evicted), medians of {settings.repeats} ABBA")


if __name__ == "__main__":
    harness.worker_main(worker)
