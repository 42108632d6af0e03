"""Seeded chaos runs of whole jobs: four processes (tests/scripts/chaos_job.py: FSDP2 DTensors and a ShardedArray
over gloo, the manager with asynchronous saves, a local tier per host replicated to a peer, the persistent tier on
the GCS emulator or moto behind a fault proxy) restarted cycle after cycle, each cycle with faults drawn from the
seed (tests/chaos_faults.py: SIGKILL of a process or of the whole job at a moment an event of the library marks,
SIGSTOP past the coordination timeout, a local tier wiped, a file damaged, truncated or deleted, bucket faults for
a window of requests, a host's disk full).

Checked every cycle: every process resumes from the step the model predicts, with every value bit for bit the
fault-free reference run's at that step, and so is every step it trains after; no committed step is lost or
changes; partial directories do not pile up; a failure ends every process with a clear error (a library error
naming the step or process, or, where a process died, the training's own collective failing) before the cycle's
deadline, a hang otherwise.

usage: python tests/chaos.py [--seeds 3 | --seed S[,S...]] [--cycles 100] [--store gcs|s3|both] [--timeout 20]
A failing cycle prints one line with the command that replays its seed up to it. Prints a histogram of the
faults drawn and of the outcomes; exits 1 if any cycle failed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [p for p in (HERE, os.path.join(HERE, "scripts")) if p not in sys.path]

import chaos_faults  # noqa: E402
import gcs_emulator  # noqa: E402
import s3_server  # noqa: E402
from chaos_faults import BALLAST, BucketProxy, Model  # noqa: E402
from chaos_jobs import BUCKET, Job, Reference, Store, XlaJob, Zygote  # noqa: E402

from xla_tensorstore_ckpt.core import layout  # noqa: E402

NAMING_S = 15.0  # beyond the coordination timeout, how late a process may raise after the first failure


def shown_set(steps: set) -> str:
    return " or ".join(str(s) for s in sorted(steps, key=lambda s: (isinstance(s, str), -1 if s is None else s)))


def retained_away(missing: set[int], committed: set[int], keep: int = 2) -> set[int]:
    """The `missing` steps retention does not explain: those with fewer than `keep` newer `committed` steps (a
    process that died, or exited on an error, in the middle of retention's deletes deleted them without telling)."""
    return {s for s in missing if len([c for c in committed if c > s]) < keep}


def fingerprint(files: dict[str, str], step: int) -> str:
    """The hash of a step's files (names and hashes), its marker left out (it records when it was written), and
    so is Orbax's completion mark beside it: retention deletes that mark first and the marker next, so a process
    killed between the two leaves a step committed for us, its data whole, that Orbax no longer lists (found by
    seed 0, cycle 20: not a change of what any restore reads)."""
    marks = (f"{step}/{layout.CHECKPOINT_METADATA}", f"{step}/{layout.COMMIT_SUCCESS}")
    mine = sorted((n, h) for n, h in files.items() if n.split("/", 1)[0] == str(step) and n not in marks)
    return hashlib.sha256(json.dumps(mine).encode()).hexdigest()


def mount_small_file_system(path: str, size: str = "256m") -> str:
    """Mount a file system of `size` of its own (tmpfs) at `path`, which a full disk then fills; needs root."""
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], check=True, capture_output=True)
    return path


def small_file_systems_available() -> bool:
    """Whether `mount_small_file_system` works here (root, and mounting allowed)."""
    if os.geteuid() != 0:
        return False
    path = tempfile.mkdtemp(prefix="chaos-mount-")
    try:
        mount_small_file_system(path, "1m")
    except (OSError, subprocess.CalledProcessError):
        return False
    else:
        subprocess.run(["umount", path], check=False)
        return True
    finally:
        os.rmdir(path)


def local_fingerprint(directory: str) -> str:
    h = hashlib.sha256()
    for path in chaos_faults.files_under(directory):
        if not path.endswith("_CHECKPOINT_METADATA"):
            with open(path, "rb") as f:
                h.update(os.path.relpath(path, directory).encode() + hashlib.sha256(f.read()).digest())
    return h.hexdigest()


