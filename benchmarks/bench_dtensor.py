"""DTensor state saved and restored by this library and by torch.distributed.checkpoint (DCP), same job, same
state, side by side; and each checkpoint opened by `xtckpt` and by JAX's Orbax.

Per workload (`large`: 1 GiB of float32 and bfloat16 matrices; `model`: a ~200M-parameter decoder with its AdamW
moments, ~2.4 GiB; names, shapes and dtypes from benchmarks/workloads.py), one job of 4 processes (gloo on
127.0.0.1, torch_xla never imported: every process checks and reports it) holds the state as DTensors on a 1-D
DeviceMesh("cpu", (4,)) with `Shard(0)` placements: the layout FSDP2's `fully_shard` gives parameters and AdamW
states. Each process builds only its own shard (`DTensor.from_local`), from a generator seeded by tensor and
rank, so every value is known without a gather. The model's tensors are nested as in the workload's names
(``params`` / ``exp_avg`` / ``exp_avg_sq``). Both contenders run with their defaults (both sync files).

After an untimed warm-up (a tiny state saved and restored by every path: imports, thread pools, process
groups), `--repeats` rounds (at least 7 for a measurement), the contenders alternating ABBA (even rounds this
library first), each round:

- save (sync): ``xtc.save(dir, state)`` against ``dcp.save(state, checkpoint_id=dir)``, into a fresh directory
  (the previous round's is deleted beforehand, untimed);
- save (async): this library's ``CheckpointManager(async_save=True).save(i, model=state)`` (blocking: until it
  returns; total: until ``wait_until_finished()``) against ``dcp.async_save(state, checkpoint_id=dir,
  process_group=<a gloo group of its own>)`` (blocking: until it returns the future; total: until its
  ``result()``), each into a fresh step / directory;
- restore: the round's sync checkpoint, evicted from the page cache (benchmarks/fresh_process.py), into a
  target of zeros DTensors of the same placements built beforehand: ``xtc.restore(dir, target)`` (returns new
  DTensors beside the target), the manager's ``restore(step, model=target)`` of the round's async step (in
  place, each process reading straight into its local tensors: how an FSDP2 run resumes; `xtc-in-place`)
  against ``dcp.load(target, checkpoint_id=dir)`` (in place). Round 0 checks every restored local shard bit
  for bit, for each.

Each round also measures plain file I/O of the same bytes by the same processes (first, before the contenders):
every process writes its shards' bytes to a file of its own and fsyncs it, and reads them back, evicted from the
page cache, into the target's local tensors, one read per tensor. A reference for what the disk gives, not a strict
floor: reads issued in parallel (this library's) can beat it.

Every timed region starts and ends with a barrier; each process measures its own (benchmarks/footprint.py).
Aggregated per round over the 4 processes: wall (and blocking) time of the slowest process; user and system CPU
seconds, peak resident growth and bytes read from / written to storage summed over the processes; page cache
growth is machine-wide (the maximum over the processes, which all see the same machine); fresh memory = summed
resident growth + page cache growth. Reported: medians over the rounds, per byte of state (B/B), and DCP over
this library (x faster, x the CPU) against the goals (save and restore >= 1.5x faster than DCP's; reported,
not asserted). With ``--warm-memory`` process 0 runs a throwaway process touching twice the state's bytes right
before each timed region (this VM hands fresh memory back and forth with its hypervisor; docs/performance.md).

Then, on the last round's sync checkpoints: ``xtckpt tree`` of each (exit status), and in a JAX process without
torch (no PJRT_DEVICE / CPU_NUM_DEVICES, one CPU device), Orbax on each: ``StandardCheckpointer().metadata(dir)``
(opened if it lists every array: for a directory that is not its own, Orbax answers an empty tree and raises
nothing),
``StandardCheckpointer().restore(dir)`` without a target, and a partial restore of the smallest float32 matrix
alone (``PyTreeRestore(partial_restore=True)``); both restores compare that matrix bit for bit with the saved
values (by SHA-256). A checkpoint of ours is expected to open, DCP's not (the exception class is reported).

    python benchmarks/bench_dtensor.py [--scale 1.0] [--repeats 7] [--workloads large,model] [--warm-memory]
        [--dir DIR] [--output FILE]
Only the full run (the default options; --repeats 7 or more) writes benchmarks/results/dtensor.{json,txt}; any
other writes to the temporary directory (or --output) and names the files it wrote. About 1 minute at --scale 0.25
--repeats 3 here (2 cores).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import footprint  # noqa: E402
from bench_torch_xla_import import _medians  # noqa: E402
from fresh_process import evict, run_json  # noqa: E402
from jobs import run_job  # noqa: E402

CONTENDERS = ("xtc", "dcp")
IN_PLACE = "xtc-in-place"  # the manager's restore into the target (as an FSDP2 resume does), like dcp.load
RESTORERS = ("xtc", IN_PLACE, "dcp")
BASELINE = "dcp"
OPERATIONS = ("save", "async", "restore")
PLAIN = "plain"  # every process writes its shards' bytes to a file of its own and fsyncs it / reads them back
ROWS = {"save": (*CONTENDERS, PLAIN), "async": CONTENDERS, "restore": (*RESTORERS, PLAIN)}
OPERATION_NAMES = {"save": "save (sync)", "async": "save (async)", "restore": "restore"}
PROCESSES = 4
GOAL = 1.5  # DCP's wall time over ours: the goal for sync saves and restores (reported, not asserted)
UNSET = ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS")  # the workers and the JAX process run without them


# ------------------------------------------------------------------------------------------- worker processes


def _local_rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """(start, stop) of `rank`'s rows of a dimension of `n` split by Shard(0) (torch.chunk's split)."""
    size = -(-n // world)
    return min(n, rank * size), min(n, (rank + 1) * size)


def _local_value(index: int, shape, dtype, rank: int, world: int):
    """The rows of tensor `index` that process `rank` holds: deterministic, from a generator of its own."""
    import torch

    start, stop = _local_rows(shape[0], rank, world)
    g = torch.Generator().manual_seed(index * 1009 + rank)
    return torch.randn((stop - start, *shape[1:]), generator=g).to(dtype)


def _full_value(index: int, shape, dtype, world: int):
    """Tensor `index` whole, as the processes hold it together."""
    import torch

    return torch.cat([_local_value(index, shape, dtype, r, world) for r in range(world)])


def _nest(flat: dict) -> dict:
    """``{"params/embed": v}`` -> ``{"params": {"embed": v}}``: the workload's names as a tree."""
    tree: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return tree


