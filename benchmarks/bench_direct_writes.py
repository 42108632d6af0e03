"""Saves that write their chunk data around the page cache (O_DIRECT, `SaveOptions(direct_io=True)`, the default)
or through it (tensorstore's file writes), side by side (issue 36, item 2: "same question for saves ... measure
both ways and keep what wins").

Each workload (benchmarks/workloads.py: `large` 1 GiB and `model` 2.42 GiB, sharded on 8 CPU devices, mesh 4x2) is
built in a fresh process that then times one `xtc.save` (fsync on, as by default) into a new directory; the
contenders alternate ABBA for `--repeats` rounds, and the saved directory is removed before the next process
starts. Each reports (benchmarks/footprint.py) wall time, user and system CPU, the fresh memory the save touched
(peak resident growth plus page cache growth) and the bytes it wrote; medians per byte saved are printed. The
first save of each contender is restored in its process and compared bit for bit.

    python -m benchmarks direct-writes [--scale 1.0] [--repeats 7] [--set workloads=large,model]
"""

from __future__ import annotations

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

MODES = ("direct", "buffered")


def worker(mode: str, workload: str, scale: str, path: str, check: str) -> dict:
    import torch
    import torch_xla.runtime as xr

    xr.use_spmd()
    import footprint
    import workloads

    import xla_tensorstore_ckpt as xtc

    state = workloads.build_state(workload, float(scale))
    options = xtc.SaveOptions(direct_io=mode == "direct")
    measures, _ = footprint.measure(lambda: xtc.save(path, state, options=options))
    measures["bytes"] = workloads.state_bytes(state)
    if check == "1":
        restored = xtc.restore(path)
        measures["bit_exact"] = all(torch.equal(restored[k].cpu(), v.cpu()) for k, v in state.items())
    return measures


def run(settings: harness.Settings) -> harness.Result:
    """The case `direct-writes`: each workload's saves, direct and buffered, ABBA in fresh processes."""
    rows, lines = [], []
    for workload in settings.option("workloads", ("large", "model")):
        path = os.path.join(settings.workdir, "item")

        def save(mode: str, i: int, workload=workload, path=path) -> dict:
            answer = harness.fresh(__file__, mode, workload, settings.scale, path, "1" if i < 2 else "0",
                                   what=f"the {mode} save of {workload}")
            shutil.rmtree(path)
            return answer

        runs = harness.alternated(MODES, settings.repeats, save)
        nbytes = runs[MODES[0]][0]["bytes"]
        exact = {m: all(r.get("bit_exact", True) for r in runs[m]) for m in MODES}
        lines.append(f"save of {workload} ({nbytes / 2**30:.2f} GiB, 8 CPU devices, fsync), fresh processes, "
                     f"medians of {settings.repeats} ABBA; bit-exact restores: {exact}")
        for mode in MODES:
            rows.append(harness.footprint_row(mode, runs[mode], nbytes, group=workload, bit_exact=exact[mode]))
        walls = {m: harness.median(r["wall_s"] for r in runs[m]) for m in MODES}
        lines.append(f"  direct is {walls['buffered'] / walls['direct']:.2f}x as fast as buffered")
    return harness.Result(rows, "\n".join(lines))


if __name__ == "__main__":
    harness.worker_main(worker)
