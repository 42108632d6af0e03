"""Multi-tier checkpoints (issue: multi-tier): on the 1 GiB 2D-sharded state, how long save() blocks with both
tiers due against one tier alone; a resume (restore("latest") onto fresh sharded targets) from the local tier
against one from the persistent tier; and a training loop whose state (MLP + AdamW) is 1 GiB too, saving the local
tier every step, and also the persistent tier every few steps, against the same loop without checkpoints. The
persistent tier is on local disk, the GCS emulator or moto's S3 server (--persistent gcs|s3), the training
loop's included. Medians (min-max) of repeats (at least 7 for a measurement), variants interleaved. --scale
scales every state (the loop's width follows).

Beside each wall time, what the call cost in the terms the library controls (issue 36; benchmarks/footprint.py):
user and system CPU seconds of this process, the fresh host memory touched (peak resident growth + page cache
growth, machine-wide) and the bytes this process read from / wrote to storage (the block layer's count), per byte
of state (B/B). For a save: the call to save() (what blocks the caller) and the whole save until written
(save() + wait_until_finished()); for a resume: restore() until the device buffers are ready; for a training loop:
its steps plus the manager's close() (the last save's commit). With the persistent tier on an object store, its
server is another process of this machine: its CPU seconds are given apart, and the bytes it stores are in its
memory (the GCS emulator's in-memory backend), not in this process's figures.

First, peer replication (`local_replication=2`; benchmarks/peer_replication_job.py): a job of 4 processes over
gloo, 64 MiB x scale per process, a local tier each, the persistent tier on the GCS emulator (or the run's object
store), FSDP=4 and DP=2 x FSDP=2 (whose peers already hold their shards): save() blocking time with
replication on and off (ABBA); resume with intact local tiers, with one wiped host, and with two wiped hosts
holding each other's copies (the persistent fallback); bytes sent to peers per step and read from the
persistent tier; disk per host.

usage: python -m benchmarks multi-tier [--scale 1.0] [--repeats 7] [--quick] [--set loop_steps=10 (0: no loop)]
          [--set loop_repeats=3] [--set persistent_every=5] [--set width=N (default: 1 GiB x scale of state)]
          [--set batch=2048] [--set persistent=local|gcs|s3] [--set replication_repeats=7 (0: no job)]
          [--set only_replication=1]
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Callable
from typing import Any

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import torch_xla  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import footprint  # noqa: E402
import harness  # noqa: E402
import jobs  # noqa: E402
import workloads  # noqa: E402
from bench_async import LAYERS, loop_state_bytes, loop_width, training_loop  # noqa: E402
from object_stores import start_object_store  # noqa: E402

import xla_tensorstore_ckpt as xtc  # noqa: E402
from xla_tensorstore_ckpt import storage  # noqa: E402
from xla_tensorstore_ckpt.tools import inspection  # noqa: E402


def median_range(values: list[float]) -> str:
    """``median s (min-max)``, for the prose."""
    return f"{harness.median(values):.3f} s ({min(values):.3f}-{max(values):.3f})"


SERVER_PID: int | None = None  # the object store's server process, when the persistent tier is on one


def process_cpu_s(pid: int | None) -> float:
    """User + system CPU seconds that process `pid` has used so far (0 without a process)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # from the 3rd field (state) on
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def settle(timeout_s: float = 30.0) -> float:
    """Wait until the object store's server is idle (at most a clock tick of CPU in 0.5 s), at most `timeout_s`;
    return the seconds waited. After a save it goes on working for a while (it frees the step that retention
    deleted): on this 2-core machine that work would compete with the next measured call, whichever tier that
    call writes (a real object store runs on other machines)."""
    start = time.perf_counter()
    while SERVER_PID is not None and time.perf_counter() - start < timeout_s:
        before = process_cpu_s(SERVER_PID)
        time.sleep(0.5)
        if process_cpu_s(SERVER_PID) - before <= 0.011:
            break
    return time.perf_counter() - start


def measured(fn: Callable[[], Any]) -> tuple[dict, Any]:
    """footprint.measure(fn), plus ``server_cpu_s``: the CPU seconds the object store's server used meanwhile."""
    before = process_cpu_s(SERVER_PID)
    measures, result = footprint.measure(fn)
    return {**measures, "server_cpu_s": process_cpu_s(SERVER_PID) - before}, result


