"""The commit protocol, shared by the item-level `save` and the manager's steps.

1. Every process finishes the writes it started and makes them durable (`finish_writes`); if any process
   fails, every process raises and nothing is committed.
2. The primary finishes each item (`commit`): merges its processes' OCDBT stores into the item's root store,
   writes the files its format finishes an item with (`formats.item_files`: ``_strings.json``, ``_METADATA``,
   Orbax's ``commit_success.txt``); then the final files in order (a step's, `formats.step_files`), the last
   being the commit point; then publishes (a step written under a
   temporary name is renamed into place, where the storage renames). Every process learns the outcome.

A step or item copied elsewhere stays valid: nothing refers to absolute paths, and on storage that cannot rename
(object stores) the commit point is a file written last. Both functions are collective with several processes
and block.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from .. import arrays, formats
from ..core import layout
from ..core.errors import CheckpointError, with_context
from ..multihost.distributed import Coordinator
from ..storage import Location
from .save_plan import SavePlan
from .writing import Writes

logger = logging.getLogger("xla_tensorstore_ckpt")


def finish_writes(coordinator: Coordinator, loc: Location, start: Callable[[], Writes], *, fsync: bool,
                  what: str) -> Writes:
    """Start (if `start` has not) and wait for this process's writes under `loc`, then, with `fsync`, make
    them durable; return them. Raises on every process if one failed: its own error there,
    `CoordinationError` elsewhere."""
    def finish() -> Writes:
        try:
            writes = start()
            arrays.wait_all(writes.pending)
            if fsync:
                loc.sync_files(writes.files, writes.trees)
        except CheckpointError as exc:  # named by what is being saved, not only by the temporary name written
            raise with_context(exc, f"writing {what}") from exc
        return writes

    return coordinator.everywhere(f"writing {what}", finish)


def commit(coordinator: Coordinator, loc: Location, items: Mapping[str, SavePlan], final: Sequence[tuple[str, bytes]],
           *, fsync: bool, what: str, publish: Callable[[], None] | None = None) -> None:
    """The primary finishes each item of `items` (name relative to `loc`; "" for `loc` itself), writes `final`
    (name relative to `loc`, content) in order, then calls `publish`. Raises on every process if it failed."""
    def write() -> None:
        try:
            for name, plan in items.items():
                finish_item(loc.child(name) if name else loc, plan, fsync=fsync)
            for name, data in final:
                loc.write(name, data, fsync=fsync)
            if publish is not None:
                publish()
        except CheckpointError as exc:
            raise with_context(exc, f"committing {what}") from exc

    coordinator.on_primary(f"committing {what}", write)


def finish_item(item: Location, plan: SavePlan, *, fsync: bool) -> None:
    """Merge the item's OCDBT stores, then write the files its format finishes an item with (v2: its string
    leaves, its manifest with their checksum and its own, Orbax's completion mark)."""
    if plan.store.kind == "ocdbt":
        stores = [n for n in item.list() if n.startswith(layout.OCDBT_PROCESS_PREFIX)]
        if stores:
            arrays.merge_ocdbt(item, stores)
            if fsync:
                item.sync_files([layout.OCDBT_MANIFEST], trees=["d"])
    for name, data in formats.item_files(plan.manifest, plan.strings):
        item.write(name, data, fsync=fsync)


def discard(written: Location, what: str) -> None:
    """Delete `written`, the directory a failed save of `what` wrote, so that a full disk gets its room back at
    once (primary only, once every process is past its writes: the failure was agreed). A failure to delete is
    logged, never raised over the save's own error."""
    try:
        written.delete_tree()
    except CheckpointError as exc:
        logger.warning("could not delete %s, written by a failed save of %s: %s", written, what, exc)
