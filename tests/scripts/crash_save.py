"""A saving process that kills itself (SIGKILL, like kill -9) at a chosen point of a save.

usage: crash_save.py ROOT --kill-at MODULE.FUNCTION:N [--steps 1,2,3] [--async] [--max-to-keep K]
Saves the given steps of a deterministic CPU state with a CheckpointManager; the N-th call of MODULE.FUNCTION
(a module of xla_tensorstore_ckpt, or os) counted from the start of the last step's save kills the process
before the call runs. Exits 0 if the point was never reached.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import arrays, saving, storage  # noqa: F401 - patched by name


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(2048, generator=g).to(torch.bfloat16),
            "layers": [{"k": torch.randn(32, 32, generator=g)} for _ in range(4)], "step": step}


def install(target: str) -> None:
    name, count = target.rsplit(":", 1)
    module_name, function_name = name.rsplit(".", 1)
    module = globals()[module_name]
    real = getattr(module, function_name)
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == int(count):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    setattr(module, function_name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--kill-at", required=True)
    parser.add_argument("--steps", default="1,2,3")
    parser.add_argument("--async", dest="async_save", action="store_true")
    parser.add_argument("--max-to-keep", type=int, default=None)
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    options = xtc.CheckpointManagerOptions(
        save_interval_steps=1, max_to_keep=args.max_to_keep, async_save=args.async_save, save_rng=False,
        save_options=xtc.SaveOptions(host_batch_bytes=4096))  # one small batch per array: many staging points
    manager = xtc.CheckpointManager(args.root, options)
    for step in steps:
        if step == steps[-1]:
            manager.wait_until_finished()  # count calls of the last save only
            install(args.kill_at)
        manager.save(step, model=state_for(step))
    manager.close()


if __name__ == "__main__":
    main()
