"""What a format is: the protocols each format module implements, and that the registry (`formats`) picks from.

A format module (`v1`, `v2`, `orbax`, `safetensors`, `dcp`) is itself the implementation: its module-level names
satisfy these protocols, so adding a format is one module and one line in the registry. Formats are recognised
by content, each asked in the registry's order whether a document is its own (`claims_*`); none may claim a
document another format also claims.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..core.records import ItemManifest, StepMetadata
from ..storage import Location

KeyPath = tuple[str | int, ...]


class ItemFormat(Protocol):
    """A format items can be read in."""

    NAME: str  # the registry's key, recorded in `ItemManifest.format`
    DESCRIPTION: str  # for people: "Orbax", "Hugging Face safetensors", ...
    FILE_SUFFIX: str | None  # an item that is one file with this suffix: asked before ``_METADATA`` is read
    # Restores match the target's keys by dotted name, not by key path (DCP: its keys are flattened names, and
    # ``{"state": {0: ...}}`` is saved as ``state.0``).
    MATCH_BY_NAME: bool

    def claims_item(self, loc: Location, doc: dict | None) -> bool:
        """True if the item at `loc` is in this format; `doc` is its ``_METADATA`` decoded, None if it has none.
        Blocks on at most a few small reads."""

    def decode_item(self, loc: Location, doc: dict | None, *, where: str) -> ItemManifest:
        """The manifest of an item this format claimed, validated: `CorruptCheckpointError` naming `where` (or
        the file at fault) for anything malformed."""

    def array_names(self, paths: list[KeyPath]) -> list[str]:
        """The name each key path's array is (or would be) stored under, deterministic (every process computes
        the same); also how tools name the item's values."""


class StepFormat(Protocol):
    """A format steps can be read in."""

    NAME: str
    VERSION: int  # recorded in `StepMetadata.format_version` (0: Orbax's own)
    # Whether its committed steps carry Orbax's ``commit_success.txt`` after the marker on storage that cannot
    # rename, so that one killed between the two is finished on the next listing (`tier`).
    COMPLETION_MARK: bool

    def claims_step(self, doc: dict) -> bool:
        """True if a decoded ``_CHECKPOINT_METADATA`` is in this format."""

    def decode_step(self, loc: Location, doc: dict, step: int | None, *, where: str) -> StepMetadata | None:
        """The marker of the step at `loc` (number `step`, or from its name); None if the document describes
        no step (an Orbax item's own metadata). Raises `CorruptCheckpointError` if malformed."""

    def is_committed(self, loc: Location, marker: StepMetadata) -> bool:
        """Whether a step with this marker is committed (beyond the marker: Orbax's need its completion mark on
        storage that cannot rename). Blocks on at most one small read."""


class WriteFormat(ItemFormat, StepFormat, Protocol):
    """A format this library writes: how arrays are named, which JSON leaves are also arrays, and the files a
    commit writes (`commit`)."""

    # The names of the files `item_files` / `step_files` write, known before their contents are: an output
    # replaced on storage that cannot rename loses them first (`outputs`).
    ITEM_COMMIT_FILES: tuple[str, ...]
    STEP_COMMIT_FILES: tuple[str, ...]

    def scalar_dtype(self, value: Any) -> str | None:
        """The zarr dtype a JSON scalar leaf is also stored as (a 0-d array), or None if it is not."""

    def save_warning(self, leaves: list[tuple[KeyPath, Any]], names: list[str]) -> str | None:
        """What the save planner warns of for these leaves stored under these names (the keys other readers of
        this format cannot restore), or None."""

    def item_files(self, manifest: ItemManifest, strings: dict[str, str]) -> list[tuple[str, bytes]]:
        """The files that finish an item, in the order written, the last its commit point: the string leaves,
        the manifest (recording the strings' checksum), the completion mark."""

    def step_files(self, marker: StepMetadata) -> list[tuple[str, bytes]]:
        """The files that commit a step, in order: the marker, then the completion mark."""
