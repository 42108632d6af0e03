"""A zstd-compressed item restored by this library's direct chunk reader against tensorstore's reader (which read
every compressed array before the direct reader decoded zstd), and against the same item raw (issue 65, item 6).

State: a 4-layer, width-512 decoder (benchmarks/bench_incremental.py) after 3 AdamW steps, its float32 weights and
moments (150 MB); saved raw and at zstd level 3, then restored into new CPU tensors `--repeats` times per mode
(page cache warm: the restore's own cost), medians of wall and CPU seconds, the modes alternating twice. Every
restore is compared bit for bit.

    python benchmarks/bench_zstd_restore.py [--repeats 7] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt.arrays import local_chunks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_incremental import VOCAB, Decoder  # noqa: E402


def _trained_state() -> dict:
    torch.manual_seed(0)
    model = Decoder(512, 4)
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


def _restore(path: str, state: dict, repeats: int, through_tensorstore: bool) -> tuple[float, float]:
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
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    state = _trained_state()
    root = tempfile.mkdtemp(prefix="bench-zstd-restore-", dir=args.dir)
    try:
        xtc.save(os.path.join(root, "raw"), state)
        xtc.save(os.path.join(root, "zstd"), state, options=xtc.SaveOptions(compression="zstd"))
        modes = (("raw", "direct", False), ("zstd", "direct", False), ("zstd", "tensorstore", True))
        for _ in range(2):
            for item, reader, through in modes:
                wall, cpu = _restore(os.path.join(root, item), state, args.repeats, through)
                print(f"{item:5} {reader:12} wall {wall:.3f} s  CPU {cpu:.3f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