def _leaf(tree: dict, name: str):
    for part in name.split("/"):
        tree = tree[part]
    return tree


def worker(workload: str, scale: float, root: str, repeats: int, warm_memory: bool) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import workloads
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import xla_tensorstore_ckpt as xtc

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    dcp_group = dist.new_group(backend="gloo")  # async_save's background collectives: a group of their own
    entries = [(name, tuple(shape), dtype) for name, shape, dtype, _, _ in workloads.specs(workload, scale)[0]]
    nbytes = workloads.spec_bytes(workload, scale)

    def dtensor(local, shape):
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)

    state = _nest({name: dtensor(_local_value(i, shape, dtype, rank, world), shape)
                   for i, (name, shape, dtype) in enumerate(entries)})
    target = _nest({name: dtensor(torch.zeros_like(_leaf(state, name).to_local()), shape)
                    for name, shape, _ in entries})

    def exact(tree) -> bool:
        return all(isinstance(_leaf(tree, name), DTensor) and tuple(_leaf(tree, name).placements) == (Shard(0),)
                   and torch.equal(_leaf(tree, name).to_local(), _leaf(state, name).to_local())
                   for name, _, _ in entries)

    def on_primary(fn) -> None:
        dist.barrier()
        if rank == 0:
            fn()
        dist.barrier()

    def delete(path: str) -> None:
        on_primary(lambda: shutil.rmtree(path, ignore_errors=True))

    def timed(fn, *, warm: bool = True) -> tuple[dict, object]:
        """`fn` measured on every process between two barriers (process 0 warms memory first if asked)."""
        if warm and warm_memory and rank == 0:
            footprint.warm_memory(2 * nbytes)
        dist.barrier()
        measures, result = footprint.measure(fn)
        dist.barrier()
        return measures, result

    managers = {}

    def save_async(contender: str, directory: str, step: int, tree):
        """Start an async save; return what `finish` waits for."""
        if contender == "xtc":
            manager = managers.get(directory)
            if manager is None:
                manager = managers[directory] = xtc.CheckpointManager(directory, xtc.CheckpointManagerOptions(
                    save_interval_steps=1, max_to_keep=None, save_rng=False))
            manager.save(step, model=tree)
            return manager
        return dcp.async_save(tree, checkpoint_id=os.path.join(directory, str(step)), process_group=dcp_group)

    def finish(contender: str, handle) -> None:
        if contender == "xtc":
            handle.wait_until_finished()
        else:
            getattr(handle, "upload_completion", handle).result()

    def forget(contender: str, directory: str, step: int) -> None:
        """Delete an async save's step, untimed."""
        if contender == "xtc" and directory in managers:
            if step in managers[directory].all_steps():
                managers[directory].delete(step)
        else:
            delete(os.path.join(directory, str(step)))

    def async_run(contender: str, directory: str, step: int, tree):
        def run() -> float:
            started = time.perf_counter()
            handle = save_async(contender, directory, step, tree)
            blocking = time.perf_counter() - started
            finish(contender, handle)
            return blocking

        return run

    def in_place(path: str, into) -> object:
        """`path` is a step of the round's async root: the manager restores it into `into`."""
        directory, step = os.path.split(path)
        managers[directory].restore(int(step), model=into)
        return into

    save = {"xtc": lambda path, tree: xtc.save(path, tree),
            "dcp": lambda path, tree: dcp.save(tree, checkpoint_id=path)}
    restore = {"xtc": lambda path, into: xtc.restore(path, into), IN_PLACE: in_place,
               "dcp": lambda path, into: (dcp.load(into, checkpoint_id=path), into)[1]}

    # Warm-up, untimed: every path once on a tiny state (imports, thread pools, process groups).
    tiny = {"w": dtensor(torch.ones(4, 8), (4 * world, 8))}
    tiny_target = {"w": dtensor(torch.zeros(4, 8), (4 * world, 8))}
    for contender in CONTENDERS:
        path = os.path.join(root, "warm-up", contender)
        save[contender](path, tiny)
        restore[contender](path, tiny_target)
        finish(contender, save_async(contender, os.path.join(root, "warm-up", f"{contender}-async"), 0, tiny))
    in_place(os.path.join(root, "warm-up", "xtc-async", "0"), tiny_target)
    dist.barrier()

    plain_path = os.path.join(root, PLAIN, f"{rank}.bin")
    os.makedirs(os.path.dirname(plain_path), exist_ok=True)

    def raw(value):
        """A DTensor's local bytes, as a writable numpy view."""
        return value.to_local().view(torch.uint8).numpy().reshape(-1)

    def plain_write() -> None:
        with open(plain_path, "wb", buffering=0) as f:
            for name, _, _ in entries:
                f.write(raw(_leaf(state, name)))
            os.fsync(f.fileno())

    def plain_read() -> None:
        with open(plain_path, "rb", buffering=0) as f:
            for name, _, _ in entries:
                view, done = memoryview(raw(_leaf(target, name))), 0
                while done < len(view):
                    done += f.readinto(view[done:]) or len(view)  # a short file ends the loop (caught below)

    runs: dict = {op: {c: [] for c in ROWS[op]} for op in OPERATIONS}
    checked = {}
    for i in range(repeats):
        order = CONTENDERS if i % 2 == 0 else tuple(reversed(CONTENDERS))
        if os.path.exists(plain_path):
            os.remove(plain_path)
        measures, _ = timed(plain_write)
        runs["save"][PLAIN].append(measures)
        for contender in order:
            path = os.path.join(root, f"{contender}-sync")
            delete(path)
            measures, _ = timed(lambda c=contender, p=path: save[c](p, state))
            runs["save"][contender].append(measures)
        for contender in order:
            directory = os.path.join(root, f"{contender}-async")
            forget(contender, directory, i - 1)
            measures, blocking = timed(async_run(contender, directory, i, state))
            runs["async"][contender].append({**measures, "blocking_s": blocking})
        on_primary(lambda: evict(os.path.dirname(plain_path)))
        measures, _ = timed(plain_read)
        runs["restore"][PLAIN].append(measures)
        if i == 0:
            checked[PLAIN] = exact(target)
        for contender in RESTORERS if i % 2 == 0 else tuple(reversed(RESTORERS)):
            path = (os.path.join(root, f"{contender}-sync") if contender != IN_PLACE
                    else os.path.join(root, "xtc-async", str(i)))
            with torch.no_grad():
                for name, _, _ in entries:
                    _leaf(target, name).to_local().zero_()
            on_primary(lambda p=path: evict(p))
            measures, out = timed(lambda c=contender, p=path: restore[c](p, target))
            runs["restore"][contender].append(measures)
            if i == 0:
                checked[contender] = exact(out)
            del out
    for manager in managers.values():
        manager.close()
    # The array the Orbax process restores: the smallest float32 matrix, its digest from the known values.
    probe = min(((i, name, shape, dtype) for i, (name, shape, dtype) in enumerate(entries)
                 if dtype == torch.float32 and len(shape) == 2), key=lambda e: (e[2][0] * e[2][1], e[0]))
    digest = None
    if rank == 0:
        import hashlib

        full = _full_value(probe[0], probe[2], probe[3], world)
        digest = hashlib.sha256(full.numpy().tobytes()).hexdigest()
    dist.barrier()
    return {"rank": rank, "bytes": nbytes, "tensors": len(entries), "runs": runs, "exact": checked,
            "probe": {"name": probe[1], "shape": list(probe[2]), "sha256": digest},
            "torch_xla_imported": "torch_xla" in sys.modules}


