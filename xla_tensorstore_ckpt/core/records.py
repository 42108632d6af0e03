"""The neutral records every format reader returns and every writer takes: what an item holds (`ItemManifest`:
the tree with an `ArrayMetadata` per array and JSON leaves inline) and what a step holds (`StepMetadata`, its
commit marker). Immutable, independent of the on-disk encoding; no torch_xla, no tensorstore."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from . import dtypes, layout, tree


@dataclass(frozen=True)
class SavedSharding:
    """How a tensor was sharded when saved: its HLO sharding (empty for a DTensor), the number of tiles per
    dimension, the replication factor, when they could be recovered the mesh and partition spec, and a
    DTensor's placements."""

    hlo: str
    tiles: tuple[int, ...]
    replicas: int
    num_devices: int
    mesh_shape: tuple[int, ...] | None = None
    axis_names: tuple[str, ...] | None = None
    partition_spec: tuple[Any, ...] | None = None
    placements: tuple[str, ...] | None = None  # a DTensor's, e.g. ("Shard(dim=0)", "Replicate()")

    def describe(self) -> str:
        """Short text for listings: ``mesh (4, 2) ('x', 'y') spec ('x', None)``, a DTensor's mesh and
        placements, or the tile layout."""
        if self.placements is not None:
            names = f" {self.axis_names}" if self.axis_names else ""
            return f"dtensor mesh {self.mesh_shape}{names} placements ({', '.join(self.placements)})"
        if self.mesh_shape is not None and self.partition_spec is not None:
            names = f" {self.axis_names}" if self.axis_names else ""
            return f"mesh {self.mesh_shape}{names} spec {self.partition_spec}"
        return f"tiles {self.tiles} x{self.replicas} replicas"


# `ArrayMetadata.opaque` of the bytes of a value torch.distributed.checkpoint serialized itself (a "byte-IO" item):
# only DCP decodes them (`dcp_storage`), the user's own trust decision.
OPAQUE_DCP_BYTES = "dcp-bytes"
OPAQUE_KINDS = frozenset({OPAQUE_DCP_BYTES})


@dataclass(frozen=True)
class ArrayMetadata:
    """One stored tensor: its zarr array directory (relative to the item), shape, zarr dtype name, chunk
    shape and the sharding it was saved with (None for CPU or unsharded tensors). `opaque` marks a 1-D uint8
    array that holds bytes another tool encoded (`OPAQUE_DCP_BYTES`: a value DCP serialized itself), which this
    library stores and hands back as bytes but never decodes; None for every tensor."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    sharding: SavedSharding | None = None
    opaque: str | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtypes.by_name(self.dtype).torch

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.by_name(self.dtype).itemsize

    @property
    def num_chunks(self) -> int:
        """Chunks holding data (none for an array with a zero-length dimension)."""
        return math.prod(-(-n // c) for n, c in zip(self.shape, self.chunk_shape))


@dataclass(frozen=True)
class RawArrayMetadata(ArrayMetadata):
    """A tensor stored as its raw bytes in C order at `offset` of a file (a Hugging Face safetensors tensor):
    `path` is its key, `file` the file's name relative to the item (empty when the item is the file itself).
    `chunk_shape` is the row block streaming readers take at a time (the file holds one contiguous run)."""

    file: str = ""
    offset: int = 0


@dataclass(frozen=True)
class PieceMetadata:
    """One saved shard of a tensor stored as a piece of its own (a DCP chunk): the region [`offsets`,
    `offsets + sizes`) of the tensor, in the entry at [`start`, `start + length`) of `file`."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int
    length: int


@dataclass(frozen=True)
class PiecesArrayMetadata(ArrayMetadata):
    """A tensor stored as pieces that tile it, each a ``torch.save`` blob of one region (a DCP tensor): `path` is
    its key. `chunk_shape` is the row block streaming readers take at a time (pieces need not form a grid)."""

    pieces: tuple[PieceMetadata, ...] = ()


@dataclass(frozen=True)
class ArrayStore:
    """Where and how an item's arrays are stored.

    kind: "directories" (one zarr directory per array, named by `ArrayMetadata.path`) or "ocdbt" (one OCDBT
        key-value store at the item directory, arrays under the key prefix `ArrayMetadata.path`).
    zarr_format: 3, or 2 for Orbax checkpoints written with ``use_zarr3=False``.
    checksums: every chunk carries a crc32c (this library's arrays; Orbax's do not).
    fill_missing: a missing chunk reads as the fill value (Orbax checkpoints written without
        ``store_array_data_equal_to_fill_value``) instead of being an error.
    refs: an item of an incremental step: its chunk tables, and the chunks it references in base steps
        (`formats.item_refs.ItemRefs`); None for a standalone item.
    """

    kind: str = "directories"
    zarr_format: int = 3
    checksums: bool = True
    fill_missing: bool = False
    refs: Any = None


@dataclass(frozen=True)
class ItemManifest:
    """What one item holds: `tree` has `ArrayMetadata` leaves for arrays and the values themselves for JSON
    leaves; `store` says where the arrays are. `format` names the format it was read from or will be written
    in (`formats`: "v2", "orbax", "safetensors", ...)."""

    tree: Any
    format: str
    store: ArrayStore = ArrayStore()
    # The CRC32C (8 hex digits) of the item's _strings.json as its _METADATA records it (`checksums`); None: not
    # recorded (no string leaves, or written before checksums, or by Orbax).
    strings_crc32c: str | None = None

    def arrays(self) -> list[tuple[layout.KeyPath, ArrayMetadata]]:
        return [(p, v) for p, v in tree.flatten(self.tree) if isinstance(v, ArrayMetadata)]

    def leaves(self) -> dict[layout.KeyPath, Any]:
        return dict(tree.flatten(self.tree))


@dataclass(frozen=True)
class StepMetadata:
    """The commit marker of a step, written last: a step is committed iff it exists and decodes. Holds what the
    step contains and how it came to be."""

    step: int
    items: tuple[str, ...]
    created_at: float
    committed_at: float
    metrics: dict[str, Any] | None = None
    custom: dict[str, Any] | None = None
    versions: dict[str, str] | None = None
    process_count: int = 1
    format_version: int = 2  # the format it was read from (0: Orbax's own); 2, the one written, by default
    # A step of a manager's local tier: the process that wrote it (its index then), whether the step was also
    # due for the persistent tier (a restart that does not find it there redoes that copy), and that tier's root
    # (a local tier reused by another run is not mistaken for this one's).
    writer: int | None = None
    persistent_copy: bool = False
    persistent_root: str | None = None
    # Where a manager with several tiers found the step ("local", "persistent"); never stored.
    tiers: tuple[str, ...] = ()
    # An incremental step: the steps holding chunks it references (`incremental`); retention keeps them.
    bases: tuple[int, ...] = ()
    # A delta step: the most saves between one of its delta chunks and that chunk's anchor (0: none).
    chain: int = 0
    # An incremental step: how many saves of its tier since the last full anchor step (0: this is one), which
    # `CheckpointManagerOptions.anchor_every` bounds.
    since_anchor: int = 0
