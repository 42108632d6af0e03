"""torch.distributed.checkpoint's own API with this library's storage (`DCPStorageWriter` / `DCPStorageReader`)
against DCP's `FileSystemWriter` / `FileSystemReader`, same job, same state, side by side.

The DTensor workloads of benchmarks/bench_dtensor.py (`large`: 1 GiB of float32 and bfloat16 matrices; `model`: a
~200M-parameter decoder with its AdamW moments, ~2.4 GiB), held by 4 processes (gloo on 127.0.0.1, no torch_xla)
as DTensors with `Shard(0)` placements on a 1-D mesh, built as that benchmark builds them (its helpers). After an
untimed warm-up, `--repeats` rounds (at least 7 for a measurement), the contenders alternating ABBA, each round:

- save: ``dcp.save(state, storage_writer=DCPStorageWriter(dir))`` against ``dcp.save(state,
  storage_writer=FileSystemWriter(dir))``, into a fresh directory (the previous round's deleted, untimed);
- load: the round's checkpoint, evicted from the page cache (benchmarks/fresh_process.py), into a target of
  zeros DTensors of the same placements, in place: ``dcp.load(target, storage_reader=DCPStorageReader(dir))``
  against ``dcp.load(target, storage_reader=FileSystemReader(dir))``. Round 0 checks every local shard bit for bit.

Both with their defaults (both sync files). Every timed region starts and ends with a barrier; footprint columns
as in bench_dtensor.py (benchmarks/footprint.py): wall of the slowest process, CPU seconds and bytes read/written
summed over the processes, fresh memory. Reported: medians, and DCP's over ours against the goals (save >= 1.5x and
load >= 1.3x faster, CPU <= 0.5x theirs; reported, not asserted).

    python -m benchmarks dcp-storage [--scale 1.0] [--repeats 7] [--set workloads=large,model] [--output FILE]
"""

from __future__ import annotations

import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dtensor_jobs  # noqa: E402
import harness  # noqa: E402
from dtensor_jobs import PROCESSES  # noqa: E402
from fresh_process import evict  # noqa: E402

CONTENDERS = ("ours", "filesystem")
BASELINE = "filesystem"
OPERATIONS = ("save", "load")
GOALS = {"save": 1.5, "load": 1.3}  # DCP's FileSystem wall time over ours
CPU_GOAL = 0.5  # our CPU seconds over theirs, at most


def worker(workload: str, scale: str, root: str, repeats: str) -> dict:
    """One process of the job: `repeats` rounds of dcp.save and dcp.load through each storage, ABBA."""
    import torch.distributed.checkpoint as dcp

    import xla_tensorstore_ckpt as xtc

    job = dtensor_jobs.Process(workload, float(scale))
    state, target = job.state, job.target
    writers = {"ours": xtc.DCPStorageWriter, "filesystem": dcp.FileSystemWriter}
    readers = {"ours": xtc.DCPStorageReader, "filesystem": dcp.FileSystemReader}

    def save(contender: str, path: str, tree) -> None:
        dcp.save(tree, storage_writer=writers[contender](path))

    def load(contender: str, path: str, into) -> None:
        dcp.load(into, storage_reader=readers[contender](path))

    for contender in CONTENDERS:  # warm-up, untimed: imports, thread pools
        path = os.path.join(root, "warm-up", contender)
        save(contender, path, job.tiny(1.0))
        load(contender, path, job.tiny(0.0))
    runs: dict = {op: {c: [] for c in CONTENDERS} for op in OPERATIONS}
    exact = {}
    for i in range(int(repeats)):
        order = harness.alternate(CONTENDERS, i + 1)[-len(CONTENDERS):]  # round i of ABBA
        for contender in order:
            path = os.path.join(root, contender)
            job.delete(path)
            runs["save"][contender].append(job.timed(lambda c=contender, p=path: save(c, p, state))[0])
        for contender in order:
            path = os.path.join(root, contender)
            job.zero_target()
            job.on_primary(lambda p=path: evict(p))
            runs["load"][contender].append(job.timed(lambda c=contender, p=path: load(c, p, target))[0])
            if i == 0:
                exact[contender] = job.exact(target)
    job.dist.barrier()
    return {"rank": job.rank, "bytes": job.nbytes, "tensors": len(job.entries), "runs": runs, "exact": exact,
            "torch_xla_imported": dtensor_jobs.torch_xla_imported()}


