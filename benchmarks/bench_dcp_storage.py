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

    python benchmarks/bench_dcp_storage.py [--scale 1.0] [--repeats 7] [--workloads large,model] [--dir DIR]
        [--output FILE]
Writes benchmarks/results/dcp_storage.{json,txt} for the full run (default options, --repeats >= 7), else files in
the temporary directory (or --output).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import footprint  # noqa: E402
from bench_dtensor import PROCESSES, UNSET, _aggregate, _leaf, _local_value, _nest, _summary  # noqa: E402
from fresh_process import evict  # noqa: E402
from jobs import run_job  # noqa: E402

CONTENDERS = ("ours", "filesystem")
BASELINE = "filesystem"
OPERATIONS = ("save", "load")
GOALS = {"save": 1.5, "load": 1.3}  # DCP's FileSystem wall time over ours
CPU_GOAL = 0.5  # our CPU seconds over theirs, at most


def worker(workload: str, scale: float, root: str, repeats: int) -> dict:
    import math

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import workloads
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import xla_tensorstore_ckpt as xtc

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    entries = [(name, tuple(shape), dtype) for name, shape, dtype, _, _ in workloads.specs(workload, scale)[0]]

    def dtensor(local, shape):
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)

    state = _nest({name: dtensor(_local_value(i, shape, dtype, rank, world), shape)
                   for i, (name, shape, dtype) in enumerate(entries)})
    target = _nest({name: dtensor(torch.zeros_like(_leaf(state, name).to_local()), shape)
                    for name, shape, _ in entries})
    writers = {"ours": xtc.DCPStorageWriter, "filesystem": dcp.FileSystemWriter}
    readers = {"ours": xtc.DCPStorageReader, "filesystem": dcp.FileSystemReader}

    def save(contender: str, path: str, tree) -> None:
        dcp.save(tree, storage_writer=writers[contender](path))

    def load(contender: str, path: str, into) -> None:
        dcp.load(into, storage_reader=readers[contender](path))

    def on_primary(fn) -> None:
        dist.barrier()
        if rank == 0:
            fn()
        dist.barrier()

    def timed(fn) -> dict:
        dist.barrier()
        measures, _ = footprint.measure(fn)
        dist.barrier()
        return measures

    tiny = {"w": dtensor(torch.ones(4, 8), (4 * world, 8))}
    for contender in CONTENDERS:  # warm-up, untimed: imports, thread pools
        path = os.path.join(root, "warm-up", contender)
        save(contender, path, tiny)
        load(contender, path, {"w": dtensor(torch.zeros(4, 8), (4 * world, 8))})
    runs: dict = {op: {c: [] for c in CONTENDERS} for op in OPERATIONS}
    exact = {}
    for i in range(repeats):
        order = CONTENDERS if i % 2 == 0 else tuple(reversed(CONTENDERS))
        for contender in order:
            path = os.path.join(root, contender)
            on_primary(lambda p=path: shutil.rmtree(p, ignore_errors=True))
            runs["save"][contender].append(timed(lambda c=contender, p=path: save(c, p, state)))
        for contender in order:
            path = os.path.join(root, contender)
            with torch.no_grad():
                for name, _, _ in entries:
                    _leaf(target, name).to_local().zero_()
            on_primary(lambda p=path: evict(p))
            runs["load"][contender].append(timed(lambda c=contender, p=path: load(c, p, target)))
            if i == 0:
                exact[contender] = all(torch.equal(_leaf(target, n).to_local(), _leaf(state, n).to_local())
                                       for n, _, _ in entries)
    dist.barrier()
    return {"rank": rank, "bytes": workloads.spec_bytes(workload, scale), "tensors": len(entries), "runs": runs,
            "exact": exact, "torch_xla_imported": "torch_xla" in sys.modules}


def measure(scale: float, repeats: int, workdir: str, workload_names: tuple[str, ...]) -> dict:
    """One job of 4 processes per workload; blocks for minutes at scale 1."""
    out: dict = {"scale": scale, "repeats": repeats, "processes": PROCESSES, "workloads": {}}
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    for workload in workload_names:
        root = os.path.join(workdir, f"dcp-storage-{workload}")
        print(f"dcp_storage: {PROCESSES} processes, {workload}, {repeats} rounds ...", file=sys.stderr, flush=True)
        answers = run_job([os.path.abspath(__file__), "--worker", workload, str(scale), root, str(repeats)],
                          PROCESSES, env=env, timeout_s=4 * 3600)
        nbytes = answers[0]["bytes"]
        rounds = {op: {c: [_aggregate([a["runs"][op][c][i] for a in answers]) for i in range(repeats)]
                       for c in CONTENDERS} for op in OPERATIONS}
        median = {op: {c: _summary(rounds[op][c], nbytes) for c in CONTENDERS} for op in OPERATIONS}
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--workloads", default="large,model")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (a temporary directory in it)")
    parser.add_argument("--output", default=None)
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        workload, scale, root, repeats = args.worker
        print(json.dumps(worker(workload, float(scale), root, int(repeats))))
        return
    reference = (args.scale, args.workloads) == (1.0, "large,model") and args.repeats >= 7
    output = args.output or (os.path.join(HERE, "results", "dcp_storage.json") if reference else os.path.join(
        tempfile.gettempdir(), f"xtc-bench-dcp-storage-{args.scale:g}.json"))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="xtc-bench-dcp-storage-", dir=args.dir) as workdir:
        result = measure(args.scale, args.repeats, workdir, tuple(args.workloads.split(",")))
    result["seconds"] = time.perf_counter() - started
    text = (describe(result) + f"\n{time.strftime('%Y-%m-%d')}, python benchmarks/bench_dcp_storage.py --scale "
            f"{args.scale:g} --repeats {args.repeats} --workloads {args.workloads}: {result['seconds']:.0f} s")
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w") as f:
        json.dump({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **result}, f, indent=1)
    with open(os.path.splitext(output)[0] + ".txt", "w") as f:
        f.write(text + "\n")
    print(f"written {output}", file=sys.stderr)


if __name__ == "__main__":
    main()
