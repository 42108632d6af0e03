"""Many runs of one test script, each a process of its own, for the price of one import (tests/scripts/forking.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

FORKING = os.path.join(os.path.dirname(__file__), "scripts", "forking.py")


def run_forked(script: str, argvs: list[list[str]], *, parallel: int = 2, env: dict | None = None,
               job_envs: list[dict[str, str]] | None = None, timeout: float = 900,
               python: str = sys.executable) -> list[subprocess.CompletedProcess]:
    """Run ``script ARGV`` for each of `argvs` (at most `parallel` at once), each in a fork of one process that
    imported the script once (with `env`; run by `python`, another stack's interpreter for a cross-stack test),
    each run with its entry of `job_envs` added to its environment; their exit statuses and output, as
    `subprocess.run` would give them. Blocks until every run has ended (a kill is an end: the event waited
    for)."""
    env = dict(os.environ if env is None else env)
    env.pop("PJRT_DEVICE", None)  # the scripts run on CPU tensors, without torch_xla
    job_envs = job_envs or [{} for _ in argvs]
    with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
        jobs = [{"argv": [str(a) for a in argv], "env": job_env, "out": os.path.join(tmp, f"{i}.out"),
                 "err": os.path.join(tmp, f"{i}.err")} for i, (argv, job_env) in enumerate(zip(argvs, job_envs))]
        proc = subprocess.run([python, FORKING, script, str(parallel)],
                              input="".join(json.dumps(job) + "\n" for job in jobs), capture_output=True, text=True,
                              env=env, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"the forking runner failed:\n{proc.stderr[-3000:]}")
        codes = [json.loads(line)["returncode"] for line in proc.stdout.splitlines()]
        return [subprocess.CompletedProcess([script, *job["argv"]], code, open(job["out"]).read(),
                                            open(job["err"]).read()) for job, code in zip(jobs, codes)]


def launch_job(script: str, world: int, *args: str, env: dict | None = None,
               rank_args: list[list[str]] | None = None, python: str = sys.executable) -> list[dict]:
    """Run ``script ARGS`` (then the rank's entry of `rank_args`) as the `world` processes of one job (gloo on
    127.0.0.1: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; `env` added), forked from one process that imported
    the script once (`run_forked`); each one's return code, stderr and JSON lines, in rank order. Blocks until
    every process has ended (a kill is an end: the event waited for)."""
    from gcs_emulator import free_port

    common = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                  **(env or {}))
    argvs = [[*args, *(rank_args[rank] if rank_args else [])] for rank in range(world)]
    runs = run_forked(script, argvs, parallel=world, env=common,
                      job_envs=[{"RANK": str(rank)} for rank in range(world)], timeout=600, python=python)
    return [{"returncode": run.returncode, "stderr": run.stderr,
             "lines": [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]} for run in runs]
