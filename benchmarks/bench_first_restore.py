"""The first restore in a process against the ones after it (issue 36, item 4), same process, same checkpoint.

Per workload (`large`, 1 GiB 2D-sharded; `model`, 2.42 GiB FSDP-sharded; benchmarks/workloads.py) a process of its
own saves the state (8 CPU devices, mesh 4x2) with the manager. Then, per case, `--repeats` fresh processes
each build the target (mesh 2x4, untimed) and restore `restores` times in a row, the checkpoint's files
evicted from the page cache before every restore, so that each one reads the disk:

- `resume, in place`: the manager's ``restore(step, model=target)``, as a job resuming does;
- `resume, new tensors`: ``xtc.restore(step_dir, target)``, the result dropped before the next;
- `after a save, in place`: the process first saves the state itself (another step), drops it, then restores as
  above: the first restore then meets the memory the save just gave back.

Each restore reports (benchmarks/footprint.py) wall time, user and system CPU seconds, fresh host memory touched
and bytes read; the summary gives, per case, the median over processes of first / median of the later ones.

    python -m benchmarks first-restore [--set workloads=large,model] [--repeats 3] [--set restores=4] [--scale 1]
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import footprint  # noqa: E402
import harness  # noqa: E402
from fresh_process import evict  # noqa: E402

CASES = ("resume, in place", "resume, new tensors", "after a save, in place")
GOAL = 1.3  # first / steady (issue 36)


def worker(kind: str, *args: str) -> dict:
    """A fresh process's work: ``save WORKLOAD ROOT SCALE`` or ``restore CASE WORKLOAD ROOT RESTORES SCALE``."""
    if kind == "save":
        return worker_save(args[0], args[1], float(args[2]))
    return worker_restore(args[0], args[1], args[2], int(args[3]), float(args[4]))


def worker_save(workload: str, root: str, scale: float) -> dict:
    import torch_xla.runtime as xr
    import workloads

    xr.use_spmd()
    import xla_tensorstore_ckpt as xtc

    state = workloads.build_state(workload, scale)
    with xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(save_rng=False, max_to_keep=None)) as manager:
        manager.save(1, model=state, force=True)
    return {"bytes": workloads.state_bytes(state)}


def worker_restore(case: str, workload: str, root: str, restores: int, scale: float) -> dict:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    import workloads

    xr.use_spmd()
    import xla_tensorstore_ckpt as xtc

    manager = xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(save_rng=False, max_to_keep=None))
    if case == "after a save, in place":
        state = workloads.build_state(workload, scale)
        manager.save(2, model=state, force=True)
        manager.wait_until_finished()
        del state
    target = workloads.build_target(workload, scale)
    xm.wait_device_ops()

    def restore() -> None:
        if case == "resume, new tensors":
            out = xtc.restore(os.path.join(root, "1", "model"), target)
        else:
            manager.restore(1, model=target)
            out = target
        torch_xla.sync()
        xm.wait_device_ops()
        del out

    runs = []
    for _ in range(restores):
        evict(root)
        measures, _ = footprint.measure(restore)
        runs.append(measures)
    if case == "after a save, in place":
        manager.delete(2)
    manager.close()
    return {"runs": runs}


def measure(settings: harness.Settings) -> dict:
    """Per workload: one save in a fresh process, then `settings.repeats` fresh processes per case, each
    restoring `restores` times; their runs."""
    workloads_, processes = settings.option("workloads", ("large", "model")), settings.repeats
    restores, workdir, scale = settings.option("restores", 4), settings.workdir, settings.scale
    result: dict = {"processes": processes, "restores": restores, "workloads": {}}
    for workload in workloads_:
        root = os.path.join(workdir, workload)
        print(f"first-restore: saving {workload} ...", file=sys.stderr, flush=True)
        saved = harness.fresh(__file__, "save", workload, root, scale, what=f"the save of {workload}")
        cases: dict = {}
        for case in CASES:
            print(f"first-restore: {workload}, {case} ...", file=sys.stderr, flush=True)
            cases[case] = [harness.fresh(__file__, "restore", case, workload, root, restores, scale,
                                         what=f"{case} of {workload}")["runs"] for _ in range(processes)]
        result["workloads"][workload] = {"bytes": saved["bytes"], "cases": cases}
    return result


def describe(result: dict) -> str:
    lines = [f"first-restore: the first restore in a process against the later ones (each after evicting the "
             f"checkpoint's files), {result['restores']} restores per process, {result['processes']} processes per "
             f"case; 8 CPU devices, saved on mesh 4x2, restored onto 2x4; medians"]
    for workload, entry in result["workloads"].items():
        gib = entry["bytes"] / 2**30
        lines.append(f"  {workload} ({gib:.2f} GiB)")
        for case, processes in entry["cases"].items():
            first = [runs[0] for runs in processes]
            later = [r for runs in processes for r in runs[1:]]
            ratios = [runs[0]["wall_s"] / harness.median(r["wall_s"] for r in runs[1:]) for runs in processes]
            ratio = harness.median(ratios)

            def med(key: str, rows: list) -> float:
                return harness.median(r[key] for r in rows)

            lines.append(
                f"    {case:24} first {med('wall_s', first):.3f} s (CPU {med('user_s', first):.2f} + "
                f"{med('system_s', first):.2f} s, fresh {med('fresh_bytes', first) / entry['bytes']:.2f} B/B), "
                f"later {med('wall_s', later):.3f} s (CPU {med('user_s', later):.2f} + {med('system_s', later):.2f} s, "
                f"fresh {med('fresh_bytes', later) / entry['bytes']:.2f} B/B): first / later {ratio:.2f}x "
                f"(per process {', '.join(f'{r:.2f}' for r in ratios)}; goal <= {GOAL}x: "
                f"{'met' if ratio <= GOAL else 'NOT met'})")
    return "\n".join(lines)


def run(settings: harness.Settings) -> harness.Result:
    """The case `first-restore`: per workload one save, then `repeats` fresh processes per case."""
    result = measure(settings)
    rows = []
    for workload, entry in result["workloads"].items():
        for case, processes in entry["cases"].items():
            ratios = [runs[0]["wall_s"] / harness.median(r["wall_s"] for r in runs[1:]) for runs in processes]
            rows.append(harness.footprint_row(f"{case}: first", [runs[0] for runs in processes], entry["bytes"],
                                              group=workload, first_over_later=harness.median(ratios)))
            rows.append(harness.footprint_row(f"{case}: later", [r for runs in processes for r in runs[1:]],
                                              entry["bytes"], group=workload))
    return harness.Result(rows, describe(result), result)


if __name__ == "__main__":
    harness.worker_main(worker)