def costs(runs: list[dict], nbytes: float, *, io: tuple[str, ...] = ("written", "read")) -> str:
    """Medians of the measures beside the wall time: CPU user + sys, fresh memory (resident + page cache) and
    the bytes in `io` per byte of state, and the server's CPU when there is one."""
    def med(key: str) -> float:
        return harness.median(m[key] for m in runs)

    text = (f"CPU {med('user_s'):.2f} + {med('system_s'):.2f} s; fresh {med('fresh_bytes') / nbytes:.2f} B/B "
            f"({med('rss_growth_bytes') / nbytes:.2f}+{med('page_cache_growth_bytes') / nbytes:.2f})")
    for kind in io:
        text += f"; {kind} {med(kind + '_bytes') / nbytes:.2f} B/B"
    if SERVER_PID is not None:
        text += f"; server CPU {med('server_cpu_s'):.2f} s"
    return text


def options(local: str | None, *, persistent_every: int | None, local_every: int | None = None):
    return xtc.CheckpointManagerOptions(save_interval_steps=persistent_every, max_to_keep=1, save_rng=False,
                                        local_directory=local, local_save_interval_steps=local_every,
                                        local_max_to_keep=1)


def blocking(state: dict, root: str, tmp: str, repeats: int) -> dict[str, dict[str, list[dict]]]:
    """Per case (persistent tier alone, local tier alone, both due), the measures (`measured`) of each repeat's
    call to save() ("blocking") and of the whole save, save() + wait_until_finished() ("whole")."""
    managers = {
        "persistent tier alone": xtc.CheckpointManager(f"{root}/alone", options(None, persistent_every=1)),
        "local tier alone": xtc.CheckpointManager(f"{root}/unused", options(
            os.path.join(tmp, "local-alone"), persistent_every=None, local_every=1)),
        "both tiers due": xtc.CheckpointManager(f"{root}/both", options(
            os.path.join(tmp, "local-both"), persistent_every=1, local_every=1)),
    }
    runs: dict[str, dict[str, list[dict]]] = {name: {"blocking": [], "whole": []} for name in managers}
    for step in range(repeats + 1):  # step 0 warms every path up
        for name, manager in managers.items():
            manager.wait_until_finished()
            os.sync()
            settle()
            blocked = {}

            def whole(manager=manager, step=step, blocked=blocked) -> None:
                blocked["measures"], _ = measured(lambda: manager.save(step, model=state))
                manager.wait_until_finished()

            measures, _ = measured(whole)
            if step:
                runs[name]["blocking"].append(blocked["measures"])
                runs[name]["whole"].append(measures)
    for manager in managers.values():
        manager.close()
    return runs


def resumes(state: dict, root: str, tmp: str, repeats: int, scale: float) -> dict[str, list[dict]]:
    """The measures (`measured`) of restore("latest") onto fresh targets resharded 4x2 -> 2x4 until the device
    buffers are ready, from the local tier and from the persistent one."""
    local = os.path.join(tmp, "local-resume")
    with xtc.CheckpointManager(f"{root}/resume", options(local, persistent_every=1, local_every=1)) as manager:
        manager.save(1, model=state)
    runs: dict[str, list[dict]] = {"local tier": [], "persistent tier": []}

    def restore(manager, target) -> int:
        step = manager.restore("latest", model=target)
        torch_xla._XLAC._xla_wait_device_ops(devices=[])
        return step

    for repeat in range(repeats + 1):
        for name, local_directory in (("local tier", local), ("persistent tier", None)):
            target = workloads.build_target("large", scale)
            with xtc.CheckpointManager(f"{root}/resume", options(
                    local_directory, persistent_every=1, local_every=1 if local_directory else None)) as manager:
                settle()
                measures, step = measured(lambda manager=manager, target=target: restore(manager, target))
                tiers = manager.metadata(1).tiers
            if step != 1 or tiers != (("local", "persistent") if local_directory else ("persistent",)):
                raise RuntimeError(f"resume from the {name} did not restore step 1")
            if repeat:
                runs[name].append(measures)
            del target
    return runs


