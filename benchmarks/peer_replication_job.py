"""One process of bench_multi_tier.py's peer-replication job (gloo on 127.0.0.1: RANK, WORLD_SIZE, MASTER_*).
Each process holds one row shard of every array (`ShardedArray`, no devices; with --replicas R, DP = R x
FSDP = 4 / R: data-parallel replicas hold the same shard) and has a local tier of its own.

1. save() blocking time, local tier due every step, `local_replication=2` against 1, alternating ABBA; bytes
   sent to peers per step; disk used per host.
2. resumes (restore("latest") onto fresh targets, values compared exactly), per repeat: intact local tiers;
   one wiped host (process 1's local directory deleted: its step comes from its peer); both with the page cache
   as the saves left it, with every local file evicted, and with every one cached; two wiped hosts holding each
   other's copies (0 and 2: the persistent tier, --root, is used). Wall time and CPU seconds (user + system) of
   each; the fresh memory each touched (resident growth per process, page cache growth machine-wide); bytes each
   restore read from the persistent tier, from the restore events.

Run by bench_multi_tier.py as ``peer_replication_job.py --worker ROOT LOCAL_BASE MIB REPEATS REPLICAS`` in every
process of the job; prints its answer as one JSON line (`harness.worker_main`). Not meant to be run alone.
"""

from __future__ import annotations

import os
import shutil
import time

import footprint
import fresh_process
import harness
import torch

import xla_tensorstore_ckpt as xtc

ARRAYS, COLUMNS = 4, 1024
CACHE_STATES = ("as saved", "evicted", "cached")


def set_page_cache(directory: str, cache: str) -> None:
    """Leave the page cache as it is, or evict every file under `directory` from it, or read each file once."""
    if cache == "evicted" and os.path.isdir(directory):
        fresh_process.evict(directory)
    elif cache == "cached":
        for parent, _, names in os.walk(directory):
            for name in names:
                with open(os.path.join(parent, name), "rb") as f:
                    while f.read(1 << 24):
                        pass


def state(step: int | None, rows: int, index: int, count: int, replicas: int = 1) -> dict:
    """Process `index` holds row shard `index mod count / replicas` of every array (DP = replicas x FSDP)."""
    shards = count // replicas
    shape, shard, index = (rows * shards, COLUMNS), (rows, COLUMNS), index % shards
    box = [((index * rows, (index + 1) * rows), (0, COLUMNS))]
    if step is None:
        return {f"w{i}": xtc.ShardedArray.target(shape, torch.float32, shard, box) for i in range(ARRAYS)}
    return {f"w{i}": xtc.ShardedArray(shape, torch.float32, shard, ((box[0], torch.full(shard, float(step * 10 + i))),))
            for i in range(ARRAYS)}


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)


def worker(root: str, local_base: str, mib: str, repeats: str, replicas: str) -> dict:
    """One process of the job: `mib` of state, `repeats` measured rounds, `replicas` data-parallel replicas
    (a DP x FSDP layout); its measurements."""
    coordinator = xtc.Coordinator.from_environment()
    me, count = coordinator.index, coordinator.count
    repeats, replicas = int(repeats), int(replicas)
    rows = max(1, int(float(mib) * 2**20 / (ARRAYS * COLUMNS * 4)))
    events: list = []
    base = dict(max_to_keep=2, save_rng=False, local_save_interval_steps=1, local_max_to_keep=2,
                listeners=(events.append,))

    def local_dir(name: str, process: int = me) -> str:
        return os.path.join(local_base, name, f"host{process}")

    # 1. blocking time of save(), replication on and off, alternating ABBA
    managers = {k: xtc.CheckpointManager(f"{root}/blocking-{k}", xtc.CheckpointManagerOptions(
        save_interval_steps=None, local_directory=local_dir(f"blocking-{k}"), local_replication=k, **base))
        for k in (1, 2)}
    blocked: dict[int, list[float]] = {1: [], 2: []}
    for turn, k in enumerate(harness.alternate((1, 2), 2 * repeats + 1)):
        step = turn // 2  # step 0 warms both up
        values = state(step, rows, me, count, replicas)
        coordinator.everywhere("align", lambda: None)
        start = time.perf_counter()
        managers[k].save(step, model=values, force=True)
        elapsed = time.perf_counter() - start
        managers[k].wait_until_finished()
        if step:
            blocked[k].append(elapsed)
    sent = [e.details["sent_bytes"] for e in events if e.kind == "peer_copies_committed"]
    own = du(os.path.join(local_dir("blocking-2"), str(2 * repeats)))
    disk = {k: du(local_dir(f"blocking-{k}")) for k in (1, 2)}
    for manager in managers.values():
        manager.close()

    # 2. resumes: intact, one wiped host, two wiped hosts holding each other's copies. The page cache decides
    # much of a local restore's time here, so each of the first two runs in three states of it: as the saves left
    # it (own steps written with O_DIRECT are not cached; copies received from peers are), every local file
    # evicted, and every local file read once before.
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, local_directory=local_dir("resume"),
                                           local_replication=2, coordination_timeout_s=300, **base)
    cases = [(f"{name}, {cache}", hosts, cache) for cache in CACHE_STATES
             for name, hosts in (("intact", ()), ("one wiped host", (1,)))]
    cases.append(("persistent fallback", (0, 2), "as saved"))
    resumes: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    resident: dict[str, list[int]] = {name: [] for name, _, _ in cases}
    page_cache: dict[str, list[int]] = {name: [] for name, _, _ in cases}
    persistent_bytes: dict[str, list[int]] = {name: [] for name, _, _ in cases}
    exact = True
    for repeat in range(repeats + 1):  # repeat 0 warms up
        with xtc.CheckpointManager(f"{root}/resume", options) as manager:
            manager.save(repeat + 1, model=state(repeat + 1, rows, me, count, replicas), force=True)
        for name, hosts, cache in cases:
            if me in hosts:
                shutil.rmtree(local_dir("resume"), ignore_errors=True)
            set_page_cache(local_dir("resume"), cache)
            coordinator.everywhere("wiped", lambda: None)
            with xtc.CheckpointManager(f"{root}/resume", options) as manager:
                target = state(None, rows, me, count, replicas)
                events.clear()
                coordinator.everywhere("align", lambda: None)
                measures, step = footprint.measure(lambda m=manager, t=target: m.restore("latest", model=t))
            expected = state(repeat + 1, rows, me, count, replicas)
            exact &= step == repeat + 1 and all(torch.equal(target[k].shards[0][1], expected[k].shards[0][1])
                                                for k in target)
            if repeat:
                resumes[name].append(measures["wall_s"])
                cpu[name].append(measures["user_s"] + measures["system_s"])
                resident[name].append(measures["rss_growth_bytes"])
                page_cache[name].append(measures["page_cache_growth_bytes"])
                persistent_bytes[name].append(sum(e.details.get("storage_bytes") or 0 for e in events
                                                  if e.kind == "restore_finished" and e.tier == "persistent"))
    coordinator.close()
    return {"process": me, "state_bytes": rows * COLUMNS * 4 * ARRAYS, "blocked": blocked, "sent_per_step": sent,
            "own_step_bytes": own, "disk": disk, "resumes": resumes, "resume_cpu": cpu,
            "resume_resident_growth": resident, "resume_page_cache_growth": page_cache,
            "persistent_bytes": persistent_bytes, "exact": exact}


if __name__ == "__main__":
    harness.worker_main(worker)
