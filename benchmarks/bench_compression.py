"""zstd-compressed saves (`SaveOptions(compression="zstd")`) against raw chunks (issue 65, item 1): what compression
saves in bytes and what it costs in save and restore time, on the benchmark workloads and on real trained values.

Workloads (benchmarks/workloads.py, sharded on 8 CPU devices, mesh 4x2; random normal values, which zstd barely
compresses: they show the cost): each run is a fresh process that times one `xtc.save` (fsync, direct writes, as
by default) into a new directory, measures what it stored, evicts it from the page cache and times a restore onto
another mesh (a cold, resharding restore); the modes alternate ABBA for `--repeats` rounds. The first run of each
mode is compared bit for bit. With ``--set storage=gcs``, into the GCS emulator (fake-gcs-server, started here), where
the restore's bytes are those that crossed the network.

Trained values (``--set trained=DIR``, a step directory of examples/train.py): every item of the step restored to host
memory, split into model weights, AdamW's first and second moments and the rest; each part saved raw and at each
level, its stored bytes compared (the ratio that matters: what real training leaves in the tensors); the weights
cast to bfloat16 too (what a BF16 run would store), and the XOR deltas of those with 1, 3 and 10 % of their
elements moved one bfloat16 step; then the whole state saved and restored raw and at level 3, in this process,
`--repeats` times each, medians.

    python -m benchmarks compression [--scale 1.0] [--repeats 7] [--set workloads=large,model] [--set levels=1,3]
                                     [--set storage=local|gcs]
    python -m benchmarks compression --set trained=CHECKPOINT_DIR/40 [--repeats 7] [--set levels=1,3,9]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402
from fresh_process import evict  # noqa: E402


def _options(mode: str):
    import xla_tensorstore_ckpt as xtc

    if mode == "raw":
        return xtc.SaveOptions()
    return xtc.SaveOptions(compression="zstd", compression_level=int(mode.split("-")[1]))


def _stored_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def worker(mode: str, workload: str, scale_: str, path: str, check: str) -> dict:
    import torch
    import torch_xla.runtime as xr

    xr.use_spmd()
    import footprint
    import workloads

    import xla_tensorstore_ckpt as xtc

    scale = float(scale_)
    state = workloads.build_state(workload, scale)
    save, _ = footprint.measure(lambda: xtc.save(path, state, options=_options(mode)))
    stored = _stored_bytes(path) if "://" not in path else None  # an object store: as on local disk
    evict(path)
    target = workloads.build_target(workload, scale)
    restore, restored = footprint.measure(lambda: xtc.restore(path, target))
    out = {"bytes": workloads.state_bytes(state), "stored": stored, "save": save, "restore": restore}
    if check == "1":
        out["bit_exact"] = all(torch.equal(restored[k].cpu(), v.cpu()) for k, v in state.items())
    return out


def _workloads(settings: harness.Settings, modes: list[str], lines: list[str], rows: list) -> None:
    from object_stores import start_object_store

    storage = settings.option("storage", "local")
    server, root = start_object_store(storage)
    env = server.environment if server is not None else {}
    try:
        for workload in settings.option("workloads", ("large", "model")):
            _workload(settings, modes, workload, root, env, lines, rows)
    finally:
        if server is not None:
            server.stop()


def _workload(settings: harness.Settings, modes: list[str], workload: str, root: str | None, env: dict,
              lines: list[str], rows: list) -> None:
    storage, count = settings.option("storage", "local"), iter(range(len(modes) * settings.repeats))
    with tempfile.TemporaryDirectory(prefix="xtc-compression-", dir=settings.workdir) as workdir:
        def one(mode: str, i: int) -> dict:
            path = os.path.join(workdir, "item") if root is None else f"{root}/{workload}-{next(count)}"
            answer = harness.fresh(__file__, mode, workload, settings.scale, path, "1" if i == 0 else "0", env=env,
                                   what=f"the {mode} run of {workload}")
            if root is None:
                shutil.rmtree(path)
            return answer

        runs = harness.alternated(modes, settings.repeats, one)
    nbytes = runs["raw"][0]["bytes"]
    exact = {m: all(r.get("bit_exact", True) for r in runs[m]) for m in modes}
    lines.append(f"{workload} ({nbytes / 2**30:.3f} GiB, 8 CPU devices, {storage}), fresh processes, medians of "
                 f"{settings.repeats} ABBA; save (fsync, direct where local) then a cold restore onto another mesh; "
                 f"bit-exact: {exact}")
    for mode in modes:
        def med(phase, key, mode=mode):
            return harness.median(r[phase][key] for r in runs[mode])

        def cpu(phase, mode=mode):
            return harness.median(r[phase]["user_s"] + r[phase]["system_s"] for r in runs[mode])

        stored = f"stored {harness.median(r['stored'] for r in runs[mode]) / nbytes:.3f} B/B  " \
            if root is None else ""
        read = "read" if root is None else "network"
        lines.append(f"  {mode:7} {stored}save wall {med('save', 'wall_s'):.3f} s CPU {cpu('save'):.2f} s  restore "
                     f"wall {med('restore', 'wall_s'):.3f} s CPU {cpu('restore'):.2f} s ({read} "
                     f"{med('restore', read + '_bytes') / nbytes:.2f} B/B)")
        for phase in ("save", "restore"):
            row = harness.footprint_row(mode, [r[phase] for r in runs[mode]], nbytes, group=f"{workload}: {phase}")
            if root is None and phase == "save":
                row.metrics["stored_bytes"] = harness.series([r["stored"] / nbytes for r in runs[mode]], "B/B")
            rows.append(row)


def _parts(step_dir: str) -> dict[str, dict]:
    """The trained state of a step, on the host, split by what the values are."""
    import torch

    import xla_tensorstore_ckpt as xtc
    from xla_tensorstore_ckpt.core.tree import flatten

    parts: dict[str, dict] = {"weights": {}, "exp_avg": {}, "exp_avg_sq": {}, "other": {}}
    for item in sorted(os.listdir(step_dir)):
        if not os.path.isdir(os.path.join(step_dir, item)):
            continue
        for path, value in flatten(xtc.restore(os.path.join(step_dir, item))):
            if not isinstance(value, torch.Tensor) or value.numel() <= 1:
                continue
            name = ".".join(map(str, (item, *path)))
            part = ("exp_avg_sq" if "exp_avg_sq" in name else "exp_avg" if "exp_avg" in name
                    else "weights" if item == "model" else "other")
            parts[part][name] = value
    return parts


def _trained(settings: harness.Settings, modes: list[str], lines: list[str], rows: list) -> None:
    import time

    import torch

    import xla_tensorstore_ckpt as xtc

    trained = settings.option("trained", "")
    parts = _parts(trained)
    parts["weights as bf16"] = {k: v.to(torch.bfloat16) for k, v in parts["weights"].items()}
    with tempfile.TemporaryDirectory(prefix="xtc-compression-", dir=settings.workdir) as workdir:
        lines.append(f"trained values of {trained}: stored bytes per raw byte (each part saved alone)")
        for part, state in parts.items():
            if not state:
                continue
            raw = sum(v.numel() * v.element_size() for v in state.values())
            ratios = []
            for mode in modes:
                path = os.path.join(workdir, part.replace(" ", "_") + mode)
                xtc.save(path, state, options=_options(mode))
                ratios.append(f"{mode} {_stored_bytes(path) / raw:.3f}")
                shutil.rmtree(path)
            dtypes = sorted({str(v.dtype).split(".")[-1] for v in state.values()})
            lines.append(f"  {part:16} {raw / 2**20:7.1f} MiB {'/'.join(dtypes):9} " + "  ".join(ratios))
        _xor_deltas(parts["weights as bf16"], lines)
        whole = {k: v for state in list(parts.values())[:4] for k, v in state.items()}
        nbytes = sum(v.numel() * v.element_size() for v in whole.values())
        lines.append(f"the whole state ({nbytes / 2**20:.1f} MiB) saved and restored in this process (warm page "
                     f"cache), medians of {settings.repeats}:")
        path = os.path.join(workdir, "whole")
        for mode in ("raw", "zstd-3"):
            saves, restores, options = [], [], _options(mode)
            for _ in range(settings.repeats):
                saves.append(_timed(lambda o=options: xtc.save(path, whole, options=o), time))
                restores.append(_timed(lambda: xtc.restore(path), time))
                shutil.rmtree(path)
            save_wall, save_cpu = (harness.median(s[i] for s in saves) for i in (0, 1))
            restore_wall, restore_cpu = (harness.median(r[i] for r in restores) for i in (0, 1))
            rows.append(harness.Row(mode, {f"{phase}_{what}": harness.series([t[k] for t in times], "s")
                                           for phase, times in (("save", saves), ("restore", restores))
                                           for k, what in ((0, "wall_s"), (1, "cpu_s"))}, "trained state"))
            lines.append(f"  {mode:7} save wall {save_wall:.3f} s CPU {save_cpu:.3f} s  restore wall "
                         f"{restore_wall:.3f} s CPU {restore_cpu:.3f} s")


def _xor_deltas(weights: dict, lines: list[str]) -> None:
    """What a lossless delta step would store (docs/incremental.md, item 3): the trained bfloat16 weights with a
    fraction of their elements moved one bfloat16 step (as small-learning-rate updates move them), XORed with the
    weights before, compressed. Simulated changes on real values: the pattern, not the fraction, is the guess."""
    import numpy as np
    import torch

    from xla_tensorstore_ckpt.arrays import zstd

    before = torch.cat([t.reshape(-1) for t in weights.values()]).view(torch.int16).numpy()
    rng = np.random.default_rng(0)
    lines.append("XOR deltas of the bfloat16 weights, zstd level 3, stored / raw:")
    for fraction in (0.01, 0.03, 0.10):
        after = before.copy()
        moved = rng.random(before.size) < fraction
        after[moved] += rng.choice(np.array([-1, 1], np.int16), int(moved.sum()))
        xor = memoryview((before ^ after).view(np.uint8))
        lines.append(f"  {fraction:4.0%} of elements changed: {len(zstd.compress(xor, 3)) / len(xor):.4f}")


def _timed(fn, time) -> tuple[float, float]:  # noqa: ANN001 - a callable and the time module
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def run(settings: harness.Settings) -> harness.Result:
    """The case `compression`: the workloads in fresh processes, or with ``--set trained=DIR`` a trained step."""
    modes = ["raw", *(f"zstd-{level}" for level in settings.option("levels", ("1", "3")))]
    lines: list[str] = []
    rows: list = []
    (_trained if settings.option("trained", "") else _workloads)(settings, modes, lines, rows)
    return harness.Result(rows, "\n".join(lines))


if __name__ == "__main__":
    harness.worker_main(worker)
