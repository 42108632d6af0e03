"""De-duplication of peer copies: the key of each item of a local step that a data-parallel replica holds
identical (`item_keys`). Items two processes in different failure domains hold with the same key (and the same
metadata files) are not copied; the copy records which process holds them (`StepFiles.shared`). Called by the
managed local tier with its save plans, before the step is queued for replication (`PeerReplicator`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping

from ... import targets
from ...saves.save_plan import SavePlan


def item_keys(plans: Mapping[str, SavePlan], per_process: Collection[str]) -> dict[str, str]:
    """For each item of a local step (`plans`: its save plans) that can be shared with a data-parallel replica:
    a digest of which regions of which arrays this process wrote. Only items whose arrays are all global
    (SPMD-sharded or replicated XLA tensors, DTensors, `ShardedArray`s) qualify, not `per_process` ones (the generator
    states: one row per process, alike in shape only): two processes writing the same regions of the same
    global arrays wrote the same values, the invariant the persistent tier's one writer per shard rests on."""
    keys = {}
    for name, plan in plans.items():
        if name in per_process or not plan.arrays or not all(targets.is_global(a.layout) for a in plan.arrays):
            continue
        regions = sorted((repr(a.key_path), sorted(w.region for w in a.writes)) for a in plan.arrays)
        keys[name] = hashlib.sha256(repr(regions).encode()).hexdigest()
    return keys
