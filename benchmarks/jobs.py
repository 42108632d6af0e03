"""Running a benchmark's job of processes on this machine: torch.distributed's environment (gloo on 127.0.0.1,
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT), every process's answer read from the last line of its output.
Used by the multi-process benchmarks (bench_multihost, bench_coordination, bench_scale, dtensor_jobs)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(args: Sequence[object], processes: int, *, env: dict[str, str] | None = None,
            timeout_s: float = 3600) -> list[dict]:
    """Run ``python *args`` (each as a string) as `processes` processes of one job (a single process gets no
    WORLD_SIZE: a plain run); blocks until all exit. Returns each process's JSON answer (its last output line),
    in rank order. Raises RuntimeError with the end of the failed process's stderr."""
    port = str(free_port())
    procs = []
    for rank in range(processes):
        penv = dict(env if env is not None else os.environ, RANK=str(rank), WORLD_SIZE=str(processes),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        if processes == 1:
            penv.pop("WORLD_SIZE")
        procs.append(subprocess.Popen([sys.executable, *map(str, args)], env=penv, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    answers, failures = [], []
    for rank, proc in enumerate(procs):
        stdout, stderr = proc.communicate(timeout=timeout_s)
        lines = stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            failures.append(f"process {rank} of {processes} exited with status {proc.returncode}:\n{stderr[-3000:]}")
            continue
        answers.append(json.loads(lines[-1]))
    if failures:
        raise RuntimeError("\n".join(failures))
    return answers


def aggregate(per_rank: Sequence[Mapping[str, float]]) -> dict:
    """One round of one contender, over the processes: the slowest process's times, summed CPU, resident growth
    and bytes, the machine-wide page cache growth (the largest any process saw)."""
    out = {"wall_s": max(r["wall_s"] for r in per_rank),
           "page_cache_growth_bytes": max(r["page_cache_growth_bytes"] for r in per_rank)}
    for key in ("user_s", "system_s", "rss_growth_bytes", "read_bytes", "written_bytes"):
        out[key] = sum(r[key] for r in per_rank)
    out["fresh_bytes"] = out["rss_growth_bytes"] + out["page_cache_growth_bytes"]
    if "blocking_s" in per_rank[0]:
        out["blocking_s"] = max(r["blocking_s"] for r in per_rank)
    return out
