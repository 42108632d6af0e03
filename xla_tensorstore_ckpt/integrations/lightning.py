"""Lightning's checkpoint I/O in this library's format: ``Trainer(plugins=[XtcCheckpointIO()])`` writes each
checkpoint Lightning names (``.../epoch=0-step=4.ckpt``) as one of our items, a directory of that name, and
reads it back for ``ckpt_path=``. Asynchronous saves are Lightning's own wrapper around it:
``plugins=[AsyncCheckpointIO(XtcCheckpointIO())]`` (a point-in-time copy of the tensors, written on a thread).

The only module that imports Lightning. Lightning calls the methods on its global rank 0 alone, so each is a
single-process operation (never a collective); each blocks until done and raises this library's errors.
"""

from __future__ import annotations

import os
from typing import Any

from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO

from .. import checkpointer, storage
from ..core.errors import CheckpointNotFoundError, UsageError
from ..multihost.distributed import Coordinator
from ..options import RestoreOptions, SaveOptions


class XtcCheckpointIO(CheckpointIO):
    """Lightning `CheckpointIO` writing and reading this library's items (local, ``gs://``, ``s3://``).
    `save_options` / `restore_options`: the item-level options of every save and load."""

    def __init__(self, save_options: SaveOptions | None = None, restore_options: RestoreOptions | None = None):
        self.save_options = save_options or SaveOptions()
        self.restore_options = restore_options or RestoreOptions()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        """Write `checkpoint` (Lightning's dict: the module's state dict, optimizer and scheduler states, loops,
        callbacks) to `path`, replacing an item already there once the new one is committed. Blocks until
        committed. Raises `UsageError` for `storage_options` (the options are the plugin's),
        `UnsupportedValueError` for a value our format cannot hold (before anything is written)."""
        if storage_options is not None:
            raise UsageError(f"XtcCheckpointIO takes its options at construction, not storage_options= "
                             f"({storage_options!r}) for {path}")
        checkpointer.save(path, checkpoint, overwrite=True, options=self.save_options,
                          coordinator=Coordinator.single())

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint at `path`, its tensors on the CPU (Lightning moves them where its modules are; no code
        from the checkpoint is run, whatever `weights_only` says). Raises `CheckpointNotFoundError` naming the
        path, and what `xtc.restore` raises for damaged data."""
        return checkpointer.restore(path, options=self.restore_options, coordinator=Coordinator.single())

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Delete the checkpoint at `path` (Lightning's retention). Raises `CheckpointNotFoundError` if absent."""
        loc = storage.location(path)
        if not loc.exists():
            raise CheckpointNotFoundError(f"no checkpoint to remove at {loc}")
        loc.delete_tree()
