"""Checkpoints torch_xla's CheckpointManager wrote, restored by torch_xla and by this library, same files, same
run (issue 37).

Per workload (`large`: 1 GiB of 2D-sharded float32 and bfloat16; `model`: a ~200M-parameter decoder with its
AdamW moments, ~2.4 GiB; benchmarks/workloads.py), torch_xla's manager saves the state (8 CPU devices, mesh
4x2) as step 1 of its root. Then each contender restores it onto another mesh (2x4), in a fresh process with 8
devices, after the files are evicted from the page cache, the target built beforehand (untimed); the
contenders alternate ABBA, `--repeats` rounds (at least 7 for a measurement):

- torch_xla: its ``CheckpointManager(root).restore(1, target)`` (DCP's load with its SPMD planner), in place;
- xtc: ``xtc.restore(root/1, target)`` (each device's shard reads the byte ranges of the chunks it overlaps);
- xtc-manager: the one-line migration, ``CheckpointManager(new_root).restore("latest", model=target,
  init_from=root)``, in place.

Each reports (benchmarks/footprint.py) the wall time until the restored tensors are on their devices, the user
and system CPU seconds, the fresh host memory touched (peak resident set growth plus page cache growth; on CPU
devices the device buffers are host memory), and the bytes read from storage. The first round also checks
every restored tensor against the saved values (bit-exact). With ``--warm-memory`` a throwaway process
touches twice the checkpoint's bytes right before each timed process (this VM hands fresh memory back and forth
with its hypervisor; see docs/performance.md), and the results say which mode produced them.

Then, on the model checkpoint: ``xtckpt convert ROOT/1 OUT --to step --max-host-bytes 256MiB`` in a process of
its own (wall, CPU, peak host memory against the largest tensor plus the budget, and a bit-exact comparison of
the step it wrote), and how DCP's tensor entries are best read (the large checkpoint, page cache warm, in one
process, alternating): this library's reader, which takes each tensor's raw storage bytes at its
``torch.save`` record's offset and unpickles nothing, against ``torch.load(weights_only=True)`` on each entry's
byte range, both assembling the same full CPU tensors.

    python -m benchmarks torch_xla-import [--scale 1.0] [--repeats 7] [--set workloads=large,model]
        [--set warm_memory=1]
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import footprint  # noqa: E402
import harness  # noqa: E402
from fresh_process import evict, run_json  # noqa: E402

CONTENDERS = ("torch_xla", "xtc", "xtc-manager")
BASELINE = "torch_xla"
CONVERT_BUDGET = 256 << 20  # --max-host-bytes of the convert
ENTRY_READERS = ("raw", "torch.load")
ENV = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "TF_CPP_MIN_LOG_LEVEL": "3"}


# ------------------------------------------------------------------------------------------- worker processes


def _expected(workload: str, scale: float) -> dict:
    """The saved values on the host, in workloads.build_state's order of the same generator."""
    import torch
    import workloads

    entries, g = workloads.specs(workload, scale)
    return {name: torch.randn(shape, generator=g).to(dtype) for name, shape, dtype, _, _ in entries}


def worker_save(workload: str, scale: float, root: str) -> dict:
    import contenders
    import torch_xla.runtime as xr
    import workloads

    xr.use_spmd()
    state = workloads.build_state(workload, scale)
    manager = contenders.TorchXlaManager(root)
    manager.save(1, state)
    manager.wait()
    return {"bytes": workloads.state_bytes(state),
            "largest_tensor_bytes": max(t.numel() * t.element_size() for t in state.values())}


def worker_restore(contender: str, workload: str, scale: float, root: str, check: bool) -> dict:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    import workloads

    xr.use_spmd()
    import xla_tensorstore_ckpt as xtc  # imported by every contender: its import is not the restore's cost

    target = workloads.build_target(workload, scale)
    xm.wait_device_ops()

    # Each manager is opened before the clock starts, as a resuming job has it (torch_xla's needs the process
    # group it sets up).
    if contender == "torch_xla":
        import contenders

        manager = contenders.TorchXlaManager(root)
    elif contender == "xtc-manager":
        manager = xtc.CheckpointManager(root + "-resumed", xtc.CheckpointManagerOptions(save_rng=False))

    def restore() -> dict:
        if contender == "torch_xla":
            manager.restore(1, target, None)
            out = target
        elif contender == "xtc":
            out = xtc.restore(os.path.join(root, "1"), target)
        else:
            if manager.restore("latest", model=target, init_from=root) != 1:
                raise RuntimeError("the manager resumed from another step")
            out = target
        torch_xla.sync()
        xm.wait_device_ops()
        return out

    measures, restored = footprint.measure(restore)
    if contender != "xtc":
        manager.close()
    if check:
        expected = _expected(workload, scale)
        measures["exact"] = sorted(restored) == sorted(expected) and all(
            torch.equal(restored[k].cpu(), v) for k, v in expected.items())
    return measures


