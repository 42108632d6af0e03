"""The side-by-side benchmark (`make bench`'s first case): every contender on every workload, each in its own
process, side by side in one run, with the machine's floors measured in the same run: an aligned table with
ratios against torch_xla's CheckpointManager, and a PNG bar chart beside the result set.

usage: python -m benchmarks side-by-side [--quick] [--scale 1.0] [--repeats 3]
          [--set workloads=large,small,model,size-sweep (also: orbax-interop,hf-import,torch_xla-import,dtensor,
                                                          multi-tier,scale)]
          [--set contenders=xtc,xtc-nofsync,xtc-async,torch_xla,torch_xla-async,torch.save,orbax]
          [--set storage=local|gcs|s3] [--set warm_restore=1] [--set warm_memory=1] [--set resumes=5]
          [--set sweep=0.25,1,4] [--set events=FILE]

Workloads (benchmarks/workloads.py): `large` 1 GiB of 2D-sharded float32 + bfloat16; `small` 2,000 tensors of
4 KiB-256 KiB; `model` a ~200M-parameter decoder with AdamW moments (~2.4 GiB), FSDP-sharded, also restored onto
4 devices; `orbax-interop` a 1 GiB step Orbax writes, restored by this library onto torch_xla and by Orbax in
JAX (benchmarks/bench_orbax_interop.py); `hf-import` the model's tensors as Hugging Face safetensors files,
loaded onto an FSDP mesh by this library and by the usual load_file path (benchmarks/bench_hf_import.py);
`torch_xla-import` the large and model workloads saved by torch_xla's CheckpointManager, restored by its own
restore and by this library (`xtc.restore`, the manager's `init_from`) in fresh processes with the page cache
evicted, at least 7 rounds ABBA, with CPU seconds, fresh memory and bytes read; `xtckpt convert` of the model
checkpoint; raw DCP entry reads against torch.load (benchmarks/bench_torch_xla_import.py);
`dtensor` the large and model workloads as DTensors (4 gloo processes, Shard(0) as FSDP2 shards them, no
torch_xla) saved (sync; async: blocking and total) and restored by this library and by torch.distributed.checkpoint
in the same job, at least 7 rounds ABBA, with CPU seconds, fresh memory and bytes read and written; each checkpoint
opened by `xtckpt tree` and by Orbax in JAX (benchmarks/bench_dtensor.py);
`size-sweep` the large workload at 0.25, 1 and 4 GiB (`--sweep`), this library and torch_xla's manager;
`multi-tier` the manager with a local tier in front of the persistent one (benchmarks/bench_multi_tier.py: save()
blocking with both tiers due against one, a training loop saving the local tier every step, resume from each
tier; the persistent tier on --storage); `scale` jobs of 1-8 processes, replication 1, 2, 4, single-replica reads
on and off, on local disk and the GCS emulator (benchmarks/bench_scale.py; run with --storage local only, its
results beside this run's as <output>-scale.json / .txt / .png).
`--quick` is a smoke test (0.02 scale, one repeat, one resume, the large and small workloads, this library against
torch_xla's manager); `--scale` shrinks every workload. The result set is named after the storage: only the full
run with the default options writes benchmarks/results/<storage>.{json,txt,png}.
The Orbax contender runs with JAX on 8 CPU devices in its own
virtual environment (benchmarks/.venv-orbax, created on first use from the package registry); the interop
workload with the Orbax of the test extra. With --storage gcs every contender writes to a fake-gcs-server
started on 127.0.0.1, with --storage s3 to moto's S3 server; torch_xla's manager
reaches them through fsspec (gcsfs, s3fs). Object stores add a floor: the same bytes uploaded and downloaded alone.
The resumes of the large and model workloads (fresh processes, `--resumes` each, ABBA) take turns with a second
floor, `placement`: a fresh process places host shards it holds in memory onto the resume's target the way the
manager's restore does, reading nothing (what torch_xla 2.9 costs once the bytes are read: its copy of each host
shard and PJRT's into the device buffer; docs/performance.md, "The copies on the way to a device").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_dtensor  # noqa: E402
import bench_hf_import  # noqa: E402
import bench_orbax_interop  # noqa: E402
import bench_torch_xla_import  # noqa: E402
import footprint  # noqa: E402
import fresh_process  # noqa: E402
import harness  # noqa: E402
import workloads  # noqa: E402
from object_stores import start_object_store  # noqa: E402

DEFAULT_CONTENDERS = ("xtc", "xtc-nofsync", "xtc-async", "torch_xla", "torch_xla-async", "torch.save", "orbax")
RESTORE_ON_4 = ("xtc", "torch_xla", "orbax")
RESUME_CONTENDERS = ("xtc", "xtc-async", "torch_xla", "orbax", "torch.save")
RESUME_WORKLOADS = ("large", "model")
PLACEMENT = "placement"  # resumed beside the contenders: placing in-memory host data alone (worker.py)
SWEEP_CONTENDERS = ("xtc", "torch_xla")
BASELINE = "torch_xla"
ORBAX_VENV = os.path.join(HERE, ".venv-orbax")


def orbax_python() -> str:
    python = os.path.join(ORBAX_VENV, "bin", "python")
    if not os.path.exists(python):
        print("creating the Orbax environment (jax, orbax-checkpoint) in benchmarks/.venv-orbax ...",
              file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", ORBAX_VENV], check=True)
        subprocess.run([python, "-m", "pip", "install", "--quiet", "jax[cpu]", "orbax-checkpoint"], check=True)
    return python


def run_worker(contender: str, workload: str, args, workdir: str, env: dict, *, devices: int = 8,
               keep: bool = False, restore_only: bool = False, resume: bool = False) -> dict:
    """One contender on one workload in a fresh process (benchmarks/worker.py, or orbax_worker.py in the Orbax
    environment) with `devices` CPU devices; its answer. Blocks; raises RuntimeError if it fails."""
    directory = os.path.join(workdir, f"{contender}-{workload}")
    flags = ",".join(name for name, on in (("keep", keep), ("restore_only", restore_only), ("resume", resume),
                                           ("warm_restore", args.warm_restore)) if on)
    env = dict(env)
    python = None
    if contender == "orbax":
        specs_file = os.path.join(tempfile.gettempdir(), f"xtc-orbax-specs-{workload}-{args.scale}.json")
        with open(specs_file, "w") as f:
            json.dump(workloads.specs_json(workload, args.scale), f)
        env.update(XTC_ORBAX_SPECS=specs_file, XTC_ORBAX_DEVICES=str(devices))
        python, script = orbax_python(), os.path.join(HERE, "orbax_worker.py")
    else:
        env.update(CPU_NUM_DEVICES=str(devices))
        script = os.path.join(HERE, "worker.py")
    return harness.fresh(script, contender, workload, args.scale, args.repeats, directory, flags, env=env,
                         python=python, what=f"{contender} on {workload}")


def read_into_fresh_memory(path: str, nbytes: int) -> float:
    """Seconds to read the file at `path` whole into a newly allocated buffer."""
    start = time.perf_counter()
    target = np.empty(nbytes, dtype=np.uint8)
    with open(path, "rb", buffering=0) as f:
        f.readinto(memoryview(target))
    return time.perf_counter() - start


def floors(nbytes: int, workdir: str, repeats: int) -> dict:
    """The machine's floor for `nbytes`: a plain sequential write with fsync, a read of that file back from the page
    cache into fresh memory (what a restore of a just-written checkpoint cannot beat), the same read after the
    file is evicted from the page cache (what a resume cannot beat), and a memory copy."""
    block = np.random.default_rng(0).integers(0, 255, size=min(nbytes, 16 << 20), dtype=np.uint8)
    writes, reads, cold_reads, copies = [], [], [], []
    for _ in range(repeats):
        path = os.path.join(workdir, "floor.bin")
        os.sync()
        start = time.perf_counter()
        with open(path, "wb") as f:
            for offset in range(0, nbytes, len(block)):
                f.write(block[: min(len(block), nbytes - offset)])
            f.flush()
            os.fsync(f.fileno())
        writes.append(time.perf_counter() - start)
        reads.append(read_into_fresh_memory(path, nbytes))
        fresh_process.evict(path)
        cold_reads.append(read_into_fresh_memory(path, nbytes))
        os.remove(path)
        source = np.ones(nbytes, dtype=np.uint8)
        start = time.perf_counter()
        copy = source.copy()
        copies.append(time.perf_counter() - start)
        del copy, source
    return {"write_fsync_s": writes, "read_s": reads, "cold_read_s": cold_reads, "memcpy_s": copies}


def object_store_floors(nbytes: int, base: str, repeats: int) -> dict:
    """The object store's own ceiling for `nbytes`: plain writes and reads of 16 MiB objects, all in flight at
    once, through tensorstore's kvstore for `base` (no zarr, no checksums), against the same server."""
    import tensorstore as ts

    from xla_tensorstore_ckpt import storage

    block = np.random.default_rng(0).integers(0, 255, size=min(nbytes, 16 << 20), dtype=np.uint8).tobytes()
    sizes = [min(len(block), nbytes - offset) for offset in range(0, nbytes, len(block))]
    writes, reads = [], []
    for run in range(repeats):
        store = ts.KvStore.open(storage.location(f"{base}/floor-{run}").kvstore_spec()).result()
        start = time.perf_counter()
        for future in [store.write(f"{i}", block[:size]) for i, size in enumerate(sizes)]:
            future.result()
        writes.append(time.perf_counter() - start)
        start = time.perf_counter()
        for future in [store.read(f"{i}") for i in range(len(sizes))]:
            future.result()
        reads.append(time.perf_counter() - start)
        store.delete_range(ts.KvStore.KeyRange()).result()
    return {"object_write_s": writes, "object_read_s": reads}


