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
not asserted). With ``--set warm_memory=1`` process 0 runs a throwaway process touching twice the state's bytes right
before each timed region (this VM hands fresh memory back and forth with its hypervisor; docs/performance.md).

Then, on the last round's sync checkpoints: ``xtckpt tree`` of each (exit status), and in a JAX process without
torch (no PJRT_DEVICE / CPU_NUM_DEVICES, one CPU device), Orbax on each: ``StandardCheckpointer().metadata(dir)``
(opened if it lists every array: for a directory that is not its own, Orbax answers an empty tree and raises
nothing),
``StandardCheckpointer().restore(dir)`` without a target, and a partial restore of the smallest float32 matrix
alone (``PyTreeRestore(partial_restore=True)``); both restores compare that matrix bit for bit with the saved
values (by SHA-256). A checkpoint of ours is expected to open, DCP's not (the exception class is reported).

    python -m benchmarks dtensor [--scale 1.0] [--repeats 7] [--set workloads=large,model] [--set warm_memory=1]
About 1 minute at --scale 0.25 --repeats 3 here (2 cores).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dtensor_jobs  # noqa: E402
import harness  # noqa: E402
from dtensor_jobs import PROCESSES, UNSET, leaf, nest  # noqa: E402
from fresh_process import evict, run_json  # noqa: E402

CONTENDERS = ("xtc", "dcp")
IN_PLACE = "xtc-in-place"  # the manager's restore into the target (as an FSDP2 resume does), like dcp.load
RESTORERS = ("xtc", IN_PLACE, "dcp")
BASELINE = "dcp"
OPERATIONS = ("save", "async", "restore")
PLAIN = "plain"  # every process writes its shards' bytes to a file of its own and fsyncs it / reads them back
ROWS = {"save": (*CONTENDERS, PLAIN), "async": CONTENDERS, "restore": (*RESTORERS, PLAIN)}
OPERATION_NAMES = {"save": "save (sync)", "async": "save (async)", "restore": "restore"}
GOAL = 1.5  # DCP's wall time over ours: the goal for sync saves and restores (reported, not asserted)


# ------------------------------------------------------------------------------------------- worker processes


def worker(workload: str, scale_: str, root: str, repeats_: str, warm_memory_: str) -> dict:
    """One process of the job: `repeats` rounds of sync save, async save and restore (its answer: its runs)."""
    import torch
    import torch.distributed.checkpoint as dcp

    import xla_tensorstore_ckpt as xtc

    repeats, warm_memory = int(repeats_), warm_memory_ == "1"
    job = dtensor_jobs.Process(workload, float(scale_))
    dist, rank, world, entries, state, target = job.dist, job.rank, job.world, job.entries, job.state, job.target
    dcp_group = dist.new_group(backend="gloo")  # async_save's background collectives: a group of their own
    exact, on_primary, delete = job.exact, job.on_primary, job.delete

    def timed(fn, *, warm: bool = True) -> tuple[dict, object]:
        return job.timed(fn, warm_memory=warm and warm_memory)

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
    tiny, tiny_target = job.tiny(1.0), job.tiny(0.0)
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
                f.write(raw(leaf(state, name)))
            os.fsync(f.fileno())

    def plain_read() -> None:
        with open(plain_path, "rb", buffering=0) as f:
            for name, _, _ in entries:
                view, done = memoryview(raw(leaf(target, name))), 0
                while done < len(view):
                    done += f.readinto(view[done:]) or len(view)  # a short file ends the loop (caught below)

    runs: dict = {op: {c: [] for c in ROWS[op]} for op in OPERATIONS}
    checked = {}
    for i in range(repeats):
        order = harness.alternate(CONTENDERS, i + 1)[-len(CONTENDERS):]  # round i of ABBA
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
        for contender in harness.alternate(RESTORERS, i + 1)[-len(RESTORERS):]:
            path = (os.path.join(root, f"{contender}-sync") if contender != IN_PLACE
                    else os.path.join(root, "xtc-async", str(i)))
            job.zero_target()
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

        full = dtensor_jobs.full_value(probe[0], probe[2], probe[3], world)
        digest = hashlib.sha256(full.numpy().tobytes()).hexdigest()
    dist.barrier()
    return {"rank": rank, "bytes": job.nbytes, "tensors": len(entries), "runs": runs, "exact": checked,
            "probe": {"name": probe[1], "shape": list(probe[2]), "sha256": digest},
            "torch_xla_imported": dtensor_jobs.torch_xla_imported()}


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
        value = np.asarray(leaf(tree, name))
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
        item = nest({name: jax.ShapeDtypeStruct(tuple(shape), np.float32, sharding=sharding)})
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
    out["orbax"] = run_json([sys.executable, os.path.abspath(__file__), "--worker", "orbax", paths["xtc"],
                             paths["dcp"], probe["name"], json.dumps(probe["shape"]), probe["sha256"], str(tensors)],
                            env, "the Orbax process")
    return out


