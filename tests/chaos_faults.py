"""The chaos harness's faults and its model of the system (tests/chaos.py runs them).

`draw` picks a cycle's faults from the cycle's own seeded generator, so one cycle replays from (seed, cycle)
alone. `Model` holds what the history says is committed where (persistent steps, each host's own local steps,
the peer copies, the files the harness damaged) and predicts, by the resume rules of docs/multi-tier.md, the step
every process must resume from. `BucketProxy` stands between the job and the object store and misbehaves for a
window of requests (503s, dropped connections, truncated bodies, slow answers).
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gcs_emulator import answer_503, drop_connection, forward, free_port

from xla_tensorstore_ckpt.core import layout

WORLD = 4  # the job's processes, one per host; host h's local steps are also on host h + 2 (local_replication=2)

# Where a process may be killed or stopped: the event after which it happens, the phase it falls into.
MOMENTS = (
    ("save_started", None, "staging"),
    ("save_staged", None, "chunk writes"),
    ("save_written", "local", "local commit"),
    ("save_written", "persistent", "persistent commit"),
    ("save_committed", "local", "replication"),
    ("save_committed", "persistent", "retention deletes"),
    ("peer_copies_committed", None, "after replication"),
    ("retention_removed", None, "after retention"),
    ("restore_planned", None, "restore"),
    ("peer_fetched", None, "peer fetch"),
)
KINDS = {"kill": 30, "kill_job": 8, "stop": 6, "wipe": 10, "damage": 14, "bucket": 12, "disk_full": 6, "none": 14}
ALONE = ("kill_job", "stop", "disk_full")  # faults a job of one process does not draw (nothing waits for it)
PROCESS_FAULTS = ("kill", "kill_job", "stop")
BALLAST = "ballast"  # the file that fills a host's local file system (chaos_job.fill_file_system)
FAILS = "fails"  # a prediction: the resume fails on every process (the persistent step it must read is damaged)


@dataclass(frozen=True)
class Fault:
    kind: str
    details: dict = field(default_factory=dict)

    def describe(self) -> str:
        return self.kind + "".join(f" {k}={v}" for k, v in self.details.items())


def draw(rng: random.Random, store: str, world: int = WORLD) -> list[Fault]:
    """One cycle's faults: one kind, or two (at most one of which stops or kills processes)."""
    kinds = [k for k in KINDS if world > 1 or k not in ALONE]
    chosen = [rng.choices(kinds, [KINDS[k] for k in kinds])[0]]
    if rng.random() < 0.3:
        second = rng.choices(kinds, [KINDS[k] for k in kinds])[0]
        if second not in chosen and not (second in PROCESS_FAULTS and chosen[0] in PROCESS_FAULTS):
            chosen.append(second)
    faults = []
    for kind in sorted(set(chosen) - {"none"} if len(chosen) > 1 else chosen):
        if kind in PROCESS_FAULTS:
            event, tier, phase = rng.choice(MOMENTS)
            faults.append(Fault(kind, {"rank": rng.randrange(world), "event": event, "tier": tier, "phase": phase,
                                       "nth": rng.randint(1, 3)}))
        elif kind == "wipe":
            faults.append(Fault(kind, {"host": rng.randrange(world)}))
        elif kind == "damage":
            faults.append(Fault(kind, {"host": rng.randrange(world), "how": rng.choice(("flip", "truncate", "delete")),
                                       "where": rng.choice(("own", "copy", "persistent") if world > 1
                                                           else ("own", "persistent")),
                                       "pick": rng.random()}))
        elif kind == "bucket":
            faults.append(Fault(kind, {"how": rng.choice(("503", "reset", "truncate", "slow")),
                                       "start": rng.randrange(0, 120), "length": rng.randint(1, 12), "store": store}))
        elif kind == "disk_full":
            # From the start, or from the moment the host's own local step is written (its marker and the copy
            # of its peer's step it then receives meet the full disk: a peer transfer failing on one process).
            # "fsize": no file of the process grows past `bytes` (EFBIG); "enospc": the host's local tier, a file
            # system of its own, keeps only `bytes` free (ENOSPC for every write and directory; `Run` mounts it).
            at = rng.choice((None, "save_written", "save_committed"))
            faults.append(Fault(kind, {"rank": rng.randrange(world), "bytes": rng.choice((512, 4096, 16384)),
                                       "at": at, "nth": rng.randint(1, 3) if at else None,
                                       "how": rng.choice(("fsize", "enospc"))}))
        else:
            faults.append(Fault("none"))
    return faults


# ---------------------------------------------------------------------------------------------------- local files