def orbax_worker(ours: str, theirs: str, name: str, shape: list[int], digest: str, tensors: int) -> dict:
    """In a JAX process without torch, on each checkpoint: Orbax's ``StandardCheckpointer().metadata`` (opened if
    it lists the `tensors` arrays), its ``restore`` without a target (every array; `name`'s compared with
    `digest`), and a partial restore of `name` alone onto one CPU device (compared too). Each: opened, or the
    exception's class."""
    import hashlib

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    def attempt(fn) -> dict:
        started = time.perf_counter()
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - reported: which checkpoint Orbax cannot open, and why
            return {"opened": False, "error": type(exc).__name__, "message": str(exc)[:300],
                    "seconds": time.perf_counter() - started}
        return {"opened": True, "seconds": time.perf_counter() - started, **out}

    def exact(tree) -> bool:
        value = np.asarray(_leaf(tree, name))
        return value.shape == tuple(shape) and hashlib.sha256(value.tobytes()).hexdigest() == digest

    def metadata(path: str) -> dict:
        with ocp.StandardCheckpointer() as checkpointer:
            meta = checkpointer.metadata(path)
        return {"arrays": len(jax.tree_util.tree_leaves(getattr(meta, "item_metadata", meta)))}

    def restore(path: str) -> dict:
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(path)
        jax.block_until_ready(restored)
        return {"arrays": len(jax.tree_util.tree_leaves(restored)), "exact": exact(restored)}

    def restore_one(path: str) -> dict:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        item = _nest({name: jax.ShapeDtypeStruct(tuple(shape), np.float32, sharding=sharding)})
        with ocp.PyTreeCheckpointer() as checkpointer:
            restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
                item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
        return {"exact": exact(restored)}

    out = {side: {what: attempt(lambda fn=fn, p=path: fn(p))
                  for what, fn in (("metadata", metadata), ("restore", restore), ("restore_one", restore_one))}
           for side, path in (("xtc", ours), ("dcp", theirs))}
    for side in out.values():  # for a directory without its metadata, Orbax answers an empty tree, raising nothing
        if side["metadata"]["opened"] and side["metadata"]["arrays"] != tensors:
            side["metadata"].update(opened=False, error=f"{side['metadata']['arrays']} of {tensors} arrays listed")
    out["torch_imported"] = "torch" in sys.modules
    return out


