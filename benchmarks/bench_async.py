"""Asynchronous saves (issue: async saves): how long save() blocks the caller on each workload (the 1 GiB
2D-sharded state, 2,000 small tensors, the 2.4 GiB model), against the floor (copying the same shards to host
memory alone), the synchronous save, and torch_xla's CheckpointManager.save_async; and a training loop that saves
every step against the same loop without saves. Beside each save's blocking time, what the whole save (until
written) cost in the terms the library controls (benchmarks/footprint.py): user and system CPU seconds of the
process, fresh host memory touched and bytes written, per byte of state. In one process, each save after the
last has finished.

usage: python -m benchmarks async [--scale 1.0] [--repeats 5] [--set workloads=large,small,model]
                                  [--set loop_steps=20 (0: no loop)] [--set width=2048] [--set batch=2048]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import contenders  # noqa: E402
import footprint  # noqa: E402
import harness  # noqa: E402
import workloads  # noqa: E402

import xla_tensorstore_ckpt as xtc  # noqa: E402


def _range(values) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def _measured(save, finish) -> dict:
    """`save()` then `finish()` (until written), measured whole (footprint), with the time `save()` blocked."""
    blocked = {}

    def run() -> None:
        start = time.perf_counter()
        save()
        blocked["s"] = time.perf_counter() - start
        finish()

    measures, _ = footprint.measure(run)
    return {**measures, "blocking_s": blocked["s"]}


def blocking_times(state, tmp, repeats):
    """Per repeat, the measures of: the host copy of the shards alone, our async save, our sync save and
    torch_xla's save_async (`_measured`; the floor blocks for all of its time)."""
    tensors = list(state.values())
    sharded = [t for t in tensors if torch_xla._XLAC._get_xla_sharding_spec(t)]
    unsharded = [t for t in tensors if not torch_xla._XLAC._get_xla_sharding_spec(t)]
    floor, ours_async, ours_sync, theirs = [], [], [], []
    async_mgr = xtc.CheckpointManager(os.path.join(tmp, "async"), xtc.CheckpointManagerOptions(
        save_interval_steps=1, max_to_keep=1, save_rng=False))
    sync_mgr = xtc.CheckpointManager(os.path.join(tmp, "sync"), xtc.CheckpointManagerOptions(
        save_interval_steps=1, max_to_keep=1, save_rng=False, async_save=False))
    txla = contenders.TorchXlaManager(os.path.join(tmp, "txla"))

    def host_copy() -> None:
        shards = (torch_xla._XLAC._get_local_shards(sharded) if sharded else [],
                  torch_xla._XLAC._xla_get_cpu_tensors(unsharded) if unsharded else [])
        del shards

    for step in range(repeats + 1):  # step 0 warms every path up
        runs = []
        os.sync()
        runs.append(_measured(host_copy, lambda: None))
        os.sync()
        runs.append(_measured(lambda step=step: async_mgr.save(step, model=state), async_mgr.wait_until_finished))
        os.sync()
        runs.append(_measured(lambda step=step: sync_mgr.save(step, model=state), sync_mgr.wait_until_finished))
        os.sync()
        runs.append(_measured(lambda step=step: txla.manager.save_async(step, state, force=True), txla.manager.join))
        shutil.rmtree(os.path.join(tmp, "txla", str(step - 1)), ignore_errors=True)
        if step:
            for into, measures in zip((floor, ours_async, ours_sync, theirs), runs):
                into.append(measures)
    async_mgr.close()
    sync_mgr.close()
    return floor, ours_async, ours_sync, theirs