def step_dirs(directory: str) -> dict[int, str]:
    """The committed steps of a local directory (a final name with its marker), by step."""
    out = {}
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if name.isdigit() and os.path.isfile(os.path.join(directory, name, layout.CHECKPOINT_METADATA)):
            out[int(name)] = os.path.join(directory, name)
    return out


def copy_dirs(host_dir: str) -> dict[tuple[int, int], str]:
    """The committed peer copies a host holds: (writer, step) -> directory."""
    base, out = os.path.join(host_dir, "peer_copies"), {}
    for writer in os.listdir(base) if os.path.isdir(base) else []:
        for name in os.listdir(os.path.join(base, writer)) if writer.isdigit() else []:
            if name.isdigit() and os.path.isfile(os.path.join(base, writer, name, "copy.json")):
                out[(int(writer), int(name))] = os.path.join(base, writer, name)
    return out


def partials(directory: str) -> list[str]:
    """Leftovers of saves or copies that never committed, anywhere under a local directory."""
    return sorted(os.path.join(d, n) for d, names, _ in os.walk(directory) for n in names
                  if layout.TMP_STEP_SUFFIX in n or ".partial-" in n)


def files_under(directory: str) -> list[str]:
    return sorted(os.path.join(d, n) for d, _, names in os.walk(directory) for n in names)


def spoiled(data: bytes, how: str) -> bytes | None:
    """`data` damaged as `how` says: a byte in the middle flipped, or cut in half; None: "delete"."""
    if how == "delete":
        return None
    if how == "truncate":
        return data[:len(data) // 2]
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0x5A]) + data[middle + 1:]


def damage_persistent(fault: Fault, store, model: Model) -> str | None:
    """Damage one object of the persistent tier's newest committed step (its markers aside: a step without them
    is not committed, which retention and resume already handle); the object's name, or None if there is none."""
    step = max(model.persistent, default=None)
    if step is None:
        return None
    marks = {f"{step}/{layout.CHECKPOINT_METADATA}", f"{step}/{layout.COMMIT_SUCCESS}"}
    names = sorted(n for n in store.objects() if n.startswith(f"{step}/") and n not in marks)
    if not names:
        return None
    name = names[int(fault.details["pick"] * len(names))]
    store.replace(name, spoiled(store.read(name), fault.details["how"]))
    model.damaged_persistent.add(step)
    return f"{store.root}/{name}"


def damage(fault: Fault, local_base: str, model: Model) -> str | None:
    """Damage one file of a host's newest own step or peer copy (flip a byte, truncate, delete); the file, or None
    if there is nothing to damage."""
    host_dir = os.path.join(local_base, f"host{fault.details['host']}")
    if fault.details["where"] == "own":
        targets = step_dirs(host_dir)
        key = max(targets, default=None)
    else:
        targets = copy_dirs(host_dir)
        key = max(targets, key=lambda ws: ws[1], default=None)
    if key is None:
        return None
    candidates = [f for f in files_under(targets[key]) if os.path.getsize(f) > 0]
    if not candidates:
        return None
    path = candidates[int(fault.details["pick"] * len(candidates))]
    with open(path, "rb") as f:
        data = spoiled(f.read(), fault.details["how"])
    if data is None:
        os.remove(path)
    else:
        with open(path, "wb") as f:
            f.write(data)
    if fault.details["where"] == "own":
        model.damaged_own[fault.details["host"]].add(key)
    else:
        model.damaged_copies[fault.details["host"]].add(key)
    return path


def wipe(host: int, local_base: str, model: Model) -> None:
    shutil.rmtree(os.path.join(local_base, f"host{host}"), ignore_errors=True)
    model.own[host] = set()
    model.damaged_own[host] = set()


# ---------------------------------------------------------------------------------------------------- the model


