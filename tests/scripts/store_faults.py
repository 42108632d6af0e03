"""Saves and restores through a flaky network (the parent points the object store's clients, GCS or S3, at a
fault-injecting proxy).

usage: store_faults.py ROOT STEPS -> one JSON line: {"committed": [...], "failed": {step: error}, "restored": [...]}
"""

from __future__ import annotations

import json
import sys

import torch

import xla_tensorstore_ckpt as xtc


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 128, generator=g), "layers": [torch.randn(64, 64, generator=g) for _ in range(6)],
            "step": step}


def main() -> None:
    root, steps = sys.argv[1], int(sys.argv[2])
    failed = {}
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=None, save_rng=False)
    with xtc.CheckpointManager(root, options) as mgr:
        for step in range(1, steps + 1):
            try:
                mgr.save(step, model=state_for(step))
                mgr.wait_until_finished()
            except xtc.CheckpointError as exc:
                failed[step] = str(exc)
        restored = []
        for step in mgr.all_steps():
            model = {"w": torch.zeros(256, 128), "layers": [torch.zeros(64, 64) for _ in range(6)], "step": 0}
            mgr.restore(step, model=model)
            expected = state_for(step)
            assert torch.equal(model["w"], expected["w"]) and model["step"] == step
            assert all(torch.equal(a, b) for a, b in zip(model["layers"], expected["layers"]))
            restored.append(step)
        print(json.dumps({"committed": mgr.all_steps(), "failed": failed, "restored": restored}))


if __name__ == "__main__":
    main()
