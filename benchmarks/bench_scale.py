"""How save and restore cost grows with the number of hosts (issue 34): jobs of 1, 2, 4 and 8 processes (gloo on
127.0.0.1, `ShardedArray` states as the multi-host tests use), data-parallel replication R = 1, 2, 4 (a DP=R x
FSDP=P/R layout: process p holds FSDP shard p mod P/R of every array), on local disk and on the GCS emulator.

Two states per job: weak scaling (every process holds --weak-mib of state: the global state grows with P/R) and
strong scaling (a fixed global state of --strong-mib). Each is saved --repeats times, then restored onto the same
layout 2 x --repeats times, single-replica reads on and off alternating ABBA in the same processes, every value
compared exactly. With single-replica reads the broadcast cap is --cap-mib, below the state, so that it binds.

Reported per configuration: wall time of the slowest process (median over the repeats); bytes written and read
from storage per process (max and mean: the balance) and in total over the unique (stored) bytes; bytes sent
between processes; peak host memory above the state (RSS high-water mark, benchmarks/memory.py) against the cap
plus one batch. This machine has 2 cores that every process of a job shares, and the emulator runs on them too:
wall times above 2 processes include waiting for a core, so the byte figures are the robust ones. Local
restores read a just-written checkpoint from the page cache.

    python -m benchmarks scale [--quick] [--scale 1.0] [--repeats 7] [--set processes=1,2,4,8]
                               [--set replicas=1,2,4] [--set storage=local,gcs] [--set weak_mib=64]
                               [--set strong_mib=256] [--set cap_mib=16] [--set trees=/old,/new]
With ``--set trees=/old/checkout,/new/checkout`` every configuration's job runs `rounds` times (default 1) per
checkout (PYTHONPATH), in ABBA order, the first checkout alternating from one configuration to the next (their
repeats pooled), and the text ends with the new/old
ratios of save and restore times per configuration (the last tree over the first).
The reference run (about 11 minutes here) writes benchmarks/results/scale.{json,txt,png}; --quick (1, 2 and 4
processes, 0.1 scale, 3 repeats: a few minutes) and any other run write theirs to the temporary directory.
"""

from __future__ import annotations

import functools
import gc
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402
import jobs  # noqa: E402

ARRAYS = 8
COLUMNS = 1024  # float32: 4 KiB per row
ROW_BYTES = COLUMNS * 4


def layout(processes: int, replicas: int, rank: int, shard_rows: int):
    """(global shape, shard shape, this process's shard index) of every array of a DP=replicas layout."""
    fsdp = processes // replicas
    k = rank % fsdp
    return (shard_rows * fsdp, COLUMNS), (shard_rows, COLUMNS), ((k * shard_rows, (k + 1) * shard_rows), (0, COLUMNS))


