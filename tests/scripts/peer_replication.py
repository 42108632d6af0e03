"""One process of a simulated four-host job with a local tier per host replicated to one peer
(``local_replication=2``: host h's steps are also held by host h + 2 mod 4). Gloo on 127.0.0.1; RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT in the environment. The rows a process holds follow its host, as devices do on a pod.

usage: peer_replication.py save ROOT LOCAL_BASE [KILL_HOST]
           saves steps 1-3 (persistent every 2, local every step) and waits for the replication; with KILL_HOST,
           that host's process kills itself in the replication of step 3, when the copy it received is about to
           commit (the others then fail that step's replication)
       peer_replication.py restore ROOT LOCAL_BASE
           restore("latest"), every value checked against its step
With XTC_LAYOUT=dp, host h holds row shard h % 2 of two (data-parallel replicas: 0 and 2, 1 and 3).
Rank r runs on host XTC_HOSTS[r] (a comma-separated list; default 0,1,2,3), whose local tier is
LOCAL_BASE/host<HOST>. With XTC_PIECE_BYTES=n, files travel between peers in pieces of n bytes, two per round
(many rounds, two in flight). With XTC_UNREADABLE=s, a sender cannot read the files it sends whose path contains
s (as if they vanished after they were listed). With XTC_FSIZE=h:n, host h cannot write files past n bytes (its
disk full, as far as its writes go), from the start or, with XTC_FSIZE_FROM=s, from the moment the replication
of step s starts moving files (its own step s is committed: the copy of its peer's step s cannot be written). With
XTC_UNLISTABLE=h, host h cannot list the files of its local steps when it is to send them (as if they vanished
after the holdings were gathered). With XTC_INCREMENTAL=1, the manager saves incremental steps and the model
has a frozen weight (64 KiB per host) beside "w", the same at every step: steps 2 and 3 reference step 1's
chunks of it. Prints one JSON line: {"rank", "host", ...}.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import sys
import warnings

import torch
from multitier import Loader  # this directory's: the same data loader as the two-host tests

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt.checkpoint_manager import peer_copies
from xla_tensorstore_ckpt.core import tunables

HOSTS, ROWS, COLUMNS = 4, 16, 32
SHARD = (ROWS, COLUMNS)
FROZEN_ROWS = 32 * ROWS  # XTC_INCREMENTAL: a frozen weight 32x "w"'s size, as a fine-tune's base outweighs its adapters


def shards() -> int:
    """XTC_LAYOUT=dp: data-parallel replicas, DP=2 x FSDP=2: host h holds row shard h % 2 of two (hosts 0 and 2
    alike). Read per run, not at import: one forking server serves every layout (tests/forked.py)."""
    return 2 if os.environ.get("XTC_LAYOUT") == "dp" else HOSTS


def global_value(step: int) -> torch.Tensor:
    return torch.randn((shards() * ROWS, COLUMNS), generator=torch.Generator().manual_seed(step))


def incremental() -> bool:
    return os.environ.get("XTC_INCREMENTAL") == "1"


def frozen_value() -> torch.Tensor:
    return torch.randn((shards() * FROZEN_ROWS, COLUMNS), generator=torch.Generator().manual_seed(12345))


def model_for(step: int | None, host: int) -> dict:
    shard = host % shards()
    index = ((shard * ROWS, (shard + 1) * ROWS), (0, COLUMNS))
    frozen = ((shard * FROZEN_ROWS, (shard + 1) * FROZEN_ROWS), (0, COLUMNS))
    if step is None:
        model = {"w": xtc.ShardedArray.target((shards() * ROWS, COLUMNS), torch.float32, SHARD, [index])}
        if incremental():
            model["frozen"] = xtc.ShardedArray.target((shards() * FROZEN_ROWS, COLUMNS), torch.float32,
                                                      (FROZEN_ROWS, COLUMNS), [frozen])
        return model
    model = {"w": xtc.ShardedArray.from_tensor(global_value(step), SHARD, [index])}
    if incremental():
        model["frozen"] = xtc.ShardedArray.from_tensor(frozen_value(), (FROZEN_ROWS, COLUMNS), [frozen])
    return model


def kill_before_committing_step(step: int) -> None:
    """Die (SIGKILL) when this process is about to commit a peer copy of `step` it received: as it renames the
    copy's directory, whose marker names the step, into place (`os.rename`, the system call, is what is
    replaced)."""
    rename = os.rename

    def dying(source, target, *args, **kwargs):
        marker = os.path.join(source, peer_copies.on_disk.COPY_MARKER)
        if os.path.isfile(marker):
            with open(marker) as f:
                if json.load(f)["step"] == step:
                    os.kill(os.getpid(), signal.SIGKILL)
        return rename(source, target, *args, **kwargs)

    os.rename = dying


def main() -> None:
    if os.environ.get("XTC_PIECE_BYTES"):
        piece = int(os.environ["XTC_PIECE_BYTES"])
        tunables.overridden(peer_piece_bytes=piece, peer_round_bytes=4 * piece).__enter__()  # for the process
    if os.environ.get("XTC_UNREADABLE"):
        readable = peer_copies.file_transfer._read_piece
        peer_copies.file_transfer._read_piece = lambda path, start, out: (
            os.environ["XTC_UNREADABLE"] not in path and readable(path, start, out))
    mode, root, local_base = sys.argv[1], sys.argv[2], sys.argv[3]
    kill_host = int(sys.argv[4]) if len(sys.argv) > 4 else None
    rank = int(os.environ["RANK"])
    host = int(os.environ.get("XTC_HOSTS", "0,1,2,3").split(",")[rank])
    events: list[dict] = []
    if os.environ.get("XTC_UNLISTABLE") == str(host):
        def unlistable(directory, writer, step):
            raise PermissionError(13, "Permission denied", directory)

        peer_copies.on_disk.list_files = unlistable
    def fill_disk() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(os.environ["XTC_FSIZE"].split(":")[1]), resource.RLIM_INFINITY))

    full_from = int(os.environ["XTC_FSIZE_FROM"]) if os.environ.get("XTC_FSIZE_FROM") else None
    if os.environ.get("XTC_FSIZE", "").startswith(f"{host}:"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit then fail with EFBIG
        if full_from is None:
            fill_disk()

    fills_later = os.environ.get("XTC_FSIZE", "").startswith(f"{host}:") and full_from is not None

    def listen(event) -> None:
        if fills_later and event.kind == "peer_copies_started" and event.step == full_from:
            fill_disk()  # the replication of that step starts moving files
        events.append({"kind": event.kind, "tier": event.tier, "step": event.step, "nbytes": event.nbytes,
                       "details": event.details})

    logs: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("xla_tensorstore_ckpt").addHandler(handler)
    logging.getLogger("xla_tensorstore_ckpt").setLevel(logging.INFO)
    options = xtc.CheckpointManagerOptions(
        save_interval_steps=2, max_to_keep=2, local_directory=os.path.join(local_base, f"host{host}"),
        local_save_interval_steps=1, local_max_to_keep=2, local_replication=2, coordination_timeout_s=120,
        listeners=(listen,), incremental=incremental())
    manager = xtc.CheckpointManager(root, options)
    out: dict = {"rank": rank, "host": host}
    if mode == "save":
        if kill_host == host:
            kill_before_committing_step(3)
        try:
            for step in (1, 2, 3):
                torch.manual_seed(100 * step + host)
                manager.save(step, model=model_for(step, host), data_loader=Loader(10 * step))
            manager.wait_until_finished()
            out["error"] = None
        except xtc.CheckpointError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        out.update(local=manager.all_steps("local"), persistent=manager.all_steps("persistent"))
    else:
        model, loader = model_for(None, host), Loader()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = manager.restore("latest", model=model, data_loader=loader)
        (index, data), = model["w"].shards
        expected = global_value(step)[index[0][0]:index[0][1]]
        equal = bool(torch.equal(data, expected))
        if incremental():
            (index, data), = model["frozen"].shards
            equal = equal and bool(torch.equal(data, frozen_value()[index[0][0]:index[0][1]]))
        out.update(step=step, equal=equal, position=loader.position,
                   draw=torch.rand(1).item(), warnings=[str(w.message) for w in caught])
    out.update(logs=logs, events=[e for e in events if e["kind"] != "save_started"])
    try:
        manager.close()
    except xtc.CheckpointError as exc:
        out["close_error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
