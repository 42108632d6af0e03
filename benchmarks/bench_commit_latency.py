"""Commit latency of a synchronous manager save while another process writes to the same file system.

A training host also runs data loaders and log writers. A save that makes its files durable with one `syncfs`
waits for every dirty page of the file system, theirs included; a save that syncs exactly its own files and
directories does not. This measures a small synchronous save (16 tensors, 1 MiB) on a quiet machine and while a
second process writes 1 GiB files in a loop (no fsync, as a data pipeline writing shards or a logger would), in
the same run, and prints the medians and the ratio. The quiet saves are split around the busy ones (half before,
half after, each after an `os.sync()`: ABBA), so that neither case alone meets the state the machine is in when the
run starts. Saves come `--interval` seconds apart, as training steps would put them: in between, the other
writer's dirty pages pile up.

Beside the latency, each save is measured in the terms the library controls (benchmarks/footprint.py, issue 36):
user and system CPU seconds of this process (the other writer is another process), its resident growth, the page
cache growth, and the bytes this process wrote to storage, per byte of state (B/B); medians. Page cache growth is
machine-wide: while the other writer runs it is mostly that writer's dirty pages, so there fresh memory (resident +
page cache growth) says nothing about the save; the resident growth is reported on its own for both cases.

    python benchmarks/bench_commit_latency.py [--saves 15] [--interval 2] [--dir /path/on/the/same/file/system]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import footprint  # noqa: E402

import xla_tensorstore_ckpt as xtc  # noqa: E402

STATE_BYTES = 16 * 128 * 128 * 4


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


def time_saves(root: str, saves: int, interval: float) -> list[dict]:
    """Each save's footprint measures (`wall_s`: its latency)."""
    state = {f"w{i}": torch.randn(128, 128) for i in range(16)}
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=2, async_save=False, save_rng=False)
    runs = []
    with xtc.CheckpointManager(root, options) as manager:
        for step in range(1, saves + 1):
            time.sleep(interval)  # training steps between saves, while the other writer goes on
            measures, _ = footprint.measure(lambda step=step: manager.save(step, model=state))
            runs.append(measures)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--saves", type=int, default=15)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between saves (not timed)")
    parser.add_argument("--dir", default=None, help="a directory on the file system to measure (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as base:
        os.sync()
        quiet = time_saves(os.path.join(base, "quiet-before"), args.saves // 2, args.interval)
        stop, started = multiprocessing.Event(), multiprocessing.Event()
        writer = multiprocessing.Process(target=other_writer, args=(base, stop, started))
        writer.start()
        started.wait()
        try:
            busy = time_saves(os.path.join(base, "busy"), args.saves, args.interval)
        finally:
            stop.set()
            writer.join()
        os.sync()  # the other writer's dirty pages, so that the quiet saves after it are quiet again
        quiet += time_saves(os.path.join(base, "quiet-after"), args.saves - args.saves // 2, args.interval)
    print(f"commit latency: a synchronous manager save of 16 tensors ({STATE_BYTES / 2**20:.2f} MiB) every "
          f"{args.interval:g} s: {args.saves} on a quiet machine ({args.saves // 2} before, the rest after) and "
          f"{args.saves} while another process writes 1 GiB files without syncing; medians (latency: median and max); "
          "B/B: per byte of state")
    print(f"  {'case':5}  {'latency s (max)':15}  {'CPU s (user+sys)':16}  {'resident B/B':12}  {'page cache B/B':14}  "
          f"{'fresh B/B':9}  {'written B/B':11}")
    for label, runs in (("quiet", quiet), ("busy", busy)):
        def med(key: str, runs: list[dict] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        latency = f"{med('wall_s'):.4f} ({max(r['wall_s'] for r in runs):.3f})"
        cpu = f"{med('user_s') + med('system_s'):.3f} ({med('user_s'):.3f}+{med('system_s'):.3f})"
        print(f"  {label:5}  {latency:15}  {cpu:16}  {med('rss_growth_bytes') / STATE_BYTES:12.2f}  "
              f"{med('page_cache_growth_bytes') / STATE_BYTES:14.2f}  {med('fresh_bytes') / STATE_BYTES:9.2f}  "
              f"{med('written_bytes') / STATE_BYTES:11.2f}")
    busy_over_quiet = statistics.median(r["wall_s"] for r in busy) / statistics.median(r["wall_s"] for r in quiet)
    print("  page cache growth is machine-wide: under 'busy' it is mostly the other writer's dirty pages, so its page "
          "cache and fresh columns do not describe the save (its resident growth does)")
    print(f"  busy / quiet latency: {busy_over_quiet:.2f}x")
    for label, runs in (("quiet", quiet), ("busy", busy)):
        print(f"  {label} saves in order, latency / CPU ms: "
              + ", ".join(f"{r['wall_s'] * 1e3:.0f}/{(r['user_s'] + r['system_s']) * 1e3:.0f}" for r in runs))


if __name__ == "__main__":
    main()