# ----------------------------------------------------------------------------------------------- the runner


def _aggregate(per_rank: list[dict]) -> dict:
    """One round of one contender, over the processes: the slowest process's times, summed CPU, resident growth
    and bytes, the machine-wide page cache growth (the largest any process saw)."""
    out = {"wall_s": max(r["wall_s"] for r in per_rank),
           "page_cache_growth_bytes": max(r["page_cache_growth_bytes"] for r in per_rank)}
    for key in ("user_s", "system_s", "rss_growth_bytes", "read_bytes", "written_bytes"):
        out[key] = sum(r[key] for r in per_rank)
    out["fresh_bytes"] = out["rss_growth_bytes"] + out["page_cache_growth_bytes"]
    if "blocking_s" in per_rank[0]:
        out["blocking_s"] = max(r["blocking_s"] for r in per_rank)
    return out


def _summary(rounds: list[dict], nbytes: int) -> dict:
    out = _medians(rounds, nbytes)
    out["written_per_byte"] = statistics.median(r["written_bytes"] for r in rounds) / nbytes
    if "blocking_s" in rounds[0]:
        out["blocking_s"] = statistics.median(r["blocking_s"] for r in rounds)
    return out


def _opened(root: str, probe: dict, tensors: int) -> dict:
    """`xtckpt tree` of each sync checkpoint, then Orbax in a JAX process of its own."""
    paths = {c: os.path.join(root, f"{c}-sync") for c in CONTENDERS}
    xtckpt = os.path.join(os.path.dirname(sys.executable), "xtckpt")
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    out: dict = {"xtckpt_tree": {}}
    for contender, path in paths.items():
        proc = subprocess.run([xtckpt, "tree", path], capture_output=True, text=True, env=env, timeout=600)
        out["xtckpt_tree"][contender] = {"status": proc.returncode, "lines": len(proc.stdout.splitlines()),
                                         "stderr": proc.stderr.strip()[-300:]}
    out["orbax"] = run_json([sys.executable, os.path.abspath(__file__), "--orbax", paths["xtc"], paths["dcp"],
                             probe["name"], json.dumps(probe["shape"]), probe["sha256"], str(tensors)], env,
                            "the Orbax process")
    return out


