"""The first restore in a process against the ones after it (issue 36, item 4), same process, same checkpoint.

Per workload (`large`, 1 GiB 2D-sharded; `model`, 2.42 GiB FSDP-sharded; benchmarks/workloads.py) a process of its
own saves the state (8 CPU devices, mesh 4x2) with the manager. Then, per case, `--processes` fresh processes
each build the target (mesh 2x4, untimed) and restore `--restores` times in a row, the checkpoint's files
evicted from the page cache before every restore, so that each one reads the disk:

- `resume, in place`: the manager's ``restore(step, model=target)``, as a job resuming does;
- `resume, new tensors`: ``xtc.restore(step_dir, target)``, the result dropped before the next;
- `after a save, in place`: the process first saves the state itself (another step), drops it, then restores as
  above: the first restore then meets the memory the save just gave back.

Each restore reports (benchmarks/footprint.py) wall time, user and system CPU seconds, fresh host memory touched
and bytes read; the summary gives, per case, the median over processes of first / median of the later ones.

    python benchmarks/bench_first_restore.py [--workloads large,model] [--processes 3] [--restores 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import footprint  # noqa: E402
from fresh_process import evict, run_json  # noqa: E402

CASES = ("resume, in place", "resume, new tensors", "after a save, in place")
ENV = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "TF_CPP_MIN_LOG_LEVEL": "3"}
GOAL = 1.3  # first / steady (issue 36)


def worker_save(workload: str, root: str) -> dict:
    import torch_xla.runtime as xr
    import workloads

    xr.use_spmd()
    import xla_tensorstore_ckpt as xtc

    state = workloads.build_state(workload, 1.0)
    with xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(save_rng=False, max_to_keep=None)) as manager:
        manager.save(1, model=state, force=True)
    return {"bytes": workloads.state_bytes(state)}


def worker_restore(case: str, workload: str, root: str, restores: int) -> dict:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    import workloads

    xr.use_spmd()
    import xla_tensorstore_ckpt as xtc

    manager = xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(save_rng=False, max_to_keep=None))
    if case == "after a save, in place":
        state = workloads.build_state(workload, 1.0)
        manager.save(2, model=state, force=True)
        manager.wait_until_finished()
        del state
    target = workloads.build_target(workload, 1.0)
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


def measure(workloads_: tuple[str, ...], processes: int, restores: int, workdir: str) -> dict:
    result: dict = {"processes": processes, "restores": restores, "workloads": {}}
    for workload in workloads_:
        root = os.path.join(workdir, workload)
        print(f"first-restore: saving {workload} ...", file=sys.stderr, flush=True)
        saved = _run(["save", workload, root], f"the save of {workload}")
        cases: dict = {}
        for case in CASES:
            print(f"first-restore: {workload}, {case} ...", file=sys.stderr, flush=True)
            cases[case] = [_run(["restore", case, workload, root, str(restores)], f"{case} of {workload}")["runs"]
                           for _ in range(processes)]
        result["workloads"][workload] = {"bytes": saved["bytes"], "cases": cases}
    return result


def _run(args: list[str], what: str) -> dict:
    return run_json([sys.executable, os.path.abspath(__file__), "--worker", *args], dict(os.environ, **ENV), what)


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
            ratios = [runs[0]["wall_s"] / statistics.median(r["wall_s"] for r in runs[1:]) for runs in processes]
            ratio = statistics.median(ratios)

            def med(key: str, rows: list) -> float:
                return statistics.median(r[key] for r in rows)

            lines.append(
                f"    {case:24} first {med('wall_s', first):.3f} s (CPU {med('user_s', first):.2f} + "
                f"{med('system_s', first):.2f} s, fresh {med('fresh_bytes', first) / entry['bytes']:.2f} B/B), "
                f"later {med('wall_s', later):.3f} s (CPU {med('user_s', later):.2f} + {med('system_s', later):.2f} s, "
                f"fresh {med('fresh_bytes', later) / entry['bytes']:.2f} B/B): first / later {ratio:.2f}x "
                f"(per process {', '.join(f'{r:.2f}' for r in ratios)}; goal <= {GOAL}x: "
                f"{'met' if ratio <= GOAL else 'NOT met'})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="large,model")
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--restores", type=int, default=4)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, *rest = args.worker
        if kind == "save":
            answer = worker_save(rest[0], rest[1])
        else:
            answer = worker_restore(rest[0], rest[1], rest[2], int(rest[3]))
        print(json.dumps(answer))
        return
    with tempfile.TemporaryDirectory(prefix="xtc-first-restore-", dir=args.dir) as workdir:
        result = measure(tuple(args.workloads.split(",")), args.processes, args.restores, workdir)
    print(describe(result), file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