def child(root: str, replicas: str, scale: str, repeats: str, weak_mib: str, strong_mib: str, cap_mib: str) -> dict:
    """One process of the job (``bench_scale.py --worker ...``, run by `jobs.run_job`): save and restore both
    states; its measurements (printed as one JSON line by `harness.worker_main`)."""
    import torch.distributed as dist

    rank, processes = int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", "1"))
    if processes > 1:
        dist.init_process_group("gloo")
    barrier = dist.barrier if processes > 1 else (lambda: None)
    fsdp = processes // int(replicas)
    cap = int(float(cap_mib) * float(scale) * 2**20) // ROW_BYTES * ROW_BYTES
    rows_for = {"weak": max(1, int(float(weak_mib) * float(scale) * 2**20 / ARRAYS / ROW_BYTES)),
                "strong": max(1, int(float(strong_mib) * float(scale) * 2**20 / ARRAYS / ROW_BYTES) // fsdp)}
    out = {"rank": rank, "cap": cap,
           "batch": cap}  # read_jobs.batch_bytes: a batch is at most the cap (below read_batch_bytes here)
    for scaling, shard_rows in rows_for.items():
        shape, shard_shape, index = layout(processes, int(replicas), rank, shard_rows)
        out[scaling] = _save_and_restore(f"{root}/{processes}-{replicas}-{scaling}", shape, shard_shape, index,
                                         int(repeats), cap, barrier, rank, ((int(replicas), fsdp), (None, 0)))
    if processes > 1:
        dist.destroy_process_group()
    return out


def _save_and_restore(base: str, shape, shard_shape, index, repeats: int, cap: int, barrier, rank: int,
                       mesh) -> dict:
    """Save this process's shards of the state `repeats` times under `base`, restore the last save 2 x `repeats`
    times (single-replica reads ABBA), delete what was written. `mesh`: the layout's process mesh
    (`ShardedArray.mesh`), from which every process derives the others' shards instead of gathering them."""
    import dataclasses

    import memory
    import torch

    import xla_tensorstore_ckpt as xtc
    from xla_tensorstore_ckpt import storage

    try:
        from xla_tensorstore_ckpt.core import events
    except ImportError:  # a checkout from before the folders (`--set trees=`)
        from xla_tensorstore_ckpt import events
    # A checkout from before `ShardedArray.mesh` gathers the others' shards instead of deriving them.
    meshed = (mesh,) if "mesh" in {f.name for f in dataclasses.fields(xtc.ShardedArray)} else ()
    state = {}
    for a in range(ARRAYS):
        data = torch.randn(shard_shape, generator=torch.Generator().manual_seed(a * 1000 + index[0][0]))
        state[f"layer{a}"] = xtc.ShardedArray(shape, torch.float32, shard_shape, ((index, data),), *meshed)
    target = {name: xtc.ShardedArray.target(shape, torch.float32, shard_shape, [index], *meshed) for name in state}
    state_bytes = ARRAYS * shard_shape[0] * ROW_BYTES
    written: list[int] = []
    save_options = xtc.SaveOptions(listeners=(lambda e: e.kind == events.SAVE_WRITTEN and written.append(e.nbytes),))
    saves = []
    for r in range(repeats):
        path = f"{base}/save-{r}"
        barrier()
        cpu = time.process_time()
        seconds, peak, _ = memory.measure(functools.partial(xtc.save, path, state, options=save_options))
        saves.append({"seconds": seconds, "cpu": time.process_time() - cpu, "peak_extra": peak,
                      "written": written[-1]})
        barrier()
        if r < repeats - 1 and rank == 0:
            storage.location(path).delete_tree()
    finished: list[dict] = []
    listeners = (lambda e: e.kind == events.RESTORE_FINISHED and finished.append(e.details),)
    restores = []
    for on in harness.alternate((True, False), repeats):  # single-replica reads on, off, off, on, ...
        options = xtc.RestoreOptions(single_replica_reads=on, broadcast_max_bytes=cap, listeners=listeners)
        gc.collect()
        barrier()
        cpu = time.process_time()
        seconds, peak, restored = memory.measure(functools.partial(xtc.restore, path, target, options=options))
        cpu = time.process_time() - cpu
        exact = all(torch.equal(restored[name].shards[0][1], state[name].shards[0][1]) for name in state)
        details = finished[-1]
        restores.append({"on": on, "seconds": seconds, "cpu": cpu, "peak_extra": peak - state_bytes, "exact": exact,
                         "storage_bytes": details["storage_bytes"], "sent": details.get("peer_bytes_sent", 0),
                         "received": details.get("peer_bytes_received", 0)})
        del restored
    barrier()
    if rank == 0:
        storage.location(path).delete_tree()
    return {"state_bytes": state_bytes, "global_bytes": ARRAYS * shape[0] * ROW_BYTES, "saves": saves,
            "restores": restores}


def summarize(answers: list[dict], processes: int, replicas: int, storage_kind: str) -> list[dict]:
    """Per scaling, the configuration's figures from every process's answer."""
    rows = []
    for scaling in ("weak", "strong"):
        per = [a[scaling] for a in answers]
        repeats = len(per[0]["saves"])
        save_s = [max(p["saves"][i]["seconds"] for p in per) for i in range(repeats)]
        save_cpu = [sum(p["saves"][i]["cpu"] for p in per) for i in range(repeats)]
        written = [p["saves"][-1]["written"] for p in per]
        row = {"storage": storage_kind, "processes": processes, "replicas": replicas, "scaling": scaling,
               "global_bytes": per[0]["global_bytes"], "state_bytes": per[0]["state_bytes"],
               "save_s": save_s, "save_cpu": save_cpu, "written_max": max(written),
               "written_mean": statistics.mean(written),
               "written_total": sum(written), "save_peak_extra": max(s["peak_extra"] for p in per for s in p["saves"]),
               "cap": answers[0]["cap"], "batch": answers[0]["batch"]}
        for mode, on in (("on", True), ("off", False)):
            runs = [i for i, r in enumerate(per[0]["restores"]) if r["on"] == on]
            read = [p["restores"][runs[-1]]["storage_bytes"] for p in per]
            row[mode] = {
                "restore_s": [max(p["restores"][i]["seconds"] for p in per) for i in runs],
                "restore_cpu": [sum(p["restores"][i]["cpu"] for p in per) for i in runs],
                "read_max": max(read), "read_mean": statistics.mean(read), "read_total": sum(read),
                "sent_total": sum(p["restores"][runs[-1]]["sent"] for p in per),
                "received_max": max(p["restores"][runs[-1]]["received"] for p in per),
                "peak_extra": max(p["restores"][i]["peak_extra"] for p in per for i in runs),
                "exact": all(p["restores"][i]["exact"] for p in per for i in runs)}
        rows.append(row)
    return rows


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def table(rows: list[dict]) -> str:
    lines = []
    for storage_kind in dict.fromkeys(r["storage"] for r in rows):
        for scaling in ("weak", "strong"):
            chosen = [r for r in rows if r["storage"] == storage_kind and r["scaling"] == scaling]
            if not chosen:
                continue
            lines.append(f"\n{storage_kind}, {scaling} scaling "
                         f"({'each process holds the same state' if scaling == 'weak' else 'one global state'}):")
            header = (f"{'P':>2} {'R':>2} {'global MiB':>10} {'save s':>7} {'wr max/mean':>11} {'peak+ MiB':>9} | "
                      f"{'restore on s':>12} {'off s':>7} {'off/on':>6} | {'read/unique on':>14} {'off':>5} "
                      f"{'rd max/mean':>11} {'sent MiB':>8} | {'peak+ on MiB':>12} {'off':>5} {'cap+batch':>9} "
                      f"{'exact':>5}")
            lines += [header, "-" * len(header)]
            for r in chosen:
                on, off = r["on"], r["off"]
                t_on, t_off = harness.median(on["restore_s"]), harness.median(off["restore_s"])
                unique = r["global_bytes"]
                lines.append(
                    f"{r['processes']:>2} {r['replicas']:>2} {_mib(unique):>10} {harness.median(r['save_s']):7.3f} "
                    f"{r['written_max'] / r['written_mean']:11.3f} {_mib(r['save_peak_extra']):>9} | "
                    f"{t_on:12.3f} {t_off:7.3f} {t_off / t_on:6.2f} | {on['read_total'] / unique:14.3f} "
                    f"{off['read_total'] / unique:5.2f} {on['read_max'] / on['read_mean']:11.3f} "
                    f"{_mib(on['sent_total']):>8} | {_mib(on['peak_extra']):>12} {_mib(off['peak_extra']):>5} "
                    f"{_mib(r['cap'] + r['batch']):>9} {str(on['exact'] and off['exact']):>5}")
    lines.append("")
    lines.append("P processes, R replicas (DP=R x FSDP=P/R); times: slowest process, median; wr / rd max/mean: bytes "
                 "written / read from storage by the busiest process over the mean (balance); read/unique: bytes "
                 "read from storage by all processes over the stored bytes (single-replica reads on, off); sent: "
                 "bytes sent between processes (on); peak+: peak host RSS above the state of the busiest process "
                 "(save; restore on, off; restores also above the restored state); cap+batch: the bound for peak+ "
                 "with single-replica reads. 2 cores shared by every process and the emulator: byte figures are "
                 "the robust ones.")
    return "\n".join(lines)


def merged(results: list[dict]) -> list[dict]:
    """One row per tree and configuration: the series of its jobs (`rounds`) pooled, the rest the first's."""
    out: dict[tuple, dict] = {}
    for r in results:
        key = (r["tree"], r["storage"], r["scaling"], r["processes"], r["replicas"])
        if key not in out:
            out[key] = {**r, "on": dict(r["on"]), "off": dict(r["off"])}
            continue
        row = out[key]
        row["save_s"] = row["save_s"] + r["save_s"]
        row["save_cpu"] = row["save_cpu"] + r["save_cpu"]
        for mode in ("on", "off"):
            for series in ("restore_s", "restore_cpu"):
                row[mode][series] = row[mode][series] + r[mode][series]
    return list(out.values())


def compared(results: list[dict], old: str, new: str) -> str:
    """Per configuration, `new`'s medians over `old`'s (below 1: `new` is faster): wall time of the slowest
    process and CPU seconds of all processes, of a save and of a restore with single-replica reads on and off;
    and the geometric mean of each column."""
    def key(r: dict) -> tuple:
        return r["storage"], r["scaling"], r["processes"], r["replicas"]

    def figures(r: dict) -> list[float]:
        return [harness.median(r[k]) for k in ("save_s", "save_cpu")] + [
            harness.median(r[m][k]) for m in ("on", "off") for k in ("restore_s", "restore_cpu")]

    olds = {key(r): r for r in results if r["tree"] == old}
    names = ("save s", "cpu", "rest. on s", "cpu", "off s", "cpu")
    lines = [f"\nnew/old: {new} over {old} (medians; below 1: faster; s: slowest process, cpu: all processes)",
             f"{'storage':>7} {'scaling':>7} {'P':>2} {'R':>2} " + " ".join(f"{n:>10}" for n in names)]
    columns: list[list[float]] = [[] for _ in names]
    for r in (r for r in results if r["tree"] == new):
        ratios = [a / b for a, b in zip(figures(r), figures(olds[key(r)]))]
        for column, ratio in zip(columns, ratios):
            column.append(ratio)
        lines.append(f"{r['storage']:>7} {r['scaling']:>7} {r['processes']:>2} {r['replicas']:>2} "
                     + " ".join(f"{x:10.2f}" for x in ratios))
    lines.append(f"{'geometric mean':>22} " + " ".join(f"{statistics.geometric_mean(c):10.2f}" for c in columns))
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["storage"] for r in rows))
    fig, axes = plt.subplots(len(kinds), 3, figsize=(16, 4.2 * len(kinds)), squeeze=False)
    for ax_row, kind in zip(axes, kinds):
        for ax, (scaling, what) in zip(ax_row, (("weak", "restore s"), ("strong", "restore s"),
                                                ("weak", "read / unique"))):
            for replicas, colour in zip((1, 2, 4), ("tab:blue", "tab:orange", "tab:green")):
                chosen = sorted((r for r in rows if r["storage"] == kind and r["scaling"] == scaling
                                 and r["replicas"] == replicas), key=lambda r: r["processes"])
                if not chosen:
                    continue
                x = [r["processes"] for r in chosen]
                for mode, style in (("on", "-o"), ("off", "--x")):
                    if what == "restore s":
                        y = [harness.median(r[mode]["restore_s"]) for r in chosen]
                    else:
                        y = [r[mode]["read_total"] / r["global_bytes"] for r in chosen]
                    ax.plot(x, y, style, color=colour, label=f"R={replicas}, single-replica {mode}")
            if what == "restore s":
                for replicas, colour in zip((1, 2, 4), ("tab:blue", "tab:orange", "tab:green")):
                    chosen = sorted((r for r in rows if r["storage"] == kind and r["scaling"] == scaling
                                     and r["replicas"] == replicas), key=lambda r: r["processes"])
                    if chosen:
                        ax.plot([r["processes"] for r in chosen], [harness.median(r["save_s"]) for r in chosen],
                                ":s", color=colour, alpha=0.5, label=f"R={replicas}, save")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("processes")
            ax.set_ylabel(what)
            ax.set_title(f"{kind}: {scaling} scaling, {what}")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run(settings: harness.Settings) -> harness.Result:
    """The case `scale`: a job per storage, process count and replication (blocks for all of them)."""
    processes_ = [int(p) for p in settings.option("processes", ("1", "2", "4", "8"))]
    replicas_ = [int(r) for r in settings.option("replicas", ("1", "2", "4"))]
    sizes = [str(settings.option(key, default)) for key, default in
             (("weak_mib", 64.0), ("strong_mib", 256.0), ("cap_mib", 16.0))]
    from object_stores import start_object_store

    trees = settings.option("trees", ()) or ("",)  # "": this checkout
    rounds = settings.option("rounds", 1)  # jobs per configuration and tree (ABBA), their repeats pooled
    results = []
    configuration = 0
    for kind in settings.option("storage", ("local", "gcs")):
        server, bucket = start_object_store(kind)
        env = dict(os.environ, **(server.environment if server else {}))
        try:
            with tempfile.TemporaryDirectory(prefix="scale-", dir=settings.workdir) as tmp:
                for processes in processes_:
                    for replicas in (r for r in replicas_ if r <= processes and processes % r == 0):
                        first = trees if configuration % 2 == 0 else trees[::-1]
                        for tree in harness.alternate(first, rounds):
                            print(f"{kind}: {processes} processes, R={replicas} {tree}...", file=sys.stderr,
                                  flush=True)
                            tree_env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, (
                                tree, env.get("PYTHONPATH"))))) if tree else env
                            answers = jobs.run_job([os.path.abspath(__file__), "--worker", f"{bucket or tmp}/scale",
                                                    replicas, settings.scale, settings.repeats, *sizes], processes,
                                                   env=tree_env)
                            results += [dict(r, tree=tree) for r in summarize(answers, processes, replicas, kind)]
                        configuration += 1
        finally:
            if server is not None:
                server.stop()
    results = merged(results)
    rows = [harness.Row(f"P={r['processes']} R={r['replicas']}" + (f" {r['tree']}" if r["tree"] else ""),
                        {"save_s": harness.series(r["save_s"], "s"),
                         "restore_on_s": harness.series(r["on"]["restore_s"], "s"),
                         "restore_off_s": harness.series(r["off"]["restore_s"], "s")},
                        f"{r['storage']}, {r['scaling']} scaling",
                        {"global_bytes": r["global_bytes"], "read_over_unique_on": r["on"]["read_total"]
                         / r["global_bytes"], "read_over_unique_off": r["off"]["read_total"] / r["global_bytes"],
                         "sent_bytes_on": r["on"]["sent_total"], "exact": r["on"]["exact"] and r["off"]["exact"]})
            for r in results]
    text = (f"Scale: save and restore by {', '.join(map(str, processes_))} processes, DP=R x FSDP=P/R, {ARRAYS} "
            "float32 arrays\n")
    for tree in trees:
        text += (f"\n== {tree}" if tree else "") + table([r for r in results if r["tree"] == tree])
    if len(trees) > 1:
        text += compared(results, trees[0], trees[-1])
    files = []
    try:
        plot([r for r in results if r["tree"] == trees[-1]], settings.beside(".png"))
        files.append(settings.beside(".png"))
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
    return harness.Result(rows, text, {"results": results}, files)


if __name__ == "__main__":
    harness.worker_main(child)
