"""Which step a same-host restart reads warm (issue 65, item 6): the restore right after a save, and a restart on
the same host (the step's files still in the page cache) against a restart on a fresh host (the files evicted:
``posix_fadvise(DONTNEED)`` on every file of the step, which drops their clean pages as a new host would not
have them), for a step written around the page cache (``direct_io``, the persistent tier's default) and through
it (``SaveOptions.page_cache``, the local tier's default), beside torch_xla's CheckpointManager (DCP through
fsspec: buffered writes, then fsync) where torch_xla is installed.

CPU tensors: every contender, in a fresh process of its own, saves the same state (256 MiB x `--scale` of float32
in 16 tensors) with fsync, then restores it in place into preallocated tensors (as a resumed trainer does), warm
then cold, every restore compared with `torch.equal`; `--repeats` fresh steps each, after one uncounted (imports,
plan caches), medians. A restart in a fresh process adds the same interpreter and import time to every
contender, so it is left out.

    python -m benchmarks warm-restart [--repeats 7] [--scale 1] [--set dir=DIR]
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402
from fresh_process import evict  # noqa: E402

TENSORS = 16
PHASES = (("save", "save (fsync)"), ("warm", "restore after save"), ("cold", "restore, fresh host"))
NAMES = {"direct": "xtc direct_io", "cached": "xtc page_cache", "torch_xla": "torch_xla manager"}


class Ours:
    def __init__(self, root: str, page_cache: bool):
        self.root, self.page_cache = root, page_cache

    def save(self, step: int, state: dict) -> None:
        import xla_tensorstore_ckpt as xtc

        xtc.save(os.path.join(self.root, str(step)), state, options=xtc.SaveOptions(page_cache=self.page_cache))

    def restore(self, step: int, target: dict) -> dict:
        import xla_tensorstore_ckpt as xtc

        return xtc.restore(os.path.join(self.root, str(step)), target)


class TorchXla:
    def __init__(self, root: str):
        import torch.distributed as dist
        from torch_xla.experimental.distributed_checkpoint import CheckpointManager

        if not dist.is_initialized():  # DCP needs a process group, even of one
            with socket.socket() as s:  # a free port: other jobs may run beside this one
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        self.root = root
        self.manager = CheckpointManager(root, save_interval=1, chkpt_on_preemption=False)

    def save(self, step: int, state: dict) -> None:
        self.manager.save(step, state, force=True)

    def restore(self, step: int, target: dict) -> dict:
        self.manager.restore(step, target)
        return target


def _timed(action, *args, check: dict | None = None) -> tuple[float, float]:  # noqa: ANN001 - a bound method
    """Wall and CPU seconds of `action(*args)`; with `check`, what it returns must equal it, tensor by tensor
    (raises RuntimeError otherwise)."""
    import torch

    wall, cpu = time.perf_counter(), time.process_time()
    out = action(*args)
    seconds = time.perf_counter() - wall, time.process_time() - cpu
    if check is not None and not all(torch.equal(out[k], v) for k, v in check.items()):
        raise RuntimeError(f"a restore of step {args[0]} returned other values than were saved")
    return seconds


def worker(contender: str, root: str, mib_: str, repeats_: str) -> dict:
    """One contender in a fresh process (`harness.fresh`): `repeats` steps saved, restored warm and cold, after an
    uncounted first; per phase the walls and CPU seconds and their medians."""
    import torch

    rows_per_tensor = max(1, int(float(mib_) * (1 << 20)) // (TENSORS * 4096 * 4))
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(rows_per_tensor, 4096, generator=g) for i in range(TENSORS)}
    runner = TorchXla(root) if contender == "torch_xla" else Ours(root, contender == "cached")
    runs: dict[str, list] = {phase: [] for phase, _ in PHASES}
    for step in range(int(repeats_) + 1):  # the first, uncounted, warms up imports and plan caches
        target = {k: torch.empty_like(v) for k, v in state.items()}
        save = _timed(runner.save, step, state)
        warm = _timed(runner.restore, step, target, check=state)
        evict(os.path.join(root, str(step)))
        cold = _timed(runner.restore, step, target, check=state)
        shutil.rmtree(os.path.join(root, str(step)), ignore_errors=True)
        if step:
            for phase, seconds in (("save", save), ("warm", warm), ("cold", cold)):
                runs[phase].append(seconds)
    return {phase: {"wall": harness.median(w for w, _ in r), "cpu": harness.median(c for _, c in r),
                    "walls": [w for w, _ in r], "cpus": [c for _, c in r]} for phase, r in runs.items()}


def result(raw: dict, note: str = "") -> harness.Result:
    """The result set of the contenders' answers (``raw["results"]``, by name; ``raw["mib"]``): a row per contender
    (wall and CPU seconds of each phase); the text is the table of medians, GiB/s and CPU seconds, after `note`."""
    gib = raw["mib"] / 1024
    rows = [harness.Row(name, {f"{phase}_{what}_s": harness.series(r[phase][what + "s"], "s")
                               for phase, _ in PHASES for what in ("wall", "cpu")})
            for name, r in raw["results"].items()]
    lines = [note] if note else []
    lines += [f"{raw['mib']:g} MiB, medians of {raw['repeats']}: seconds (GiB/s), CPU seconds",
              f"{'variant':20} " + " ".join(f"{title:>{w}}" for (_, title), w in zip(PHASES, (22, 24, 24)))]
    for name, r in raw["results"].items():
        cells = [f"{r[k]['wall']:.3f} ({gib / r[k]['wall']:.2f}) {r[k]['cpu']:.2f}" for k, _ in PHASES]
        lines.append(f"{name:20} {cells[0]:>22} {cells[1]:>24} {cells[2]:>24}")
    return harness.Result(rows, "\n".join(lines), raw)


def run(settings: harness.Settings) -> harness.Result:
    """The case `warm-restart`: ours around and through the page cache, then torch_xla's manager where it is
    installed, each contender in a fresh process."""
    mib = 256 * settings.scale
    contenders = ["direct", "cached"] + (["torch_xla"] if importlib.util.find_spec("torch_xla") else [])
    base = tempfile.mkdtemp(prefix="xtc-warm-restart-", dir=settings.option("dir", "") or settings.workdir)
    results = {}
    try:
        for contender in contenders:
            results[NAMES[contender]] = harness.fresh(__file__, contender, os.path.join(base, contender), mib,
                                                      settings.repeats, what=f"the {NAMES[contender]} run")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return result({"mib": mib, "repeats": settings.repeats, "results": results})


if __name__ == "__main__":
    harness.worker_main(worker)