def loops(root: str, tmp: str, args: types.SimpleNamespace, width: int) -> dict[str, list[dict]]:
    """`args.loop_steps` training steps without checkpoints, saving the local tier every step, and saving it
    every step plus the persistent tier (at `root`: the object store when there is one) every
    `args.persistent_every` steps; `args.loop_repeats` times, the variants interleaved so that drift of this
    shared machine spreads over all of them. Per variant and repeat: the steps' seconds ("loop_s") and the
    measures (`measured`) of the steps plus the manager's close()."""
    variants = {
        "without checkpoints": None,
        "local tier every step": dict(persistent_every=None, local_every=1),
        f"local every step + persistent every {args.persistent_every}": dict(
            persistent_every=args.persistent_every, local_every=1),
    }
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for repeat in range(args.loop_repeats):
        for index, (name, kw) in enumerate(variants.items()):
            persistent, local = f"{root}/loop-{index}-{repeat}", os.path.join(tmp, f"loop-local-{index}-{repeat}")
            opts = None if kw is None else options(local, **kw)
            measures: dict = {}
            settle()
            server = process_cpu_s(SERVER_PID)
            seconds = training_loop(persistent, args.loop_steps, opts, width, args.batch, measures)
            runs[name].append({**measures, "server_cpu_s": process_cpu_s(SERVER_PID) - server, "loop_s": seconds})
            if kw is not None and kw["persistent_every"] and not any(
                    s.status == "committed" for s in inspection.list_steps(persistent)):
                raise RuntimeError(f"the loop '{name}' committed no persistent step under {persistent}")
            shutil.rmtree(local, ignore_errors=True)  # a GiB per loop: only one loop's steps on disk at a time
            target = storage.location(persistent)
            if target.exists():
                target.delete_tree()
    return runs


def replication(args: types.SimpleNamespace, tmp: str, root: str, env: dict[str, str], replicas: int) -> dict:
    """The peer-replication job (benchmarks/peer_replication_job.py): 4 processes over gloo, a local tier each,
    `replicas` data-parallel replicas, the persistent tier at `root`. Returns its summary, also printed."""
    answers = jobs.run_job([os.path.join(HERE, "peer_replication_job.py"), "--worker", f"{root}/replication-{replicas}",
                            os.path.join(tmp, f"replication-{replicas}"), 64 * args.scale, args.replication_repeats,
                            replicas], 4, env=env)

    def slowest(key: str, name) -> list[float]:
        return [max(a[key][name][i] for a in answers) for i in range(len(answers[0][key][name]))]

    blocked = {k: slowest("blocked", k) for k in ("1", "2")}
    resumes = {name: slowest("resumes", name) for name in answers[0]["resumes"]}
    cpu = {name: [sum(a["resume_cpu"][name][i] for a in answers) for i in range(len(answers[0]["resume_cpu"][name]))]
           for name in answers[0]["resume_cpu"]}
    # Fresh memory of a resume: every process's resident growth, plus the page cache's (machine-wide: the
    # largest any process saw), medians over the repeats.
    fresh = {name: harness.median(sum(a["resume_resident_growth"][name][i] for a in answers)
                                     + max(a["resume_page_cache_growth"][name][i] for a in answers)
                                     for i in range(len(answers[0]["resume_resident_growth"][name])))
             for name in answers[0]["resume_resident_growth"]}
    caches = [name.split(", ", 1)[1] for name in resumes if name.startswith("intact, ")]
    summary = {
        "processes": len(answers), "state_bytes_per_process": answers[0]["state_bytes"],
        "blocked_s": blocked, "blocked_ratio": harness.median(blocked["2"]) / harness.median(blocked["1"]),
        "resume_s": resumes, "resume_cpu_s_all_processes": cpu, "resume_fresh_bytes_all_processes": fresh,
        "wiped_over_intact": {cache: harness.median(resumes[f"one wiped host, {cache}"])
                              / harness.median(resumes[f"intact, {cache}"]) for cache in caches},
        "persistent_bytes": {name: max(max(a["persistent_bytes"][name]) for a in answers) for name in resumes},
        "sent_per_step": [harness.median(a["sent_per_step"]) for a in answers],
        "own_step_bytes": [a["own_step_bytes"] for a in answers],
        "disk": [a["disk"] for a in answers], "exact": all(a["exact"] for a in answers)}
    mib = 2**20
    print(f"peer replication (local_replication=2), 4 processes over gloo, DP={replicas} x FSDP={4 // replicas}, "
          f"{summary['state_bytes_per_process'] / mib:.0f} MiB per process, persistent tier on {root.split(':')[0]}; "
          f"slowest process, median (min-max) of {args.replication_repeats} (blocking: {2 * args.replication_repeats})")
    print(f"  save() blocks: replication off {median_range(blocked['1'])}, on {median_range(blocked['2'])} = "
          f"{summary['blocked_ratio']:.2f}x (goal <= 1.1x)")
    print("  resumes (page cache as the saves left it: own steps not cached, peer copies cached; or every local file "
          "evicted; or every one cached first), wall time; CPU user + sys and fresh memory touched (resident and "
          "page cache growth) of the 4 processes together; bytes read from the persistent tier (max per process)")
    for name, values in resumes.items():
        print(f"    {name:31s} {median_range(values)}; CPU {harness.median(cpu[name]):.3f} s; fresh "
              f"{fresh[name] / mib:.0f} MiB; {summary['persistent_bytes'][name] / mib:.1f} MiB read")
    print("  one wiped host / intact (goal <= 1.5x): " + ", ".join(
        f"{cache} {ratio:.2f}x" for cache, ratio in summary["wiped_over_intact"].items()))
    print(f"  sent to peers per step, per process: {[round(b / mib, 2) for b in summary['sent_per_step']]} MiB; "
          f"one step's own files {[round(b / mib, 2) for b in summary['own_step_bytes']]} MiB")
    print("  disk per host (local tier, 2 steps kept): off " + ", ".join(
        f"{d['1'] / mib:.1f}" for d in summary["disk"]) + " MiB; on " + ", ".join(
        f"{d['2'] / mib:.1f}" for d in summary["disk"]) + " MiB (goal <= 2x off)")
    print(f"  exact: {summary['exact']}")
    return summary


