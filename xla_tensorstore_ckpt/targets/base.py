"""What a target is: the protocol each tensor kind implements, and that the registry (`targets`) picks from, with
the helpers several targets share.

A target owns every decision that depends on the kind of a value (a CPU tensor, a ShardedArray's host shards, a
DTensor, an XLA tensor): whether a value is its own, what cannot be saved, what a save plan depends on, where its
shards are, how their data comes to the host, how a restored value is built from read regions, and how it is put
in place. The save and restore paths ask the target; none of them names a kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch.autograd.graph import increment_version

from ..core import dtypes
from ..core.tensor_layout import Index, LocalShard, TensorLayout
from .holdings import Holding


class ReadJob(Protocol):
    """What `Target.build` is told of the value it builds: a restore's `restores.read_jobs.ReadJob` is one. A
    protocol here, so that targets, below the restore path, do not import it."""

    @property
    def reference(self) -> Any:
        """The target leaf the value is placed like (a tensor, DTensor, ShardedArray), or None."""

    @property
    def dtype(self) -> torch.dtype:
        """The restored value's dtype."""

    @property
    def layout(self) -> TensorLayout:
        """Where the data goes: the reference's local shards, or one whole-array CPU shard."""


class Target(Protocol):
    """A kind of array value. Methods taking lists are called once per batch of values of this target (torch_xla
    wants one call for many tensors); each returns one result per value, in order."""

    NAME: str  # the registry's key, recorded in `TensorLayout.target`
    # Restored data goes to devices through host buffers that are free again once `build` returns (they come
    # from a restore's reusable batch buffers), and `settle` waits for a placed value's transfer.
    DEVICE_BOUND: bool
    # A local shard is one chunk of the array's chunk grid (`TensorLayout.shard_shape`); False when the layout's
    # shard shape is a grid that shards are made of several chunks of.
    SHARDS_ARE_CHUNKS: bool
    # Every process restores the whole array (the regions of the others are its own): single-replica reads
    # derive them without asking.
    WHOLE_ON_EVERY_PROCESS: bool
    # A restore in place puts restored values into the existing ones (`assign`), which keep their identity;
    # else the container's entry is replaced.
    ASSIGNS_IN_PLACE: bool

    def claims(self, value: Any) -> bool:
        """Whether `value` (a tree leaf, or a restore target's reference) is of this kind. Cheap; imports nothing
        heavy. Asked in the registry's order: the first target that claims a value owns it."""

    def unsaveable(self, value: Any) -> str | None:
        """Why `value` cannot be saved as it is (the caller names the key), or None. Its dtype is checked
        by the caller."""

    def signatures(self, values: Sequence[Any]) -> list[tuple]:
        """What each value's save plan depends on besides its key (kind, shape, dtype, sharding): a plan made for
        one value serves another of the same signature. Called first by every save (XLA: runs the pending
        computations of `values` so that their data exists); blocks on that."""

    def layouts(self, values: Sequence[Any], signatures: Sequence[tuple] | None = None) -> list[TensorLayout]:
        """The local shards of each value (no data transfer); `signatures` from `signatures` if the caller has
        them (a save), None for a restore target's references."""

    def fetch(self, values: Sequence[Any], layouts: Sequence[TensorLayout],
              wanted: Sequence[Sequence[LocalShard]], *, copy: bool) -> list[list[torch.Tensor]]:
        """Host data of the `wanted` shards of each value, unpadded, one tensor per wanted shard. Host data is
        referenced unless `copy` (a caller that returns before writing must not see training change it).
        Blocks until the copies are done."""

    def fetched_elements(self, layout: TensorLayout, wanted: Sequence[LocalShard]) -> int:
        """Elements one `fetch` of `wanted` brings to the host (torch_xla fetches every local shard of a tiled
        tensor)."""

    def placing_elements(self, layout: TensorLayout) -> int:
        """Elements of host copies `build` leaves behind until the data is placed (torch_xla copies host data on
        its way to the devices); 0 for data that stays on the host."""

    def build(self, job: ReadJob, regions: dict, *, release: bool) -> Any:
        """The restored value of `job` from its read `regions` (`region` finds a shard's data in them), of
        `job.dtype`, placed like `job.reference`. With `release`, the reference's device data is released first
        (the caller puts the new value in its place). Blocks on transfers it starts, not on their end."""

    def settle(self, value: Any) -> None:
        """Block until the transfer of a value `build` made is done (DEVICE_BOUND targets)."""

    def local_memory(self, value: Any) -> torch.Tensor | None:
        """The tensor whose memory holds `value`'s data in this process, which a restore in place may read into
        (a DTensor's local tensor, a CPU tensor itself), or None."""

    def assign(self, targets: Sequence[Any], values: Sequence[Any]) -> None:
        """Put each restored value into its target, keeping the target's identity (an optimizer's parameters
        stay its own): copies or swaps of data, no computation."""

    def is_global(self, layout: TensorLayout) -> bool:
        """Whether the array is one global array of which processes hold parts (what one process wrote of it,
        another holding the same regions wrote alike), not a value of this process alone."""

    def holding(self, value: Any, layout: TensorLayout, count: int) -> Holding | None:
        """Every process's regions of `value` (laid out as `layout` here) among `count` processes, computed from
        its sharding without asking the others (`holdings`), or None where its layout does not tell them. The
        writers of a save and the single-replica reads of a restore are planned from it."""


def region(index: Index, reads: dict) -> Any:
    """The data of `index` (a numpy view into the read that contains it), or None for an empty shard."""
    # Loops, not generators: asked for every shard of every array a restore builds.
    for a, b in index:
        if a == b:
            return None
    for read, data in reads.items():
        if index == read:
            return data
        cut = []
        for (a, b), (ra, rb) in zip(index, read):
            if a < ra or rb < b:
                break
            cut.append(slice(a - ra, b - ra))
        else:
            return data[tuple(cut)]
    raise AssertionError(f"no read covers {index}")  # the reads are planned to cover every shard


def host_tensor(job: ReadJob, index: Index, regions: dict) -> torch.Tensor:
    """The restored data of the region `index` of `job` as a host tensor of `job.dtype` (a view of the read
    where no cast is needed; an empty tensor for an empty region)."""
    data = region(index, regions)
    if data is None:
        return torch.empty(tuple(b - a for a, b in index), dtype=job.dtype)
    return dtypes.numpy_to_tensor(data).to(job.dtype)


def whole_size(wanted: Sequence[LocalShard]) -> int:
    return sum(s.size for s in wanted)


def host_clones(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A copy of each host tensor (as ``clone`` makes it), in one batched copy: a save stages an optimizer's
    thousands of small tensors, and a ``clone`` each cost several times more, which every asynchronous save
    blocked on."""
    if not tensors:
        return []
    out = [torch.empty_like(t) for t in tensors]
    with torch.no_grad():
        torch._foreach_copy_(out, list(tensors))
    return out


def copy_host(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy restored host data `value` into `target`, unless the restore read it into that memory already;
    then only its autograd version moves, as a copy would have moved it."""
    with torch.no_grad():
        if target.data_ptr() != value.data_ptr() or target.numel() == 0:
            target.copy_(value)
        else:
            increment_version(target)