median, spread = harness.median, harness.spread


def table(results: list[dict], floor: dict[str, dict]) -> str:
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in results):
        rows = [r for r in results if r["workload"] == workload]
        base = next((r for r in rows if r["contender"] == BASELINE), None)
        nbytes = rows[0]["state_bytes"]
        f = floor[workload]
        lines.append(f"\n{workload}: {nbytes / 2**30:.2f} GiB; floor on this machine: sequential write+fsync "
                     f"{median(f['write_fsync_s']):.3f} s, read back {median(f['read_s']):.3f} s, "
                     f"cold read {median(f['cold_read_s']):.3f} s, memcpy {median(f['memcpy_s']):.3f} s")
        if "object_write_s" in f:
            lines.append(f"object store alone (16 MiB objects through tensorstore's kvstore): write "
                         f"{median(f['object_write_s']):.3f} s, read {median(f['object_read_s']):.3f} s")
        header = (f"{'contender':16} {'fsync':5} {'save s':>13} {'x base':>6} {'blocked s':>13} {'restore s':>13} "
                  f"{'x base':>6} {'4 dev s':>7} {'GiB/s':>6} {'peak+':>6} {'files':>6} {'MiB':>7} {'exact':>5}")
        lines += [header, "-" * len(header)]
        for r in rows:
            save, restore = median(r["save_s"]), median(r["restore_s"])
            ratio_save = f"{median(base['save_s']) / save:5.2f}x" if base else "   n/a"
            ratio_restore = f"{median(base['restore_s']) / restore:5.2f}x" if base else "   n/a"
            four = f"{median(r['restore_4dev_s']):7.3f}" if r.get("restore_4dev_s") else "      -"
            lines.append(
                f"{r['contender']:16} {'yes' if r['fsync'] else 'no':5} {save:7.3f}±{spread(r['save_s']):<5.3f} "
                f"{ratio_save:>6} {median(r['blocked_s']):7.3f}±{spread(r['blocked_s']):<5.3f} "
                f"{restore:7.3f}±{spread(r['restore_s']):<5.3f} {ratio_restore:>6} {four} "
                f"{nbytes / 2**30 / save:6.2f} {r['save_peak_extra_bytes'] / max(1, r['distinct_shard_bytes']):5.2f}x "
                f"{r['files']:6d} {r['bytes_written'] / 2**20:7.1f} {str(r.get('restore_exact', '-')):>5}")
        for r in (r for r in rows if r.get("save_footprint")):
            lines.append(f"  {r['contender']:14} save: {footprint.summary(r['save_footprint'], nbytes, read=False)}; "
                         f"restore: {footprint.summary(r['restore_footprint'], nbytes, read=True)}")
    for workload, f in floor.items():
        if f.get("resume_s"):
            nbytes = next(b["state_bytes"] for b in results if b["workload"] == workload and "state_bytes" in b)
            place, cold = median(f["resume_s"]), median(f["cold_read_s"])
            lines.append(f"placement {workload:6} {place:7.3f} s (min {min(f['resume_s']):.3f}, max "
                         f"{max(f['resume_s']):.3f}, {len(f['resume_s'])} runs, in the ABBA turns): the restored "
                         f"bytes placed on torch_xla tensors from memory, no read; with the cold read floor "
                         f"{cold + place:.3f} s; {footprint.summary(f['resume_footprint'], nbytes, read=True)}")
    for r in (r for r in results if r.get("resume_s")):
        base = next((b for b in results if b["workload"] == r["workload"] and b["contender"] == BASELINE), None)
        cold = median(floor[r["workload"]]["cold_read_s"])
        placed = floor[r["workload"]].get("resume_s")
        both = f", {median(r['resume_s']) / (cold + median(placed)):.2f}x read + placement" if placed else ""
        resume = median(r["resume_s"])
        versus = f"{median(base['resume_s']) / resume:.2f}x torch_xla's, " if base and base.get("resume_s") else ""
        nbytes = next(b["state_bytes"] for b in results if b["workload"] == r["workload"] and "state_bytes" in b)
        measured = f"; {footprint.summary(r['resume_footprint'], nbytes, read=True)}" if r.get(
            "resume_footprint") else ""
        lines.append(f"resume {r['workload']:6} {r['contender']:10} {resume:7.3f} s (min {min(r['resume_s']):.3f}, "
                     f"max {max(r['resume_s']):.3f}, {len(r['resume_s'])} runs, ABBA): {versus}"
                     f"{resume / cold:.2f}x the cold read floor ({cold:.3f} s){both}{measured}")
    lines.append("")
    lines.append("resume: a fresh process, the checkpoint evicted from the page cache, the target built, one restore "
                 "(the headline restore figure: what a restarted trainer waits for); the contenders take turns "
                 "ABBA (forwards in even rounds, backwards in odd ones); the restore columns are in-process restores "
                 "after a save.")
    lines.append("CPU: user + system seconds of the whole process during the call; fresh: host memory it touched "
                 "(peak resident set growth + page cache growth) per byte of state; read / written: bytes from / to "
                 "storage (the block layer's count) per byte of state; medians over the runs (benchmarks/"
                 "footprint.py). Under each workload's table, the same for the in-process saves (until written) and "
                 "restores.")
    lines.append("save: until written (and fsynced where 'fsync' says so); blocked: time the caller waits in save(); "
                 "restore: onto another mesh (4 dev: in a process with 4 devices); x base: times faster than "
                 "torch_xla's CheckpointManager; peak+: peak host RSS above the state during the first save, over "
                 "the distinct shard bytes; median ± half the range of the runs.")
    return "\n".join(lines)


