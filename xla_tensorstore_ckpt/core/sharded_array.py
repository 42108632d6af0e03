"""`ShardedArray`: a global array of which this process holds some shards as host (CPU) tensors.

This is what a process of a multi-host job sees of an SPMD tensor — its addressable shards and their indices —
without torch_xla: the checkpointer treats it exactly like the local shards of an XLA tensor. Useful for
host-side state sharded across processes, for pipelines that already hold shards on the host, and for
exercising multi-host saves with several processes on one machine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import UnsupportedValueError

Index = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ShardedArray:
    """`shape`/`dtype` of the global array, `shard_shape` of its shard grid (shard k along a dimension covers
    ``[k * s, min((k + 1) * s, n))``), and the shards this process holds: (index, data) with `data` a CPU
    tensor of the index's extent, or None in a restore target (then `restore` fills it).

    `mesh`, if given, says how every process of the job holds the grid, so that each derives the others'
    shards instead of gathering them (a save's writers, single-replica reads): (mesh shape, the array dimension
    each mesh axis splits, None where it replicates), the processes placed on the mesh in rank order, as a
    DTensor's ranks are on its device mesh. Process at mesh point m holds, along dimension d, shard k of the
    grid, k the position (C order) of m's coordinates on the axes splitting d: a DP=2 x FSDP=4 layout of
    dimension 0 is ``((2, 4), (None, 0))``. Processes beyond the mesh hold nothing. Where the shards held are not
    these, the processes gather them as without it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    shard_shape: tuple[int, ...]
    shards: tuple[tuple[Index, torch.Tensor | None], ...]
    mesh: tuple[tuple[int, ...], tuple[int | None, ...]] | None = None

    def __post_init__(self) -> None:
        if len(self.shard_shape) != len(self.shape) or any(s < 1 for s in self.shard_shape):
            raise UnsupportedValueError(f"shard shape {self.shard_shape} does not fit shape {self.shape}")
        if self.mesh is not None and not (
                len(self.mesh) == 2 and len(self.mesh[0]) == len(self.mesh[1]) and all(
                    isinstance(n, int) and n >= 1 for n in self.mesh[0]) and all(
                    d is None or (isinstance(d, int) and 0 <= d < len(self.shape)) for d in self.mesh[1])):
            raise UnsupportedValueError(f"mesh {self.mesh} is not (mesh shape, the array dimension each mesh axis "
                                        f"splits or None) for shape {self.shape}")
        for index, data in self.shards:
            if len(index) != len(self.shape) or any(
                    not (0 <= a <= b <= n) or a % s or (b != min(a + s, n) and b != a)
                    for (a, b), s, n in zip(index, self.shard_shape, self.shape)):
                raise UnsupportedValueError(f"shard index {index} is not a shard of shape {self.shape} on the "
                                            f"grid {self.shard_shape}")
            if data is not None and (tuple(data.shape) != tuple(b - a for a, b in index) or data.dtype != self.dtype
                                     or data.device.type != "cpu"):
                raise UnsupportedValueError(f"shard {index} holds a {data.dtype} {data.device} tensor of shape "
                                            f"{tuple(data.shape)}")

    @classmethod
    def from_tensor(cls, full: torch.Tensor, shard_shape: Sequence[int], indices: Sequence[Index],
                    mesh: tuple[tuple[int, ...], tuple[int | None, ...]] | None = None) -> ShardedArray:
        """The shards at `indices` of a whole (CPU) tensor."""
        return cls(tuple(full.shape), full.dtype, tuple(shard_shape),
                   tuple((tuple(i), full[tuple(slice(a, b) for a, b in i)].clone()) for i in indices), mesh)

    @classmethod
    def target(cls, shape: Sequence[int], dtype: torch.dtype, shard_shape: Sequence[int],
               indices: Sequence[Index], mesh: tuple[tuple[int, ...], tuple[int | None, ...]] | None = None
               ) -> ShardedArray:
        """A restore target: which shards this process wants, without data."""
        return cls(tuple(shape), dtype, tuple(shard_shape), tuple((tuple(i), None) for i in indices), mesh)

    @staticmethod
    def grid(shape: Sequence[int], shard_shape: Sequence[int]) -> list[Index]:
        """Every shard index of the grid, in C order."""
        axes = [[(k * s, min((k + 1) * s, n)) for k in range(max(1, math.ceil(n / s)))]
                for n, s in zip(shape, shard_shape)]
        indices: list[Index] = [()]
        for axis in axes:
            indices = [i + (a,) for i in indices for a in axis]
        return indices
