"""Single-replica reads for `reader.DCPStorageReader` (``RestoreOptions(single_replica_reads=True)``): where DCP's
plan has several ranks read the same stored region (replicated targets, HSDP's replicas), the coordinator's
`prepare_global_plan` picks one of them to read it (`balancing.balance`: the least loaded holder) and the
others receive it from that rank over the job's default process group (`distributed.Coordinator.exchange`, gloo
point to point). Each rank gets its part as its `LoadPlan.storage_data` (`SharedReads`). Pure planning here, plus
the exchange.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.distributed.checkpoint.planner import LoadItemType

from ..multihost.balancing import balance
from ..multihost.distributed import Coordinator

Region = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class SharedReads:
    """One rank's part: the positions of its plan's items another rank reads for it (`skip`), and per peer, in
    order, the positions of its items whose data it sends (`sends`) or receives into (`receives`)."""

    skip: frozenset[int]
    sends: tuple[tuple[int, tuple[int, ...]], ...]
    receives: tuple[tuple[int, tuple[int, ...]], ...]


def plan_shared(plans: Sequence[Any], region: Callable[[Any], Region], nbytes: Callable[[Any], int]
                ) -> list[SharedReads]:
    """Each rank's `SharedReads`, from every rank's DCP `LoadPlan` (`region(item)`: the stored region a tensor
    read item names; `nbytes(item)`: its size). Deterministic; called by the coordinator."""
    groups: dict[tuple[str, Region], dict[int, int]] = {}
    for rank, plan in enumerate(plans):
        for position, item in enumerate(plan.items):
            if item.type != LoadItemType.BYTE_IO:
                groups.setdefault((item.storage_index.fqn, region(item)), {}).setdefault(rank, position)
    shared = sorted((key, members) for key, members in groups.items() if len(members) > 1)
    readers = balance([(key, nbytes(plans[min(m)].items[m[min(m)]]), sorted(m)) for key, m in shared], len(plans))
    skip: list[set[int]] = [set() for _ in plans]
    sends: list[dict[int, list[int]]] = [{} for _ in plans]
    receives: list[dict[int, list[int]]] = [{} for _ in plans]
    for key, members in shared:
        reader = readers[key]
        for rank, position in sorted(members.items()):
            if rank != reader:
                skip[rank].add(position)
                sends[reader].setdefault(rank, []).append(members[reader])
                receives[rank].setdefault(reader, []).append(position)
    return [SharedReads(frozenset(s), tuple((p, tuple(v)) for p, v in sorted(out.items())),
                        tuple((p, tuple(v)) for p, v in sorted(into.items())))
            for s, out, into in zip(skip, sends, receives)]


def exchange(shared: SharedReads, rank: int, world: int, sent: dict[int, np.ndarray],
             buffers: dict[int, np.ndarray], where: str) -> None:
    """Send the data read for each position of `shared.sends` (`sent`, by position) and receive into `buffers`
    (by position, of the sender's sizes), as raw bytes. Blocks; raises `CoordinationError` naming the peer."""
    def raw(array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array).reshape(-1).view(np.uint8)

    coordinator = Coordinator(None, rank, world)  # the default process group, as dcp.load's is
    coordinator.exchange({peer: [raw(sent[p]) for p in positions] for peer, positions in shared.sends},
                         {peer: [raw(buffers[p]) for p in positions] for peer, positions in shared.receives},
                         lambda peer: f"regions of {where} read by process {peer}")