def measure(settings: harness.Settings) -> dict:
    """One job of 4 processes per workload; blocks for minutes at scale 1."""
    scale, repeats, workdir = settings.scale, settings.repeats, settings.workdir
    workload_names = settings.option("workloads", ("large", "model"))
    out: dict = {"scale": scale, "repeats": repeats, "processes": PROCESSES, "workloads": {}}
    for workload in workload_names:
        root = os.path.join(workdir, f"dcp-storage-{workload}")
        print(f"dcp_storage: {PROCESSES} processes, {workload}, {repeats} rounds ...", file=sys.stderr, flush=True)
        answers = dtensor_jobs.run(__file__, [workload, scale, root, repeats])
        nbytes = answers[0]["bytes"]
        rounds = dtensor_jobs.rounds(answers, {op: CONTENDERS for op in OPERATIONS}, repeats)
        median = {op: {c: dtensor_jobs.summary(rounds[op][c], nbytes) for c in CONTENDERS} for op in OPERATIONS}
        out["workloads"][workload] = {
            "bytes": nbytes, "tensors": answers[0]["tensors"], "rounds": rounds, "median": median,
            "exact": {c: all(a["exact"][c] for a in answers) for c in CONTENDERS},
            "torch_xla_imported": any(a["torch_xla_imported"] for a in answers),
            "speedup": {op: median[op][BASELINE]["wall_s"] / median[op]["ours"]["wall_s"] for op in OPERATIONS},
            "cpu_ratio": {op: median[op]["ours"]["cpu_s"] / median[op][BASELINE]["cpu_s"] for op in OPERATIONS}}
        shutil.rmtree(root, ignore_errors=True)
    return out


def describe(result: dict) -> str:
    lines = [f"dcp.save / dcp.load, {result['processes']} processes, scale {result['scale']:g}, medians of "
             f"{result['repeats']} rounds (ABBA)"]
    for workload, r in result["workloads"].items():
        lines.append(f"  {workload}: {r['bytes'] / 2**30:.2f} GiB in {r['tensors']} tensors; bit-exact "
                     f"{r['exact']}; torch_xla imported: {r['torch_xla_imported']}")
        lines.append(f"    {'op':5} {'storage':11} {'wall s':>7} {'cpu s':>7} {'fresh B/B':>9} {'read B/B':>8} "
                     f"{'written B/B':>11}")
        for op in OPERATIONS:
            for c in CONTENDERS:
                m = r["median"][op][c]
                lines.append(f"    {op:5} {c:11} {m['wall_s']:7.2f} {m['cpu_s']:7.2f} "
                             f"{m['fresh_per_byte']:9.2f} {m['read_per_byte']:8.2f} "
                             f"{m['written_per_byte']:11.2f}")
            met = r["speedup"][op] >= GOALS[op] and r["cpu_ratio"][op] <= CPU_GOAL
            lines.append(f"    {op}: ours {r['speedup'][op]:.2f}x faster than FileSystem (goal >= {GOALS[op]}x), "
                         f"{r['cpu_ratio'][op]:.2f}x its CPU (goal <= {CPU_GOAL}x): {'met' if met else 'NOT met'}")
    return "\n".join(lines)


def run(settings: harness.Settings) -> harness.Result:
    """The case `dcp-storage`: one job of 4 processes per workload."""
    result = measure(settings)
    rows = [harness.footprint_row(c, r["rounds"][op][c], r["bytes"], group=f"{workload}: {op}")
            for workload, r in result["workloads"].items() for op in OPERATIONS for c in CONTENDERS]
    return harness.Result(rows, describe(result), result)


if __name__ == "__main__":
    harness.worker_main(worker)