def worker_convert(source: str, out: str, budget: int) -> dict:
    from xla_tensorstore_ckpt import cli

    measures, status = footprint.measure(lambda: cli.main(
        ["convert", source, out, "--to", "step", "--max-host-bytes", str(budget)]))
    measures["status"] = status
    measures["torch_xla_imported"] = "torch_xla" in sys.modules
    return measures


def worker_compare(source: str, converted: str) -> dict:
    import torch

    import xla_tensorstore_ckpt as xtc

    a, b = xtc.restore(source), xtc.restore(os.path.join(converted, "model"))
    return {"exact": sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), "tensors": len(a)}


def worker_entries(step: str, repeats: int) -> dict:
    """Read every tensor of the DCP step `step` into full CPU tensors, alternating this library's raw reader and
    torch.load(weights_only=True) per entry; the page cache is warmed by an uncounted read of each."""
    import io

    import numpy as np
    import torch

    import xla_tensorstore_ckpt as xtc
    from xla_tensorstore_ckpt import formats, storage

    arrays = [meta for _, meta in formats.read_item(storage.location(step)).arrays()]

    def by_torch_load() -> dict:
        out = {}
        handles: dict[str, object] = {}
        try:
            for meta in arrays:
                full = torch.empty(meta.shape, dtype=getattr(torch, meta.dtype))
                for piece in meta.pieces:
                    f = handles.get(piece.file) or handles.setdefault(piece.file, open(os.path.join(step, piece.file),
                                                                                      "rb"))
                    f.seek(piece.start)
                    blob = torch.load(io.BytesIO(f.read(piece.length)), weights_only=True)
                    full[tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes))] = blob
                out[meta.path] = full
        finally:
            for f in handles.values():
                f.close()
        return out

    readers = {"raw": lambda: xtc.restore(step), "torch.load": by_torch_load}
    first = {name: read() for name, read in readers.items()}
    exact = sorted(first["raw"]) == sorted(first["torch.load"]) and all(
        torch.equal(first["raw"][k], first["torch.load"][k]) for k in first["raw"])
    del first
    runs = harness.alternated(list(readers), repeats, lambda name, _round: footprint.measure(readers[name])[0])
    nbytes = sum(int(np.prod(m.shape)) * torch.empty(0, dtype=getattr(torch, m.dtype)).element_size()
                 for m in arrays)
    return {"bytes": nbytes, "runs": runs, "exact": exact}


# ----------------------------------------------------------------------------------------------- the runner


def _run(args: list[str], what: str, devices: bool = True) -> dict:
    env = dict(os.environ, **ENV) if devices else dict(os.environ)
    return run_json([sys.executable, os.path.abspath(__file__), "--worker", *args], env, what)


def measure(settings: harness.Settings) -> dict:
    """Save each workload with torch_xla's manager, restore it `repeats` times per contender (fresh processes,
    ABBA), convert the model checkpoint, compare the entry readers. Blocks for minutes at scale 1."""
    scale, repeats, workdir = settings.scale, settings.repeats, settings.workdir
    workload_names = settings.option("workloads", ("large", "model"))
    warm_memory = settings.option("warm_memory", False)
    out: dict = {"scale": scale, "repeats": repeats, "mode": "warm-memory" if warm_memory else "cold-memory",
                 "workloads": {}}
    for workload in workload_names:
        root = os.path.join(workdir, workload)
        print(f"torch_xla-import: torch_xla's manager saves {workload} ...", file=sys.stderr, flush=True)
        saved = _run(["save", workload, str(scale), root], f"torch_xla's save of {workload}")
        def restore(contender: str, i: int, workload=workload, root=root, saved=saved) -> dict:
            evict(root)
            if warm_memory:
                footprint.warm_memory(2 * saved["bytes"])
            return _run(["restore", contender, workload, str(scale), root, str(int(i == 0))],
                        f"{contender}'s restore of {workload}")

        runs = harness.alternated(CONTENDERS, repeats, restore)
        result = {**saved, "runs": runs, "exact": all(runs[c][0]["exact"] for c in CONTENDERS),
                  "median": {c: harness.footprint_medians(runs[c], saved["bytes"]) for c in CONTENDERS}}
        base = result["median"][BASELINE]
        result["speedup"] = {c: base["wall_s"] / result["median"][c]["wall_s"] for c in CONTENDERS if c != BASELINE}
        result["cpu_ratio"] = {c: result["median"][c]["cpu_s"] / base["cpu_s"] for c in CONTENDERS if c != BASELINE}
        out["workloads"][workload] = result
        if workload == "model":
            converted = os.path.join(workdir, "converted", "1")
            evict(root)
            print("torch_xla-import: xtckpt convert of the model checkpoint ...", file=sys.stderr, flush=True)
            convert = _run(["convert", os.path.join(root, "1"), converted, str(CONVERT_BUDGET)], "xtckpt convert",
                           devices=False)
            convert.update(_run(["compare", os.path.join(root, "1"), converted], "the converted step's check",
                                devices=False))
            convert["budget_bytes"] = CONVERT_BUDGET
            convert["bound_bytes"] = saved["largest_tensor_bytes"] + CONVERT_BUDGET
            out["convert"] = convert
        if workload == "large":
            print("torch_xla-import: DCP entries, raw bytes against torch.load ...", file=sys.stderr, flush=True)
            entries = _run(["entries", os.path.join(root, "1"), str(repeats)], "the entry readers", devices=False)
            entries["median"] = {n: harness.footprint_medians(entries["runs"][n], entries["bytes"])
                                 for n in ENTRY_READERS}
            out["entries"] = entries
    return out