def run(settings: harness.Settings) -> harness.Result:
    """The case `multi-tier`, in this process (torch_xla's 8 CPU devices): the peer-replication jobs, then the
    blocking, resume and training-loop measurements; blocks for all of them. Its prose is what it prints as it
    measures."""
    args = types.SimpleNamespace(
        scale=settings.scale, repeats=settings.repeats, loop_steps=settings.option("loop_steps", 10),
        loop_repeats=settings.option("loop_repeats", 3), persistent_every=settings.option("persistent_every", 5),
        width=settings.option("width", 0), batch=settings.option("batch", 2048),
        persistent=settings.option("persistent", "local"),
        replication_repeats=settings.option("replication_repeats", 7),
        only_replication=settings.option("only_replication", False))
    text = io.StringIO()
    rows: list[harness.Row] = []
    raw: dict[str, Any] = {}
    with contextlib.redirect_stdout(text):  # the report's lines, printed as each part is measured
        _measure_all(args, settings.workdir, rows, raw)
    return harness.Result(rows, text.getvalue(), raw)


def _server_cpu(measures: list[dict]) -> dict:
    """The object store server's CPU seconds as a series, when the persistent tier is on one."""
    return {"server_cpu_s": harness.series((m["server_cpu_s"] for m in measures), "s")} if SERVER_PID else {}


def _measure_all(args: types.SimpleNamespace, workdir: str, rows: list[harness.Row], raw: dict) -> None:
    """Every part of the case in turn, appending to `rows` and `raw` (the peer-replication summaries)."""
    global SERVER_PID
    server, bucket = start_object_store(args.persistent)
    if server is not None:
        os.environ.update(server.environment)
        SERVER_PID = server.process.process.pid
    try:
        with tempfile.TemporaryDirectory(prefix="tiers-", dir=workdir) as tmp:
            root = bucket or os.path.join(tmp, "persistent")
            if args.replication_repeats:
                _replication_jobs(args, tmp, bucket, rows, raw)
            if args.only_replication:
                return
            _tiers(args, root, tmp, rows)
    finally:
        if server is not None:
            server.stop()
        SERVER_PID = None


def _replication_jobs(args: types.SimpleNamespace, tmp: str, bucket: str | None, rows: list[harness.Row],
                      raw: dict) -> None:
    # Its persistent tier on an object store: the GCS emulator unless the run has one.
    job_server, job_root = (None, bucket) if bucket else start_object_store("gcs")
    try:
        env = dict(os.environ, **(job_server.environment if job_server else {}))
        env.pop("PJRT_DEVICE", None)
        for replicas in (1, 2):  # DP=2: each process's peer is its replica, which holds its shards
            summary = replication(args, tmp, job_root, env, replicas)
            raw[f"replication_dp{replicas}"] = summary
            group = f"peer replication, DP={replicas} x FSDP={4 // replicas} (slowest process)"
            rows += [harness.Row(f"save() blocks, replication {'on' if on == '2' else 'off'}",
                                 {"wall_s": harness.series(summary["blocked_s"][on], "s")}, group)
                     for on in ("1", "2")]
            rows += [harness.Row(f"resume, {name}", {"wall_s": harness.series(values, "s")}, group,
                                 {"persistent_bytes": summary["persistent_bytes"][name]})
                     for name, values in summary["resume_s"].items()]
    finally:
        if job_server is not None:
            job_server.stop()


