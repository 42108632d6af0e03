"""One process of a job of 4 (gloo on 127.0.0.1; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment)
that saves and restores arrays laid out as data-parallel replicas would hold them: run by
tests/test_replica_reads.py.

usage: replica_reads.py save PATH                -> saves this process's shards of every array into PATH
       replica_reads.py restore PATH MODE...     -> restores onto the restore layouts once per MODE ("on": with
                                                    single-replica reads, "off": without), checks every value
       replica_reads.py manager ROOT            -> a manager saves step 1 (model: every array), a new one resumes
                                                    it in place with single-replica reads, and a third, on an
                                                    empty root, initialises from its model item (init_from)
       replica_reads.py die PATH RANK            -> restores with single-replica reads; process RANK dies once
                                                    the reads of its first batch have started
Prints one JSON line per restore: {"rank", "mode", "ok", "storage_bytes", "sent", "received", "error"}.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt.core import events

WORLD = 4


def dp_fsdp(shape, dp: int, rank: int) -> tuple[tuple[int, ...], list]:
    """The shard grid and shards of process `rank` in a DP=dp x FSDP=WORLD/dp layout sharding dimension 0."""
    fsdp = WORLD // dp
    shard_shape = (-(-shape[0] // fsdp), *shape[1:])
    grid = xtc.ShardedArray.grid(shape, shard_shape)
    return shard_shape, [grid[rank % fsdp]] if rank % fsdp < len(grid) else []


# name -> (shape, dtype, save layout, restore layout); a layout maps rank -> (shard shape, shard indices)
def layouts(rank: int) -> dict:
    def strided(shape, shard_shape, step):
        grid = xtc.ShardedArray.grid(shape, shard_shape)
        return shard_shape, [index for k, index in enumerate(grid) if k % WORLD in ((rank + j) % WORLD
                                                                                     for j in range(step))]

    return {
        # DP=2 x FSDP=2, restored onto the same layout: each shard read once, sent to the other replica
        "dp2": ((64, 256), torch.float32, dp_fsdp((64, 256), 2, rank), dp_fsdp((64, 256), 2, rank)),
        # DP=4 x FSDP=1: a fully replicated tensor, every process holds all of it
        "replicated": ((128, 128), torch.float32, dp_fsdp((128, 128), 4, rank), dp_fsdp((128, 128), 4, rank)),
        # saved by FSDP=4, restored by DP=4 (every process wants it all): reshards onto another layout
        "gathered": ((96, 64), torch.bfloat16, dp_fsdp((96, 64), 1, rank), dp_fsdp((96, 64), 4, rank)),
        # partially replicated: each shard held by two processes, not in DP groups
        "partial": ((32, 64), torch.float32, strided((32, 64), (8, 64), 1), strided((32, 64), (8, 64), 2)),
        # uneven shards (13 rows in shards of 4), restored on a grid that cuts across the saved chunks
        "uneven": ((13, 96), torch.float32, dp_fsdp((13, 96), 1, rank), strided((13, 96), (3, 96), 2)),
        # saved FSDP=4, restored DP=2 x FSDP=2 with shards straddling chunks
        "reshard": ((48, 40), torch.int32, dp_fsdp((48, 40), 4, rank), dp_fsdp((48, 40), 2, rank)),
    }


# The meshes of the DP x FSDP layouts (save, restore), from which every process derives the others' shards;
# the strided layouts have none: their chunk lists are gathered.
MESHES = {"dp2": (((2, 2), (None, 0)),) * 2, "replicated": (((4, 1), (None, 0)),) * 2,
          "gathered": (((1, 4), (None, 0)), ((4, 1), (None, 0))), "reshard": (((1, 4), (None, 0)), ((2, 2), (None, 0)))}


def global_value(name: str, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if dtype == torch.int32:
        return torch.randint(-1000, 1000, shape, generator=g, dtype=torch.int32)
    return torch.randn(shape, generator=g).to(dtype)


def state(rank: int) -> dict:
    out = {}
    for name, (shape, dtype, (shard_shape, indices), _) in layouts(rank).items():
        out[name] = xtc.ShardedArray.from_tensor(global_value(name, shape, dtype), shard_shape, indices,
                                                 MESHES.get(name, (None,))[0])
    return out


def target(rank: int) -> dict:
    return {name: xtc.ShardedArray.target(shape, dtype, shard_shape, indices, MESHES.get(name, (None, None))[1])
            for name, (shape, dtype, _, (shard_shape, indices)) in layouts(rank).items()}


def check(rank: int, restored: dict) -> bool:
    for name, (shape, dtype, _, (_, indices)) in layouts(rank).items():
        full = global_value(name, shape, dtype)
        got = dict(restored[name].shards)
        if set(got) != set(map(tuple, indices)):
            return False
        for index, data in got.items():
            if not torch.equal(data, full[tuple(slice(a, b) for a, b in index)]):
                return False
    return True


def restore(path: str, rank: int, mode: str, *, die: bool = False) -> dict:
    """Restore `path` onto this process's layouts; with `die`, the process exits (status 9) as soon as the reads
    of its first batch have started."""
    finished = []

    def listener(event: events.Event) -> None:
        if die and event.kind == events.RESTORE_BATCH_ISSUED:
            os._exit(9)
        if event.kind == events.RESTORE_FINISHED:
            finished.append(event)

    options = xtc.RestoreOptions(single_replica_reads=mode == "on", listeners=(listener,),
                                 broadcast_max_bytes=int(os.environ.get("XTC_BROADCAST_MAX_BYTES", 256 << 20)))
    line = {"rank": rank, "mode": mode}
    try:
        restored = xtc.restore(path, target(rank), options=options)
    except xtc.CheckpointError as exc:
        return {**line, "ok": False, "error": type(exc).__name__, "message": str(exc)[:2000]}
    details = finished[0].details
    return {**line, "ok": check(rank, restored), "storage_bytes": details["storage_bytes"],
            "sent": details.get("peer_bytes_sent"), "received": details.get("peer_bytes_received")}


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    if mode == "save":
        # Tensors every process holds whole are split into chunks written by different processes (from 16 KiB).
        xtc.save(path, state(rank), options=xtc.SaveOptions(use_ocdbt=os.environ.get("XTC_OCDBT", "1") == "1",
                                                              single_file_max_bytes=0, split_bytes=16 << 10))
        print(json.dumps({"rank": rank, "saved": True}), flush=True)
    elif mode == "restore":
        for how in sys.argv[3:]:
            print(json.dumps(restore(path, rank, how)), flush=True)
    elif mode == "manager":
        finished = []
        listener = (lambda e: e.kind == events.RESTORE_FINISHED and finished.append(e))
        options = xtc.CheckpointManagerOptions(
            save_interval_steps=1, async_save=False, coordination_timeout_s=120,
            save_options=xtc.SaveOptions(split_bytes=16 << 10),
            restore_options=xtc.RestoreOptions(single_replica_reads=True, listeners=(listener,)))
        with xtc.CheckpointManager(f"{path}/run", options) as manager:
            manager.save(1, model=state(rank), extra={"step": 1})
        for how in ("resume", "init_from"):
            model = target(rank)
            finished.clear()
            root = f"{path}/run" if how == "resume" else f"{path}/fresh"
            with xtc.CheckpointManager(root, options) as manager:
                step = manager.restore("latest", model=model, init_from=f"{path}/run/1/model")
            (event,) = [e for e in finished if e.item == "model"]
            print(json.dumps({"rank": rank, "mode": how, "step": step, "ok": check(rank, model),
                              "storage_bytes": event.details["storage_bytes"],
                              "received": event.details["peer_bytes_received"]}), flush=True)
    elif mode == "die":
        print(json.dumps(restore(path, rank, "on", die=rank == int(sys.argv[3]))), flush=True)


if __name__ == "__main__":
    main()
