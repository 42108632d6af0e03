"""Multi-tier checkpoints (issue: multi-tier): on the 1 GiB 2D-sharded state, how long save() blocks with both
tiers due against one tier alone; a resume (restore("latest") onto fresh sharded targets) from the local tier
against one from the persistent tier; and a training loop whose state (MLP + AdamW) is 1 GiB too, saving the local
tier every step, and also the persistent tier every few steps, against the same loop without checkpoints. The
persistent tier is on local disk, the GCS emulator or moto's S3 server (--persistent gcs|s3), the training
loop's included. Medians (min-max) of repeats, variants interleaved. --scale scales every state (the loop's
width follows).

usage: python benchmarks/bench_multi_tier.py [--scale 1.0] [--repeats 5] [--loop-steps 10] [--loop-repeats 3]
                                            [--persistent-every 5] [--persistent local|gcs|s3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import torch_xla  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads  # noqa: E402
from bench_async import LAYERS, loop_state_bytes, loop_width, training_loop  # noqa: E402
from run import start_object_store  # noqa: E402

import xla_tensorstore_ckpt as xtc  # noqa: E402
from xla_tensorstore_ckpt import inspection, storage  # noqa: E402


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} s ({min(values):.3f}-{max(values):.3f})"


def options(local: str | None, *, persistent_every: int | None, local_every: int | None = None):
    return xtc.CheckpointManagerOptions(save_interval_steps=persistent_every, max_to_keep=1, save_rng=False,
                                        local_directory=local, local_save_interval_steps=local_every,
                                        local_max_to_keep=1)


def blocking(state: dict, root: str, tmp: str, repeats: int) -> dict[str, list[float]]:
    """Seconds save() blocks: persistent tier alone, local tier alone, both due."""
    managers = {
        "persistent tier alone": xtc.CheckpointManager(f"{root}/alone", options(None, persistent_every=1)),
        "local tier alone": xtc.CheckpointManager(f"{root}/unused", options(
            os.path.join(tmp, "local-alone"), persistent_every=None, local_every=1)),
        "both tiers due": xtc.CheckpointManager(f"{root}/both", options(
            os.path.join(tmp, "local-both"), persistent_every=1, local_every=1)),
    }
    times: dict[str, list[float]] = {name: [] for name in managers}
    for step in range(repeats + 1):  # step 0 warms every path up
        for name, manager in managers.items():
            manager.wait_until_finished()
            os.sync()
            start = time.perf_counter()
            manager.save(step, model=state)
            elapsed = time.perf_counter() - start
            manager.wait_until_finished()
            if step:
                times[name].append(elapsed)
    for manager in managers.values():
        manager.close()
    return times


def resumes(state: dict, root: str, tmp: str, repeats: int, scale: float) -> dict[str, list[float]]:
    """Seconds of restore("latest") onto fresh targets resharded 4x2 -> 2x4, from the local tier and from the
    persistent one."""
    local = os.path.join(tmp, "local-resume")
    with xtc.CheckpointManager(f"{root}/resume", options(local, persistent_every=1, local_every=1)) as manager:
        manager.save(1, model=state)
    times: dict[str, list[float]] = {"local tier": [], "persistent tier": []}
    for repeat in range(repeats + 1):
        for name, local_directory in (("local tier", local), ("persistent tier", None)):
            target = workloads.build_target("large", scale)
            with xtc.CheckpointManager(f"{root}/resume", options(
                    local_directory, persistent_every=1, local_every=1 if local_directory else None)) as manager:
                start = time.perf_counter()
                step = manager.restore("latest", model=target)
                torch_xla._XLAC._xla_wait_device_ops(devices=[])
                elapsed = time.perf_counter() - start
                tiers = manager.metadata(1).tiers
            if step != 1 or tiers != (("local", "persistent") if local_directory else ("persistent",)):
                raise RuntimeError(f"resume from the {name} did not restore step 1")
            if repeat:
                times[name].append(elapsed)
            del target
    return times


def loops(root: str, tmp: str, args: argparse.Namespace, width: int) -> dict[str, list[float]]:
    """Seconds of `args.loop_steps` training steps without checkpoints, saving the local tier every step, and
    saving it every step plus the persistent tier (at `root`: the object store when there is one) every
    `args.persistent_every` steps; `args.loop_repeats` times, the variants interleaved so that drift of this
    shared machine spreads over all of them."""
    variants = {
        "without checkpoints": None,
        "local tier every step": dict(persistent_every=None, local_every=1),
        f"local every step + persistent every {args.persistent_every}": dict(
            persistent_every=args.persistent_every, local_every=1),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.loop_repeats):
        for index, (name, kw) in enumerate(variants.items()):
            persistent, local = f"{root}/loop-{index}-{repeat}", os.path.join(tmp, f"loop-local-{index}-{repeat}")
            opts = None if kw is None else options(local, **kw)
            times[name].append(training_loop(persistent, args.loop_steps, opts, width, args.batch))
            if kw is not None and kw["persistent_every"] and not any(
                    s.status == "committed" for s in inspection.list_steps(persistent)):
                raise RuntimeError(f"the loop '{name}' committed no persistent step under {persistent}")
            shutil.rmtree(local, ignore_errors=True)  # a GiB per loop: only one loop's steps on disk at a time
            target = storage.location(persistent)
            if target.exists():
                target.delete_tree()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=float, default=1.0, help="the states: 1 GiB x scale")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loop-steps", type=int, default=10, help="0: no training loop")
    parser.add_argument("--loop-repeats", type=int, default=3)
    parser.add_argument("--persistent-every", type=int, default=5,
                        help="the loop's persistent interval; two persistent saves in a 10-step loop")
    parser.add_argument("--width", type=int, default=None,
                        help="the loop's MLP width (default: its training state is 1 GiB x scale)")
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--persistent", choices=("local", "gcs", "s3"), default="local")
    args = parser.parse_args()
    server, bucket = start_object_store(args.persistent)
    if server is not None:
        os.environ.update(server.environment)
    try:
        with tempfile.TemporaryDirectory(prefix="xtc-bench-tiers-") as tmp:
            root = bucket or os.path.join(tmp, "persistent")
            state = workloads.build_state("large", args.scale)
            where = {"gcs": "the GCS emulator", "s3": "moto's S3 server"}.get(args.persistent, "local disk")
            print(f"1 GiB x {args.scale}, persistent tier on {where}, local tier on local disk; "
                  f"median (min-max) of {args.repeats}")
            times = blocking(state, root, tmp, args.repeats)
            print("time save() blocks the caller:")
            for name, values in times.items():
                print(f"  {name:22s} {spread(values)}")
            both = statistics.median(times["both tiers due"])
            print(f"  both / persistent alone = {both / statistics.median(times['persistent tier alone']):.2f}x, "
                  f"both / local alone = {both / statistics.median(times['local tier alone']):.2f}x (goal <= 1.1x)")
            times = resumes(state, root, tmp, args.repeats, args.scale)
            print("resume (restore('latest') onto fresh targets resharded 4x2 -> 2x4, in process):")
            for name, values in times.items():
                print(f"  from the {name:16s} {spread(values)}")
            ratio = statistics.median(times["persistent tier"]) / statistics.median(times["local tier"])
            print(f"  the local tier resumes {ratio:.2f}x faster")
            del state
            if args.loop_steps == 0:
                return
            width = args.width or loop_width(args.scale)
            times = loops(root, tmp, args, width)
            without = statistics.median(times["without checkpoints"])
            print(f"training loop, {args.loop_steps} steps of {LAYERS * (width * width + width) / 1e6:.0f}M parameters "
                  f"+ AdamW ({loop_state_bytes(width) / 2**30:.2f} GiB of state), batch {args.batch} x {width}, "
                  f"{without / args.loop_steps:.2f} s per step without checkpoints; persistent saves to {where}; "
                  f"median (min-max) of {args.loop_repeats}, interleaved:")
            for name, values in times.items():
                goal = " (goal <= 1.2x)" if name == "local tier every step" else ""
                print(f"  {name:38s} {spread(values)} = {statistics.median(values) / without:.2f}x{goal}")
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
