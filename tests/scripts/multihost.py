"""One process of a simulated multi-host job (gloo on 127.0.0.1; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the
environment). Each process holds a disjoint part of the shards of global arrays, as it would on a pod.

usage: multihost.py save ROOT            -> saves the item ROOT/item from this process's shards
       multihost.py restore ROOT OUT     -> restores its part of another shard split, writes it to OUT/rank<r>
       multihost.py manager ROOT KILL    -> manager saves steps 1 and 2; the process of rank KILL dies in step 2
       multihost.py rng_save ROOT        -> seeds its generators by rank, saves step 1, prints the next draws
       multihost.py rng_restore ROOT     -> restores step 1 (RNG states included), prints the next draws
       multihost.py gather ROOT          -> all_gathers records small and large (one process's only large),
                                            flags (`any`), maxima (`reduce_max`), broadcasts, a result the
                                            primary shares and its error, a save planned after a
                                            precondition that failed on process 1; prints them
       multihost.py stall ROOT WHEN P    -> the manager saves step 1; then the process of rank P stops itself
                                            (SIGSTOP) before the save of step 2 (WHEN=save) or the restore of
                                            step 1 (WHEN=restore); the others print the error naming it, then
                                            process 0 kills it
Prints one JSON line: {"rank": r, "bytes": bytes this process wrote, ...}.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import sys
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fault_backends import hooked, kill_at  # noqa: E402

import xla_tensorstore_ckpt as xtc  # noqa: E402
from xla_tensorstore_ckpt.core.errors import CoordinationError  # noqa: E402
from xla_tensorstore_ckpt.multihost.distributed import Coordinator  # noqa: E402
from xla_tensorstore_ckpt.saves import save_plan  # noqa: E402

# name -> (shape, dtype, save shard shape, restore shard shape)
ARRAYS = {
    "tiled": ((32, 16), torch.float32, (4, 8), (16, 4)),
    "uneven": ((10, 6), torch.float32, (3, 6), (10, 2)),
    "bf16": ((16, 8), torch.bfloat16, (8, 4), (4, 8)),
    "partial": ((8, 8), torch.float32, (4, 8), (8, 8)),
    "replicated": ((1024, 512), torch.float32, (1024, 512), (256, 512)),
}


def global_value(name: str) -> torch.Tensor:
    shape, dtype, _, _ = ARRAYS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g).to(dtype)


def held_shards(name: str, shard_shape, rank: int, world: int, *, restore: bool) -> list:
    grid = xtc.ShardedArray.grid(ARRAYS[name][0], shard_shape)
    if name == "replicated" and not restore:
        return grid  # every process holds the whole tensor
    if name == "partial" and not restore:
        return [grid[rank % len(grid)]]  # each shard held by several processes
    offset = 1 if restore else 0  # restore: another assignment of shards to processes
    return [index for k, index in enumerate(grid) if (k + offset) % world == rank]


def state(rank: int, world: int) -> dict:
    tree = {name: xtc.ShardedArray.from_tensor(global_value(name), ARRAYS[name][2],
                                               held_shards(name, ARRAYS[name][2], rank, world, restore=False))
            for name in ARRAYS}
    tree["meta"] = {"step": 7, "note": "multi-host"}
    return tree


def stall(root: str, when: str, stalled: int, rank: int, world: int) -> None:
    """See the module's usage. Exits without closing: the job's groups are unusable after a missed deadline."""
    other = Coordinator.from_environment()  # another coordinator of each process, as a manager's tiers have
    pids = other.all_gather(os.getpid())
    # Long enough that the collectives before the stall never miss it on a loaded machine (running the suite's
    # other workers beside this job): only the stopped process may be named.
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, async_save=False, save_rng=False,
                                           coordination_timeout_s=15)
    manager = xtc.CheckpointManager(root, options)
    manager.save(1, model=state(rank, world))
    if rank == stalled:
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        if when == "save":
            manager.save(2, model=state(rank, world))
        else:
            manager.restore(1, model=state(rank, world))
        print(json.dumps({"rank": rank, "error": None}), flush=True)
    except xtc.CoordinationTimeoutError as exc:
        try:  # the other coordinator does not wait for the process this one found stopped
            other.all_gather(rank)
            then = None
        except xtc.CoordinationTimeoutError as again:
            then = {"missing": list(again.missing), "message": str(again)[:500]}
        try:  # closing does not wait for the stopped process either, even where it hosts the side channel
            manager.close()
        except xtc.CheckpointError:
            pass
        print(json.dumps({"rank": rank, "error": type(exc).__name__, "phase": exc.phase,
                          "missing": list(exc.missing), "message": str(exc)[:500], "then": then,
                          "closed": True}), flush=True)
    # Process 0 hosts the side channel the others name the stopped one through: it leaves when they are done
    # (process 1 does, where process 0 is the stopped one).
    with open(f"{root}/named.{rank}", "w"):
        pass
    if rank == (1 if stalled == 0 else 0):
        while len([p for p in range(world) if os.path.exists(f"{root}/named.{p}")]) < world - 1:
            time.sleep(0.05)
        os.kill(pids[stalled], signal.SIGKILL)
    os._exit(0)


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    options = xtc.SaveOptions(split_bytes=1 << 20)
    if mode == "save":
        seen: list = []
        xtc.save(f"{root}/item", state(rank, world), options=dataclasses.replace(options, listeners=(seen.append,)))
        written = next(e for e in seen if e.kind == "save_written")  # the chunk bytes this process wrote
        print(json.dumps({"rank": rank, "bytes": written.details["chunk_bytes"]}), flush=True)
    elif mode == "restore":
        target = {name: xtc.ShardedArray.target(shape, dtype, restore_shards,
                                                held_shards(name, restore_shards, rank, world, restore=True))
                  for name, (shape, dtype, _, restore_shards) in ARRAYS.items()}
        target["meta"] = {"step": 0, "note": ""}
        out = xtc.restore(f"{root}/item", target)
        shards = {name: {json.dumps([list(i) for i in index]): data for index, data in out[name].shards}
                  for name in ARRAYS}
        xtc.save(f"{sys.argv[3]}/rank{rank}", {"shards": shards, "meta": out["meta"]}, coordinator=Coordinator.single())
        print(json.dumps({"rank": rank, "restored": {n: len(s) for n, s in shards.items()}}), flush=True)
    elif mode == "gather":
        coordinator = Coordinator.from_environment()
        small = coordinator.all_gather({"rank": rank, "name": f"p{rank}"})
        large = coordinator.all_gather(list(range(rank, rank + 3000)))
        mixed = coordinator.all_gather("x" * (9000 if rank == world - 1 else rank))
        flags = [coordinator.any(rank == world - 1), coordinator.any(False), coordinator.any(True)]
        maxima = coordinator.reduce_max([rank, -rank, 7])
        told = [coordinator.broadcast({"from": rank}), coordinator.broadcast(("y" * 5000, rank))]
        shared = coordinator.on_primary("naming the step", lambda: ("tmp", rank), share=True)
        try:
            coordinator.on_primary("preparing step 9", lambda: {}["step 9"], share=True)
            failed = None
        except (KeyError, CoordinationError) as exc:
            failed = [type(exc).__name__, str(exc)]
        small_state = {"w": torch.arange(4.0)}
        planned = sorted(save_plan.plan_saves({"item": small_state}, coordinator=coordinator, precondition=(
            save_plan.Precondition("taking the roots before step 3", None))))
        try:  # a precondition that failed on process 1 alone, raised by the planning's agreement everywhere
            save_plan.plan_saves({"item": small_state}, coordinator=coordinator, precondition=save_plan.Precondition(
                "taking the roots before step 3", KeyError("root") if rank == 1 else None))
            unmet = None
        except (KeyError, CoordinationError) as exc:
            unmet = [type(exc).__name__, str(exc)]
        coordinator.close()
        print(json.dumps({"rank": rank, "small": small, "large": large, "mixed": mixed, "any": flags,
                          "max": maxima, "told": told, "shared": shared, "failed": failed, "planned": planned,
                          "unmet": unmet}), flush=True)
    elif mode == "stall":
        stall(root, sys.argv[3], int(sys.argv[4]), rank, world)
    elif mode in ("rng_save", "rng_restore"):
        manager = xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(save_interval_steps=1, async_save=False))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if mode == "rng_save":
                torch.manual_seed(100 + rank)
                random.seed(200 + rank)
                np.random.seed(300 + rank)
                manager.save(1, extra={"step": 1})
            else:
                manager.restore("latest", extra={"step": 0})
        manager.close()
        draws = [torch.rand(3).tolist(), random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn()]
        print(json.dumps({"rank": rank, "draws": draws, "warnings": [str(w.message) for w in caught]}), flush=True)
    else:
        kill_rank = int(sys.argv[3])
        manager_options = xtc.CheckpointManagerOptions(save_interval_steps=1, async_save=False, save_rng=False,
                                                       coordination_timeout_s=60, save_options=options)
        # The process of rank KILL dies when step 2's chunks are written, before they are synced.
        hook = kill_at("sync_files:2") if rank == kill_rank else (lambda *_: None)
        manager = xtc.CheckpointManager(hooked(root, hook), manager_options)
        manager.save(1, model=state(rank, world))
        try:
            manager.save(2, model=state(rank, world))
            print(json.dumps({"rank": rank, "step2": "committed"}), flush=True)
        except xtc.CheckpointError as exc:
            print(json.dumps({"rank": rank, "step2": type(exc).__name__, "error": str(exc)[:500]}), flush=True)
        print(json.dumps({"rank": rank, "steps": manager.all_steps()}), flush=True)
        manager.close()  # the other modes leave their groups to be destroyed at exit


if __name__ == "__main__":
    main()
