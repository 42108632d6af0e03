"""One process of a two-process job (gloo on 127.0.0.1; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the
environment) saving incremental delta steps 1-3 of a row-sharded array: process 0's rows move a little every step
(stored as deltas), process 1's never change (referenced from step 1); each process also keeps its own local tier.

usage: incremental_job.py ROOT LOCAL_BASE      -> prints {"rank", "persistent", "local", "bases"} as JSON
"""

from __future__ import annotations

import json
import os
import sys

import torch

import xla_tensorstore_ckpt as xtc

SHAPE, SHARD = (64, 32), (32, 32)


def global_value(step: int) -> torch.Tensor:
    value = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    value[0, :step] += 1  # rows of process 0 only
    return value


def main() -> None:
    root, local_base = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    options = xtc.CheckpointManagerOptions(
        save_interval_steps=1, max_to_keep=1, incremental=True, delta=True, save_rng=False, async_save=True,
        local_directory=os.path.join(local_base, f"host{rank}"), local_save_interval_steps=1, local_max_to_keep=1,
        coordination_timeout_s=120)
    index = ((rank * SHARD[0], (rank + 1) * SHARD[0]), (0, SHARD[1]))
    with xtc.CheckpointManager(root, options) as manager:
        for step in (1, 2, 3):
            manager.save(step, model={"w": xtc.ShardedArray.from_tensor(global_value(step), SHARD, [index])})
        manager.wait_until_finished()
        print(json.dumps({"rank": rank, "persistent": manager.all_steps("persistent"),
                          "local": manager.all_steps("local"), "bases": list(manager.metadata(3).bases)}),
              flush=True)


if __name__ == "__main__":
    main()
