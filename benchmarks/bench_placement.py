"""Placing host data on torch_xla SPMD tensors through the two entry points torch_xla 2.9 offers (issue 36).

A restore onto torch_xla tensors ends by handing host data to torch_xla. Two bindings build a sharded tensor
from host memory:

- `cpu-shards`: ``_global_tensor_from_cpu_shards(shards, op_sharding, shape)``, one host tensor per device, as
  this library's `targets.xla.place` calls it. It copies every shard (``AtenSource``) before PJRT's transfer, and it
  holds the GIL while it does (no ``NoGilSection`` in its binding).
- `from-aten`: ``_xla_tensors_from_aten([global], [device], [XlaShardingSpec])``, the one whole host tensor, as
  torch_xla's data loader sends a sharded batch. It lets go of the GIL, but cuts the global tensor per device
  itself (``ShardingUtil::ShardTensor``: ``.contiguous()`` of each slice, then ``constant_pad_nd``, which copies
  even with no padding) before the same ``AtenSource`` copy.

Both place the `large` workload (1 GiB: 6 float32 and 4 bfloat16 tensors of 4096 x 8192, benchmarks/workloads.py)
onto its restore target (8 CPU devices, mesh 2x4), from host data made before the timed region, and wait until the
transfers are done. Each run is a fresh process; the contenders alternate (ABBA); the first run of each is checked
bit for bit. Measured (benchmarks/footprint.py): wall time, user and system CPU seconds and fresh memory; and the
GIL: a Python thread sleeping 1 ms in a loop records how late it wakes, so its longest lateness is about the
longest stretch for which something held the GIL (what a reading thread waits through; with both cores busy, the
OS's scheduling delay is in it too).

    python -m benchmarks placement [--repeats 7] [--scale 1]
"""

from __future__ import annotations

import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import footprint  # noqa: E402
import harness  # noqa: E402

CONTENDERS = ["cpu-shards", "from-aten"]


class _Lateness:
    """A thread that sleeps `tick` seconds in a loop and records how much later than asked it woke."""

    def __init__(self, tick: float = 0.001):
        self.tick, self.late, self._stop = tick, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            before = time.perf_counter()
            time.sleep(self.tick)
            self.late.append(time.perf_counter() - before - self.tick)

    def __enter__(self) -> _Lateness:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


def worker(contender: str, check: str, scale: str = "1.0") -> dict:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    import workloads

    xr.use_spmd()
    from xla_tensorstore_ckpt.targets import xla as sharding

    X = torch_xla._XLAC
    target = workloads.build_target("large", float(scale))
    names = list(target)
    entries = {name: spec for name, _, _, _, spec in workloads.specs("large", float(scale))[0]}
    generator = torch.Generator().manual_seed(0)
    host = {name: torch.randn(tuple(target[name].shape), generator=generator).to(target[name].dtype) for name in names}
    layouts = dict(zip(names, sharding.layouts([target[n] for n in names])))
    shards = {name: [host[name][tuple(slice(a, b) for a, b in s.index)].contiguous() for s in layouts[name].shards]
              for name in names}
    mesh = workloads.restore_mesh()  # the target's
    specs = {name: xs.ShardingSpec(mesh, entries[name]).xla_spec(host[name]) for name in names}
    device = str(torch_xla.device())
    xm.wait_device_ops()

    def place() -> dict:
        if contender == "cpu-shards":
            out = {n: sharding.place(target[n], layouts[n], shards[n]) for n in names}
        else:
            out = {n: X._xla_tensors_from_aten([host[n]], [device], [specs[n]])[0] for n in names}
        for tensor in out.values():
            sharding.wait_transferred(tensor)
        xm.wait_device_ops()
        return out

    with _Lateness() as lateness:
        measures, out = footprint.measure(place)
    measures["gil_longest_s"] = max(lateness.late, default=0.0)
    measures["gil_late_s"] = sum(lateness.late)
    if check == "check":
        measures["exact"] = all(torch.equal(out[n].cpu(), host[n]) and
                                X._get_xla_sharding_spec(out[n]) == X._get_xla_sharding_spec(target[n])
                                for n in names)
    measures["bytes"] = workloads.state_bytes(host)
    return measures


def run(settings: harness.Settings) -> harness.Result:
    """The case `placement`: each entry point in fresh processes, ABBA; the first run of each checked."""
    runs = harness.alternated(CONTENDERS, settings.repeats, lambda contender, i: harness.fresh(
        __file__, contender, "check" if i == 0 else "-", settings.scale, what=f"the placement by {contender}"))
    nbytes = runs[CONTENDERS[0]][0]["bytes"]
    lines = [f"placement: the large workload ({nbytes / 2**30:.2f} GiB) placed from host memory onto mesh 2x4 of 8 "
             f"CPU devices, fresh processes, ABBA, medians of {settings.repeats}"]
    walls = {c: harness.median(r["wall_s"] for r in rows) for c, rows in runs.items()}
    rows_ = []
    for contender, rows in runs.items():
        each = ", ".join(f"{r['wall_s']:.3f}" for r in rows)
        lines.append(f"  {contender:10} {walls[contender]:.3f} s ({each}); "
                     f"{footprint.summary(rows, nbytes, read=True).split(', read')[0]}; "
                     f"GIL held up to {harness.median(r['gil_longest_s'] for r in rows) * 1e3:.0f} ms at a stretch, "
                     f"{harness.median(r['gil_late_s'] for r in rows) * 1e3:.0f} ms in all; "
                     f"bit-exact {rows[0]['exact']}")
        metrics = harness.footprint_metrics(rows, nbytes)
        metrics.update(harness.footprint_metrics(rows, None, ("gil_longest_s", "gil_late_s")))
        rows_.append(harness.Row(contender, metrics, params={"exact": rows[0]["exact"]}))
    lines.append(f"  from-aten / cpu-shards: {walls['from-aten'] / walls['cpu-shards']:.2f}x the wall time")
    return harness.Result(rows_, "\n".join(lines), {"rounds": settings.repeats, "runs": runs})


if __name__ == "__main__":
    harness.worker_main(worker)
