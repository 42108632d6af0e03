"""Measuring in fresh processes: evicting a checkpoint's files from the page cache, so that the next read comes
from the disk as after a restart (no root needed: sync, then POSIX_FADV_DONTNEED on every file), and running a
measuring process that answers with one JSON line. Plain standard library: imported by the torch_xla workers and
by the Orbax worker in its own virtual environment alike."""

from __future__ import annotations

import json
import os
import subprocess


def evict(path: str) -> None:
    """Drop the files under `path` (a directory or one file) from the page cache. Object store paths
    (``gs://``, ``s3://``) are left alone: their servers keep the data in memory anyway."""
    if "://" in path:
        return
    os.sync()
    files = [path] if os.path.isfile(path) else [os.path.join(root, name) for root, _, names in os.walk(path)
                                                 for name in names]
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_json(cmd: list[str], env: dict, what: str) -> dict:
    """Run `cmd` with `env` and return the JSON document on the last line of its output; raises RuntimeError
    with the end of its stderr, naming `what`, if it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def abba(contenders: list[str], rounds: int) -> list[str]:
    """The order of `rounds` fresh-process runs of each contender: forwards in even rounds, backwards in odd ones
    (A B B A A B ...), so that no contender always runs first or right after another one."""
    return [c for i in range(rounds) for c in (contenders if i % 2 == 0 else contenders[::-1])]