class Run:
    """One seed's run: `cycles` cycles on a fresh persistent root and fresh local tiers."""

    def __init__(self, seed: int, store: str, port: int, workdir: str, timeout: float, steps: int,
                 launch, proxy: BucketProxy, world: int = 4, full_disks: str = "fsize"):
        self.seed, self.store_kind, self.timeout, self.steps, self.world = seed, store, timeout, steps, world
        self.store = Store(store, port, f"chaos/{seed}-{os.getpid()}-{time.time_ns()}")
        self.workdir, self.local_base = workdir, os.path.join(workdir, "local")
        # With "tmpfs", each host's local tier is a file system of its own, which a full disk fills (ENOSPC);
        # with "fsize" a full disk is a limit on the size of the process's files (EFBIG).
        self.mounts = [mount_small_file_system(os.path.join(self.local_base, f"host{h}"))
                       for h in range(world)] if full_disks == "tmpfs" else []
        self.launch, self.proxy = launch, proxy  # launch(argv, directory): a `Job` (or an `XlaJob`)
        self.reference = Reference(launch, workdir, world)
        self.model = Model(world)
        self.persistent_prints: dict[int, str] = {}
        self.local_prints: dict[tuple[int, int], str] = {}
        self.faults: collections.Counter = collections.Counter()
        self.outcomes: collections.Counter = collections.Counter()
        self.errors: collections.Counter = collections.Counter()
        self.latencies: list[float] = []  # per failed cycle: seconds from the first failure to the last process's error
        self.history: list[str] = []  # one line per cycle

    def repro(self, cycle: int) -> str:
        return (f"PYTHONPATH={os.path.dirname(HERE)} {sys.executable} {os.path.abspath(__file__)} --seed {self.seed} "
                f"--cycles {cycle + 1} --store {self.store_kind} --timeout {self.timeout:g} --steps {self.steps}"
                f" --full-disks {'tmpfs' if self.mounts else 'fsize'}" + (" --xla" if self.world == 1 else ""))

    def close(self) -> None:
        """Unmount the hosts' file systems (`full_disks="tmpfs"`)."""
        for path in self.mounts:
            subprocess.run(["umount", "--lazy", path], check=False)
        self.mounts = []

    def cycle(self, number: int) -> list[str]:
        """Run one cycle; the problems found (empty if none)."""
        rng = random.Random(f"{self.seed}:{number}")
        faults = chaos_faults.draw(rng, self.store_kind, self.world)
        directory = os.path.join(self.workdir, f"cycle{number}")
        os.makedirs(os.path.join(directory, "pids"))
        plan = {"root": self.store.root, "local_base": self.local_base, "steps": self.steps,
                "timeout": self.timeout, "pids": os.path.join(directory, "pids"), "trigger": None, "fsize": None}
        notes, process_fault = [], None
        self.proxy.arm(None)
        for fault in faults:
            d = fault.details
            if fault.kind in chaos_faults.PROCESS_FAULTS:
                process_fault = fault
                plan["trigger"] = {"rank": d["rank"], "kind": d["event"], "tier": d["tier"], "nth": d["nth"],
                                   "action": fault.kind}
            elif fault.kind == "wipe":
                chaos_faults.wipe(d["host"], self.local_base, self.model)
            elif fault.kind == "damage" and d["where"] == "persistent":
                notes.append(f"damaged {chaos_faults.damage_persistent(fault, self.store, self.model)}")
            elif fault.kind == "damage":
                notes.append(f"damaged {chaos_faults.damage(fault, self.local_base, self.model)}")
            elif fault.kind == "bucket":
                self.proxy.arm({"how": d["how"], "start": d["start"], "length": d["length"]})
            elif fault.kind == "disk_full":
                how = d["how"] if self.mounts else "fsize"
                ballast = os.path.join(self.local_base, f"host{d['rank']}", BALLAST)
                plan["fsize"] = {"rank": d["rank"], "bytes": d["bytes"], "at": d["at"], "nth": d["nth"], "how": how,
                                 "ballast": ballast}
                notes.append(f"full disk: {'ENOSPC' if how == 'enospc' else 'EFBIG'}")
        self._refresh_copies()
        expected = self.model.predict()
        self.reference.cover(max(s or 0 for s in expected) + self.steps)
        with open(os.path.join(directory, "plan.json"), "w") as f:
            json.dump(plan, f)
        job = self.launch(["run", os.path.join(directory, "plan.json")], directory)
        stop_rank = process_fault.details["rank"] if process_fault and process_fault.kind == "stop" else None
        try:
            codes = job.wait(8 * self.timeout + 240, stop_rank)
        except KeyboardInterrupt:  # the run is being stopped: no process of this cycle outlives it
            job.kill()
            raise
        for host in range(self.world):  # the full disk ends with the cycle
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.local_base, f"host{host}", BALLAST))
        lines = job.lines()
        problems = self._check_run(faults, process_fault, expected, codes, lines, job.outs)
        problems += self._learn(lines)
        notes += self._remove_damaged_persistent(expected, lines)
        self.faults.update(fault.kind for fault in faults)  # counted once the cycle has run (not if stopped)
        shown = "; ".join(f.describe() for f in faults) + "".join(f"; {n}" for n in notes)
        errors = sorted({f"{x['type']}: {x['error'][:300]}" for rank in lines for x in rank if "error" in x})
        self.history.append(f"cycle {number}: {shown}; resume {shown_set(expected)}; exit codes {codes}"
                            + "".join(f"; {e}" for e in errors[:2]))
        if problems:
            problems = [f"cycle {number} ({shown}, expected resume {shown_set(expected)}): {p}" for p in problems]
        else:
            shutil.rmtree(directory)
        return problems

    def _check_run(self, faults, process_fault, expected, codes, lines, outs) -> list[str]:
        problems = []
        fired = [x["fault"] for rank_lines in lines for x in rank_lines if "fault" in x]
        died = any(f in chaos_faults.PROCESS_FAULTS for f in fired)
        if None in codes:
            problems.append(f"hang: processes {[r for r, c in enumerate(codes) if c is None]} had not ended "
                            f"{8 * self.timeout + 240:g} s after the start")
        for rank, (code, rank_lines) in enumerate(zip(codes, lines)):
            for x in rank_lines:
                if "resumed" in x:
                    if x["resumed"] not in expected:
                        problems.append(f"process {rank} resumed from step {x['resumed']}, the model says "
                                        f"{shown_set(expected)}")
                    elif x["digest"] != self.reference[rank][x["resumed"] or 0]:
                        problems.append(f"process {rank}'s state restored at step {x['resumed']} differs from the "
                                        f"reference run's")
                if "step" in x and "digest" in x and x["digest"] != self.reference[rank][x["step"]]:
                    problems.append(f"process {rank}'s state after training step {x['step']} differs from the "
                                    f"reference run's")
                if "error" in x:
                    self.errors[f"{x['type']}{'' if x['library'] else ' (training)'}"] += 1
                    if x["library"] and "step" not in x["error"] and "process" not in x["error"]:
                        problems.append(f"process {rank}'s error names neither a step nor a process: {x['error']}")
                    if not x["library"] and not died:
                        problems.append(f"process {rank} failed outside the library with no process dead: "
                                        f"{x['type']}: {x['error']}")
                    if x["type"] == "CoordinationTimeoutError" and not died:
                        problems.append(f"process {rank} waited out the coordination timeout with every process "
                                        f"alive (a peer failed without telling): {x['error']}")
            if code not in (0, 2, 3, -signal.SIGKILL, None):
                with open(outs[rank] + ".err") as f:
                    problems.append(f"process {rank} ended with status {code}: {f.read()[-1500:]}")
            if code == -signal.SIGKILL and not died:
                problems.append(f"process {rank} was killed with no kill planned")
        problems += self._check_latency(process_fault, lines)
        resumed = {x["resumed"] for rank_lines in lines for x in rank_lines if "resumed" in x}
        if len(resumed) > 1:
            problems.append(f"the processes resumed from different steps: {shown_set(resumed)}")
        ended = [c for c in codes if c is not None]
        if expected == {chaos_faults.FAILS} and not died and any(c != 2 for c in ended):
            problems.append(f"the persistent step to resume from is damaged, yet not every process failed with a "
                            f"library error (exit codes {codes})")
        if not died and any(c != 0 for c in ended) and any(c == 0 for c in ended):
            problems.append(f"a failure was raised on some processes only (exit codes {codes})")
        outcome = "hang" if None in codes else "clean" if all(c == 0 for c in codes) else \
            "killed" if died else "failed with clear errors"
        self.outcomes[outcome if not problems else "problem"] += 1
        if process_fault is not None and not died:
            self.outcomes["planned moment not reached"] += 1
        return problems

    def _check_latency(self, process_fault, lines: list[list[dict]]) -> list[str]:
        """Every process must raise soon after the first failure (a process killed or stopped, or the first error
        raised): within one coordination timeout and `NAMING_S` (the alarm's grace for naming the silent
        processes, and slack: a process's other collectives do not wait a deadline of their own for a peer one
        of them found dead), the stopped process aside (it raises once continued)."""
        raised = {rank: x["t"] for rank, rank_lines in enumerate(lines) for x in rank_lines if "error" in x}
        if not raised:
            return []
        stalled = process_fault.details["rank"] if process_fault and process_fault.kind == "stop" else None
        origin = min([x["t"] for rank_lines in lines for x in rank_lines
                      if x.get("fault") in chaos_faults.PROCESS_FAULTS] + list(raised.values()))
        late = {rank: t - origin for rank, t in raised.items() if rank != stalled}
        if not late:
            return []
        self.latencies.append(max(late.values()))
        return [f"process {rank} raised its error {seconds:.1f} s after the first failure (the coordination timeout "
                f"is {self.timeout:g} s)" for rank, seconds in late.items() if seconds > self.timeout + NAMING_S]

    def _learn(self, lines: list[list[dict]]) -> list[str]:
        """Update the model from what the processes reported, then compare it with what is on disk: a step the
        history committed must be there, unchanged; a step there that the history did not commit must be one a
        process was saving when the cycle ended (its commit landed, its event did not)."""
        problems, started = [], [set() for _ in range(self.world)]
        for rank, rank_lines in enumerate(lines):
            for x in rank_lines:
                if "event" in x:
                    self.model.learn(rank, x)
                    if x["event"] == "save_started":
                        started[rank].add(x["step"])
                elif "resumed" in x:
                    self.model.resumed(rank, x["resumed"])
        recommitted = {(rank, x["step"]) for rank, rank_lines in enumerate(lines) for x in rank_lines
                       if x.get("event") == "save_committed"}
        for host in range(self.world):
            host_dir = os.path.join(self.local_base, f"host{host}")
            on_disk = chaos_faults.step_dirs(host_dir)
            lost = retained_away(self.model.own[host] - set(on_disk) - self.model.damaged_own[host],
                                 self.model.own[host] | set(on_disk))
            if lost:
                problems.append(f"host {host} lost its committed local steps {sorted(lost)}")
            phantom = set(on_disk) - self.model.own[host] - started[host]
            if phantom:
                problems.append(f"host {host} holds local steps {sorted(phantom)} no process committed")
            self.model.own[host] = (self.model.own[host] & set(on_disk)) | (set(on_disk) & started[host])
            for step, path in on_disk.items():
                key = (host, step)
                if step in self.model.damaged_own[host] or (host, step) in recommitted:
                    self.local_prints.pop(key, None)
                    continue
                now = local_fingerprint(path)
                if self.local_prints.setdefault(key, now) != now:
                    problems.append(f"host {host}'s committed local step {step} changed ({path})")
            for key in [k for k in self.local_prints if k[0] == host and k[1] not in on_disk]:
                del self.local_prints[key]
            leftovers = chaos_faults.partials(host_dir)
            if len(leftovers) > 4:
                problems.append(f"partial directories pile up on host {host}: {leftovers}")
        objects = self.store.objects()
        on_store = {int(n.split("/", 1)[0]) for n in objects if n.endswith("/_CHECKPOINT_METADATA")
                    and n.split("/", 1)[0].isdigit()}
        uncommitted = sorted({n.split("/", 1)[0] for n in objects if "/" in n} - {str(s) for s in on_store})
        if len(uncommitted) > 2:
            problems.append(f"partial steps pile up in the persistent tier: {uncommitted}")
        lost = retained_away(self.model.persistent - on_store, self.model.persistent | on_store)
        if lost:
            problems.append(f"the persistent tier lost its committed steps {sorted(lost)}")
        phantom = on_store - self.model.persistent - set().union(*started)
        if phantom:
            problems.append(f"the persistent tier holds steps {sorted(phantom)} no process committed")
        self.model.persistent = on_store & (self.model.persistent | set().union(*started))
        for step in on_store:
            now = fingerprint(objects, step)
            if any((r, step) in recommitted for r in range(self.world)) or step in self.model.damaged_persistent:
                self.persistent_prints[step] = now
            elif self.persistent_prints.setdefault(step, now) != now:
                problems.append(f"the persistent tier's committed step {step} changed")
        self.persistent_prints = {s: p for s, p in self.persistent_prints.items() if s in on_store}
        self.model.damaged_persistent &= self.model.persistent
        return problems

    def _remove_damaged_persistent(self, expected: set, lines: list[list[dict]]) -> list[str]:
        """After a resume that failed on a damaged persistent step, delete that step, as an operator would (else
        every later cycle fails the same way); what was removed."""
        resumed = any("resumed" in x for rank_lines in lines for x in rank_lines)
        if chaos_faults.FAILS not in expected or resumed or not self.model.damaged_persistent:
            return []
        removed = sorted(self.model.damaged_persistent)
        for step in removed:
            self.store.delete_step(step)
            self.persistent_prints.pop(step, None)
        self.model.persistent -= set(removed)
        self.model.damaged_persistent.clear()
        return [f"damaged persistent steps {removed} removed after the failed resume"]

    def _refresh_copies(self) -> None:
        for host in range(self.world):
            held = set(chaos_faults.copy_dirs(os.path.join(self.local_base, f"host{host}")))
            self.model.copies[host] = held
            self.model.damaged_copies[host] &= held


