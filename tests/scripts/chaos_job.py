"""One process of the chaos harness's job (tests/chaos.py), the fault-free reference run, and the zygote that forks
them.

usage: chaos_job.py zygote          -> forks a process per request read on stdin (one JSON line each: {"argv",
                                       "env", "out", "err"}), copying its output to those files; answers {"pid"}
                                       at once and {"exit": pid, "code"} once the process ended (code < 0: killed)
       chaos_job.py run PLAN        -> one rank of the job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): resume,
                                       train PLAN["steps"] steps with the manager saving each, exit
       chaos_job.py reference STEPS -> the same training without any checkpoint: the digests after each step

The job: FSDP2 (DTensors) on a tiny model with AdamW and a scheduler, plus a `ShardedArray` table whose row shard
h this rank (its host) updates each step, dropout drawing from the RNG the manager saves. The manager has its full
configuration: asynchronous saves, a persistent tier (PLAN["root"], behind the harness's fault proxy), a local tier
per host replicated to one peer. Every event the manager reports is printed as a JSON line, and PLAN["trigger"]
turns one of them into the fault: SIGKILL of this process or of the whole job, or SIGSTOP. Prints JSON lines:
{"event"}, {"resumed", "digest"}, {"step", "digest"}, {"fault"}, then {"done"} or {"error", "type", "library"}
(faults and errors with "t", the wall clock: how long after a process died the others raised).
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import resource
import select
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from dtensor_job import VOCAB, batch_at, fsdp_model  # this directory's
from forking import run_child  # this directory's
from torch.distributed.tensor import DTensor

import xla_tensorstore_ckpt as xtc

ROWS, COLUMNS = 8, 16  # the table: row shard h of 4 on host h


def emit(**fields) -> None:
    print(json.dumps(fields, default=str), flush=True)


def tensor_bytes(t: torch.Tensor) -> bytes:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def digest(model, optimizer, scheduler, data: dict) -> str:
    """This rank's whole state, bit for bit: its shards of the model and optimizer, the scheduler, its data
    position and table shard, its torch RNG."""
    h = hashlib.sha256()
    for name, value in model.state_dict().items():
        h.update(name.encode() + tensor_bytes(value))
    for index, entries in sorted(optimizer.state_dict()["state"].items()):
        for name, value in sorted(entries.items()):
            raw = tensor_bytes(value) if torch.is_tensor(value) else str(value).encode()
            h.update(f"{index}.{name}".encode() + raw)
    h.update(json.dumps(scheduler.state_dict(), sort_keys=True, default=str).encode())
    (_, shard), = data["table"].shards
    h.update(str(data["position"]).encode() + tensor_bytes(shard) + tensor_bytes(torch.get_rng_state()))
    return h.hexdigest()[:20]


def table(rank: int, world: int, empty: bool) -> xtc.ShardedArray:
    index = [((rank * ROWS, (rank + 1) * ROWS), (0, COLUMNS))]
    if empty:
        return xtc.ShardedArray.target((world * ROWS, COLUMNS), torch.float32, (ROWS, COLUMNS), index)
    return xtc.ShardedArray.from_tensor(torch.zeros(world * ROWS, COLUMNS), (ROWS, COLUMNS), index)


def train_step(step: int, rank: int, world: int, model, optimizer, scheduler, data: dict) -> None:
    batch = batch_at(data["position"] * world + rank)
    loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    data["position"] += 1
    (index, shard), = data["table"].shards
    noise = torch.randn(shard.shape, generator=torch.Generator().manual_seed(7919 * step + rank))
    data["table"] = xtc.ShardedArray(data["table"].shape, shard.dtype, data["table"].shard_shape,
                                     ((index, shard * 0.5 + noise),))


class Trigger:
    """The planned fault, on the `nth` event of `kind` (and `tier`) this rank sees: `kill` (SIGKILL this process),
    `kill_job` (SIGKILL every process of the job, this one last) or `stop` (SIGSTOP this process: the harness
    continues it once the others have ended)."""

    def __init__(self, spec: dict | None, rank: int, pids: str):
        self.spec = spec if spec is not None and spec["rank"] == rank else None
        self.pids, self.seen = pids, 0

    def __call__(self, event) -> None:
        spec = self.spec
        if spec is None or event.kind != spec["kind"] or spec.get("tier") not in (None, event.tier):
            return
        self.seen += 1
        if self.seen != spec["nth"]:
            return
        emit(fault=spec["action"], at=event.kind, tier=event.tier, step=event.step, t=time.time())
        if spec["action"] == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        if spec["action"] == "kill_job":
            for name in os.listdir(self.pids):
                pid = int(open(os.path.join(self.pids, name)).read())
                if pid != os.getpid():
                    os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def fill_disk(spec: dict) -> None:
    """This host's disk full from now on. "enospc": its local tier's own file system filled, `bytes` left free,
    by a file the harness removes after the cycle; "fsize": no file of this process grows past `bytes` (EFBIG).
    Any thread."""
    if spec["how"] == "enospc":
        st = os.statvfs(os.path.dirname(spec["ballast"]))
        with open(spec["ballast"], "wb") as f:
            os.posix_fallocate(f.fileno(), 0, max(1, st.f_bavail * st.f_frsize - spec["bytes"]))
    else:
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["bytes"], resource.RLIM_INFINITY))


class DiskFiller:
    """A full disk from a moment on: the `nth` local-tier event of `at` this rank sees (its step's files written,
    or its step committed: the step's marker, then the copies it receives from its peer, meet the full disk)."""

    def __init__(self, spec: dict | None):
        self.spec = spec if spec is not None and spec.get("at") else None
        self.seen = 0

    def __call__(self, event) -> None:
        if self.spec is None or event.kind != self.spec["at"] or event.tier != "local":
            return
        self.seen += 1
        if self.seen == self.spec["nth"]:
            emit(fault="disk_full", at=event.kind, tier=event.tier, step=event.step)
            fill_disk(self.spec)


def report(event) -> None:
    emit(event=event.kind, tier=event.tier, step=event.step, details=event.details)


def run(plan: dict) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks for every stack on a hang
    with open(os.path.join(plan["pids"], str(rank)), "w") as f:
        f.write(str(os.getpid()))
    full = plan.get("fsize") if plan.get("fsize") and plan["fsize"]["rank"] == rank else None
    if full is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # here: the main thread (writes past the budget: EFBIG)
        if full.get("at") is None:
            fill_disk(full)
    dist.init_process_group("gloo", timeout=timedelta(seconds=plan["timeout"]))
    model, optimizer, scheduler = fsdp_model(world, "fsdp")
    data = {"position": 0, "table": table(rank, world, empty=False)}
    options = xtc.CheckpointManagerOptions(
        save_interval_steps=2, max_to_keep=2, local_directory=os.path.join(plan["local_base"], f"host{rank}"),
        local_save_interval_steps=1, local_max_to_keep=2, local_replication=2, async_save=True,
        coordination_timeout_s=plan["timeout"],
        listeners=(report, Trigger(plan.get("trigger"), rank, plan["pids"]), DiskFiller(full)))
    try:
        manager = xtc.CheckpointManager(plan["root"], options)
        restored = {"position": 0, "table": table(rank, world, empty=True)}
        start = manager.restore("latest", model=model, optimizer=optimizer, lr_scheduler=scheduler, extra=restored)
        if start is not None:
            data = restored
        emit(resumed=start, digest=digest(model, optimizer, scheduler, data))
        for step in range((start or 0) + 1, (start or 0) + 1 + plan["steps"]):
            train_step(step, rank, world, model, optimizer, scheduler, data)
            emit(step=step, digest=digest(model, optimizer, scheduler, data))
            manager.save(step, model=model, optimizer=optimizer, lr_scheduler=scheduler, extra=data)
        manager.close()
    except xtc.CheckpointError as exc:
        emit(error=str(exc), type=type(exc).__name__, library=True, t=time.time())
        os._exit(2)  # no clean-up that could wait for a dead peer
    except Exception as exc:  # noqa: BLE001 - a peer's death seen by the training's own collectives
        emit(error=str(exc), type=type(exc).__name__, library=False, t=time.time())
        os._exit(3)
    emit(done=True)
    os._exit(0)


def reference(steps: int) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    model, optimizer, scheduler = fsdp_model(world, "fsdp")
    data = {"position": 0, "table": table(rank, world, empty=False)}
    digests = [digest(model, optimizer, scheduler, data)]
    for step in range(1, steps + 1):
        train_step(step, rank, world, model, optimizer, scheduler, data)
        digests.append(digest(model, optimizer, scheduler, data))
    emit(rank=rank, digests=digests)
    os._exit(0)


def zygote() -> None:
    """Fork a child per request; nothing here starts a thread or a tensorstore context, so forking is safe."""
    poller = select.poll()
    poller.register(0, select.POLLIN)
    copies: dict[int, int] = {}  # a child's pipe -> the file it is copied to
    pipes: dict[int, set[int]] = {}  # a child's pid -> its pipes still open
    exits: dict[int, int] = {}  # a pidfd -> its child's pid
    ended: dict[int, int] = {}  # pid -> exit code, reported once its pipes are drained too

    def report_ended(pid: int) -> None:
        if pid in ended and not pipes[pid]:
            print(json.dumps({"exit": pid, "code": ended.pop(pid)}), flush=True)
            del pipes[pid]

    while True:
        for fd, _ in poller.poll():
            if fd == 0:
                line = sys.stdin.readline()
                if not line:
                    return
                job = json.loads(line)
                (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
                pid = os.fork()
                if pid == 0:
                    for other in (out_r, err_r, *copies, *copies.values(), *exits):
                        os.close(other)
                    os.environ.update(job["env"])
                    sys.argv = [__file__, *job["argv"]]
                    run_child(main, out_w, err_w)
                os.close(out_w)
                os.close(err_w)
                pipes[pid] = {out_r, err_r}
                for read_end, path in ((out_r, job["out"]), (err_r, job["err"])):
                    copies[read_end] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    poller.register(read_end, select.POLLIN)
                pidfd = os.pidfd_open(pid)
                exits[pidfd] = pid
                poller.register(pidfd, select.POLLIN)
                print(json.dumps({"pid": pid, "out": job["out"]}), flush=True)
            elif fd in copies:
                data = os.read(fd, 1 << 16)
                if data:
                    os.write(copies[fd], data)
                    continue
                poller.unregister(fd)
                os.close(copies.pop(fd))
                os.close(fd)
                pid = next(p for p, open_pipes in pipes.items() if fd in open_pipes)
                pipes[pid].discard(fd)
                report_ended(pid)
            elif fd in exits:
                pid = exits.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                ended[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                report_ended(pid)


def main() -> None:
    mode = sys.argv[1]
    if mode == "zygote":
        zygote()
    elif mode == "run":
        with open(sys.argv[2]) as f:
            run(json.load(f))
    else:
        reference(int(sys.argv[2]))


if __name__ == "__main__":
    main()
