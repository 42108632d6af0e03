"""How fast content hashes run on one core, against what a save already spends (issue 65, item 2: "hashing costs
<= 5 % of a full save's CPU seconds"; docs/incremental.md uses these figures to choose the hash).

Each hash digests 64 MiB of random float32 values (CPU seconds of this thread, medians of `--repeats`;
`--scale` scales the 64 MiB); CRC32C,
which every save computes already, is the reference. Hashes from packages that are not installed (`xxhash`,
`blake3`: not dependencies of this library) are skipped; `--set path=DIR` adds a directory to the import path for them.
The last column is the CPU a hash would add to a save of 1 GiB, as a share of `--set save_cpu_per_gib` (default 0.67 s:
the `model` workload's direct save, docs/performance.md).

    python -m benchmarks chunk-hashes [--repeats 7] [--scale 1] [--set save_cpu_per_gib=0.67] [--set path=DIR]
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def _hashes() -> dict:
    import crc32c

    out = {"crc32c (every save has it)": crc32c.crc32c,
           "sha256": lambda b: hashlib.sha256(b).digest(), "sha1": lambda b: hashlib.sha1(b).digest(),
           "blake2b": lambda b: hashlib.blake2b(b).digest(), "md5": lambda b: hashlib.md5(b).digest()}
    try:
        import xxhash

        out["xxh3_128"] = lambda b: xxhash.xxh3_128(b).digest()
    except ImportError:
        pass
    try:
        import blake3

        out["blake3 (one thread)"] = lambda b: blake3.blake3(b).digest()
    except ImportError:
        pass
    return out


def run(settings: harness.Settings) -> harness.Result:
    """The case `chunk-hashes`: each hash over the same data, CPU seconds of this thread."""
    save_cpu = settings.option("save_cpu_per_gib", 0.67)
    if settings.option("path", ""):
        sys.path.insert(0, settings.option("path", ""))
    size = int((64 << 20) * settings.scale) // 4 * 4
    data = memoryview(np.random.default_rng(0).standard_normal(size // 4).astype(np.float32).view(np.uint8))
    gib = len(data) / 2**30
    rows, lines = [], [f"{size / 2**20:g} MiB of float32, one core, CPU seconds, medians of {settings.repeats}; "
                       f"a save spends {save_cpu:.2f} s of CPU per GiB"]
    for name, digest in _hashes().items():
        times = []
        for _ in range(settings.repeats):
            start = time.thread_time()
            digest(data)
            times.append(time.thread_time() - start)
        per_gib = harness.median(times) / gib
        rows.append(harness.Row(name, {"cpu_s": harness.series(times, "s"),
                                       "cpu_s_per_gib": harness.series([t / gib for t in times], "s/GiB")},
                                params={"share_of_save_cpu": per_gib / save_cpu}))
        lines.append(f"  {name:28} {1 / per_gib:6.2f} GiB/s  {per_gib:.3f} s/GiB  "
                     f"{100 * per_gib / save_cpu:5.1f} % of a save's CPU")
    return harness.Result(rows, "\n".join(lines))


if __name__ == "__main__":
    harness.worker_main()
