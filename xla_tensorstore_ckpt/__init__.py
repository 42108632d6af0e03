"""xla_tensorstore_ckpt: Orbax-style checkpointing for PyTorch/XLA SPMD.

Each shard of an SPMD tensor is written into one chunk of a zarr v3 array (through tensorstore) at its index in
the global array, so a checkpoint restores onto any mesh, any device count, or plain CPU. Importing this package
does not import torch_xla.
"""

# `policies` and `events`: the two modules users name in their options (docs/quickstart.md), as
# `xtc.policies.LatestN(3)` and `xtc.events.JsonLinesListener(path)`, or imported from the package by name.
from .checkpoint_manager import policies as policies
from .checkpoint_manager.manager import CheckpointManager, CheckpointManagerOptions
from .checkpoint_manager.training_state import skip_batches
from .checkpointer import metadata, restore, save
from .core import events as events
from .core import zarr_dtypes as _zarr_dtypes
from .core.errors import (
    AsyncSaveError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CoordinationError,
    CoordinationTimeoutError,
    CorruptCheckpointError,
    FormatVersionError,
    ItemNotFoundError,
    KeyMismatchError,
    ShapeMismatchError,
    StepNotFoundError,
    StorageError,
    UnsupportedValueError,
    UsageError,
)
from .core.records import ArrayMetadata, SavedSharding, StepMetadata
from .core.sharded_array import ShardedArray
from .multihost.distributed import Coordinator
from .options import RestoreOptions, SaveOptions
from .restores.restore_plan import KeyPlan, RestorePlan, plan_restore
from .tools.inspection import open_array
from .version import __version__ as __version__

_zarr_dtypes.register_when_imported()

__all__ = [
    "ArrayMetadata",
    "AsyncSaveError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointManagerOptions",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CoordinationError",
    "CoordinationTimeoutError",
    "Coordinator",
    "CorruptCheckpointError",
    "DCPLoadPlanner",
    "DCPStorageReader",
    "DCPStorageWriter",
    "FormatVersionError",
    "ItemNotFoundError",
    "KeyPlan",
    "KeyMismatchError",
    "RestoreOptions",
    "RestorePlan",
    "SaveOptions",
    "SavedSharding",
    "ShapeMismatchError",
    "ShardedArray",
    "StepMetadata",
    "StepNotFoundError",
    "StorageError",
    "UnsupportedValueError",
    "UsageError",
    "metadata",
    "open_array",
    "plan_restore",
    "restore",
    "save",
    "skip_batches",
]


def __getattr__(name: str):
    # torch.distributed.checkpoint is imported only by those who use DCP's storage classes (`dcp_storage`).
    if name in ("DCPLoadPlanner", "DCPStorageReader", "DCPStorageWriter"):
        from . import dcp_storage

        return getattr(dcp_storage, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
