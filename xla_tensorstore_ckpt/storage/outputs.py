"""Outputs of the offline tools (``xtckpt convert``, exports) that never lose what a user pointed them at.

Three rules, applied by every command that writes:

1. A destination that is its source, lies inside it or holds it (after resolving symbolic links, on every
   backend) is refused before anything is read or written (`check_separate`).
2. An existing destination is kept unless the caller asked to replace it (`CheckpointExistsError` otherwise),
   and is never deleted before its replacement is complete.
3. The output is written under a temporary name beside the destination and put in its place at the end
   (`StagedDirectory`, `StagedFiles`): a failed or interrupted command leaves the old destination as it was
   (and at most a temporary directory, which the next run of the same command, or a manager for a step,
   removes).

Called by `convert` and `export`; everything blocks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from .. import storage
from ..core import layout
from ..core.errors import CheckpointExistsError, UsageError
from .local import fsync_path

_TMP_MARK = ".xtckpt-tmp-"


def check_separate(source: storage.Location, destination: storage.Location, *, what: str = "convert") -> None:
    """`UsageError` if writing `destination` could change `source`: the same place, or one inside the other."""
    if source.overlaps(destination):
        raise UsageError(f"cannot {what} {source} into {destination}: the destination is, holds or lies inside the "
                         f"source (symbolic links resolved); choose a destination outside it")


def check_vacant(destination: storage.Location, *, overwrite: bool) -> None:
    """`CheckpointExistsError` if `destination` holds anything (a file, or a directory with files in it) and
    not `overwrite`."""
    if overwrite:
        return
    if destination.is_file():
        raise CheckpointExistsError(f"{destination} is an existing file; pass --overwrite to replace it")
    if not destination.is_empty():
        raise CheckpointExistsError(f"{destination} already holds files; pass --overwrite to replace them")


@contextmanager
def staged_directory(destination: storage.Location, *, overwrite: bool, commit_files: Sequence[str] = (),
                     step: bool = False) -> Iterator[storage.Location]:
    """Yield an empty temporary directory beside `destination` to write the output into; when the block ends
    without an error, put it in place of `destination` (`Location.replace`, which deletes the old one's
    `commit_files` first on storage that cannot rename); on an error, delete it and keep `destination`.
    A destination that is a symbolic link is followed: the directory it points to is replaced, and the link
    stays. `step`: the temporary directory is named as a step being saved (``<step>.orbax-checkpoint-tmp-<n>``),
    which a manager of the root recognizes as partial and removes. Raises `CheckpointExistsError` (see
    `check_vacant`) before anything is written."""
    check_vacant(destination, overwrite=overwrite)
    final = destination.resolved()
    temporary = (final.parent.child(layout.tmp_step_name(final.name, time.time_ns())) if step
                 else temporary_sibling(final))
    _remove_stale(final)
    try:
        yield temporary
        temporary.replace(final, commit_files=commit_files)
    except BaseException:
        temporary.delete_tree()
        raise


def temporary_sibling(final: storage.Location) -> storage.Location:
    """A new temporary directory's location beside `final`, for an output that replaces it."""
    return final.parent.child(f".{final.name}{_TMP_MARK}{time.time_ns()}")


def _remove_stale(final: storage.Location) -> None:
    """Delete temporary directories that an interrupted earlier command left beside `final`."""
    prefix = f".{final.name}{_TMP_MARK}"
    for name in final.parent.list():
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            final.parent.child(name).delete_tree()


class StagedFiles:
    """Files written under temporary names in one local directory and renamed into place together
    (`publish`), for exports. `path(name)` is where to write the file `name`; `discard` deletes whatever
    was written. Local paths only."""

    def __init__(self, directory: str):
        self.directory = directory
        self._stamp = time.time_ns()
        self._written: list[str] = []

    def path(self, name: str) -> str:
        self._written.append(name)
        return os.path.join(self.directory, f".{name}{_TMP_MARK}{self._stamp}")

    def publish(self, remove: Sequence[str] = ()) -> list[str]:
        """Delete the files `remove` (names in the directory: a previous export's), then rename every written
        file into place, in the order written (so an index written last lands last). Returns the final paths."""
        for name in remove:
            path = os.path.join(self.directory, name)
            if os.path.lexists(path) and name not in self._written:
                os.remove(path)
        final = []
        for name in self._written:
            target = os.path.join(self.directory, name)
            os.replace(self.path_of(name), target)
            final.append(target)
        fsync_path(self.directory)
        return final

    def path_of(self, name: str) -> str:
        return os.path.join(self.directory, f".{name}{_TMP_MARK}{self._stamp}")

    def discard(self) -> None:
        for name in self._written:
            try:
                os.remove(self.path_of(name))
            except FileNotFoundError:
                pass

