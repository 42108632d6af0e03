"""The steps under a checkpoint root: what a step directory is called, which are committed, partial or invalid,
and how a step is deleted. The manager and the command line both use `StepIndex`, so they agree on what a step is.

A step ``<root>/<name>`` is committed iff its marker (``_CHECKPOINT_METADATA``) exists, decodes and names the same
step; a step directory without a marker is partial (a save that never committed); one whose marker does not
decode, or names another step, is invalid. Everything blocks; the index holds no state beyond its root.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from . import formats, layout
from .errors import CorruptCheckpointError, FormatVersionError, StorageError
from .formats import StepMetadata
from .storage import Location

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

    def location(self, step: int) -> Location:
        """Where `step` lives (committed or not). Not for an `ANY_PREFIX` index."""
        return self.root.child(layout.step_name(step, self.prefix))

    def scan(self) -> list[StepEntry]:
        """Every step directory with its status, oldest step first."""
        entries = []
        for name in self.root.list():
            step = layout.parse_step_name(name, None if self.prefix == ANY_PREFIX else self.prefix,
                                          any_prefix=self.prefix == ANY_PREFIX)
            if step is not None:
                entries.append(self._entry(step, name))
        return sorted(entries, key=lambda e: (e.step, e.name))

    def _entry(self, step: int, name: str) -> StepEntry:
        loc = self.root.child(name)
        try:
            marker = formats.read_step(loc)
        except (CorruptCheckpointError, FormatVersionError) as exc:
            return StepEntry(step, name, "invalid", problem=str(exc))
        if marker is None:
            return StepEntry(step, name, "partial")
        if marker.step != step:
            return StepEntry(step, name, "invalid", problem=f"its marker in {loc} names step {marker.step}")
        return StepEntry(step, name, "committed", marker)

    def remove_partial(self, entries: list[StepEntry]) -> None:
        """Delete the partial steps among `entries` (saves that crashed before their commit), unless a marker
        has appeared meanwhile."""
        for entry in entries:
            loc = self.root.child(entry.name)
            if entry.status == "partial" and loc.read(layout.CHECKPOINT_METADATA) is None:
                loc.delete_tree()

    def delete(self, step: int) -> None:
        """Uncommit `step` (its marker first), then delete its files. Retried; a step is never left committed but
        half deleted. Raises `StorageError` if it cannot be deleted."""
        loc = self.location(step)
        for attempt in range(3):
            try:
                loc.delete(layout.CHECKPOINT_METADATA)
                loc.delete_tree()
                return
            except StorageError:
                if attempt == 2:
                    raise
                time.sleep(0.1 * 2**attempt)
