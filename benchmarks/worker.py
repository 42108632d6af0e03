"""Runs one contender on one workload in this process and prints one JSON line of measurements.

usage: worker.py --worker CONTENDER WORKLOAD SCALE REPEATS DIR FLAGS
FLAGS: comma-separated, any of keep (keep the last step for a restore-only run), warm_restore (one uncounted
restore before the timed ones), restore_only (only restore the kept step, e.g. in a process with another device
count), resume (evict the kept step from the page cache, build the target, restore it once; the step stays for
the next resume). DIR: a local directory, gs:// or s3://bucket/prefix. Run by run.py (`harness.fresh`) in a
fresh process per contender so that peak memory is the contender's own; prints its answer as one JSON line.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import types

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import contenders  # noqa: E402
import footprint  # noqa: E402
import fresh_process  # noqa: E402
import harness  # noqa: E402
import workloads  # noqa: E402

from xla_tensorstore_ckpt import storage  # noqa: E402
from xla_tensorstore_ckpt.targets import xla as sharding  # noqa: E402


def _disk_usage(path: str) -> tuple[int, int]:
    if path.startswith("gs://"):
        from xla_tensorstore_ckpt.storage.gcs import _gcsfs

        sizes = _gcsfs().du(path[len("gs://"):], total=False)
        return len(sizes), sum(sizes.values())
    if path.startswith("s3://"):
        import boto3  # moto's dependency, so in every environment that can run an S3 server here

        bucket, _, prefix = path[len("s3://"):].partition("/")
        pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                               Prefix=prefix.rstrip("/") + "/")
        sizes = [item["Size"] for page in pages for item in page.get("Contents", ())]
        return len(sizes), sum(sizes)
    files = size = 0
    for root, _, names in os.walk(path):
        for n in names:
            files += 1
            size += os.path.getsize(os.path.join(root, n))
    return files, size


def _distinct_shard_bytes(state) -> int:
    total = 0
    for t, lay in zip(state.values(), sharding.layouts(list(state.values()))):
        total += sum(s.size for s in lay.distinct_shards()) * t.element_size()
    return total


PLACEMENT = "placement"  # not a contender: the floor of placing a restore's host data onto torch_xla tensors


def _placement(target: dict):
    """What a restore in place onto torch_xla 2.9 tensors must do once it has read the bytes, timed apart from
    reading them: each target tensor's host shards (made and touched here, untimed) placed on its devices the way
    the manager's restore places them (`sharding.place` with the target's device data released first, then
    `sharding.assign`; torch_xla copies each host shard, `AtenSource`, and PJRT copies that into the device
    buffer), returning when the last tensor is handed over, as the restore does. Returns the timed call."""
    tensors = list(target.values())
    lays = sharding.layouts(tensors)
    shards = []
    for tensor, lay in zip(tensors, lays):
        by_index = {shard.index: torch.ones(lay.shard_shape, dtype=tensor.dtype) for shard in lay.shards}
        shards.append([by_index[shard.index] for shard in lay.shards])

    def place() -> None:
        for tensor, lay, host in zip(tensors, lays, shards):
            sharding.assign([tensor], [sharding.place(tensor, lay, host, release_target=True)])

    return place


def worker(contender: str, workload: str, scale: str, repeats: str, directory: str, flags: str) -> dict:
    """One contender on one workload in this process (the arguments as the usage above says); its answer."""
    if workload not in workloads.WORKLOADS:
        raise ValueError(f"no workload {workload!r} (known: {', '.join(workloads.WORKLOADS)})")
    given = set(flags.split(",")) - {""}
    unknown = given - {"keep", "warm_restore", "restore_only", "resume"}
    if unknown:
        raise ValueError(f"unknown worker flag(s) {sorted(unknown)}")
    args = types.SimpleNamespace(contender=contender, workload=workload, scale=float(scale), repeats=int(repeats),
                                 dir=directory, **{flag: flag in given for flag in ("keep", "warm_restore",
                                                                                    "restore_only", "resume")})
    return _run(args)


def _run(args: types.SimpleNamespace) -> dict:
    entries, _ = workloads.specs(args.workload, args.scale)
    restore_specs = {name: spec for name, _, _, _, spec in entries}
    devices = xr.global_runtime_device_count()
    mesh_b = xs.Mesh(np.arange(devices), (2, devices // 2), ("a", "b"))

    def place(name: str, cpu: torch.Tensor) -> torch.Tensor:
        t = cpu.to("xla")
        if restore_specs[name] is not None:
            xs.mark_sharding(t, mesh_b, restore_specs[name])
        return t

    def timed_restores(contender: contenders.Contender) -> tuple[list[dict], dict]:
        """Restore the last saved step `args.repeats` times onto a fresh target each time (after one uncounted
        restore with --warm-restore, like the first save: lazy initialisation, first-touch of fresh buffers);
        the footprint of each (benchmarks/footprint.py: wall and CPU seconds, fresh memory, bytes read) and the
        last restored state."""
        restored = None
        if args.warm_restore:
            restored = contender.restore(args.repeats, workloads.build_target(args.workload, args.scale), place)
        measured = []
        for _ in range(args.repeats):
            target = workloads.build_target(args.workload, args.scale)
            del restored
            os.sync()
            measures, restored = footprint.measure(lambda target=target: contender.restore(args.repeats, target,
                                                                                           place))
            measured.append(measures)
        return measured, restored

    root = os.path.join(args.dir, "root")
    if args.resume and args.contender == PLACEMENT:
        target = workloads.build_target(args.workload, args.scale)
        measures, _ = footprint.measure(_placement(target))
        return {"contender": PLACEMENT, "workload": args.workload, "restore_s": [measures["wall_s"]],
                "footprint": measures}
    if args.resume:
        fresh_process.evict(args.dir)
        contender = contenders.CONTENDERS[args.contender](root)
        target = workloads.build_target(args.workload, args.scale)
        measures, _ = footprint.measure(lambda: contender.restore(args.repeats, target, place))
        result = {"contender": contender.name, "workload": args.workload, "restore_s": [measures["wall_s"]],
                  "footprint": measures}
        contender.close()
        return result
    if args.restore_only:
        contender = contenders.CONTENDERS[args.contender](root)
        result = {"contender": contender.name, "workload": args.workload, "devices": devices, "restore_s": []}
        measured, _ = timed_restores(contender)
        result["restore_s"] = [m["wall_s"] for m in measured]
        result["restore_footprint"] = measured
        contender.close()
        storage.location(args.dir).delete_tree()
        return result

    if "://" not in args.dir:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
    state = workloads.build_state(args.workload, args.scale)
    contender = contenders.CONTENDERS[args.contender](root)
    result = {"contender": contender.name, "workload": args.workload, "scale": args.scale, "devices": devices,
              "fsync": contender.fsync, "state_bytes": workloads.state_bytes(state),
              "distinct_shard_bytes": _distinct_shard_bytes(state), "save_s": [], "blocked_s": [],
              "restore_s": [], "restore_peak_extra_bytes": [], "save_footprint": [], "restore_footprint": []}

    def save(step: int) -> float:
        start = time.perf_counter()
        contender.save(step, state)
        blocked = time.perf_counter() - start
        contender.wait()
        return blocked

    # The first save in a fresh process shows the peak extra host memory (RSS high-water mark above the RSS
    # with the state built); it also warms up lazy initialisation, so its time is not counted.
    first, _ = footprint.measure(lambda: save(0))
    result["save_peak_extra_bytes"] = first["rss_growth_bytes"]
    result["files"], result["bytes_written"] = _disk_usage(contender.path(0) if args.contender != "torch.save"
                                                           else root)
    for step in range(1, args.repeats + 1):
        # Each measurement starts with no dirty pages; deleting the previous step lets the page cache reuse its
        # memory (first-touch of fresh memory is very slow in this VM and would add noise unrelated to I/O).
        contender.delete(step - 1)
        os.sync()
        measures, blocked = footprint.measure(lambda step=step: save(step))
        result["save_s"].append(measures["wall_s"])
        result["blocked_s"].append(blocked)
        result["save_footprint"].append(measures)
    result["restore_footprint"], restored = timed_restores(contender)
    result["restore_s"] = [m["wall_s"] for m in result["restore_footprint"]]
    result["restore_peak_extra_bytes"] = [m["rss_growth_bytes"] for m in result["restore_footprint"]]
    keys = list(state)[:: max(1, len(state) // 8)]
    result["restore_exact"] = all(torch.equal(restored[k].cpu(), state[k].cpu()) for k in keys)
    contender.close()
    if not args.keep:
        storage.location(args.dir).delete_tree()
    return result


if __name__ == "__main__":
    harness.worker_main(worker)
