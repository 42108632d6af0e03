"""Loading Hugging Face safetensors onto an FSDP-sharded model: this library against the usual path, same files,
same run.

The `model` workload's tensors (a ~200M-parameter decoder with its AdamW moments, ~2.4 GiB of float32 at scale
1) are written as a Hugging Face checkpoint: `model-0000k-of-0000n.safetensors` files of about 1/5 of the
total each, plus `model.safetensors.index.json` (Hugging Face's 5 GB shards, scaled down to a few files). Each
contender then runs in a fresh process with 8 devices, after the files have been evicted from the page cache:
it builds the model (zeros, FSDP-sharded over the first mesh axis; untimed), then loads the weights into it:

- usual: for each file, ``safetensors.torch.load_file`` (the whole file on the host), then for each tensor
  ``.to("xla")`` and ``mark_sharding`` onto the model's mesh, replacing the model's tensor;
- xtc: ``CheckpointManager.restore("latest", model=..., init_from=<the directory>)`` on an empty root: each
  device's shard reads its own byte ranges and is swapped in batch by batch;
- xtc-budget: the same with ``RestoreOptions(max_host_bytes=256 MiB)``: batches within the budget, and the
  freed host memory returned to the OS after each (see xla_tensorstore_ckpt/core/host_memory.py).

Reported: the seconds until every tensor is on its devices, and the peak growth of the process's resident
memory above the built model (on CPU devices the devices' buffers are host memory too, and the model's own
are not counted); beside them (benchmarks/footprint.py) the CPU seconds, the fresh memory touched (that growth
plus the page cache's) and the bytes read from the disk, per byte of the files. The contenders take turns ABBA;
with ``--warm-memory`` a throwaway process touches twice the files' bytes right before each run. The loaded
values are checked against the files. Prints one JSON line.

    python -m benchmarks hf-import [--scale 1.0] [--repeats 7] [--set warm_memory=1]
"""

from __future__ import annotations

import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import footprint  # noqa: E402
import harness  # noqa: E402
from fresh_process import evict, run_json  # noqa: E402

FILES = 5
BUDGET = 256 << 20  # the xtc-budget contender's RestoreOptions.max_host_bytes


