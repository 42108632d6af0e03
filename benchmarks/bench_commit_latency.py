"""Commit latency of a synchronous manager save while another process writes to the same file system.

A training host also runs data loaders and log writers. A save that makes its files durable with one `syncfs`
waits for every dirty page of the file system, theirs included; a save that syncs exactly its own files and
directories does not. This measures a small synchronous save (16 tensors, 1 MiB) on a quiet machine and while a
second process writes 1 GiB files in a loop (no fsync, as a data pipeline writing shards or a logger would), in
the same run, and prints the medians and the ratio. Saves come `--interval` seconds apart, as training steps
would put them: in between, the other writer's dirty pages pile up.

    python benchmarks/bench_commit_latency.py [--saves 15] [--interval 2] [--dir /path/on/the/same/file/system]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import xla_tensorstore_ckpt as xtc  # noqa: E402


def other_writer(directory: str, stop: multiprocessing.Event, started: multiprocessing.Event) -> None:
    """Write 1 GiB files in 64 MiB blocks until told to stop, never syncing; keep the last three (deleting a
    file would drop its dirty pages instead of writing them)."""
    block = os.urandom(64 << 20)
    written: list[str] = []
    while not stop.is_set():
        path = os.path.join(directory, f"other-writer-{len(written)}.bin")
        written.append(path)
        with open(path, "wb") as f:
            for _ in range(16):
                f.write(block)
                started.set()
                if stop.is_set():
                    break
        if len(written) > 3:
            os.remove(written[-4])


def time_saves(root: str, saves: int, interval: float) -> list[float]:
    state = {f"w{i}": torch.randn(128, 128) for i in range(16)}
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=2, async_save=False, save_rng=False)
    times = []
    with xtc.CheckpointManager(root, options) as manager:
        for step in range(1, saves + 1):
            time.sleep(interval)  # training steps between saves, while the other writer goes on
            start = time.perf_counter()
            manager.save(step, model=state)
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--saves", type=int, default=15)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between saves (not timed)")
    parser.add_argument("--dir", default=None, help="a directory on the file system to measure (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as base:
        os.sync()
        quiet = time_saves(os.path.join(base, "quiet"), args.saves, args.interval)
        stop, started = multiprocessing.Event(), multiprocessing.Event()
        writer = multiprocessing.Process(target=other_writer, args=(base, stop, started))
        writer.start()
        started.wait()
        try:
            busy = time_saves(os.path.join(base, "busy"), args.saves, args.interval)
        finally:
            stop.set()
            writer.join()
    result = {"quiet_median_s": statistics.median(quiet), "busy_median_s": statistics.median(busy),
              "quiet_max_s": max(quiet), "busy_max_s": max(busy),
              "busy_over_quiet": statistics.median(busy) / statistics.median(quiet)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