def sweep_summary(results: list[dict]) -> str:
    """Seconds per GiB of save and restore at each size of the size sweep, and how the largest compares with the
    smallest (issue 21: at most 1.2x)."""
    swept = [r for r in results if "sweep_gib" in r]
    lines = []
    for contender in dict.fromkeys(r["contender"] for r in swept):
        rows = sorted((r for r in swept if r["contender"] == contender), key=lambda r: r["sweep_gib"])
        per_gib = [(r["sweep_gib"], median(r["save_s"]) / (r["state_bytes"] / 2**30),
                    median(r["restore_s"]) / (r["state_bytes"] / 2**30)) for r in rows]
        sizes = ", ".join(f"{g:g} GiB: save {s:.2f} / restore {r:.2f}" for g, s, r in per_gib)
        growth = (f"; largest/smallest: save {per_gib[-1][1] / per_gib[0][1]:.2f}x, restore "
                  f"{per_gib[-1][2] / per_gib[0][2]:.2f}x" if len(per_gib) > 1 else "")
        lines.append(f"  {contender:10} s per GiB at {sizes}{growth}")
    return "\n\nsize sweep (large workload, in-process):\n" + "\n".join(lines) if lines else ""


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads_seen = list(dict.fromkeys(r["workload"] for r in results))
    fig, axes = plt.subplots(1, len(workloads_seen), figsize=(6 * len(workloads_seen), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], workloads_seen):
        rows = [r for r in results if r["workload"] == workload]
        x = np.arange(len(rows))
        for offset, (key, label) in zip((-0.27, 0, 0.27), (("save_s", "save"), ("blocked_s", "blocked"),
                                                           ("restore_s", "restore"))):
            values = [median(r[key]) for r in rows]
            errors = [spread(r[key]) for r in rows]
            ax.bar(x + offset, values, 0.27, yerr=errors, label=label, capsize=2)
        ax.set_xticks(x, [r["contender"] for r in rows], rotation=30, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("seconds (log)")
        ax.set_title(f"{workload} ({rows[0]['state_bytes'] / 2**30:.2f} GiB)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(settings: harness.Settings) -> harness.Result:
    """The case `side-by-side` (`make bench`'s first): every contender on every workload in its own process. The
    workloads that are cases of their own (orbax-interop, hf-import, torch_xla-import, dtensor, multi-tier, scale)
    run here only when ``--set workloads=...`` names them; ``--set warm_memory=1``: resumes, torch_xla-import and
    dtensor: a throwaway process touches twice the checkpoint's bytes before each timed process or region (this
    VM's fresh memory is slow to hand over; docs/performance.md); ``--set events=FILE``: this library's contenders
    write every save and restore event to FILE (JSON lines)."""
    import cases

    defaults = cases.CASES["side-by-side"].options
    args = types.SimpleNamespace(scale=settings.scale, repeats=settings.repeats,
                                 **{key: settings.option(key, value) for key, value in defaults.items()})
    args.resumes = int(args.resumes)
    args.warm_restore = settings.option("warm_restore", False)
    args.warm_memory = settings.option("warm_memory", False)
    results, floor, parts = _run_workloads(args, settings.beside)
    files = []
    try:
        plot(results, settings.beside(".png"))
        files.append(settings.beside(".png"))
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
    raw = {"storage": args.storage, "floors": floor, "results": results, **parts}
    return harness.Result(_rows(results, floor), _text(results, floor, parts), raw, files)


def _text(results: list[dict], floor: dict[str, dict], parts: dict) -> str:
    """The prose of a result set: the table with ratios and floors, the parts other cases' code measured, the
    size sweep."""
    text = table(results, floor)
    for name, module in (("orbax_interop", bench_orbax_interop), ("hf_import", bench_hf_import),
                         ("torch_xla_import", bench_torch_xla_import), ("dtensor", bench_dtensor)):
        if parts.get(name) is not None:
            text += "\n\n" + module.describe(parts[name])
    text += sweep_summary(results)
    if parts.get("multi_tier") is not None:
        text += "\n\nmulti-tier: " + parts["multi_tier"]
    if parts.get("scaling") is not None:
        text += "\n\n" + parts["scaling"]
    return text


def from_legacy(old: dict, text: str) -> dict:
    """The results document (`harness.SCHEMA`) of a result set this case wrote before the harness
    (benchmarks/results/<storage>.json with ``results`` and ``floors``, and its .txt, `text`, kept as the prose):
    the same measurements, its time and settings. Used to move the committed result sets onto the schema."""
    case = harness.Case("side-by-side", "run", "", output=lambda settings: old["storage"])
    result = harness.Result(_rows(old["results"], old["floors"]), text, old)
    return {**harness.document(case, harness.Settings(old["repeats"], old["scale"]), result), "time": old["time"]}


def _rows(results: list[dict], floor: dict[str, dict]) -> list[harness.Row]:
    """The result set's rows: per workload, each contender's timed series and footprint columns (per byte of
    state), then the machine's floors."""
    rows = []
    for r in results:
        metrics = {key: harness.series(r[key], "s") for key in ("save_s", "blocked_s", "restore_s", "resume_s",
                                                                "restore_4dev_s") if r.get(key)}
        for phase in ("save", "restore", "resume"):
            if r.get(f"{phase}_footprint"):
                for key, stat in harness.footprint_metrics(r[f"{phase}_footprint"], r.get("state_bytes")).items():
                    if key != "wall_s":
                        metrics[f"{phase}_{key}"] = stat
        base = next((b for b in results if b["workload"] == r["workload"] and b["contender"] == BASELINE), None)
        params = {"fsync": r.get("fsync"), "files": r.get("files"), "exact": r.get("restore_exact")}
        if base is not None:  # x base: times faster than torch_xla's CheckpointManager, medians
            params.update({f"{key}_x_base": median(base[key]) / median(r[key]) for key in ("save_s", "restore_s")})
        if r.get("distinct_shard_bytes"):  # peak+: the first save's peak host RSS above the state, per shard byte
            params["save_peak_extra"] = r["save_peak_extra_bytes"] / r["distinct_shard_bytes"]
        rows.append(harness.Row(r["contender"], metrics, r["workload"], params))
    for workload, f in floor.items():
        # resume_s of a floor is the placement alone (in-memory host data onto the resume's target, no read)
        metrics = {("placement_s" if key == "resume_s" else key): harness.series(values, "s")
                   for key, values in f.items() if key.endswith("_s") and values}
        rows.append(harness.Row("floor", metrics, f"{workload}: the machine's floor"))
    return rows


def _case(name: str, scale: float, repeats: int, output: str, **options: object) -> str:
    """Another case run by the harness in a process of its own (it starts its own servers); blocks, returns its
    text. Raises RuntimeError with the end of its stderr if it fails."""
    cmd = [sys.executable, "-m", "benchmarks", name, "--scale", str(scale), "--repeats", str(repeats),
           "--output", output, *(f"--set={k}={v}" for k, v in options.items())]
    proc = subprocess.run(cmd, cwd=os.path.dirname(HERE), env=dict(os.environ), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the case {name} (run by side-by-side) failed:\n{proc.stderr[-3000:]}")
    return proc.stdout.strip()


# The workloads measured by other cases' code (their result in the raw document under the key), and whether they
# run only on local files (their contenders write local files).
PARTS = {"orbax-interop": ("orbax_interop", True), "hf-import": ("hf_import", True),
         "torch_xla-import": ("torch_xla_import", True), "dtensor": ("dtensor", True),
         "multi-tier": ("multi_tier", False), "scale": ("scaling", True)}


def _run_workloads(args: types.SimpleNamespace, beside: Callable[[str], str]) -> tuple[list, dict, dict]:
    """Every workload of `args` in turn (blocks for the whole run): the per-contender results, the floors and
    the parts run by other benchmarks' code; the cases run in processes of their own write their result sets at
    ``beside(SUFFIX)``."""
    contenders = args.contenders.split(",")
    env = dict(os.environ)
    if args.events:
        env["XTC_BENCH_EVENTS"] = os.path.abspath(args.events)
    server, base = start_object_store(args.storage)
    if server is not None:
        env.update(server.environment)
        os.environ.update(server.environment)  # for the object store floor
        contenders = [c for c in contenders if c not in ("torch.save", "orbax")]  # local files only
    results: list[dict] = []
    floor: dict[str, dict] = {}
    parts: dict = {key: None for key, _ in PARTS.values()}
    try:
        with tempfile.TemporaryDirectory(prefix="xtc-bench-", dir=os.environ.get("XTC_BENCH_DIR")) as workdir:
            base = base or workdir
            for workload in args.workloads.split(","):
                if workload in PARTS:
                    key, local_only = PARTS[workload]
                    if server is None or not local_only:
                        parts[key] = _part(workload, args, workdir, beside)
                elif workload == "size-sweep":
                    _size_sweep(args, workdir, base, env, results, floor)
                else:
                    _contenders_on(workload, contenders, args, workdir, base, env, server is not None, results,
                                   floor)
    finally:
        if server is not None:
            server.stop()
    return results, floor, parts


def _part(workload: str, args: types.SimpleNamespace, workdir: str, beside: Callable[[str], str]) -> object:
    """A workload another case measures: in this process (its `measure`) or, for those that start their own
    servers, as that case in a process of its own (its text). Blocks."""
    print(f"running the {workload} benchmark ...", file=sys.stderr, flush=True)
    warm = {"warm_memory": "1" if args.warm_memory else "0"}
    if workload == "multi-tier":
        return _case("multi-tier", args.scale, max(args.repeats, 5), beside("-multi-tier.json"), loop_steps=10,
                     persistent=args.storage)
    if workload == "scale":
        return _case("scale", args.scale, args.repeats, beside("-scale.json"))
    module, repeats = {"orbax-interop": (bench_orbax_interop, args.repeats), "hf-import": (bench_hf_import,
                                                                                          args.repeats),
                       "torch_xla-import": (bench_torch_xla_import, max(args.repeats, 7)),
                       "dtensor": (bench_dtensor, max(args.repeats, 7))}[workload]
    return module.measure(harness.Settings(repeats, args.scale, options=warm, workdir=workdir))


def _size_sweep(args: types.SimpleNamespace, workdir: str, base: str, env: dict, results: list, floor: dict) -> None:
    """The large workload at each size of ``args.sweep`` (GiB times the scale), in process, for xtc and
    torch_xla; appends to `results` and `floor`."""
    for gib in (float(g) * args.scale for g in args.sweep.split(",")):
        label = f"large-{gib:g}GiB"
        sized = types.SimpleNamespace(**{**vars(args), "scale": gib})
        floor[label] = floors(workloads.spec_bytes("large", gib), workdir, args.repeats)
        for contender in SWEEP_CONTENDERS:
            print(f"running {contender} on {label} ({args.storage}) ...", file=sys.stderr, flush=True)
            results.append({**run_worker(contender, "large", sized, base, env), "workload": label, "sweep_gib": gib})


def _contenders_on(workload: str, contenders: list[str], args: types.SimpleNamespace, workdir: str, base: str,
                   env: dict, object_store: bool, results: list, floor: dict) -> None:
    """The machine's floors for `workload`, then each contender in a fresh process (saves and in-process
    restores), the resumes alternated ABBA, the restores onto 4 devices; appends to `results` and `floor`."""
    nbytes = workloads.spec_bytes(workload, args.scale)
    floor[workload] = floors(nbytes, workdir, args.repeats)
    if object_store:
        floor[workload].update(object_store_floors(nbytes, base, args.repeats))
    resumed = workload in RESUME_WORKLOADS and args.resumes > 0
    kept = {}
    for contender in contenders:
        print(f"running {contender} on {workload} ({args.storage}) ...", file=sys.stderr, flush=True)
        keep = (workload == "model" and contender in RESTORE_ON_4) or (resumed and contender in RESUME_CONTENDERS)
        result = run_worker(contender, workload, args, base, env, keep=keep)
        results.append(result)
        if keep:
            kept[contender] = result
    if resumed:  # fresh processes, page cache evicted; alternated ABBA so that all see the same machine
        print(f"resuming {workload} {args.resumes} times ...", file=sys.stderr, flush=True)
        order = [c for c in kept if c in RESUME_CONTENDERS] + [PLACEMENT]
        for contender in harness.alternate(order, args.resumes):
            if args.warm_memory:
                footprint.warm_memory(2 * nbytes)
            resumed_once = run_worker(contender, workload, args, base, env, resume=True)
            into = floor[workload] if contender == PLACEMENT else kept[contender]
            into.setdefault("resume_s", []).extend(resumed_once["restore_s"])
            into.setdefault("resume_footprint", []).append(resumed_once["footprint"])
    for contender, result in kept.items():
        if workload == "model" and contender in RESTORE_ON_4:
            result["restore_4dev_s"] = run_worker(contender, workload, args, base, env, devices=4,
                                                  restore_only=True)["restore_s"]
        elif "://" not in base:
            shutil.rmtree(os.path.join(base, f"{contender}-{workload}"), ignore_errors=True)


if __name__ == "__main__":
    harness.worker_main(case="side-by-side")
