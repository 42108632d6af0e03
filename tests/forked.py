"""Many runs of one test script, each a process of its own, for the price of one import: a server per script
(tests/scripts/forking.py) imports it once and forks a process per run, for every test of a pytest process."""

from __future__ import annotations

import atexit
import collections
import json
import os
import selectors
import subprocess
import sys
import tempfile
import threading

FORKING = os.path.join(os.path.dirname(__file__), "scripts", "forking.py")
# What a job's batch sets itself: the servers differ only by the rest of their environment. The tests' own knobs
# (XTC_*) are read by the scripts when they run, never at import, so one server serves them all.
PER_BATCH = ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
PER_RUN_PREFIX = "XTC_"
# pytest names the running test and its phase here: a server keyed on it served one job, and its import cost
# three times what the jobs it served did (251 servers in one run of both suites: 714 CPU-s against 282).
PER_TEST = ("PYTEST_CURRENT_TEST",)
# Where the object-store clients send their requests (an emulator, or a fault proxy in front of it, a port per
# test): read when a client is made, in the run, never at import. A server keyed on them was started anew for each
# proxy (18 of the 39 servers of one run of both suites, all for tests/scripts/replica_reads.py).
PER_RUN = ("TENSORSTORE_GCS_HTTP_URL", "STORAGE_EMULATOR_HOST", "AWS_ENDPOINT_URL")
_NOT_KEYED = PER_BATCH + PER_TEST + PER_RUN
# Servers kept per pytest process, the least recently used closed first: tests of one module run together, and
# each server holds torch imported (a few hundred MB).
MAX_SERVERS = 3


class _Server:
    """A forking.py process serving batches of runs of `script`, started with `env`."""

    def __init__(self, python: str, script: str, env: dict) -> None:
        self.stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen([python, FORKING, script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.stderr, env=env, text=True)

    def run(self, batch: dict, timeout: float) -> list[int]:
        """Send `batch`, wait for its exit statuses (the event: the server's answer line). Raises RuntimeError if
        the server died, subprocess.TimeoutExpired (the server killed) past `timeout`."""
        try:
            self.process.stdin.write(json.dumps(batch) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # the server died: told below
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                self.close(kill=True)
                raise subprocess.TimeoutExpired(self.process.args, timeout)
        line = self.process.stdout.readline()
        if not line:
            self.close(kill=True)
            self.stderr.seek(0)
            raise RuntimeError(f"the forking runner failed:\n{self.stderr.read().decode(errors='replace')[-3000:]}")
        return json.loads(line)["returncodes"]

    def close(self, *, kill: bool = False) -> None:
        if kill:
            self.process.kill()
        else:
            self.process.stdin.close()
        self.process.wait()
        self.process.stdout.close()
        self.stderr.close()


_servers: collections.OrderedDict[tuple, _Server] = collections.OrderedDict()
# A server answers one batch at a time, in order: threads of a test that run jobs take turns (`run_forked`); a
# batch of several jobs runs them in parallel.
_turns = threading.Lock()


def _server(python: str, script: str, env: dict) -> _Server:
    key = (python, script, tuple(sorted((k, v) for k, v in env.items()
                                        if k not in _NOT_KEYED and not k.startswith(PER_RUN_PREFIX))))
    server = _servers.pop(key, None)
    if server is None or server.process.poll() is not None:
        server = _Server(python, script, env)
    _servers[key] = server
    while len(_servers) > MAX_SERVERS:
        _servers.popitem(last=False)[1].close()
    return server


@atexit.register
def _close_all() -> None:
    while _servers:
        _servers.popitem()[1].close()


def run_forked(script: str, argvs: list[list[str]], *, parallel: int = 2, env: dict | None = None,
               job_envs: list[dict[str, str]] | None = None, timeout: float = 900,
               python: str = sys.executable) -> list[subprocess.CompletedProcess]:
    """Run ``script ARGV`` for each of `argvs` (at most `parallel` at once), each in a fork of a server that
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
        with _turns:
            server = _server(python, os.path.abspath(script), env)
            codes = server.run({"parallel": parallel, "env": env, "jobs": jobs}, timeout)
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
