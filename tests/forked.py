"""Many runs of one test script, each a process of its own, for the price of one import (tests/scripts/forking.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

FORKING = os.path.join(os.path.dirname(__file__), "scripts", "forking.py")


def run_forked(script: str, argvs: list[list[str]], *, parallel: int = 2, env: dict | None = None,
               timeout: float = 900) -> list[subprocess.CompletedProcess]:
    """Run ``script ARGV`` for each of `argvs` (at most `parallel` at once), each in a fork of one process that
    imported the script once; their exit statuses and output, as `subprocess.run` would give them. Blocks until
    every run has ended (a kill is an end: the event waited for)."""
    env = dict(os.environ if env is None else env)
    env.pop("PJRT_DEVICE", None)  # the scripts run on CPU tensors, without torch_xla
    with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
        jobs = [{"argv": [str(a) for a in argv], "out": os.path.join(tmp, f"{i}.out"),
                 "err": os.path.join(tmp, f"{i}.err")} for i, argv in enumerate(argvs)]
        proc = subprocess.run([sys.executable, FORKING, script, str(parallel)],
                              input="".join(json.dumps(job) + "\n" for job in jobs), capture_output=True, text=True,
                              env=env, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"the forking runner failed:\n{proc.stderr[-3000:]}")
        codes = [json.loads(line)["returncode"] for line in proc.stdout.splitlines()]
        return [subprocess.CompletedProcess([script, *job["argv"]], code, open(job["out"]).read(),
                                            open(job["err"]).read()) for job, code in zip(jobs, codes)]


def launch_job(script: str, world: int, *args: str, env: dict | None = None) -> list[dict]:
    """Run ``script ARGS`` as the `world` processes of one job (gloo on 127.0.0.1: RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT; `env` added); each one's return code, stderr and JSON lines, in rank order. Blocks until every
    process has ended (a kill is an end: the event waited for)."""
    from gcs_emulator import free_port

    port = str(free_port())
    procs = []
    for rank in range(world):
        penv = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                    **(env or {}))
        penv.pop("PJRT_DEVICE", None)
        procs.append(subprocess.Popen([sys.executable, script, *args], env=penv, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        results.append({"returncode": proc.returncode, "stderr": err,
                        "lines": [json.loads(x) for x in out.splitlines() if x.startswith("{")]})
    return results
