"""Which step a same-host restart reads warm (issue 65, item 6): the restore right after a save, and a restart on
the same host (the step's files still in the page cache) against a restart on a fresh host (the files evicted:
``posix_fadvise(DONTNEED)`` on every file of the step, which drops their clean pages as a new host would not
have them), for a step written around the page cache (``direct_io``, the persistent tier's default) and through
it (``SaveOptions.page_cache``, the local tier's default), beside torch_xla's CheckpointManager (DCP through
fsspec: buffered writes, then fsync) where torch_xla is installed.

CPU tensors, one process: every variant saves the same state (`--mib` MiB of float32 in 16 tensors) with fsync,
then restores it in place into preallocated tensors (as a resumed trainer does), warm then cold; medians of
`--repeats` (a fresh step each time). A restart in a fresh process adds the same interpreter and import time to
every variant, so it is left out.

    python benchmarks/bench_warm_restart.py [--mib 256] [--repeats 7] [--dir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

import xla_tensorstore_ckpt as xtc

TENSORS = 16


def _evict(path: str) -> None:
    """Drop every file under `path` from the page cache (clean pages: the save synced them)."""
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Ours:
    def __init__(self, root: str, page_cache: bool):
        self.root, self.page_cache = root, page_cache
        self.name = "xtc page_cache" if page_cache else "xtc direct_io"

    def save(self, step: int, state: dict) -> None:
        xtc.save(os.path.join(self.root, str(step)), state, options=xtc.SaveOptions(page_cache=self.page_cache))

    def restore(self, step: int, target: dict) -> dict:
        return xtc.restore(os.path.join(self.root, str(step)), target)


class TorchXla:
    name = "torch_xla manager"

    def __init__(self, root: str):
        import torch.distributed as dist
        from torch_xla.experimental.distributed_checkpoint import CheckpointManager

        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29533")
            dist.init_process_group("gloo", rank=0, world_size=1)
        self.root = root
        self.manager = CheckpointManager(root, save_interval=1, chkpt_on_preemption=False)

    def save(self, step: int, state: dict) -> None:
        self.manager.save(step, state, force=True)

    def restore(self, step: int, target: dict) -> dict:
        self.manager.restore(step, target)
        return target


def _timed(action, *args, check: dict | None = None) -> tuple[float, float]:
    """Wall and CPU seconds of `action(*args)`; with `check`, what it returns must equal it, tensor by tensor."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = action(*args)
    seconds = time.perf_counter() - wall, time.process_time() - cpu
    if check is not None and not all(torch.equal(out[k], v) for k, v in check.items()):
        raise RuntimeError("a restore returned other values than were saved")
    return seconds


def run(contender, state: dict, repeats: int) -> dict:
    rows = []
    for step in range(repeats + 1):  # the first, uncounted, warms up imports and plan caches
        target = {k: torch.empty_like(v) for k, v in state.items()}
        save = _timed(contender.save, step, state)
        warm = _timed(contender.restore, step, target, check=state)
        _evict(os.path.join(contender.root, str(step)))
        cold = _timed(contender.restore, step, target, check=state)
        shutil.rmtree(os.path.join(contender.root, str(step)), ignore_errors=True)
        if step:
            rows.append({"save": save, "warm": warm, "cold": cold})
    return {k: {"wall": statistics.median(r[k][0] for r in rows), "cpu": statistics.median(r[k][1] for r in rows)}
            for k in ("save", "warm", "cold")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = args.mib * (1 << 20) // (TENSORS * 4096 * 4)
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(rows, 4096, generator=g) for i in range(TENSORS)}
    base = tempfile.mkdtemp(prefix="bench-warm-", dir=args.dir)
    results = {}
    try:
        contenders = [lambda: Ours(os.path.join(base, "direct"), False),
                      lambda: Ours(os.path.join(base, "cached"), True)]
        try:
            import torch_xla  # noqa: F401

            contenders.append(lambda: TorchXla(os.path.join(base, "torch_xla")))
        except ImportError:
            pass
        for make in contenders:
            contender = make()
            results[contender.name] = run(contender, state, args.repeats)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    gib = args.mib / 1024
    print(f"{args.mib} MiB, medians of {args.repeats}: seconds (GiB/s), CPU seconds")
    print(f"{'variant':20} {'save (fsync)':>22} {'restore after save':>24} {'restore, fresh host':>24}")
    for name, r in results.items():
        cells = [f"{r[k]['wall']:.3f} ({gib / r[k]['wall']:.2f}) {r[k]['cpu']:.2f}" for k in ("save", "warm", "cold")]
        print(f"{name:20} {cells[0]:>22} {cells[1]:>24} {cells[2]:>24}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mib": args.mib, "repeats": args.repeats, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
