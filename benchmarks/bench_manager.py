"""Manager overhead (issue: CheckpointManager): the manager's own cost over the item save on the 1 GiB workload
(listing, marker, retention deletes), and latest_step() on a root with 1,000 committed steps.

usage: python -m benchmarks manager [--scale 1.0] [--repeats 7]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import workloads  # noqa: E402

import xla_tensorstore_ckpt as xtc  # noqa: E402
from xla_tensorstore_ckpt import formats  # noqa: E402
from xla_tensorstore_ckpt.core import layout  # noqa: E402
from xla_tensorstore_ckpt.saves import commit, save_plan, writing  # noqa: E402

ITEM_WORK = [0.0]  # seconds the manager spends in the item-level work it shares with xtc.save
_DEPTH = threading.local()  # timed calls nest (stage_and_write waits with wait_all): count the outermost only


def _timed(module, name):
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        depth = getattr(_DEPTH, "value", 0)
        _DEPTH.value = depth + 1
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            _DEPTH.value = depth
            if depth == 0:
                ITEM_WORK[0] += time.perf_counter() - start

    setattr(module, name, wrapper)


for _module, _name in ((save_plan, "plan_save"), (writing, "stage_and_write"), (commit, "finish_writes")):
    _timed(_module, _name)


def run(settings: harness.Settings) -> harness.Result:
    """The case `manager`: item and manager saves alternating in this process; then a root of 1,000 steps."""
    state = workloads.build_state("large", settings.scale)
    lines = []
    with tempfile.TemporaryDirectory(prefix="xtc-bench-manager-", dir=settings.workdir) as tmp:
        item_times, manager_times, own_times = [], [], []
        options = xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=1, async_save=False,
                                               save_rng=False)
        manager = xtc.CheckpointManager(os.path.join(tmp, "root"), options)
        xtc.save(os.path.join(tmp, "warm"), state)
        for step in range(1, settings.repeats + 1):
            # Both write a fresh directory each time; the previous copy is deleted outside the timing (the
            # manager deletes it on its background thread after the commit, as retention always does).
            shutil.rmtree(os.path.join(tmp, f"item{step - 1}"), ignore_errors=True)
            manager.wait_until_finished()
            os.sync()
            start = time.perf_counter()
            xtc.save(os.path.join(tmp, f"item{step}"), state)
            item_times.append(time.perf_counter() - start)
            os.sync()
            ITEM_WORK[0] = 0.0
            start = time.perf_counter()
            manager.save(step, model=state)  # commits, then deletes the previous step (max_to_keep=1)
            manager_times.append(time.perf_counter() - start)
            own_times.append(manager_times[-1] - ITEM_WORK[0])
        manager.close()
        item, managed = harness.median(item_times), harness.median(manager_times)
        own = harness.median(own_times)
        lines.append(f"manager's own work (listing, marker, retention decisions; measured inside the same save): "
              f"median {1000 * own:.1f} ms = {100 * own / managed:.2f}% of its save (goal: under 5%)")
        lines.append(f"end to end, manager save vs item save: {100 * (managed - item) / item:+.1f}% "
              "(separate saves: dominated by this machine's noise)")

        root = os.path.join(tmp, "many")
        for step in range(1000):
            os.makedirs(os.path.join(root, str(step)))
            marker = xtc.StepMetadata(step=step, items=("model",), created_at=0.0, committed_at=0.0,
                                      metrics={"loss": 1.0 / (step + 1)})
            with open(os.path.join(root, str(step), layout.CHECKPOINT_METADATA), "wb") as f:
                f.write(formats.encode_step(marker))
        start = time.perf_counter()
        many = xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(max_to_keep=None))
        opened = time.perf_counter() - start
        start = time.perf_counter()
        latest = many.latest_step()
        first = time.perf_counter() - start
        many.close()
        lines.append(f"1,000 committed steps: manager start (scan and validate every marker) {1000 * opened:.1f} ms, "
                     f"latest_step() {1000 * first:.3f} ms -> {latest} (goal: under 50 ms)")
    rows = [harness.Row("item save", {"seconds": harness.series(item_times, "s")}, "large"),
            harness.Row("manager save", {"seconds": harness.series(manager_times, "s")}, "large"),
            harness.Row("manager's own work", {"seconds": harness.series(own_times, "s")}, "large"),
            harness.Row("manager start", {"seconds": harness.series([opened], "s")}, "1,000 committed steps"),
            harness.Row("latest_step()", {"seconds": harness.series([first], "s")}, "1,000 committed steps")]
    return harness.Result(rows, "\n".join(lines))


if __name__ == "__main__":
    harness.worker_main()
