"""A zstd-compressed item restored by this library's direct chunk reader against tensorstore's reader (which read
every compressed array before the direct reader decoded zstd), and against the same item raw (issue 65, item 6).

State: a 4-layer decoder of width 512 x `--scale` (benchmarks/bench_incremental.py) after 3 AdamW steps, its
float32 weights and moments (150 MB at scale 1); saved raw and at zstd level 3, then restored into new CPU tensors
`--repeats` times per mode (page cache warm: the restore's own cost), in this process, the modes taking turns ABBA
for ``--set rounds`` rounds; medians of wall and CPU seconds per round and over every restore. Every restore is
compared bit for bit.

    python -m benchmarks zstd-restore [--repeats 7] [--scale 1] [--set rounds=2] [--set dir=DIR]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402

# (item, reader): the raw item and the zstd one through the direct reader, the zstd one through tensorstore's.
MODES = ("raw direct", "zstd direct", "zstd tensorstore")


def _trained_state(width: int) -> dict:
    import torch
    from bench_incremental import VOCAB, Decoder

    torch.manual_seed(0)
    model = Decoder(width, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, VOCAB, (8, 65), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    moments = {f"{i}.{k}": v.clone() for i, s in enumerate(optimizer.state.values()) for k, v in s.items() if v.dim()}
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}, "optimizer": moments}


def _restore(path: str, state: dict, repeats: int, through_tensorstore: bool) -> tuple[list, list]:
    """`repeats` restores of `path`, wall and CPU seconds of each; raises RuntimeError if one differs from
    `state`."""
    import torch

    import xla_tensorstore_ckpt as xtc
    from xla_tensorstore_ckpt.arrays import local_chunks

    real = local_chunks._layout
    if through_tensorstore:  # the reader as it was: compressed arrays handed to tensorstore
        local_chunks._layout = lambda raw, meta: None if real(raw, meta) == "zstd" else real(raw, meta)
    try:
        walls, cpus = [], []
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            out = xtc.restore(path)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
            if not all(torch.equal(out[i][k], v) for i in state for k, v in state[i].items()):
                raise RuntimeError(f"{path} restored other values than were saved")
    finally:
        local_chunks._layout = real
    return walls, cpus


def run(settings: harness.Settings) -> harness.Result:
    """The case `zstd-restore`: the state trained and saved twice, then the modes' restores ABBA, in this
    process (the tensorstore mode patches the reader's choice)."""
    import bench_incremental

    import xla_tensorstore_ckpt as xtc

    width = bench_incremental.width(settings.scale)
    state = _trained_state(width)
    nbytes = sum(v.numel() * v.element_size() for part in state.values() for v in part.values())
    root = tempfile.mkdtemp(prefix="xtc-zstd-restore-", dir=settings.option("dir", "") or settings.workdir)
    lines = [f"width {width}: {nbytes / 1e6:.0f} MB of float32, zstd level "
             f"{xtc.SaveOptions.compression_level}; medians of {settings.repeats} warm "
             "restores per turn, in the order run"]
    try:
        xtc.save(os.path.join(root, "raw"), state)
        xtc.save(os.path.join(root, "zstd"), state, options=xtc.SaveOptions(compression="zstd"))

        def one(mode: str, _round: int) -> tuple[list, list]:
            item, reader = mode.split()
            walls, cpus = _restore(os.path.join(root, item), state, settings.repeats, reader == "tensorstore")
            lines.append(f"{item:5} {reader:12} wall {harness.median(walls):.3f} s  CPU {harness.median(cpus):.3f} s")
            return walls, cpus

        runs = harness.alternated(MODES, settings.option("rounds", 2), one)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = [harness.Row(mode, {"wall_s": harness.series([w for walls, _ in runs[mode] for w in walls], "s"),
                               "cpu_s": harness.series([c for _, cpus in runs[mode] for c in cpus], "s")})
            for mode in MODES]
    return harness.Result(rows, "\n".join(lines), {"bytes": nbytes, "width": width, "runs": runs})


if __name__ == "__main__":
    harness.worker_main()
