"""Many small arrays in few objects (issue 21): the `small` workload (2,000 tensors of 4 KiB-256 KiB, sharded
and replicated) saved and restored with format 2's default, one OCDBT store per item, against the same item with
one zarr array directory per tensor (`SaveOptions(use_ocdbt=False)`, the layout of format 1), on local disk and
on the GCS emulator, alternating, same run.

Reported per storage and layout: the files or objects of the item, the seconds of a synchronous `xtc.save`
(fsync on local disk) and of an `xtc.restore` onto another mesh (in process, after the save), medians (min-max);
16 of the tensors of the first and the last restore of each layout are compared with the saved state
bit for bit.

    python -m benchmarks small-arrays [--scale 1.0] [--repeats 5] [--set storage=local,gcs]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import torch  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import workloads  # noqa: E402
from object_stores import start_object_store  # noqa: E402
from worker import _disk_usage  # noqa: E402

import xla_tensorstore_ckpt as xtc  # noqa: E402
from xla_tensorstore_ckpt import storage  # noqa: E402

LAYOUTS = {"one OCDBT store (format 2)": True, "a directory per array": False}


def measure_at(root: str, scale: float, repeats: int) -> dict[str, dict[str, list]]:
    """Save and restore the small workload under `root` (a local directory or a gs:// prefix) `repeats` times
    per layout, alternating; seconds and object counts per layout."""
    state = workloads.build_state("small", scale)
    sample = list(state)[::max(1, len(state) // 16)]
    expected = {k: state[k].cpu() for k in sample}
    runs: dict[str, dict[str, list]] = {name: {"save_s": [], "restore_s": [], "files": [], "tensors": [len(state)]}
                                        for name in LAYOUTS}
    target = workloads.build_target("small", scale)  # xtc.restore leaves it alone: one serves every restore
    for i in range(repeats + 1):  # round 0 warms both paths up
        for name, use_ocdbt in LAYOUTS.items():
            path = f"{root}/{'ocdbt' if use_ocdbt else 'dirs'}-{i}"
            options = xtc.SaveOptions(use_ocdbt=use_ocdbt)
            start = time.perf_counter()
            xtc.save(path, state, options=options)
            saved = time.perf_counter() - start
            start = time.perf_counter()
            out = xtc.restore(path, target)
            restored = time.perf_counter() - start
            if i in (0, repeats):  # a sample: fetching one sharded tensor takes ~25 ms (a gather is compiled)
                wrong = [k for k in sample if not torch.equal(out[k].cpu(), expected[k])]
                if wrong:
                    raise SystemExit(f"{name}: restored values differ for {wrong[:3]}")
            files, _ = _disk_usage(path)
            del out
            storage.location(path).delete_tree()
            if i:
                runs[name]["save_s"].append(saved)
                runs[name]["restore_s"].append(restored)
                runs[name]["files"].append(files)
    return runs


def describe(where: str, runs: dict[str, dict[str, list]]) -> str:
    def fig(values: list[float]) -> str:
        return f"{harness.median(values):.3f} s ({min(values):.3f}-{max(values):.3f})"

    first = next(iter(runs.values()))
    lines = [f"{where}: {first['tensors'][0]:,} small tensors, median (min-max) of {len(first['save_s'])}"]
    for name, r in runs.items():
        lines.append(f"  {name:28s} {max(r['files']):5d} files  save {fig(r['save_s'])}  restore "
                     f"{fig(r['restore_s'])}")
    new, old = (runs[name] for name in LAYOUTS)

    def ratio(key: str) -> float:
        return harness.median(new[key]) / harness.median(old[key])

    lines.append(f"  format 2 / per-array directories: save {ratio('save_s'):.2f}x, restore {ratio('restore_s'):.2f}x "
                 "the time")
    return "\n".join(lines)


def run(settings: harness.Settings) -> harness.Result:
    """The case `small-arrays`: both layouts on each storage, alternating, in this process."""
    rows, texts, raw = [], [], {}
    for kind in settings.option("storage", ("local", "gcs")):
        server, root = start_object_store(kind)
        try:
            if server is not None:
                os.environ.update(server.environment)
                runs = measure_at(f"{root}/small-arrays", settings.scale, settings.repeats)
            else:
                with tempfile.TemporaryDirectory(prefix="xtc-bench-small-", dir=settings.workdir) as tmp:
                    runs = measure_at(tmp, settings.scale, settings.repeats)
        finally:
            if server is not None:
                server.stop()
        where = {"local": "local disk", "gcs": "GCS emulator", "s3": "moto S3"}[kind]
        raw[kind] = runs
        texts.append(describe(where, runs))
        rows += [harness.Row(name, {"save_s": harness.series(r["save_s"], "s"),
                                    "restore_s": harness.series(r["restore_s"], "s")}, where,
                             {"files": max(r["files"]), "tensors": r["tensors"][0]}) for name, r in runs.items()]
    return harness.Result(rows, "\n".join(texts), raw)


if __name__ == "__main__":
    harness.worker_main()
