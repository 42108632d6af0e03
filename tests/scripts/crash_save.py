"""A saving process that kills itself (SIGKILL, like kill -9) at a chosen point of a save.

usage: crash_save.py ROOT --kill-at OPERATION:N [--steps 1,2,3] [--async] [--max-to-keep K] [--plain]
                     [--incremental] [--delta] [--max-chain N]
Saves the given steps of a deterministic CPU state with a CheckpointManager on ROOT seen through a hooked storage
backend (tests/fault_backends.py); the N-th storage operation OPERATION (write, delete, open_array, file_written,
sync_files, ...) counted from the start of the last step's save kills the process before it runs. ``fsize:N``
kills it instead in the first write that takes a file past N bytes (the kernel's SIGXFSZ, RLIMIT_FSIZE): the
chunk data this process writes itself, around the storage backend. Exits 0 if the point was never reached.
Arrays go to an OCDBT store, or with --plain to one directory each. With --incremental, the manager's steps are
incremental and the state is `incremental_state_for` (most of it the same at every step); with --delta, delta
steps too (`max_chain` N, default 4), of `delta_state_for` (whose `b` moves a few elements a step).
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import sys
from collections import Counter

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fault_backends import hooked  # noqa: E402

import xla_tensorstore_ckpt as xtc  # noqa: E402


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(2048, generator=g).to(torch.bfloat16),
            "layers": [{"k": torch.randn(32, 32, generator=g)} for _ in range(4)], "step": step}


def incremental_state_for(step: int) -> dict:
    """`state_for(step)` whose `w` and `layers` are step 1's at every step: an incremental save references them."""
    return {**state_for(step), "w": state_for(1)["w"], "layers": state_for(1)["layers"]}


def delta_state_for(step: int) -> dict:
    """`incremental_state_for(step)` whose `b` is step 1's with 8 more elements moved one bf16 step at each
    step: a delta save stores it as a sparse delta on the step before."""
    b = state_for(1)["b"].view(torch.int16).clone()
    for s in range(2, step + 1):
        b[torch.arange(8) * 200 + s] += 1
    return {**incremental_state_for(step), "b": b.view(torch.bfloat16)}


class KillSwitch:
    """Kills the process at the N-th call of an operation, counting only once armed."""

    def __init__(self, point: str):
        self.operation, count = point.rsplit(":", 1)
        self.count = int(count)
        self.armed = False
        self.calls: Counter = Counter()

    def __call__(self, operation: str, path: str, count: int) -> None:
        if not self.armed:
            return
        self.calls[operation] += 1
        if operation == self.operation and self.calls[operation] == self.count:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--kill-at", required=True)
    parser.add_argument("--steps", default="1,2,3")
    parser.add_argument("--async", dest="async_save", action="store_true")
    parser.add_argument("--max-to-keep", type=int, default=None)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--incremental", action="store_true")
    parser.add_argument("--delta", action="store_true")
    parser.add_argument("--max-chain", type=int, default=4)
    args = parser.parse_args()
    state = delta_state_for if args.delta else incremental_state_for if args.incremental else state_for
    steps = [int(s) for s in args.steps.split(",")]
    options = xtc.CheckpointManagerOptions(
        save_interval_steps=1, max_to_keep=args.max_to_keep, async_save=args.async_save, save_rng=False,
        incremental=args.incremental or args.delta, delta=args.delta, max_chain=args.max_chain,
        save_options=xtc.SaveOptions(host_batch_bytes=4096,  # one small batch per array: staging interleaves
                                     use_ocdbt=not args.plain))
    switch = KillSwitch(args.kill_at)
    manager = xtc.CheckpointManager(hooked(args.root, switch), options)
    for step in steps:
        if step == steps[-1]:
            manager.wait_until_finished()  # count operations of the last save only
            switch.armed = True
            if switch.operation == "fsize":
                signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python starts with it ignored
                resource.setrlimit(resource.RLIMIT_FSIZE, (switch.count, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        manager.save(step, model=state(step))
    manager.close()


if __name__ == "__main__":
    main()