def _tiers(args: types.SimpleNamespace, root: str, tmp: str, rows: list[harness.Row]) -> None:
    """save() blocking and whole saves per tier, resumes per tier, the training loops; printed and as rows."""
    state = workloads.build_state("large", args.scale)
    nbytes = workloads.state_bytes(state)
    where = {"gcs": "the GCS emulator", "s3": "moto's S3 server"}.get(args.persistent, "local disk")
    print(f"1 GiB x {args.scale} ({nbytes / 2**30:.2f} GiB), persistent tier on {where}, local tier on local "
          f"disk; median (min-max) of {args.repeats}; CPU: user + sys of this process; fresh: peak resident "
          "growth + page cache growth (machine-wide); written / read: this process, from storage; B/B: per "
          "byte of state" + ("; server CPU: the object store's server process" if SERVER_PID else ""))
    runs = blocking(state, root, tmp, args.repeats)
    print("time save() blocks the caller, and what that call cost:")
    for name, measures in runs.items():
        print(f"  {name:22s} {median_range([m['wall_s'] for m in measures['blocking']])}; "
              f"{costs(measures['blocking'], nbytes, io=())}")
    blocked = {name: harness.median(m["wall_s"] for m in measures["blocking"]) for name, measures in runs.items()}
    both = blocked["both tiers due"]
    print(f"  both / persistent alone = {both / blocked['persistent tier alone']:.2f}x, "
          f"both / local alone = {both / blocked['local tier alone']:.2f}x (goal <= 1.1x)")
    print("the whole save, save() + wait_until_finished():")
    for name, measures in runs.items():
        print(f"  {name:22s} {median_range([m['wall_s'] for m in measures['whole']])}; "
              f"{costs(measures['whole'], nbytes)}")
    for part, group in (("blocking", "save() blocks"), ("whole", "the whole save")):
        rows += [harness.Row(name, {**harness.footprint_metrics(measures[part], nbytes),
                                    **_server_cpu(measures[part])}, group) for name, measures in runs.items()]
    runs = resumes(state, root, tmp, args.repeats, args.scale)
    print("resume (restore('latest') onto fresh targets resharded 4x2 -> 2x4, in process, until the device "
          "buffers are ready):")
    for name, measures in runs.items():
        print(f"  from the {name:16s} {median_range([m['wall_s'] for m in measures])}; {costs(measures, nbytes)}")
    ratio = (harness.median(m["wall_s"] for m in runs["persistent tier"])
             / harness.median(m["wall_s"] for m in runs["local tier"]))
    print(f"  the local tier resumes {ratio:.2f}x faster")
    rows += [harness.Row(f"from the {name}", {**harness.footprint_metrics(measures, nbytes),
                                              **_server_cpu(measures)}, "resume") for name, measures in runs.items()]
    del state
    if args.loop_steps:
        _training_loops(args, root, tmp, where, rows)


def _training_loops(args: types.SimpleNamespace, root: str, tmp: str, where: str, rows: list[harness.Row]) -> None:
    width = args.width or loop_width(args.scale)
    runs = loops(root, tmp, args, width)
    without = harness.median(m["loop_s"] for m in runs["without checkpoints"])
    loop_bytes = loop_state_bytes(width)
    print(f"training loop, {args.loop_steps} steps of {LAYERS * (width * width + width) / 1e6:.0f}M parameters "
          f"+ AdamW ({loop_bytes / 2**30:.2f} GiB of state), batch {args.batch} x {width}, "
          f"{without / args.loop_steps:.2f} s per step without checkpoints; persistent saves to {where}; "
          f"median (min-max) of {args.loop_repeats}, interleaved; then what the steps and the last commit "
          "cost, B/B per byte of the training state (over all the steps):")
    for name, measures in runs.items():
        goal = " (goal <= 1.2x)" if name == "local tier every step" else ""
        seconds = [m["loop_s"] for m in measures]
        print(f"  {name:38s} {median_range(seconds)} = {harness.median(seconds) / without:.2f}x{goal}")
        print(f"  {'':38s} {costs(measures, loop_bytes)}")
        rows.append(harness.Row(name, {"loop_s": harness.series(seconds, "s"),
                                       **harness.footprint_metrics(measures, loop_bytes), **_server_cpu(measures)},
                                f"training loop, {args.loop_steps} steps"))


if __name__ == "__main__":
    harness.worker_main()