def describe(result: dict) -> str:
    """The result as the lines of the benchmark report."""
    gib = 2**30
    lines = [f"torch_xla-import: checkpoints torch_xla's CheckpointManager saved (8 devices, mesh 4x2), restored "
             f"onto mesh 2x4 in fresh processes, page cache evicted, {result['mode']}, medians of "
             f"{result['repeats']} (ABBA)"]
    for workload, r in result["workloads"].items():
        lines.append(f"  {workload} ({r['bytes'] / gib:.2f} GiB), bit-exact: {r['exact']}")
        for contender in CONTENDERS:
            m = r["median"][contender]
            versus = "" if contender == BASELINE else (f": {r['speedup'][contender]:.2f}x faster, "
                                                       f"{r['cpu_ratio'][contender]:.2f}x the CPU")
            lines.append(f"    {contender:12} {m['wall_s']:7.3f} s, CPU {m['cpu_s']:6.2f} s ({m['user_s']:.2f} user "
                         f"+ {m['system_s']:.2f} sys; {m['cpu_s'] / (r['bytes'] / gib):.2f} s/GiB), fresh memory "
                         f"{m['fresh_per_byte']:.2f} B/B ({m['rss_growth_per_byte']:.2f} resident + "
                         f"{m['page_cache_per_byte']:.2f} page cache), read {m['read_per_byte']:.2f} B/B{versus}")
    if "convert" in result:
        c = result["convert"]
        within = "within" if c["rss_growth_bytes"] <= c["bound_bytes"] else "OVER"
        lines.append(f"  xtckpt convert of the model checkpoint to a step (--max-host-bytes "
                     f"{c['budget_bytes'] >> 20} MiB): {c['wall_s']:.2f} s, CPU {c['user_s'] + c['system_s']:.2f} s, "
                     f"peak host memory +{c['rss_growth_bytes'] / 2**20:.0f} MiB (bound: largest tensor + budget = "
                     f"{c['bound_bytes'] / 2**20:.0f} MiB: {within}), "
                     f"wrote {c['written_bytes'] / gib:.2f} GiB, bit-exact: {c['exact']} ({c['tensors']} tensors)")
    if "entries" in result:
        e = result["entries"]
        raw, load = e["median"]["raw"], e["median"]["torch.load"]
        lines.append(f"  DCP tensor entries ({e['bytes'] / gib:.2f} GiB, page cache warm, one process): raw storage "
                     f"bytes {raw['wall_s']:.3f} s, CPU {raw['cpu_s']:.2f} s; torch.load(weights_only=True) per entry "
                     f"{load['wall_s']:.3f} s, CPU {load['cpu_s']:.2f} s: raw is {load['wall_s'] / raw['wall_s']:.2f}x "
                     f"faster, {raw['cpu_s'] / load['cpu_s']:.2f}x the CPU; same tensors: {e['exact']}")
    return "\n".join(lines)


def run(settings: harness.Settings) -> harness.Result:
    """The case `torch_xla-import`: per workload torch_xla's save, then the contenders' restores ABBA."""
    result = measure(settings)
    rows = [harness.footprint_row(c, r["runs"][c], r["bytes"], group=workload)
            for workload, r in result["workloads"].items() for c in CONTENDERS]
    if "entries" in result:
        rows += [harness.footprint_row(n, result["entries"]["runs"][n], result["entries"]["bytes"],
                                       group="DCP tensor entries") for n in ENTRY_READERS]
    return harness.Result(rows, describe(result), result)


def worker(kind: str, *rest: str) -> dict:
    """A fresh process's work: save, restore, convert, compare or entries (the runner's `_run` arguments)."""
    if kind == "save":
        return worker_save(rest[0], float(rest[1]), rest[2])
    if kind == "restore":
        return worker_restore(rest[0], rest[1], float(rest[2]), rest[3], rest[4] == "1")
    if kind == "convert":
        return worker_convert(rest[0], rest[1], int(rest[2]))
    if kind == "compare":
        return worker_compare(rest[0], rest[1])
    return worker_entries(rest[0], int(rest[1]))


if __name__ == "__main__":
    harness.worker_main(worker)