def measure(scale: float, repeats: int, workdir: str, workload_names: tuple[str, ...] = ("large", "model"),
            warm_memory: bool = False) -> dict:
    """One job of 4 processes per workload: `repeats` rounds of sync save, async save and restore, this library
    and DCP alternating ABBA; then each checkpoint opened by xtckpt and by Orbax. Blocks for many minutes at
    scale 1."""
    out: dict = {"scale": scale, "repeats": repeats, "processes": PROCESSES,
                 "mode": "warm-memory" if warm_memory else "cold-memory", "workloads": {}}
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    for workload in workload_names:
        root = os.path.join(workdir, f"dtensor-{workload}")
        print(f"dtensor: {PROCESSES} processes save and restore {workload}, {repeats} rounds ...", file=sys.stderr,
              flush=True)
        started = time.perf_counter()
        answers = run_job([os.path.abspath(__file__), "--worker", workload, str(scale), root, str(repeats),
                           str(int(warm_memory))], PROCESSES, env=env, timeout_s=4 * 3600)
        nbytes = answers[0]["bytes"]
        rounds = {op: {c: [_aggregate([a["runs"][op][c][i] for a in answers]) for i in range(repeats)]
                       for c in ROWS[op]} for op in OPERATIONS}
        result = {"bytes": nbytes, "tensors": answers[0]["tensors"], "job_seconds": time.perf_counter() - started,
                  "exact": {c: all(a["exact"][c] for a in answers) for c in (*RESTORERS, PLAIN)},
                  "torch_xla_imported": any(a["torch_xla_imported"] for a in answers), "rounds": rounds,
                  "per_rank": [a["runs"] for a in answers],
                  "median": {op: {c: _summary(rounds[op][c], nbytes) for c in ROWS[op]} for op in OPERATIONS}}
        result["speedup"] = {op: result["median"][op][BASELINE]["wall_s"] / result["median"][op]["xtc"]["wall_s"]
                             for op in OPERATIONS}
        result["speedup"]["restore_in_place"] = (result["median"]["restore"][BASELINE]["wall_s"]
                                                 / result["median"]["restore"][IN_PLACE]["wall_s"])
        result["speedup"]["async_blocking"] = (result["median"]["async"][BASELINE]["blocking_s"]
                                               / result["median"]["async"]["xtc"]["blocking_s"])
        result["cpu_ratio"] = {op: result["median"][op]["xtc"]["cpu_s"] / result["median"][op][BASELINE]["cpu_s"]
                               for op in OPERATIONS}
        result["cpu_ratio"]["restore_in_place"] = (result["median"]["restore"][IN_PLACE]["cpu_s"]
                                                   / result["median"]["restore"][BASELINE]["cpu_s"])
        print(f"dtensor: {workload}: xtckpt and Orbax open the checkpoints ...", file=sys.stderr, flush=True)
        result["opened"] = _opened(root, answers[0]["probe"], result["tensors"])
        shutil.rmtree(root, ignore_errors=True)
        out["workloads"][workload] = result
    return out


