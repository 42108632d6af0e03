"""The steps under a checkpoint root: what a step directory is called, which are committed, partial or invalid,
and how a step is deleted. The manager and the command line both use `StepIndex`, so they agree on what a step is.

A step ``<root>/<name>`` written by this library is committed iff its marker (``_CHECKPOINT_METADATA``) exists,
decodes and names the same step; a step directory without one is partial (a save that never committed), and so is
a step still under its temporary name (``<name>.orbax-checkpoint-tmp-<n>``, where the storage renames); one whose
marker does not decode, or names another step, is invalid. A step Orbax wrote is committed by Orbax's rule: its
directory has its final name (storage that renames) or holds ``commit_success.txt`` (object stores); partial
steps that hold Orbax's items are never deleted (they may be another program's). Step numbers may be zero-padded
(Orbax's ``step_format_fixed_length``: ``0023``); new steps are named with the padding the root's steps already
have. Everything blocks; the index holds no state beyond its root and that padding, learned from a listing.

A step directory that is a symbolic link (to a step of another run's root, say) is a step like the others: it
is listed, and restored through the link. Nothing is ever renamed or deleted through a link: retention and
`delete` remove the link alone, and partial-step cleanup leaves a linked partial step (and what it points to)
alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from .. import formats
from ..core import layout
from ..core.errors import CorruptCheckpointError, FormatVersionError, StorageError, UnsupportedValueError
from ..core.records import StepMetadata
from ..storage import Location

ANY_PREFIX = "*"  # a StepIndex prefix accepting every ``<prefix>_<n>`` and plain ``<n>`` name (read-only use)

Status = Literal["committed", "partial", "invalid"]


@dataclass(frozen=True)
class StepEntry:
    """One step-named directory under a root."""

    step: int
    name: str
    status: Status
    marker: StepMetadata | None = None
    problem: str | None = None  # why an invalid step is invalid


class StepIndex:
    """The steps of one root whose directories are named ``<prefix>_<step>`` (or ``<step>`` without a prefix)."""

    def __init__(self, root: Location, prefix: str | None = None):
        self.root = root
        self.prefix = prefix
        self._width: int | None = None  # the zero padding of the root's step numbers (`_learn_width`)
        self._width_known = False

    def location(self, step: int) -> Location:
        """Where `step` lives (committed or not), its number padded as the root's steps are (the first call
        lists the root, unless `scan` has). Not for an `ANY_PREFIX` index."""
        if not self._width_known:
            self._learn_width(self.root.list())
        return self.root.child(layout.step_name(step, self.prefix, self._width))

    def scan(self) -> list[StepEntry]:
        """Every step directory with its status, oldest step first."""
        entries = []
        names = self.root.list()
        self._learn_width(names)
        for name in names:
            step = self.step_of(name)
            if step is not None:
                entries.append(self._entry(step, name))
        return sorted(entries, key=lambda e: (e.step, e.name))

    def _learn_width(self, names: list[str]) -> None:
        """The padding of the root's step names (the widest, if they disagree); None if none is padded."""
        widths = [layout.step_name_width(_final_name(name), self.prefix) for name in names]
        self._width = max((w for w in widths if w is not None), default=None)
        self._width_known = True

    def step_of(self, name: str) -> int | None:
        return layout.parse_step_name(_final_name(name), None if self.prefix == ANY_PREFIX else self.prefix,
                                      any_prefix=self.prefix == ANY_PREFIX)

    def _entry(self, step: int, name: str) -> StepEntry:
        loc = self.root.child(name)
        if layout.is_tmp_step_name(name):
            return StepEntry(step, name, "partial")
        try:
            marker = formats.read_step(loc, step)
        except (CorruptCheckpointError, FormatVersionError, UnsupportedValueError) as exc:
            return StepEntry(step, name, "invalid", problem=str(exc))  # a storage failure is raised: it may pass
        if marker is None:
            return StepEntry(step, name, "partial")
        if marker.step != step:
            return StepEntry(step, name, "invalid", problem=f"its marker in {loc} names step {marker.step}")
        if not formats.step_format(marker).is_committed(loc, marker):
            return StepEntry(step, name, "partial")  # Orbax's, not finalized
        return StepEntry(step, name, "committed", marker)

    def remove_partial(self, entries: list[StepEntry]) -> tuple[list[str], dict[str, str]]:
        """Delete the partial steps among `entries` (saves that crashed before their commit), unless a marker
        has appeared meanwhile or they hold items Orbax wrote. Returns the names deleted, and those that could
        not be, with why (a partial step left behind is harmless: it is never listed as committed)."""
        removed, failed = [], {}
        for entry in entries:
            loc = self.root.child(entry.name)
            try:
                if entry.status != "partial" or loc.is_link() or formats.holds_orbax_items(loc):
                    continue
                if layout.is_tmp_step_name(entry.name) or loc.read(layout.CHECKPOINT_METADATA) is None:
                    loc.delete_tree()
                    removed.append(entry.name)
            except OSError as exc:  # StorageError included
                failed[entry.name] = str(exc)
        return removed, failed

    def delete(self, step: int) -> None:
        """Uncommit `step`, then delete its files: where the storage renames, by renaming the step to a
        temporary name first (no reader, Orbax included, sees it committed after that); elsewhere by deleting
        Orbax's completion mark and the marker first. Retried; a step is never left committed but half deleted.
        Raises `StorageError` if it cannot be deleted. A step that is a symbolic link loses only the link."""
        loc = self.location(step)
        if loc.is_link():  # linked in from elsewhere (another run's root): what it points to is not ours
            loc.delete_tree()
            return
        for attempt in range(3):
            try:
                if self.root.capabilities.renames and loc.exists():
                    doomed = self.root.child(layout.tmp_step_name(loc.name, time.time_ns()))
                    loc.rename_to(doomed)
                    loc = doomed
                loc.delete(layout.COMMIT_SUCCESS)
                loc.delete(layout.CHECKPOINT_METADATA)
                loc.delete_tree()
                return
            except StorageError:
                if attempt == 2:
                    raise
                time.sleep(0.1 * 2**attempt)


def _final_name(name: str) -> str:
    """A step directory's name without the temporary suffix of a save under way."""
    return name.split(layout.TMP_STEP_SUFFIX, 1)[0] if layout.is_tmp_step_name(name) else name