@dataclass
class Model:
    """What is committed where, by the history: persistent steps; each host's own local steps; the peer copies
    each holds ((writer, step), read back from disk each cycle); what the harness damaged."""

    world: int = WORLD
    persistent: set[int] = field(default_factory=set)
    own: list[set[int]] = field(init=False)
    copies: list[set[tuple[int, int]]] = field(init=False)
    damaged_own: list[set[int]] = field(init=False)
    damaged_copies: list[set[tuple[int, int]]] = field(init=False)
    damaged_persistent: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.own, self.copies = [set() for _ in range(self.world)], [set() for _ in range(self.world)]
        self.damaged_own, self.damaged_copies = [set() for _ in range(self.world)], [set() for _ in range(self.world)]

    def predict(self) -> set[int | str | None]:
        """The steps every process may resume from: the newest local step, at least as new as the newest persistent
        one, that every host can restore; else the newest persistent step; None if nothing is committed; FAILS if
        that persistent step is damaged (the last candidate: the restore must fail on every process, naming it).
        More than one where the harness damaged files: a damaged byte a restore never reads (an OCDBT data file
        holds superseded nodes too) harms nothing, so each damaged step or copy may count as whole or not."""
        damaged = [("own", h, s) for h, steps in enumerate(self.damaged_own) for s in steps]
        damaged += [("copy", h, k) for h, keys in enumerate(self.damaged_copies) for k in keys]
        damaged += [("persistent", -1, s) for s in self.damaged_persistent]
        if len(damaged) > 6:  # too many to enumerate: the two extremes
            choices = [damaged, []]
        else:
            choices = [[d for i, d in enumerate(damaged) if mask >> i & 1] for mask in range(1 << len(damaged))]
        out = set()
        for harmful in choices:
            out.add(self._predict({(h, s) for kind, h, s in harmful if kind == "own"},
                                  {(h, k) for kind, h, k in harmful if kind == "copy"},
                                  {s for kind, _, s in harmful if kind == "persistent"}))
        return out

    def _predict(self, damaged_own: set[tuple[int, int]], damaged_copies: set[tuple[int, tuple[int, int]]],
                 damaged_persistent: set[int]):
        def intact_for(host: int, step: int) -> bool:
            if step in self.own[host] and (host, step) not in damaged_own:
                return True
            holder = (host + self.world // 2) % self.world
            return (host, step) in self.copies[holder] and (holder, (host, step)) not in damaged_copies

        newest = max(self.persistent, default=None)
        listed = set().union(*self.own)  # a step no process lists is no candidate, whoever holds copies
        for step in sorted(listed, reverse=True):
            if newest is not None and step < newest:
                break
            if all(intact_for(h, step) for h in range(self.world)):
                return step
        return FAILS if newest in damaged_persistent else newest

    def learn(self, rank: int, event: dict) -> None:
        """One event a process reported, in its order."""
        kind, tier, step = event["event"], event["tier"], event["step"]
        if kind == "save_committed" and tier == "local":
            self.own[rank].add(step)
            self.damaged_own[rank].discard(step)  # a step saved again is whole again
        elif kind == "save_committed" and tier == "persistent":
            self.persistent.add(step)
            self.damaged_persistent.discard(step)
        elif kind == "retention_removed":
            removed = set(event["details"].get("steps", ()))
            if tier == "persistent":
                self.persistent -= removed
                self.damaged_persistent -= removed
            else:
                self.own[rank] -= removed
        elif kind == "peer_fetched":
            self.own[rank].add(step)
            self.damaged_own[rank].discard(step)

    def resumed(self, rank: int, step: int | None) -> None:
        """After a restore chose `step`: local steps newer than it are gone (all of them without a step)."""
        self.own[rank] = {s for s in self.own[rank] if step is not None and s <= step}
        self.damaged_own[rank] = {s for s in self.damaged_own[rank] if s in self.own[rank]}


# ---------------------------------------------------------------------------------------------------- the bucket


class BucketProxy:
    """An HTTP proxy on 127.0.0.1 in front of the object store (`upstream_port`). Requests are numbered from
    `arm`; those numbered in [start, start + length) fail as `how` says: "503", "reset" (the connection dropped
    unanswered), "truncate" (half the body, then the connection dropped), "slow" (answered after a pause)."""

    def __init__(self, upstream_port: int):
        self.upstream_port, self.port = upstream_port, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.lock = threading.Lock()
        self.window: dict | None = None
        self.count = 0
        self.injected = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                how = proxy.next_fault()
                if how == "reset":
                    drop_connection(self)
                    return
                if how == "503":
                    answer_503(self)
                    return
                if how == "slow":
                    time.sleep(0.3)  # the fault itself: a slow answer (nothing waits on it)
                _, data = forward(self, proxy.upstream_port, body)
                if how == "truncate" and len(data) > 1:
                    self.wfile.write(data[:len(data) // 2])
                    self.wfile.flush()
                    drop_connection(self)
                    return
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):  # a client that gave up on a faulty answer
                pass

        self.server = Server(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def arm(self, window: dict | None) -> None:
        with self.lock:
            self.window, self.count = window, 0

    def next_fault(self) -> str | None:
        with self.lock:
            self.count += 1
            w = self.window
            if w is not None and w["start"] <= self.count < w["start"] + w["length"]:
                self.injected += 1
                return w["how"]
            return None

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
