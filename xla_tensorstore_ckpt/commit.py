"""The commit protocol, shared by the item-level `save` and the manager's steps.

1. Every process finishes the writes it started and makes them durable (`finish_writes`); if any process
   fails, every process raises and nothing is committed.
2. The primary writes the final files in order, the last being the commit point (`commit`): an item's
   ``_METADATA``, or a step's item manifests and then its marker. Every process learns the outcome.

Commits never rely on rename, so the same protocol holds on object stores and a copied directory stays valid.
Both functions are collective with several processes and block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from . import arrays
from .distributed import Coordinator
from .saving import Writes
from .storage import Location


def finish_writes(coordinator: Coordinator, loc: Location, start: Callable[[], Writes], *, fsync: bool,
                  what: str) -> None:
    """Start (if `start` has not) and wait for this process's writes under `loc`, then, with `fsync`, make
    them durable. Raises on every process if one failed: its own error there, `CoordinationError` elsewhere."""
    def finish() -> None:
        writes = start()
        arrays.wait_all(writes.pending)
        if fsync:
            loc.sync_files(writes.files)

    coordinator.everywhere(f"writing {what}", finish)


def commit(coordinator: Coordinator, loc: Location, files: Sequence[tuple[str, bytes]], *, fsync: bool,
           what: str) -> None:
    """The primary writes `files` (name relative to `loc`, content) in order; the last one is the commit
    point. Raises on every process if the primary failed."""
    def write() -> None:
        for name, data in files:
            loc.write(name, data, fsync=fsync)

    coordinator.on_primary(f"committing {what}", write)
