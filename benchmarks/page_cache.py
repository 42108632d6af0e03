"""Evicting a checkpoint's files from the page cache, so that the next read comes from the disk as after a
restart (no root needed: sync, then POSIX_FADV_DONTNEED on every file). Plain standard library: imported by the
torch_xla workers and by the Orbax worker in its own virtual environment alike."""

from __future__ import annotations

import os


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
