"""Commit latency of a synchronous manager save while another process writes to the same file system.

A training host also runs data loaders and log writers. A save that makes its files durable with one `syncfs`
waits for every dirty page of the file system, theirs included; a save that syncs exactly its own files and
directories does not. This measures a small synchronous save (16 tensors, 1 MiB) on a quiet machine and while a
second process writes 1 GiB files in a loop (no fsync, as a data pipeline writing shards or a logger would), in
the same run, and prints the medians and the ratio. The quiet saves are split around the busy ones (half before,
half after, each after an `os.sync()`: ABBA), so that neither case alone meets the state the machine is in when the
run starts. Saves come `interval` seconds apart, as training steps would put them: in between, the other
writer's dirty pages pile up.

Beside the latency, each save is measured in the terms the library controls (benchmarks/footprint.py, issue 36):
user and system CPU seconds of this process (the other writer is another process), its resident growth, the page
cache growth, and the bytes this process wrote to storage, per byte of state (B/B); medians. Page cache growth is
machine-wide: while the other writer runs it is mostly that writer's dirty pages, so there fresh memory (resident +
page cache growth) says nothing about the save; the resident growth is reported on its own for both cases.

    python -m benchmarks commit-latency [--repeats 15] [--set interval=2] [--set dir=/path/on/the/file/system]

`--repeats` is the number of saves of each case.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import footprint  # noqa: E402
import harness  # noqa: E402

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


def run(settings: harness.Settings) -> harness.Result:
    """The case `commit-latency`: quiet saves around busy ones, in this process, one other writer process."""
    saves, interval = settings.repeats, settings.option("interval", 2.0)
    with tempfile.TemporaryDirectory(dir=settings.option("dir", "") or settings.workdir) as base:
        os.sync()
        quiet = time_saves(os.path.join(base, "quiet-before"), saves // 2, interval)
        stop, started = multiprocessing.Event(), multiprocessing.Event()
        writer = multiprocessing.Process(target=other_writer, args=(base, stop, started))
        writer.start()
        started.wait()
        try:
            busy = time_saves(os.path.join(base, "busy"), saves, interval)
        finally:
            stop.set()
            writer.join()
        os.sync()  # the other writer's dirty pages, so that the quiet saves after it are quiet again
        quiet += time_saves(os.path.join(base, "quiet-after"), saves - saves // 2, interval)
    keys = ("wall_s", "cpu_s", "user_s", "system_s", "rss_growth_bytes", "page_cache_growth_bytes", "fresh_bytes",
            "written_bytes")
    rows = [harness.Row(label, harness.footprint_metrics(runs, STATE_BYTES, keys))
            for label, runs in (("quiet", quiet), ("busy", busy))]
    busy_over_quiet = harness.median(r["wall_s"] for r in busy) / harness.median(r["wall_s"] for r in quiet)
    lines = [f"commit latency: a synchronous manager save of 16 tensors ({STATE_BYTES / 2**20:.2f} MiB) every "
             f"{interval:g} s: {saves} on a quiet machine ({saves // 2} before, the rest after) and {saves} while "
             "another process writes 1 GiB files without syncing; medians (latency: wall_s, max in the raw runs); "
             "B/B: per byte of state",
             "  page cache growth is machine-wide: under 'busy' it is mostly the other writer's dirty pages, so its "
             "page cache and fresh columns do not describe the save (its resident growth does)",
             f"  busy / quiet latency: {busy_over_quiet:.2f}x; max latency quiet "
             f"{max(r['wall_s'] for r in quiet):.3f} s, busy {max(r['wall_s'] for r in busy):.3f} s"]
    for label, runs in (("quiet", quiet), ("busy", busy)):
        lines.append(f"  {label} saves in order, latency / CPU ms: "
                     + ", ".join(f"{r['wall_s'] * 1e3:.0f}/{(r['user_s'] + r['system_s']) * 1e3:.0f}" for r in runs))
    return harness.Result(rows, "\n".join(lines))


if __name__ == "__main__":
    harness.worker_main()
