"""Runs a script's `main()` once per job, each run in a fresh fork of this process, which imported the script (and
torch, tensorstore and this library with it) once: a crash matrix of 30 runs pays for one import, not 30.

usage: forking.py SCRIPT PARALLEL   stdin: one JSON job per line, {"argv": [...], "out": path, "err": path}
stdout: one JSON line per job, in job order: {"returncode": n} (negative: killed by that signal)

A forked child is a process of its own, as a subprocess would be: it can kill itself mid-save (SIGKILL), and
nothing it does reaches this process. Forking is safe here because this process only imports: no thread, no
tensorstore context, no torch_xla exists before the fork.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback


def _child(module, job: dict) -> None:
    for fd, path in ((1, job["out"]), (2, job["err"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    sys.argv = [module.__file__, *job["argv"]]
    code = 0
    try:
        module.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported like a subprocess's traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    script, parallel = sys.argv[1], int(sys.argv[2])
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    spec = importlib.util.spec_from_file_location("forked_script", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    jobs = [json.loads(line) for line in sys.stdin if line.strip()]
    codes: dict[int, int] = {}
    running: dict[int, int] = {}  # pid -> job index
    for index, job in enumerate(jobs):
        while len(running) >= parallel:
            pid, status = os.wait()
            codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
        pid = os.fork()
        if pid == 0:
            _child(module, job)
        running[pid] = index
    while running:
        pid, status = os.wait()
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    for index in range(len(jobs)):
        print(json.dumps({"returncode": codes[index]}), flush=True)


if __name__ == "__main__":
    main()
