"""Writes tests/golden/v2-unchecked: a checkpoint root of format version 2 as this library wrote it before its
JSON metadata files carried checksums (the writer of commit 86fd0f6).

It was run once (PJRT_DEVICE=CPU CPU_NUM_DEVICES=8, at the commit that added it); test_golden.py checks that it
keeps restoring bit for bit, with nothing to verify. Do not run it again: the point of the fixture is that it
was written by the old writer. Step 1 holds a model (OCDBT), a data loader position, `extra` values with string
leaves (so `_strings.json`) and the RNG states; step 2 a model in one directory per array.

usage: python tests/golden/make_v2_unchecked.py OUT_DIR
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def model_state(step: int) -> dict:
    """Deterministic values (no RNG involved)."""
    return {"w": torch.arange(48, dtype=torch.float32).reshape(8, 6) / (7 + step),
            "b": (torch.arange(5, dtype=torch.float32) - 2.5).to(torch.bfloat16) * step}


def extra_state() -> dict:
    return {"name": "run-a", "tokens": 1234567, "lr": 0.001, "pair": (1, "two")}


def loader_state(step: int) -> dict:
    return {"position": 60 * step, "epoch": step}


def main() -> None:
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    import xla_tensorstore_ckpt as xtc

    out = sys.argv[1]
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, async_save=False, max_to_keep=None)
    torch.manual_seed(31)
    with xtc.CheckpointManager(out, options) as manager:
        manager.save(1, model=model_state(1), extra=extra_state(), data_loader=loader_state(1),
                     metrics={"loss": 0.5})
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, async_save=False, max_to_keep=None,
                                           save_rng=False, save_options=xtc.SaveOptions(use_ocdbt=False))
    with xtc.CheckpointManager(out, options) as manager:
        manager.save(2, model=model_state(2), data_loader=loader_state(2))


if __name__ == "__main__":
    main()
