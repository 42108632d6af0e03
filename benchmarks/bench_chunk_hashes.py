"""How fast content hashes run on one core, against what a save already spends (issue 65, item 2: "hashing costs
<= 5 % of a full save's CPU seconds"; docs/incremental.md uses these figures to choose the hash).

Each hash digests 64 MiB of random float32 values (CPU seconds of this thread, medians of `--repeats`); CRC32C,
which every save computes already, is the reference. Hashes from packages that are not installed (`xxhash`,
`blake3`: not dependencies of this library) are skipped; `--path DIR` adds a directory to the import path for them.
The last column is the CPU a hash would add to a save of 1 GiB, as a share of `--save-cpu-per-gib` (default 0.67 s:
the `model` workload's direct save, docs/performance.md).

    python benchmarks/bench_chunk_hashes.py [--repeats 7] [--save-cpu-per-gib 0.67] [--path DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time

import numpy as np


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--save-cpu-per-gib", type=float, default=0.67)
    parser.add_argument("--path", help="a directory to import optional hash packages from")
    args = parser.parse_args()
    if args.path:
        sys.path.insert(0, args.path)
    data = memoryview(np.random.default_rng(0).standard_normal((64 << 20) // 4).astype(np.float32).view(np.uint8))
    gib = len(data) / 2**30
    print(f"64 MiB of float32, one core, CPU seconds, medians of {args.repeats}; a save spends "
          f"{args.save_cpu_per_gib:.2f} s of CPU per GiB")
    for name, digest in _hashes().items():
        times = []
        for _ in range(args.repeats):
            start = time.thread_time()
            digest(data)
            times.append(time.thread_time() - start)
        per_gib = statistics.median(times) / gib
        print(f"  {name:28} {1 / per_gib:6.2f} GiB/s  {per_gib:.3f} s/GiB  "
              f"{100 * per_gib / args.save_cpu_per_gib:5.1f} % of a save's CPU")


if __name__ == "__main__":
    main()
