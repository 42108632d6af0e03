"""Runs a script's `main()` once per job, each run in a fresh fork of this process, which imported the script (and
torch, tensorstore and this library with it) once: a crash matrix of 30 runs pays for one import, not 30.

usage: forking.py SCRIPT
stdin: one JSON batch per line, {"parallel": n, "env": {...}, "jobs": [{"argv": [...], "env": {...}, "out": path,
"err": path}, ...]}: the batch's jobs run at most `parallel` at once, each with the batch's environment and its
own `env` (optional) added; this process serves batch after batch until stdin ends, so a test module's many jobs
pay for one import (tests/forked.py keeps the server).
stdout: one JSON line per batch once all its jobs have ended: {"returncodes": [n, ...]} in job order (negative:
killed by that signal)

A forked child is a process of its own, as a subprocess would be: it can kill itself mid-save (SIGKILL), and
nothing it does reaches this process. Its output goes through pipes, which this process copies to the job's
files (a child that limits the size of the files it writes, RLIMIT_FSIZE, still reports in full). Forking is
safe here because this process only imports and copies output: no thread of ours (numpy's idle OpenBLAS pool is
safe to fork), no tensorstore context, no torch_xla exists before the fork.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn


def exit_code(exc: SystemExit) -> int:
    """The status an interpreter exits with for `exc`; a message is printed to stderr, as the interpreter does."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def run_child(fn: Callable[[], object], out: int, err: int | None = None) -> NoReturn:
    """In a forked child: make the descriptors `out` (and `err`) its stdout (and stderr), call `fn`, and exit
    with the status an interpreter would (a traceback for an exception)."""
    for target, fd in ((out, 1), (err, 2)):
        if target is not None:
            os.dup2(target, fd)
            os.close(target)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    if err is not None:
        sys.stderr = os.fdopen(2, "w", buffering=1)
    code = 0
    try:
        fn()
    except SystemExit as exc:
        code = exit_code(exc)
    except BaseException:  # noqa: BLE001 - reported like a subprocess's traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _child(module, env: dict, job: dict, out: int, err: int, inherited: list[int]) -> NoReturn:
    for fd in inherited:
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)  # not the server's own stdin, which carries its batches
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(job.get("env", {}))
    sys.argv = [module.__file__, *job["argv"]]
    run_child(module.main, out, err)


def main() -> None:
    script = sys.argv[1]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    spec = importlib.util.spec_from_file_location("forked_script", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for line in sys.stdin:
        if line.strip():
            batch = json.loads(line)
            codes = run_batch(module, batch["jobs"], batch["parallel"], batch["env"])
            print(json.dumps({"returncodes": codes}), flush=True)


def run_batch(module, jobs: list[dict], parallel: int, env: dict) -> list[int]:
    """Run `jobs` in forks of this process, at most `parallel` at once; their exit statuses, in job order."""
    codes: dict[int, int] = {}
    poller = select.poll()
    copies: dict[int, int] = {}  # a pipe's read end -> the job file it is copied to
    exits: dict[int, tuple[int, int]] = {}  # a child's pidfd -> (pid, job index)

    def start(index: int) -> None:
        (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
        pid = os.fork()
        if pid == 0:
            _child(module, env, jobs[index], out_w, err_w, [out_r, err_r, *copies, *copies.values(), *exits])
        os.close(out_w)
        os.close(err_w)
        for read_end, path in ((out_r, jobs[index]["out"]), (err_r, jobs[index]["err"])):
            copies[read_end] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            poller.register(read_end, select.POLLIN)
        pidfd = os.pidfd_open(pid)
        exits[pidfd] = (pid, index)
        poller.register(pidfd, select.POLLIN)

    waiting = list(range(len(jobs)))
    while waiting and len(exits) < parallel:
        start(waiting.pop(0))
    while copies or exits:
        for fd, _ in poller.poll():
            if fd in copies:
                data = os.read(fd, 1 << 16)
                if data:
                    os.write(copies[fd], data)
                    continue
                poller.unregister(fd)
                os.close(copies.pop(fd))
                os.close(fd)
            elif fd in exits:  # the child ended: the event a pidfd signals
                pid, index = exits.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                codes[index] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                if waiting:
                    start(waiting.pop(0))
    return [codes[index] for index in range(len(jobs))]


if __name__ == "__main__":
    main()
