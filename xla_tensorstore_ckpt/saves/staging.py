"""Staging a save: copying the shards a plan writes off the devices (or referencing host tensors), batch by
batch within `SaveOptions.host_batch_bytes`, cut into the chunks each write covers. Blocks.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping, Sequence

import torch

from .. import storage, targets
from ..core import grid
from ..core.tensor_layout import LocalShard
from ..options import SaveOptions
from .save_plan import ArrayPlan, ChunkWrite, SavePlan


class FetchCounts(storage.Counts):
    """What saves copied off the devices, this process's since it started (`FETCHED`): the arrays of
    device-bound targets (XLA tensors) whose shards were fetched, those shards, and their bytes; the batches
    staged (`fetch_sources` calls), and how many of those ran while Python's cyclic garbage collector was enabled
    (``batches_under_gc``: saves pause it while they plan and stage, `core.gc_pause`, so 0 unless another
    thread enabled it meanwhile). A save of one state to several tiers fetches each shard once
    (`stage_shared`); tests read these to see that."""

    FIELDS = ("device_arrays", "device_shards", "device_bytes", "batches", "batches_under_gc")


FETCHED = FetchCounts()


def stage(batch: Sequence[ArrayPlan], *, copy_cpu: bool) -> list[list[torch.Tensor]]:
    """Host data of each plan's writes (one tensor per write), fetched from the devices with one call per target
    (torch_xla: one per sharding kind; DTensors: one synchronization per device). Host tensors are referenced,
    not copied, unless `copy_cpu` (a caller that returns before the writes finish must copy: the training loop
    may change them)."""
    sources = fetch_sources(batch, copy_cpu=copy_cpu)
    return [[_cut(sources[i][w.source], w) for w in p.writes] for i, p in enumerate(batch)]


def fetch_sources(batch: Sequence[ArrayPlan], *, copy_cpu: bool) -> list[dict[LocalShard, torch.Tensor]]:
    """The host data of the local shards each plan's writes read from (`stage`): one call per target and copy
    mode (a tensor the plan owns, a scalar leaf's, is never copied)."""
    FETCHED.add(batches=1, batches_under_gc=int(gc.isenabled()))
    out: list[dict[LocalShard, torch.Tensor]] = [{} for _ in batch]
    for i, p in enumerate(batch):
        if p.owned and p.sources:  # a host tensor planning made: it is its one whole shard (hundreds per step)
            out[i] = {p.sources[0]: p.value}
    device = [0, 0, 0]  # arrays, shards, bytes fetched from devices: counted once per batch
    for copy in (True, False):
        where = [i for i, p in enumerate(batch) if not p.owned and copy_cpu == copy]
        if not where:
            continue
        fetched = targets.fetch([batch[i].value for i in where], [batch[i].layout for i in where],
                                [batch[i].sources for i in where], copy=copy)
        for i, shards in zip(where, fetched):
            out[i] = dict(zip(batch[i].sources, shards))
            if targets.of_layout(batch[i].layout).DEVICE_BOUND:
                device[0] += 1
                device[1] += len(shards)
                for shard in shards:
                    device[2] += shard.nbytes
    if device[0]:
        FETCHED.add(device_arrays=device[0], device_shards=device[1], device_bytes=device[2])
    return out


def _cut(data: torch.Tensor, write: ChunkWrite) -> torch.Tensor:
    if write.region == write.source.index:
        return data
    return data[tuple(slice(a - sa, b - sa) for (a, b), (sa, _) in zip(write.region, write.source.index))]


Staged = list[tuple[list[ArrayPlan], list[list[torch.Tensor]]]]


def stage_all(plans: Sequence[ArrayPlan], options: SaveOptions, *, copy_cpu: bool) -> Staged:
    """Host copies of everything this process writes, batch by batch (the transient fetch of a batch stays
    within `options.host_batch_bytes`). Blocks. For asynchronous saves: once this returns, training may change
    the tensors; `write_staged` then writes from the copies."""
    return [(group, stage(group, copy_cpu=copy_cpu))
            for group in grid.batches([p for p in plans if p.writes], lambda p: p.host_bytes,
                                      options.host_batch_bytes)]


def stage_shared(saves: Sequence[Mapping[str, SavePlan]], options: SaveOptions) -> list[dict[str, Staged]]:
    """Host copies for several saves of one state (a manager's tiers; items name -> plan each), for asynchronous
    saves: every local shard is copied off the devices once, by the first save that writes from it, and the
    writes of every save are cut from that copy (arrays are matched by identity: the saves must plan the same
    leaf objects). Holds one host copy of everything any save writes. Blocks."""
    fetched: dict[tuple[int, LocalShard], torch.Tensor] = {}
    out = []
    for plans in saves:
        staged_items: dict[str, Staged] = {}
        for name, plan in plans.items():
            staged: Staged = []
            for group in grid.batches([p for p in plan.arrays if p.writes], lambda p: p.host_bytes,
                                      options.host_batch_bytes):
                missing = [p for p in group if any((id(p.value), s) not in fetched for s in p.sources)]
                for p, shards in zip(missing, fetch_sources(missing, copy_cpu=True) if missing else []):
                    fetched.update({(id(p.value), s): data for s, data in shards.items()})
                staged.append((group, [[_cut(fetched[(id(p.value), w.source)], w) for w in p.writes]
                                       for p in group]))
            staged_items[name] = staged
        out.append(staged_items)
    return out