def _opened_text(o: dict) -> str:
    def orbax(entry: dict) -> str:
        if not entry["opened"]:
            return f"no ({entry['error']})"
        checked = "" if "exact" not in entry else ", bit-exact" if entry["exact"] else ", VALUES DIFFER"
        return f"yes{checked} ({entry['seconds']:.2f} s)"

    tree = ", ".join(f"{c} exit {o['xtckpt_tree'][c]['status']}" for c in CONTENDERS)
    metadata = ", ".join(f"{c} {orbax(o['orbax'][c]['metadata'])}" for c in CONTENDERS)
    restore = ", ".join(f"{c} {orbax(o['orbax'][c]['restore'])}" for c in CONTENDERS)
    one = ", ".join(f"{c} {orbax(o['orbax'][c]['restore_one'])}" for c in CONTENDERS)
    return (f"    opened by xtckpt tree: {tree}\n    opened by Orbax: metadata() {metadata}; restore() {restore}; "
            f"restore of one array {one}"
            f"{'; torch imported by the JAX process!' if o['orbax']['torch_imported'] else ''}")


def describe(result: dict) -> str:
    """The result as the lines of the benchmark report."""
    gib = 2**30
    lines = [f"dtensor: DTensor state, 1-D mesh of {result['processes']} processes (gloo, CPU), Shard(0) as FSDP2 "
             f"shards it, saved and restored by this library (xtc) and torch.distributed.checkpoint (dcp) in the same "
             f"job, {result['mode']}, medians of {result['repeats']} (ABBA); wall: the slowest process; CPU, "
             f"resident growth, bytes: summed over the processes; page cache growth: machine-wide"]
    for workload, r in result["workloads"].items():
        lines.append(f"  {workload} ({r['bytes'] / gib:.2f} GiB, {r['tensors']} tensors), bit-exact restores: "
                     + ", ".join(f"{c} {r['exact'][c]}" for c in (*RESTORERS, PLAIN))
                     + f"; torch_xla imported: {'YES' if r['torch_xla_imported'] else 'no'}; job "
                     f"{r['job_seconds']:.0f} s")
        lines.append(f"    {'operation':13} {'':12} {'wall s':>7} {'block s':>7} {'CPU s':>6} {'(user+sys)':>12} "
                     f"{'fresh B/B':>9} {'(res+cache)':>11} {'written':>7} {'read':>5}")
        for op in OPERATIONS:
            for contender in ROWS[op]:
                m = r["median"][op][contender]
                block = f"{m['blocking_s']:7.3f}" if "blocking_s" in m else f"{'':7}"
                lines.append(f"    {OPERATION_NAMES[op] if contender == CONTENDERS[0] else '':13} {contender:12} "
                             f"{m['wall_s']:7.3f} {block} {m['cpu_s']:6.2f} {m['user_s']:5.2f}+{m['system_s']:<5.2f} "
                             f"{m['fresh_per_byte']:9.2f} {m['rss_growth_per_byte']:5.2f}+"
                             f"{m['page_cache_per_byte']:<5.2f} {m['written_per_byte']:7.2f} {m['read_per_byte']:5.2f}")
            met = "met" if r["speedup"][op] >= GOAL else "NOT met"
            goal = "" if op == "async" else f"; goal >= {GOAL:g}x: {met}"
            blocking = (f" in total, {r['speedup']['async_blocking']:.2f}x in blocking" if op == "async" else "")
            plain = "" if PLAIN not in r["median"][op] else "; over plain I/O: " + ", ".join(
                f"{c} {r['median'][op][c]['wall_s'] / r['median'][op][PLAIN]['wall_s']:.2f}x" for c in ROWS[op]
                if c != PLAIN)
            lines.append(f"    {'':13} xtc is {r['speedup'][op]:.2f}x faster than dcp{blocking}, at "
                         f"{r['cpu_ratio'][op]:.2f}x its CPU{goal}{plain}")
            if op == "restore":
                met = "met" if r["speedup"]["restore_in_place"] >= GOAL else "NOT met"
                lines.append(f"    {'':13} xtc in place (as dcp.load) is {r['speedup']['restore_in_place']:.2f}x "
                             f"faster than dcp, at {r['cpu_ratio']['restore_in_place']:.2f}x its CPU; goal >= "
                             f"{GOAL:g}x: {met}")
        lines.append(_opened_text(r["opened"]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--workloads", default="large,model")
    parser.add_argument("--warm-memory", action="store_true")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (a temporary directory in it)")
    parser.add_argument("--output", default=None,
                        help="default: benchmarks/results/dtensor.json (+ .txt) for the full run with the default "
                        "options; a file in the temporary directory for any other (the committed results are never "
                        "replaced by a scaled or partial run)")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.add_argument("--orbax", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        workload, scale, root, repeats, warm = args.worker
        print(json.dumps(worker(workload, float(scale), root, int(repeats), warm == "1")))
        return
    if args.orbax:
        ours, theirs, name, shape, digest, tensors = args.orbax
        print(json.dumps(orbax_worker(ours, theirs, name, json.loads(shape), digest, int(tensors))))
        return
    reference = all(getattr(args, name) == parser.get_default(name) for name in ("scale", "workloads", "warm_memory")
                    ) and args.repeats >= parser.get_default("repeats")
    output = args.output or (os.path.join(HERE, "results", "dtensor.json") if reference else os.path.join(
        tempfile.gettempdir(), f"xtc-bench-dtensor-{args.scale:g}{'-warm' if args.warm_memory else ''}.json"))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="xtc-bench-dtensor-", dir=args.dir) as workdir:
        result = measure(args.scale, args.repeats, workdir, tuple(args.workloads.split(",")), args.warm_memory)
    result["seconds"] = time.perf_counter() - started
    text = (describe(result) + f"\n{time.strftime('%Y-%m-%d')}, python benchmarks/bench_dtensor.py --scale "
            f"{args.scale:g} --repeats {args.repeats} --workloads {args.workloads}"
            f"{' --warm-memory' if args.warm_memory else ''}: {result['seconds']:.0f} s")
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    stem = os.path.splitext(output)[0]
    with open(output, "w") as f:
        json.dump({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **result}, f, indent=1)
    with open(stem + ".txt", "w") as f:
        f.write(text + "\n")
    print(f"written {output}, {stem}.txt", file=sys.stderr)


if __name__ == "__main__":
    main()