class Model(torch.nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x


LAYERS = 8


def loop_state_bytes(width: int) -> int:
    """Bytes of the loop's training state: the MLP's parameters and AdamW's two moments, float32."""
    return 3 * 4 * LAYERS * (width * width + width)


def loop_width(gib: float) -> int:
    """The MLP width whose training state (`loop_state_bytes`) is closest to `gib` GiB, a multiple of 8 (the
    4x2 mesh splits both dimensions of each weight)."""
    return max(8, round((gib * (1 << 30) / (3 * 4 * LAYERS)) ** 0.5 / 8) * 8)


def training_loop(root: str | None, steps, options: xtc.CheckpointManagerOptions | None, width: int,
                  batch: int, measures: dict | None = None) -> float:
    """Seconds of `steps` training steps of an 8-layer MLP with AdamW, FSDP-sharded on 4x2 devices, offering
    each step to a manager of the persistent root `root` (a path or URL: gs:// too) with `options` (None: no
    checkpoints, and `root` unused). `measures`, if given, receives benchmarks/footprint.py's measures of those
    steps plus the manager's close() (the last save's commit)."""
    mesh = xs.Mesh(np.arange(8), (4, 2), ("fsdp", "model"))
    torch.manual_seed(0)
    model = Model(width, LAYERS).to("xla")
    for layer in model.layers:
        xs.mark_sharding(layer.weight, mesh, ("fsdp", "model"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mgr = xtc.CheckpointManager(root, options) if options is not None else None
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(batch, width, generator=g) for _ in range(4)]

    def step(i):
        x = data[i % 4].to("xla")
        xs.mark_sharding(x, mesh, ("fsdp", None))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
        if mgr is not None:
            mgr.save(i, model=model, optimizer=opt, extra={"step": i})

    step(0)  # compile
    torch_xla._XLAC._xla_wait_device_ops(devices=[])
    if mgr is not None:
        mgr.wait_until_finished()  # the compile step's save is not part of the loop either

    def run() -> float:
        start = time.perf_counter()
        for i in range(1, steps + 1):
            step(i)
        torch_xla._XLAC._xla_wait_device_ops(devices=[])
        elapsed = time.perf_counter() - start
        if mgr is not None:
            mgr.close()  # the last save's commit is not part of the loop's time (the loop could go on)
        return elapsed

    measured, elapsed = footprint.measure(run)
    if measures is not None:
        measures.update(measured)
    return elapsed


def run(settings: harness.Settings) -> harness.Result:
    """The case `async`: each workload's blocking times and whole saves in this process, then the training loop.
    `batch` is rows per step: compute per state byte grows with it (real LLM steps have far more)."""
    loop_steps, width, batch = (settings.option(k, d) for k, d in (("loop_steps", 20), ("width", 2048),
                                                                    ("batch", 2048)))
    rows, lines = [], []
    with tempfile.TemporaryDirectory(prefix="xtc-bench-async-", dir=settings.workdir) as tmp:
        for workload in settings.option("workloads", ("large",)):
            state = workloads.build_state(workload, settings.scale)
            floor, ours_async, ours_sync, theirs = blocking_times(state, os.path.join(tmp, workload),
                                                                  settings.repeats)
            gib = workloads.state_bytes(state) / 2**30
            del state
            nbytes = gib * 2**30
            blocked = {name: [m["blocking_s"] for m in runs] for name, runs in
                       (("floor", floor), ("async", ours_async), ("sync", ours_sync), ("theirs", theirs))}
            f, a, s, t = (harness.median(blocked[name]) for name in ("floor", "async", "sync", "theirs"))
            lines.append(f"{workload} ({gib:.2f} GiB): time the caller is blocked by save(), median (min-max) of "
                  f"{settings.repeats}")
            lines.append(f"  host copy of the shards alone (floor)  {f:.3f} s")
            lines.append(f"  xtc async save()                       {a:.3f} s ({_range(blocked['async'])}) = "
                         f"{a / f:.2f}x the floor, {a / s:.2f} of the sync save")
            lines.append(f"  xtc sync save()                        {s:.3f} s")
            lines.append(f"  torch_xla CheckpointManager.save_async {t:.3f} s ({_range(blocked['theirs'])})  -> xtc "
                         f"blocks {t / a:.2f}x less")
            lines.append("  whole save, until written (medians): wall, CPU user + sys, fresh memory and bytes written "
                         "per byte of state")
            for label, runs in (("xtc async", ours_async), ("xtc sync", ours_sync),
                                ("torch_xla save_async", theirs)):
                lines.append(f"    {label:22} {harness.median(m['wall_s'] for m in runs):.3f} s, CPU "
                      f"{harness.median(m['user_s'] for m in runs):.2f} + "
                      f"{harness.median(m['system_s'] for m in runs):.2f} s, "
                      f"fresh {harness.median(m['fresh_bytes'] for m in runs) / nbytes:.2f} B/B, written "
                      f"{harness.median(m['written_bytes'] for m in runs) / nbytes:.2f} B/B")
                rows.append(harness.Row(label, {"blocking_s": harness.series([m["blocking_s"] for m in runs], "s"),
                                                **harness.footprint_metrics(runs, int(nbytes))}, workload))
            rows.append(harness.Row("floor (host copy alone)", {"blocking_s": harness.series(blocked["floor"], "s")},
                                    workload))
        if loop_steps == 0:
            return harness.Result(rows, "\n".join(lines))
        without = training_loop(None, loop_steps, None, width, batch)
        with_saves = training_loop(os.path.join(tmp, "loop"), loop_steps, xtc.CheckpointManagerOptions(
            save_interval_steps=1, max_to_keep=2), width, batch)
        params = LAYERS * (width * width + width)
        lines.append(f"training loop, {loop_steps} steps, {params / 1e6:.0f}M parameters + AdamW "
              f"({loop_state_bytes(width) / 2**20:.0f} MiB of state), batch {batch} x {width}, "
              f"saving every step ({without / loop_steps:.2f} s per step without):")
        lines.append(f"  without checkpoints {without:.2f} s, with {with_saves:.2f} s = {with_saves / without:.2f}x "
              "(goal <= 1.3x)")
        rows += [harness.Row("without checkpoints", {"seconds": harness.series([without], "s")}, "training loop"),
                 harness.Row("saving every step", {"seconds": harness.series([with_saves], "s")}, "training loop")]
    return harness.Result(rows, "\n".join(lines))


if __name__ == "__main__":
    harness.worker_main()
