"""The restore plan's peak host memory (`xtc.plan_restore(...).peak_host_bytes`) against the peak a restore then
takes, on the benchmark workloads (benchmarks/workloads.py), each in a fresh process with 8 devices.

Per workload: save it, restore it once (lazy initialisation, buffers a reader keeps), then `--repeats` times
onto a fresh target each: plan the restore, restore it, and measure the process's resident memory at its peak
during the restore (Linux's high-water mark, reset before) above the resident memory after it, with the freed
memory returned to the OS (``malloc_trim``) before and after. That is what the restore held beyond its results:
on CPU devices the devices' buffers are host memory too, and they (with what torch_xla keeps beside them) are
what is left. Reported: the median measured and predicted peak, and their ratio (issue 33: within 10 %).

    python -m benchmarks restore-memory [--scale 1.0] [--repeats 7] [--set workloads=large,small,model]
        [--set max_host_mib=N]
"""

from __future__ import annotations

import gc
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402


def worker(workload: str, scale_: str, repeats_: str, budget_mib: str, workdir: str) -> dict:
    """In this process (8 CPU devices): the measured and predicted peaks of `repeats` restores."""
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    xr.use_spmd()
    import memory
    import workloads

    import xla_tensorstore_ckpt as xtc
    from xla_tensorstore_ckpt.core import host_memory

    def settled() -> int:
        gc.collect()
        xm.wait_device_ops()
        host_memory.return_free_memory()
        return host_memory.resident_bytes()

    scale, repeats, budget = float(scale_), int(repeats_), (int(budget_mib) << 20) or None
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


def run(settings: harness.Settings) -> harness.Result:
    """The case `restore-memory`: one fresh process per workload; measured against predicted peaks."""
    budget_mib = settings.option("max_host_mib", 0)
    rows, answers, lines = [], [], []
    for workload in settings.option("workloads", ("large", "small", "model")):
        answer = harness.fresh(__file__, workload, settings.scale, settings.repeats, budget_mib, settings.workdir,
                               what=workload)
        measured, predicted = harness.median(answer["measured"]), harness.median(answer["predicted"])
        answer["ratio"] = measured / predicted if predicted else None
        answers.append(answer)
        rows.append(harness.Row(workload, {"measured_peak_bytes": harness.series(answer["measured"], "B"),
                                           "predicted_peak_bytes": harness.series(answer["predicted"], "B")},
                                params={"ratio": answer["ratio"], "max_host_bytes": answer["max_host_bytes"]}))
        lines.append(f"{workload:>6} scale {settings.scale:g}: measured {measured / 2**20:8.1f} MiB, predicted "
                     f"{predicted / 2**20:8.1f} MiB, measured/predicted {answer['ratio']:.3f}")
    return harness.Result(rows, "\n".join(lines), raw={"rows": answers})


if __name__ == "__main__":
    harness.worker_main(worker)
