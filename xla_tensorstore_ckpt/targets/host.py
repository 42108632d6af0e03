"""The host target: a `ShardedArray`, the shards of a global array this process holds as CPU tensors (what a
process of a multi-host job holds of an SPMD tensor, without torch_xla)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..core.errors import UsageError
from ..core.sharded_array import ShardedArray
from ..core.tensor_layout import LocalShard, TensorLayout
from . import holdings
from .base import ReadJob, host_tensor, whole_size
from .holdings import Holding

NAME = "host"
DEVICE_BOUND = False
SHARDS_ARE_CHUNKS = True
ASSIGNS_IN_PLACE = False  # a restore target holds no data: the restored array replaces it
WHOLE_ON_EVERY_PROCESS = False


def claims(value: Any) -> bool:
    return isinstance(value, ShardedArray)


def unsaveable(value: ShardedArray) -> str | None:
    return None  # its shards were checked when it was made


def signatures(values: Sequence[ShardedArray]) -> list[tuple]:
    return [(NAME, v.shape, v.dtype, v.shard_shape, tuple(index for index, _ in v.shards)) for v in values]


def layouts(values: Sequence[ShardedArray], signatures: Sequence[tuple] | None = None) -> list[TensorLayout]:
    """The shards each array holds, on its shard grid."""
    return [TensorLayout(v.shape, NAME, v.shard_shape,
                         tuple(LocalShard(i, "host", index, 0) for i, (index, _) in enumerate(v.shards)))
            for v in values]


def fetch(values: Sequence[ShardedArray], layouts: Sequence[TensorLayout], wanted: Sequence[Sequence[LocalShard]],
          *, copy: bool) -> list[list[torch.Tensor]]:
    out = []
    for value, lay, shards in zip(values, layouts, wanted):
        held = dict(zip(lay.shards, (d for _, d in value.shards)))
        out.append([held[s].clone() if copy else held[s] for s in shards])
    return out


def fetched_elements(layout: TensorLayout, wanted: Sequence[LocalShard]) -> int:
    return whole_size(wanted)


def placing_elements(layout: TensorLayout) -> int:
    return 0


def build(job: ReadJob, regions: dict, *, release: bool) -> ShardedArray:
    lay = job.layout
    shards = tuple((shard.index, host_tensor(job, shard.index, regions).contiguous()) for shard in lay.shards)
    return ShardedArray(lay.shape, job.dtype, lay.shard_shape, shards)


def settle(value: Any) -> None:
    return None


def local_memory(value: Any) -> None:
    return None


def assign(targets: Sequence[Any], values: Sequence[Any]) -> None:
    raise UsageError("a ShardedArray is restored as a new value, not in place")


def is_global(layout: TensorLayout) -> bool:
    return True


def holding(value: ShardedArray, layout: TensorLayout, count: int) -> Holding | None:
    """From the array's `mesh`; None without one (a ShardedArray tells only its own shards then)."""
    if value.mesh is None:
        return None
    return holdings.mesh_groups(layout.shape, layout.shard_shape, *value.mesh, count)