def write_hf_checkpoint(directory: str, scale: float) -> tuple[int, int]:
    """The `model` workload's tensors as Hugging Face files in `directory` (files filled in order up to 1/FILES
    of the total, so FILES or FILES + 1 of them); returns their total bytes and the number of files."""
    import torch
    import workloads
    from safetensors.torch import save_file

    entries, g = workloads.specs("model", scale)

    def nbytes_of(shape, dtype) -> int:
        return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()

    total = sum(nbytes_of(shape, dtype) for _, shape, dtype, _, _ in entries)
    limit = -(-total // FILES)
    groups: list[list] = [[]]
    size = 0
    for entry in entries:
        nbytes = nbytes_of(entry[1], entry[2])
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += nbytes
    os.makedirs(directory, exist_ok=True)
    weight_map = {}
    for k, group in enumerate(groups, 1):
        name = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        tensors = {hf_name(n): torch.randn(shape, generator=g).to(dtype) for n, shape, dtype, _, _ in group}
        save_file(tensors, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update({key: name for key in tensors})
        del tensors
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total, len(groups)


def hf_name(name: str) -> str:
    return name.replace("/", ".")


_WORKER = r"""
import json, os, sys
sys.path.insert(0, {here!r})
import numpy as np, torch, torch_xla, torch_xla.core.xla_model as xm, torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
xr.use_spmd()
import workloads
from safetensors import safe_open
from safetensors.torch import load_file
import footprint
import xla_tensorstore_ckpt as xtc  # imported by both: the library's import is not the load's memory

directory, contender, budget = {directory!r}, {contender!r}, {budget!r}
mesh = xs.Mesh(np.arange(8), (8,), ("fsdp",))
entries, _ = workloads.specs("model", {scale!r})
model, specs = {{}}, {{}}
for name, shape, dtype, _, _ in entries:
    key = name.replace("/", ".")
    specs[key] = ("fsdp",) + (None,) * (len(shape) - 1)
    model[key] = torch.zeros(shape, dtype=dtype, device="xla")
    xs.mark_sharding(model[key], mesh, specs[key])
torch_xla.sync()
xm.wait_device_ops()
with open(os.path.join(directory, "model.safetensors.index.json")) as f:
    files = sorted(set(json.load(f)["weight_map"].values()))

def load():
    if contender == "usual":
        for name in files:
            state = load_file(os.path.join(directory, name))
            for key, tensor in state.items():
                placed = tensor.to("xla")
                xs.mark_sharding(placed, mesh, specs[key])
                model[key] = placed
            del state, tensor
            torch_xla.sync()
        xm.wait_device_ops()
    else:
        options = xtc.CheckpointManagerOptions(save_rng=False,
                                               restore_options=xtc.RestoreOptions(max_host_bytes=budget))
        with xtc.CheckpointManager({root!r}, options) as manager:
            assert manager.restore("latest", model=model, init_from=directory) is None

measures, _ = footprint.measure(load)
seconds, peak = measures["wall_s"], measures["rss_growth_bytes"]
exact = True
for name in files:
    with safe_open(os.path.join(directory, name), "pt") as f:
        for key in list(f.keys())[::7]:  # every 7th tensor: enough to catch a wrong offset or dtype
            exact = exact and torch.equal(model[key].cpu(), f.get_tensor(key))
print(json.dumps({{"seconds": seconds, "peak_host_bytes": peak, "exact": bool(exact), "footprint": measures}}))
"""


def run_worker(contender: str, directory: str, root: str, scale: float) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8", TF_CPP_MIN_LOG_LEVEL="3")
    budget = BUDGET if contender == "xtc-budget" else None
    script = _WORKER.format(here=HERE, directory=directory, contender=contender, scale=scale, root=root,
                            budget=budget)
    return run_json([sys.executable, "-c", script], env, contender)


def measure(settings: harness.Settings) -> dict:
    """Write the files, then alternate the contenders `repeats` times (ABBA), each in a fresh process after
    evicting the files from the page cache (and with `warm_memory`, after a process that touched twice their
    bytes)."""
    scale, repeats, workdir = settings.scale, settings.repeats, settings.workdir
    warm_memory = settings.option("warm_memory", False)
    directory = os.path.join(workdir, "hf")
    total, files = write_hf_checkpoint(directory, scale)
    count = iter(range(3 * repeats))

    def load(contender: str, _round: int) -> dict:
        evict(directory)
        if warm_memory:
            footprint.warm_memory(2 * total)
        return run_worker(contender, directory, os.path.join(workdir, f"run-{next(count)}"), scale)

    runs = harness.alternated(["usual", "xtc", "xtc-budget"], repeats, load)
    median = {c: {k: harness.median(r[k] for r in rs) for k in ("seconds", "peak_host_bytes")}
              for c, rs in runs.items()}
    return {"bytes": total, "files": files, "runs": runs, "median": median,
            "mode": "warm-memory" if warm_memory else "cold-memory",
            "exact": all(r["exact"] for rs in runs.values() for r in rs),
            "speedup": {c: median["usual"]["seconds"] / median[c]["seconds"] for c in ("xtc", "xtc-budget")},
            "memory_ratio": {c: median[c]["peak_host_bytes"] / median["usual"]["peak_host_bytes"]
                             for c in ("xtc", "xtc-budget")}}


def describe(result: dict) -> str:
    """The result as the lines of the benchmark report."""
    m = result["median"]
    usual = m["usual"]
    lines = [f"hf-import: {result['bytes'] / 2**30:.2f} GiB in {result['files']} safetensors files onto an FSDP "
             f"mesh of 8 devices, fresh process, page cache evicted, {result['mode']}, "
             f"ABBA (medians of {len(result['runs']['usual'])})",
             f"  usual path (load_file, .to, mark_sharding): {usual['seconds']:.3f} s, peak host "
             f"+{usual['peak_host_bytes'] / 2**20:.0f} MiB"]
    for contender, label in (("xtc", "this library (manager init_from)"),
                             ("xtc-budget", f"with max_host_bytes={BUDGET >> 20} MiB")):
        lines.append(f"  {label}: {m[contender]['seconds']:.3f} s, peak host "
                     f"+{m[contender]['peak_host_bytes'] / 2**20:.0f} MiB: {result['speedup'][contender]:.2f}x "
                     f"faster, {result['memory_ratio'][contender]:.2f}x the peak host memory")
    for contender, runs in result["runs"].items():
        measured = [r["footprint"] for r in runs]
        lines.append(f"  {contender:10} {footprint.summary(measured, result['bytes'], read=True)}")
    lines.append(f"  exact: {result['exact']}")
    return "\n".join(lines)


def run(settings: harness.Settings) -> harness.Result:
    """The case `hf-import`: the safetensors files written once, loaded by each contender, ABBA."""
    result = measure(settings)
    rows = []
    for contender, runs in result["runs"].items():
        row = harness.footprint_row(contender, [r["footprint"] for r in runs], result["bytes"])
        row.metrics["peak_host_bytes"] = harness.series([r["peak_host_bytes"] for r in runs], "B")
        rows.append(row)
    return harness.Result(rows, describe(result), result)


if __name__ == "__main__":
    harness.worker_main()