def run_seeds(seeds: list[int], cycles: int, stores: list[str], ports: dict[str, int], workdir: str,
              timeout: float, log, steps: int = 3, xla: bool = False, full_disks: str = "fsize") -> dict:
    """Run every seed (seed i on store i mod len(stores)), each cycle training `steps` steps; return the
    summary: cycles run, faults and outcomes by kind, errors by type, problems (each with its reproduction
    command), and per failed cycle the seconds from its first failure to the last process's error. `log(line,
    verbose=False)` is told of every cycle (verbose) and every problem. With `xla`, the job is the torch_xla SPMD
    one of a single process (no peers: no stops, job kills, full disks or peer copies). `full_disks`: "tmpfs"
    (each host's local tier a small file system of its own: a full disk is ENOSPC; needs root) or "fsize" (a
    limit on the process's file sizes: EFBIG)."""
    summary = {"cycles": 0, "faults": collections.Counter(), "outcomes": collections.Counter(),
               "errors": collections.Counter(), "problems": [], "latencies": []}
    proxies = {kind: BucketProxy(ports[kind]) for kind in stores}
    try:
        for i, seed in enumerate(seeds):
            kind = stores[i % len(stores)]
            env = dict(os.environ, **(gcs_emulator.client_environment(proxies[kind].url) if kind == "gcs"
                                      else s3_server.client_environment(proxies[kind].url)))
            env.pop("PJRT_DEVICE", None)
            zygote = None if xla else Zygote(env)
            seed_dir = os.path.join(workdir, f"seed{seed}")
            run = None
            try:
                os.makedirs(seed_dir)
                if zygote is None:
                    def launch(argv, directory, env=env):
                        return XlaJob(env, argv, directory)
                else:
                    def launch(argv, directory, zygote=zygote):
                        return Job(zygote, argv, directory)
                run = Run(seed, kind, ports[kind], seed_dir, timeout, steps, launch, proxies[kind], 1 if xla else 4,
                          "fsize" if xla else full_disks)
                for number in range(cycles):
                    try:
                        problems = run.cycle(number)
                    except KeyboardInterrupt:  # stopped (SIGINT, SIGTERM): the summary of the cycles completed
                        log(f"chaos: seed {seed} stopped during cycle {number}")
                        summary["stopped"] = True
                        break
                    summary["cycles"] += 1
                    log(f"chaos: seed {seed} {run.history[-1]}", verbose=True)
                    for p in problems:
                        log(f"chaos: seed {seed} {p}")
                    if problems:
                        log(f"chaos: seed {seed} cycle {number} failed; reproduce with: {run.repro(number)}")
                        summary["problems"] += [{"seed": seed, "cycle": number, "problem": p,
                                                 "reproduce": run.repro(number)} for p in problems]
                        break  # the model no longer matches the system: later cycles would only echo this
                for name in ("faults", "outcomes", "errors"):
                    summary[name].update(getattr(run, name))
                summary["latencies"] += run.latencies
                if summary.get("stopped"):
                    break
            finally:
                if run is not None:
                    run.close()
                if zygote is not None:
                    zygote.close()
    finally:
        for proxy in proxies.values():
            proxy.stop()
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="run seeds 0 .. N-1")
    parser.add_argument("--seed", help="run these seeds only (comma-separated: 7 or 2,3,4)")
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--store", choices=("gcs", "s3", "both"), default="both")
    parser.add_argument("--timeout", type=float, default=20.0, help="the job's coordination timeout, seconds")
    parser.add_argument("--steps", type=int, default=3, help="steps each cycle trains after its resume")
    parser.add_argument("--xla", action="store_true", help="the torch_xla SPMD job of one process")
    parser.add_argument("--workdir", help="where the local tiers and each failing cycle's output stay")
    parser.add_argument("--full-disks", choices=("auto", "tmpfs", "fsize"), default="auto",
                        help="a full disk: a host's own small file system filled (tmpfs: ENOSPC; needs root), or a "
                             "file-size limit (EFBIG); auto: tmpfs where it can be mounted")
    args = parser.parse_args()
    full_disks = args.full_disks if args.full_disks != "auto" else (
        "tmpfs" if small_file_systems_available() else "fsize")
    seeds = [int(s) for s in args.seed.split(",")] if args.seed is not None else list(range(args.seeds))
    stores = ["gcs", "s3"] if args.store == "both" else [args.store]
    servers, ports = [], {}
    if "gcs" in stores:
        servers.append(gcs_emulator.Emulator().start())
        servers[-1].create_bucket(BUCKET)
        ports["gcs"] = servers[-1].port
    if "s3" in stores:
        servers.append(s3_server.S3Server().start())
        servers[-1].create_bucket(BUCKET)
        ports["s3"] = servers[-1].port
    workdir = args.workdir or tempfile.mkdtemp(prefix="chaos-")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped: print the summary so far, then exit
    try:
        summary = run_seeds(seeds, args.cycles, stores, ports, workdir, args.timeout,
                            log=lambda line, verbose=False: print(line, flush=True), steps=args.steps, xla=args.xla,
                            full_disks=full_disks)
    finally:
        for server in servers:
            server.stop()
    latencies = sorted(summary.pop("latencies"))
    summary["raised_after_first_failure_s"] = {
        "cycles": len(latencies), "median": round(latencies[len(latencies) // 2], 1) if latencies else None,
        "max": round(latencies[-1], 1) if latencies else None,
        "over_one_timeout": sum(1 for x in latencies if x > args.timeout)}
    print(json.dumps({k: dict(v) if isinstance(v, collections.Counter) else v for k, v in summary.items()},
                     indent=1), flush=True)
    sys.exit(1 if summary["problems"] else 0)


if __name__ == "__main__":
    main()