def measure(settings: harness.Settings) -> dict:
    """One job of 4 processes per workload: `repeats` rounds of sync save, async save and restore, this library
    and DCP alternating ABBA; then each checkpoint opened by xtckpt and by Orbax. Blocks for many minutes at
    scale 1."""
    scale, repeats, workdir = settings.scale, settings.repeats, settings.workdir
    workload_names = settings.option("workloads", ("large", "model"))
    warm_memory = settings.option("warm_memory", False)
    out: dict = {"scale": scale, "repeats": repeats, "processes": PROCESSES,
                 "mode": "warm-memory" if warm_memory else "cold-memory", "workloads": {}}
    for workload in workload_names:
        root = os.path.join(workdir, f"dtensor-{workload}")
        print(f"dtensor: {PROCESSES} processes save and restore {workload}, {repeats} rounds ...", file=sys.stderr,
              flush=True)
        started = time.perf_counter()
        answers = dtensor_jobs.run(__file__, [workload, scale, root, repeats, int(warm_memory)])
        nbytes = answers[0]["bytes"]
        rounds = dtensor_jobs.rounds(answers, ROWS, repeats)
        result = {"bytes": nbytes, "tensors": answers[0]["tensors"], "job_seconds": time.perf_counter() - started,
                  "exact": {c: all(a["exact"][c] for a in answers) for c in (*RESTORERS, PLAIN)},
                  "torch_xla_imported": any(a["torch_xla_imported"] for a in answers), "rounds": rounds,
                  "per_rank": [a["runs"] for a in answers],
                  "median": {op: {c: dtensor_jobs.summary(rounds[op][c], nbytes) for c in ROWS[op]}
                             for op in OPERATIONS}}
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


def run(settings: harness.Settings) -> harness.Result:
    """The case `dtensor`: one job of 4 processes per workload, then the checkpoints opened by xtckpt and Orbax."""
    started = time.perf_counter()
    result = measure(settings)
    result["seconds"] = time.perf_counter() - started
    rows = []
    for workload, r in result["workloads"].items():
        for op in OPERATIONS:
            for contender in ROWS[op]:
                measured = r["rounds"][op][contender]
                row = harness.footprint_row(contender, measured, r["bytes"], group=f"{workload}: {OPERATION_NAMES[op]}")
                if "blocking_s" in measured[0]:
                    row.metrics["blocking_s"] = harness.series([m["blocking_s"] for m in measured], "s")
                rows.append(row)
    return harness.Result(rows, describe(result) + f"\n{result['seconds']:.0f} s", result)


def worker_entry(kind: str, *args: str) -> dict:
    """``--worker orbax OURS THEIRS NAME SHAPE DIGEST TENSORS`` (a JAX process) or ``--worker WORKLOAD ...``."""
    if kind == "orbax":
        ours, theirs, name, shape, digest, tensors = args
        return orbax_worker(ours, theirs, name, json.loads(shape), digest, int(tensors))
    return worker(kind, *args)


if __name__ == "__main__":
    harness.worker_main(worker_entry)
