"""`DCPLoadPlanner`: DCP's default load planner whose refusals name the checkpoint's path too.

DCP's `DefaultLoadPlanner` checks the state dict against the checkpoint's metadata in ``create_local_plan``,
before any storage reader sees the plan, and its errors name only the key (``Missing key in checkpoint
state_dict``, ``Size mismatch``). ``dcp.load(sd, storage_reader=DCPStorageReader(path), planner=DCPLoadPlanner())``
plans exactly as the default planner does and, where that one refuses, raises this library's error naming the
key, both shapes and the path (`DCPStorageReader.read_metadata` records the path in the metadata).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlan, TensorStorageMetadata

from ..core.errors import KeyMismatchError, ShapeMismatchError


class DCPLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` (same arguments, same plans) raising `KeyMismatchError` for keys of the state dict the
    checkpoint lacks (unless ``allow_partial_load``) and `ShapeMismatchError` for a tensor whose global shape is
    not the stored one, each naming key and path. DCP calls it on every rank; it blocks on nothing."""

    def create_local_plan(self) -> LoadPlan:
        try:
            return super().create_local_plan()
        except (RuntimeError, ValueError):
            self._raise_mismatch()  # ours where we can say more; DCP's own error otherwise
            raise

    def _raise_mismatch(self) -> None:
        metadata = self.metadata
        stored = metadata.state_dict_metadata
        meta = getattr(metadata, "storage_meta", None)
        where = str(meta.checkpoint_id) if meta is not None and meta.checkpoint_id else "the checkpoint"
        missing = sorted(fqn for fqn in self.state_dict if fqn not in stored)
        if missing and not self.allow_partial_load:
            shown = ", ".join(repr(k) for k in missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise KeyMismatchError(f"{where}: the state dict asks for {len(missing)} key(s) the checkpoint does not "
                                   f"hold: {shown}", missing=tuple(missing))
        for fqn, value in self.state_dict.items():
            entry = stored.get(fqn)
            shape = _global_shape(value)
            if isinstance(entry, TensorStorageMetadata) and shape is not None and tuple(entry.size) != shape:
                raise ShapeMismatchError(f"{where}: {fqn!r} is stored with shape {tuple(entry.size)}, the state dict's "
                                         f"tensor has shape {shape}", key=fqn, saved_shape=tuple(entry.size),
                                         target_shape=shape)


def _global_shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None  # a DTensor's shape is the global one
