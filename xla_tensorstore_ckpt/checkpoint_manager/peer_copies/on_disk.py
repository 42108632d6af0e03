"""A peer copy on disk (`PeerCopies`, `PeerReplicator`): the files of a step directory and their CRC32Cs
(`StepFiles`), where copies live under the local root (``<local root>/peer_copies/<writer>/<step>``), the copy's
marker (``copy.json``: the writer, the step, every file's size and CRC32C, the items left out) and its JSON
record, the copies a process holds, and committing one (a temporary directory, the marker, a rename into place: a
copy cut short by a crash never looks committed). Called by the replicator and the recovery of this folder; the
manager's local tier asks `copies_root` which directory to pass by. Blocks on the file system.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import crc32c

from ... import formats, storage
from ...core import layout, tunables
from ...storage.local import fsync_path, is_regular

COPIES_DIR = "peer_copies"  # under the local root; not a step name, so the local tier's scans pass it by
COPY_MARKER = "copy.json"
PARTIAL = ".partial-"  # in the name of a copy or fetch still being written
_WRITER = re.compile(r"[0-9]+")  # a writer's directory of copies (ASCII digits: "²".isdigit() holds)
log = logging.getLogger("xla_tensorstore_ckpt")


@dataclass(frozen=True)
class StepFiles:
    """The files of one step directory: relative paths, sizes and (where known) CRC32Cs, in path order."""

    writer: int
    step: int
    files: tuple[tuple[str, int], ...]
    crcs: tuple[int, ...] | None = None
    shared: tuple[tuple[str, int], ...] = ()  # (item, process): items not copied, held identical by that process

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.files)


def file_crc(path: str) -> int | None:
    if not os.path.isfile(path):
        return None
    return file_crcs(os.path.dirname(path), [(os.path.basename(path), os.path.getsize(path))])[0]


def copies_root(local_root: str) -> str:
    return os.path.join(local_root, COPIES_DIR)


def copy_dir(local_root: str, writer: int, step_name: str) -> str:
    return os.path.join(copies_root(local_root), str(writer), step_name)


def list_files(directory: str, writer: int, step: int) -> StepFiles:
    """The files under `directory` (a committed step), sizes from the file system."""
    out = []
    for parent, dirs, names in os.walk(directory):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(parent, name)
            out.append((os.path.relpath(path, directory), os.path.getsize(path)))
    return StepFiles(writer, step, tuple(sorted(out)))


def read_copy(directory: str) -> StepFiles | None:
    """The manifest of a committed peer copy, or None if `directory` holds none (absent, partial, unreadable):
    a damaged marker (one naming a file outside the copy, say, or a FIFO in its place) is logged and the copy
    treated as absent, so a resume falls back to another copy or tier."""
    marker = os.path.join(directory, COPY_MARKER)
    try:
        if not is_regular(marker):
            return None
        with open(marker, "rb") as f:
            manifest = from_record(json.loads(f.read()), marker)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring the peer copy in %s: %s", directory, str(exc)[:500])
        return None
    return manifest if manifest.crcs is not None else None


def copy_bases(directory: str) -> tuple[int, ...]:
    """The steps a committed copy's step references (its marker's `bases`: an incremental step's chunks stored
    there), () for a standalone step or a marker that cannot be read (the copy is then no use to a restore, and
    keeps nothing else)."""
    try:
        marker = formats.read_step(storage.location(directory))
    except (OSError, ValueError) as exc:  # StorageError, CorruptCheckpointError, FormatVersionError included
        log.warning("reading the bases of the peer copy in %s: %s", directory, str(exc)[:500])
        return ()
    return tuple(marker.bases) if marker is not None else ()


def record(manifest: StepFiles) -> dict:
    """A manifest as JSON: a copy's marker, and what a fetch sends its receiver (CRC32Cs null where unknown)."""
    crcs = manifest.crcs if manifest.crcs is not None else [None] * len(manifest.files)
    return {"writer": manifest.writer, "step": manifest.step,
            "files": [[path, size, crc] for (path, size), crc in zip(manifest.files, crcs)],
            "shared": [list(entry) for entry in manifest.shared]}


def from_record(record: dict, where: str) -> StepFiles:
    """Raises KeyError, TypeError or ValueError if `record` (from `where`) is not one: `CorruptCheckpointError`
    for a file or item name that would lie outside the step (`layout.relative_path`)."""
    crcs = [crc for _, _, crc in record["files"]]
    files = tuple((layout.relative_path(path, where=where, what="file"), int(size))
                  for path, size, _ in record["files"])
    shared = tuple((layout.relative_path(item, where=where, what="item", single=True), int(process))
                   for item, process in record.get("shared", []))
    return StepFiles(int(record["writer"]), int(record["step"]), files,
                     None if None in crcs else tuple(int(crc) for crc in crcs), shared)


def held_copies(local_root: str,
                step_of: Callable[[str], int | None]) -> dict[tuple[int, int], tuple[str, StepFiles]]:
    """The committed peer copies this process holds: (writer, step) -> (directory, manifest). Removes partial
    ones (a copy cut short). `step_of` parses a step directory's name."""
    held: dict[tuple[int, int], tuple[str, StepFiles]] = {}
    base = copies_root(local_root)
    for writer in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        if PARTIAL in writer:  # a fetch cut short
            shutil.rmtree(os.path.join(base, writer), ignore_errors=True)
        if not _WRITER.fullmatch(writer) or not os.path.isdir(os.path.join(base, writer)):
            continue
        for name in sorted(os.listdir(os.path.join(base, writer))):
            directory = os.path.join(base, writer, name)
            if PARTIAL in name:
                shutil.rmtree(directory, ignore_errors=True)
                continue
            step = step_of(name)
            manifest = read_copy(directory)
            if step is not None and manifest is not None and manifest.step == step:
                held[(int(writer), step)] = (directory, manifest)
    return held


def file_crcs(directory: str, files: Sequence[tuple[str, int]]) -> list[int | None]:
    """The CRC32C of each file under `directory` (None where it is missing or has another size)."""
    out: list[int | None] = []
    for path, size in files:
        full = os.path.join(directory, path)
        if not os.path.isfile(full) or os.path.getsize(full) != size:
            out.append(None)
            continue
        crc = 0
        with open(full, "rb") as f:
            while block := f.read(tunables.get("peer_piece_bytes")):
                crc = crc32c.crc32c(block, crc)
        out.append(crc)
    return out


def sync_tree(directory: str) -> None:
    for parent, _, names in os.walk(directory):
        for name in names:
            fsync_path(os.path.join(parent, name))


def commit_dir(partial: str, final: str, manifest: StepFiles | None, *, fsync: bool = True) -> None:
    """Sync the files of `partial`, write the copy marker (if `manifest`), rename it to `final` (replacing what
    is there) and sync the rename; without `fsync`, neither the files nor the rename are synced (a directory's
    fsync commits the file system's journal, which waits for every dirty page of the files it names: right after
    a save's replication, 55-110 ms for a 64 MiB fetch here)."""
    if fsync:
        sync_tree(partial)
    if manifest is not None:
        with open(os.path.join(partial, COPY_MARKER), "w") as f:
            json.dump(record(manifest), f)
            f.flush()
            os.fsync(f.fileno())
    if os.path.exists(final):
        shutil.rmtree(final)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    os.rename(partial, final)
    if fsync:
        fsync_path(os.path.dirname(final))
