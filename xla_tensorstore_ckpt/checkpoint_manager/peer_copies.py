"""Copies of each process's local steps on peer processes (``CheckpointManagerOptions(local_replication=k)``), so
that a host that lost its local disk resumes from its peers instead of the persistent tier.

After a local step commits on every process, each process sends the files of its step directory to its k - 1
peers (`peers_of`: other failure domains), who write them under ``<local root>/peer_copies/<writer>/`` and
commit each copy on their own: a temporary directory, then ``copy.json`` (the writer, the step, every file's
size and CRC32C) and a rename into place, so a copy cut short by a crash never looks committed. The copies
travel on a background thread of their own (`PeerReplicator`), over a gloo group of their own, in rounds of at
most ``peer_round_bytes`` (`tunables`) per process, the next round read and started while the one before is in flight.

At a restart (`resume`), a process whose local tier lacks the chosen step fetches its own index's step from a
process that holds it (a peer copy, or the step itself) and commits it into its local tier first
(`PeerCopies.fetch`); a process that finds its step damaged fetches the files that differ from a peer copy and
the job tries the step again (`repair`). Files only: the bytes are the writer's, verified against the copy's
CRC32C by the receiver before it commits anything.

Everything here needs the local tier on a file system (a local SSD or RAM disk); the collectives are called by
every process in the same order and block.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import crc32c
import numpy as np

from .. import targets
from ..arrays.local_reads import read_runs
from ..core import layout, tunables
from ..core.errors import CoordinationError, CorruptCheckpointError, StorageError, UsageError
from ..multihost.distributed import Coordinator, Exchange
from ..saves.async_save import BackgroundCommitter
from ..saves.save_plan import SavePlan
from ..storage.local import fsync_path, is_regular

COPIES_DIR = "peer_copies"  # under the local root; not a step name, so the local tier's scans pass it by
COPY_MARKER = "copy.json"
_PARTIAL = ".partial-"
_WRITER = re.compile(r"[0-9]+")  # a writer's directory of copies (ASCII digits: "²".isdigit() holds)
log = logging.getLogger("xla_tensorstore_ckpt")
# ``peer_round_bytes`` (`tunables`): file bytes per round of a process that sends one transfer and receives one
# (half for each; a process in more transfers holds half of it for each). Two rounds are in flight at once, so
# reading, sending and writing overlap (one 64 MiB round took 19 ms to read, 63 ms to travel and 30 ms to write
# and check, one after another). ``peer_piece_bytes``: the largest piece a round is cut into.


@dataclass(frozen=True)
class StepFiles:
    """The files of one step directory: relative paths, sizes and (where known) CRC32Cs, in path order."""

    writer: int
    step: int
    files: tuple[tuple[str, int], ...]
    crcs: tuple[int, ...] | None = None
    shared: tuple[tuple[str, int], ...] = ()  # (item, process): items not copied, held identical by that process

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.files)


# ----------------------------------------------------------------------------------------- placement

def peers_of(process: int, count: int, k: int, domain: Callable[[int], Hashable] | None = None) -> list[int]:
    """The k - 1 processes that hold copies of `process`'s local steps: by default ``process + j * count // k``
    (mod count) for j = 1 .. k - 1, the processes farthest from it in index order (whole slices, racks or pods
    apart when indices follow the topology); with `domain` (process index -> failure domain), the first
    processes after it in index order whose domains differ from its own and from each other's. Raises
    `UsageError` if there are not enough."""
    if k <= 1:
        return []
    if k > count:
        raise UsageError(f"local_replication={k} needs at least {k} processes (the job has {count})")
    if domain is None:
        peers = [(process + j * count // k) % count for j in range(1, k)]
        return list(dict.fromkeys(peers))
    used, peers = {domain(process)}, []
    for offset in range(1, count):
        other = (process + offset) % count
        if domain(other) not in used:
            used.add(domain(other))
            peers.append(other)
            if len(peers) == k - 1:
                return peers
    raise UsageError(f"local_replication={k}: process {process} finds only {len(peers)} processes in other failure "
                     f"domains than its own ({domain(process)!r}); {k - 1} are needed")


# ------------------------------------------------------------------------------------ de-duplication

def item_keys(plans: Mapping[str, SavePlan], per_process: Collection[str]) -> dict[str, str]:
    """For each item of a local step (`plans`: its save plans) that can be shared with a data-parallel replica:
    a digest of which regions of which arrays this process wrote. Only items whose arrays are all global
    (SPMD-sharded or replicated XLA tensors, DTensors, `ShardedArray`s) qualify, not `per_process` ones (the generator
    states: one row per process, alike in shape only): two processes writing the same regions of the same
    global arrays wrote the same values, the invariant the persistent tier's one writer per shard rests on."""
    keys = {}
    for name, plan in plans.items():
        if name in per_process or not plan.arrays or not all(targets.is_global(a.layout) for a in plan.arrays):
            continue
        regions = sorted((repr(a.key_path), sorted(w.region for w in a.writes)) for a in plan.arrays)
        keys[name] = hashlib.sha256(repr(regions).encode()).hexdigest()
    return keys


def _file_crc(path: str) -> int | None:
    if not os.path.isfile(path):
        return None
    return file_crcs(os.path.dirname(path), [(os.path.basename(path), os.path.getsize(path))])[0]


# -------------------------------------------------------------------------------------- files on disk

def copies_root(local_root: str) -> str:
    return os.path.join(local_root, COPIES_DIR)


def copy_dir(local_root: str, writer: int, step_name: str) -> str:
    return os.path.join(copies_root(local_root), str(writer), step_name)


def list_files(directory: str, writer: int, step: int) -> StepFiles:
    """The files under `directory` (a committed step), sizes from the file system."""
    out = []
    for parent, dirs, names in os.walk(directory):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(parent, name)
            out.append((os.path.relpath(path, directory), os.path.getsize(path)))
    return StepFiles(writer, step, tuple(sorted(out)))


def read_copy(directory: str) -> StepFiles | None:
    """The manifest of a committed peer copy, or None if `directory` holds none (absent, partial, unreadable):
    a damaged marker (one naming a file outside the copy, say, or a FIFO in its place) is logged and the copy
    treated as absent, so a resume falls back to another copy or tier."""
    marker = os.path.join(directory, COPY_MARKER)
    try:
        if not is_regular(marker):
            return None
        with open(marker, "rb") as f:
            manifest = _from_record(json.loads(f.read()), marker)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring the peer copy in %s: %s", directory, str(exc)[:500])
        return None
    return manifest if manifest.crcs is not None else None


def _record(manifest: StepFiles) -> dict:
    """A manifest as JSON: a copy's marker, and what a fetch sends its receiver (CRC32Cs null where unknown)."""
    crcs = manifest.crcs if manifest.crcs is not None else [None] * len(manifest.files)
    return {"writer": manifest.writer, "step": manifest.step,
            "files": [[path, size, crc] for (path, size), crc in zip(manifest.files, crcs)],
            "shared": [list(entry) for entry in manifest.shared]}


def _from_record(record: dict, where: str) -> StepFiles:
    """Raises KeyError, TypeError or ValueError if `record` (from `where`) is not one: `CorruptCheckpointError`
    for a file or item name that would lie outside the step (`layout.relative_path`)."""
    crcs = [crc for _, _, crc in record["files"]]
    files = tuple((layout.relative_path(path, where=where, what="file"), int(size))
                  for path, size, _ in record["files"])
    shared = tuple((layout.relative_path(item, where=where, what="item", single=True), int(process))
                   for item, process in record.get("shared", []))
    return StepFiles(int(record["writer"]), int(record["step"]), files,
                     None if None in crcs else tuple(int(crc) for crc in crcs), shared)


def held_copies(local_root: str,
                step_of: Callable[[str], int | None]) -> dict[tuple[int, int], tuple[str, StepFiles]]:
    """The committed peer copies this process holds: (writer, step) -> (directory, manifest). Removes partial
    ones (a copy cut short). `step_of` parses a step directory's name."""
    held: dict[tuple[int, int], tuple[str, StepFiles]] = {}
    base = copies_root(local_root)
    for writer in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        if _PARTIAL in writer:  # a fetch cut short
            shutil.rmtree(os.path.join(base, writer), ignore_errors=True)
        if not _WRITER.fullmatch(writer) or not os.path.isdir(os.path.join(base, writer)):
            continue
        for name in sorted(os.listdir(os.path.join(base, writer))):
            directory = os.path.join(base, writer, name)
            if _PARTIAL in name:
                shutil.rmtree(directory, ignore_errors=True)
                continue
            step = step_of(name)
            manifest = read_copy(directory)
            if step is not None and manifest is not None and manifest.step == step:
                held[(int(writer), step)] = (directory, manifest)
    return held


def file_crcs(directory: str, files: Sequence[tuple[str, int]]) -> list[int | None]:
    """The CRC32C of each file under `directory` (None where it is missing or has another size)."""
    out: list[int | None] = []
    for path, size in files:
        full = os.path.join(directory, path)
        if not os.path.isfile(full) or os.path.getsize(full) != size:
            out.append(None)
            continue
        crc = 0
        with open(full, "rb") as f:
            while block := f.read(tunables.get("peer_piece_bytes")):
                crc = crc32c.crc32c(block, crc)
        out.append(crc)
    return out


def _sync_tree(directory: str) -> None:
    for parent, _, names in os.walk(directory):
        for name in names:
            fsync_path(os.path.join(parent, name))


def _commit_dir(partial: str, final: str, manifest: StepFiles | None, *, fsync: bool = True) -> None:
    """Sync the files of `partial`, write the copy marker (if `manifest`), rename it to `final` (replacing what
    is there) and sync the rename; without `fsync`, neither the files nor the rename are synced (a directory's
    fsync commits the file system's journal, which waits for every dirty page of the files it names: right after
    a save's replication, 55-110 ms for a 64 MiB fetch here)."""
    if fsync:
        _sync_tree(partial)
    if manifest is not None:
        with open(os.path.join(partial, COPY_MARKER), "w") as f:
            json.dump(_record(manifest), f)
            f.flush()
            os.fsync(f.fileno())
    if os.path.exists(final):
        shutil.rmtree(final)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    os.rename(partial, final)
    if fsync:
        fsync_path(os.path.dirname(final))


# ------------------------------------------------------------------------------------------ transfers

@dataclass(frozen=True)
class Transfer:
    """Files of one directory going from `source` to `target`."""

    source: int
    target: int
    files: StepFiles
    paths: tuple[str, ...]  # which of the files travel


def _pieces(transfer: Transfer) -> list[tuple[str, int, int]]:
    sizes = dict(transfer.files.files)
    piece = tunables.get("peer_piece_bytes")
    return [(path, start, min(piece, sizes[path] - start)) for path in transfer.paths
            for start in range(0, max(sizes[path], 1), piece)]


def _rounds(pieces: list[tuple[str, int, int]], budget: int) -> list[list[tuple[str, int, int]]]:
    rounds: list[list[tuple[str, int, int]]] = [[]]
    held = 0
    for piece in pieces:
        if rounds[-1] and held + piece[2] > budget:
            rounds.append([])
            held = 0
        rounds[-1].append(piece)
        held += piece[2]
    return rounds


_DAMAGED = -1  # the CRC32C recorded for a file its source could not read whole


def _read_piece(path: str, start: int, out: np.ndarray) -> bool:
    """Fill `out` with the bytes of `path` from `start`; False if the file is missing or shorter."""
    try:
        read_runs(path, [(start, memoryview(out))], path)
    except (StorageError, CorruptCheckpointError):
        return False
    return True


class _Buffers:
    """Two areas the rounds' pieces are cut from, one per round in flight: a transfer touches fresh memory for
    two rounds, not for every byte it moves. The areas are kept for the next transfer (`_kept_areas`, up to
    ``peer_round_bytes`` each): a resume's fetch comes right after the process starts, and faulting in fresh areas then
    was a fifth of a 64 MiB fetch here."""

    def __init__(self) -> None:
        with _kept_lock:
            self._areas: list[np.ndarray] = [_kept_areas.pop() if _kept_areas else np.empty(0, np.uint8)
                                             for _ in range(2)]
        self._used = [0, 0]

    def reset(self, number: int, nbytes: int) -> None:
        """Round `number` (the area of the round two before it is free again) needs `nbytes`."""
        if self._areas[number % 2].size < nbytes:
            self._areas[number % 2] = np.empty(nbytes, np.uint8)
        self._used[number % 2] = 0

    def take(self, number: int, nbytes: int) -> np.ndarray:
        used = self._used[number % 2]
        self._used[number % 2] = used + nbytes
        return self._areas[number % 2][used:used + nbytes]

    def close(self) -> None:
        """Give the areas back for the next transfer (once nothing is in flight in them)."""
        with _kept_lock:
            for area in self._areas:
                if 0 < area.size <= tunables.get("peer_round_bytes") and len(_kept_areas) < 2:
                    _kept_areas.append(area)
        self._areas = []


_kept_areas: list[np.ndarray] = []
_kept_lock = threading.Lock()


def transfer(coordinator: Coordinator, transfers: Sequence[Transfer], source_dirs: Mapping[int, str],
             target_dirs: Mapping[int, str], what: str) -> tuple[dict[int, list[int]], StorageError | None]:
    """Move the files of every transfer (the same list on every process): this process reads those it is the
    source of from ``source_dirs[i]`` (i: the transfer's position) and writes those it is the target of under
    ``target_dirs[i]``, in rounds of at most ``peer_round_bytes`` (`tunables`) per process, two in flight. Returns,
    per transfer this process took part in, the CRC32C of each of its files as written (target) or read (source;
    only for a transfer without recorded CRC32Cs, whose receiver checks against the sender's, and 0 otherwise); and the
    `StorageError` of the first file this process could not write, or None (such a file is marked damaged, and
    every round is still received: the caller raises the error once its peers no longer wait for this process).
    Collective: every process calls it with the same `transfers`. Raises `CoordinationError` naming a peer that
    dies meanwhile."""
    me = coordinator.index
    # Every process knows every transfer, so all count the same rounds without asking each other.
    round_bytes = max(tunables.get("peer_piece_bytes"), tunables.get("peer_round_bytes") // 2)
    everyone = [(i, t, _rounds(_pieces(t), round_bytes)) for i, t in enumerate(transfers)]
    plans = [(i, t, rounds) for i, t, rounds in everyone if me in (t.source, t.target)]
    crcs: dict[int, dict[str, int]] = {i: {} for i, _, _ in plans}
    files = _Landing(target_dirs, crcs, what, {i: t.source for i, t, _ in plans})
    buffers = _Buffers()

    def start(number: int) -> tuple[Exchange, list[tuple[int, str, int, np.ndarray]]]:
        sends: dict[int, list[np.ndarray]] = {}
        receives: dict[int, list[np.ndarray]] = {}
        landing: list[tuple[int, str, int, np.ndarray]] = []
        buffers.reset(number, sum(length for _, _, rounds in plans if number < len(rounds)
                                  for _, _, length in rounds[number]))
        for i, t, rounds in plans:
            if number >= len(rounds):
                continue
            for path, at, length in rounds[number]:
                buffer = buffers.take(number, length)
                if t.source == me:
                    read = _read_piece(os.path.join(source_dirs[i], path), at, buffer)
                    if not read:
                        # A piece that could not be read still travels (the peer expects it), as zeros marked
                        # damaged: the receiver then refuses the file instead of waiting for it.
                        buffer[:] = 0
                    sends.setdefault(t.target, []).append(buffer)
                    if t.files.crcs is None:  # else the receiver checks against the recorded ones
                        crcs[i][path] = _DAMAGED if not read or crcs[i].get(path) == _DAMAGED else \
                            crc32c.crc32c(buffer, crcs[i].get(path, 0))
                else:
                    receives.setdefault(t.source, []).append(buffer)
                    landing.append((i, path, at, buffer))
        return coordinator.start_exchange(sends, receives, lambda peer: f"files of {what}"), landing

    count = max((len(rounds) for _, _, rounds in everyone), default=0)
    following = None
    try:
        current = start(0) if count else None
        for number in range(count):
            following = start(number + 1) if number + 1 < count else None
            exchange, landing = current
            exchange.wait()
            files.write(landing)
            current, following = following, None
    except Exception:
        # Messages of the round already started would pair up with the next transfer's on this group: wait for
        # them before raising. The error raised is the first one; a peer that died fails this wait as well.
        if following is not None:
            try:
                following[0].wait()
            except CoordinationError:
                pass
        raise
    finally:
        files.close()
    buffers.close()  # not after an error: a message of the failed round may still arrive in them
    return {i: [crcs[i].get(path, 0) for path in transfers[i].paths] for i in crcs}, files.error


class _Landing:
    """The files a transfer writes on its target, open until the last round, with the CRC32C of what was
    written so far. A file that cannot be written (a full disk) is given up, marked damaged, and the first such
    error kept in `error`: the transfer goes on receiving, since its senders would otherwise wait for it."""

    def __init__(self, target_dirs: Mapping[int, str], crcs: dict[int, dict[str, int]], what: str,
                 sources: Mapping[int, int]):
        self._dirs, self._crcs, self._what, self._sources = target_dirs, crcs, what, sources
        self._handles: dict[tuple[int, str], Any] = {}
        self._failed: set[tuple[int, str]] = set()
        self.error: StorageError | None = None

    def write(self, landing: list[tuple[int, str, int, np.ndarray]]) -> None:
        """Write the pieces of a round (an empty file comes as one empty piece, which creates it)."""
        for i, path, at, buffer in landing:
            if (i, path) in self._failed:
                continue
            try:
                handle = self._handles.get((i, path)) or self._open(i, path)
                handle.seek(at)
                handle.write(buffer)
            except OSError as exc:
                self._fail(i, path, exc)
                continue
            self._crcs[i][path] = crc32c.crc32c(buffer, self._crcs[i].get(path, 0))

    def close(self) -> None:
        for (i, path), handle in self._handles.items():
            try:
                handle.close()
            except OSError as exc:
                self._fail(i, path, exc)

    def _open(self, i: int, path: str) -> Any:
        full = os.path.join(self._dirs[i], path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        handle = self._handles[(i, path)] = open(full, "wb")  # noqa: SIM115 - closed by close(), after the last round
        return handle

    def _fail(self, i: int, path: str, exc: OSError) -> None:
        self._failed.add((i, path))
        self._crcs[i][path] = _DAMAGED
        if self.error is None:
            self.error = StorageError(f"could not write {os.path.join(self._dirs[i], path)} of {self._what} "
                                      f"received from process {self._sources[i]}: {exc}")


# ------------------------------------------------------------------------------------- replication

class PeerReplicator:
    """Sends each committed local step of this process to its peers and commits the copies it receives, on a
    background thread of its own, in the order the steps were committed (the same on every process: whether a
    step is due for the local tier depends only on the step). Errors are kept and raised by `check` / `close`
    like those of a background save."""

    def __init__(self, coordinator: Coordinator, local_root: str, k: int,
                 domain: Callable[[int], Hashable] | None, keep: int | None,
                 on_committed: Callable[[int, dict[int, list[int]], int, int], None]):
        self._coordinator, self._root, self._keep = coordinator, local_root, keep
        self._domain = domain or (lambda process: process)
        self._peers = {p: peers_of(p, coordinator.count, k, domain) for p in range(coordinator.count)}
        self._on_committed = on_committed
        self._committer = BackgroundCommitter(max_pending=1 << 30)

    def replicate(self, step: int, step_name: str, directory: str | None, keys: Mapping[str, str]) -> None:
        """Queue the replication of `step` (`directory`: this process's committed step, or None if its commit
        failed here: the others still take part, and nothing of this process is copied; `keys`: `item_keys`
        of its plans). Does not block."""
        self._committer.defer(f"replicating step {step} of the local tier {self._root} to peers", step,
                              lambda: self._replicate(step, step_name, directory, keys))

    def _sharers(self, writer: int, everyone: Sequence) -> dict[str, int]:
        """The items of `writer`'s step that another process, in another failure domain, holds identical (the
        same item key and metadata files): item -> the first such process after it in index order."""
        count = len(everyone)
        shared = {}
        for item, key in everyone[writer][1].items():
            for offset in range(1, count):
                other = (writer + offset) % count
                if everyone[other] is not None and everyone[other][1].get(item) == key and \
                        self._domain(other) != self._domain(writer):
                    shared[item] = other
                    break
        return shared

    def _replicate(self, step: int, step_name: str, directory: str | None, keys: Mapping[str, str]) -> None:
        c = self._coordinator
        mine = None
        if directory is not None:
            mine = (list_files(directory, c.index, step),
                    {item: (key, _file_crc(os.path.join(directory, item, "_METADATA")),
                            _file_crc(os.path.join(directory, item, "_strings.json"))) for item, key in keys.items()})
        everyone = c.all_gather(mine, f"listing the files of step {step} to copy")
        transfers = []
        for writer, entry in enumerate(everyone):
            if entry is None:
                continue
            shared = self._sharers(writer, everyone)
            sent = tuple((path, size) for path, size in entry[0].files if path.split("/", 1)[0] not in shared)
            files = StepFiles(writer, step, sent, shared=tuple(sorted(shared.items())))
            paths = tuple(path for path, _ in sent)
            transfers += [Transfer(writer, peer, files, paths) for peer in self._peers[writer]]
        partials = {i: copy_dir(self._root, t.source, step_name) + f"{_PARTIAL}{time.time_ns()}"
                    for i, t in enumerate(transfers) if t.target == c.index}
        sources = {i: directory for i, t in enumerate(transfers) if t.source == c.index}
        crcs_of, unwritten = transfer(c, transfers, sources, partials, f"step {step}")
        # Each writer tells its receivers the CRC32Cs of what it read; a copy commits only if they match.
        truth = c.all_gather({i: crcs for i, crcs in crcs_of.items() if transfers[i].source == c.index},
                             f"checking the copies of step {step}")
        committed: list[int] = []
        for i in partials:
            t, crcs = transfers[i], crcs_of[i]
            if crcs != truth[t.source][i] or _DAMAGED in crcs:
                shutil.rmtree(partials[i], ignore_errors=True)
                continue
            manifest = StepFiles(t.source, step, t.files.files, tuple(crcs), t.files.shared)
            try:
                _commit_dir(partials[i], copy_dir(self._root, t.source, step_name), manifest)
            except OSError as exc:  # raised below, once the step's last collective no longer waits for us
                shutil.rmtree(partials[i], ignore_errors=True)
                unwritten = unwritten or StorageError(f"could not commit the copy of step {step} of process "
                                                      f"{t.source} in {partials[i]}: {exc}")
                continue
            committed.append(t.source)
        # The copies each process committed, and why it could not write one (a full disk): a failure on one
        # process is raised on every process, not only where it happened (the others would carry on unaware).
        failure = None if unwritten is None else f"{type(unwritten).__name__}: {unwritten}"
        holders = c.all_gather((committed, failure), f"committing the copies of step {step}")
        held_by: dict[int, list[int]] = {}
        for holder, (writers, _) in enumerate(holders):
            for writer in writers:
                held_by.setdefault(writer, []).append(holder)
        self._retain()
        self._on_committed(step, held_by, sum(t.files.nbytes for t in transfers if t.source == c.index),
                           sum(transfers[i].files.nbytes for i in partials))
        if unwritten is not None:  # raised once every collective of this step is behind us
            raise unwritten
        for process, (_, status) in enumerate(holders):
            if status is not None:
                raise CoordinationError(f"replicating step {step} to peers failed on process {process}: {status}",
                                        process=process)

    def _retain(self) -> None:
        """Keep the newest `keep` copies of each writer (the local tier's count)."""
        if self._keep is None:
            return
        base = copies_root(self._root)
        for writer in os.listdir(base) if os.path.isdir(base) else []:
            if not os.path.isdir(os.path.join(base, writer)):
                continue
            entries = []
            for name in os.listdir(os.path.join(base, writer)):
                manifest = read_copy(os.path.join(base, writer, name))
                if manifest is not None:
                    entries.append((manifest.step, name))
            for _, name in sorted(entries)[:-self._keep]:
                shutil.rmtree(os.path.join(base, writer, name), ignore_errors=True)

    def defer(self, what: str, step: int, work: Callable[[], None]) -> None:
        """Run `work` on the replication thread after the replications queued so far (the local tier's retention
        deletes: never under a replication still reading the step). Does not block."""
        self._committer.defer(what, step, work)

    @property
    def coordinator(self) -> Coordinator:
        """The group the copies travel on."""
        return self._coordinator

    def check(self) -> None:
        self._committer.check()

    def wait(self) -> None:
        self._committer.wait()

    def close(self) -> None:
        """Finish the queued replications (raising their first error), then release the group."""
        try:
            self._committer.close()
        finally:
            self._coordinator.close()


# ------------------------------------------------------------------------------------------- resuming

@dataclass(frozen=True)
class Holdings:
    """What one process has for a resume: its own committed local steps (step, writer) and the committed peer
    copies it holds, (writer, step) -> the items the copy left out, each with the process whose own step holds
    it identical (not the copies' file lists: every process receives every process's holdings, and a list can
    have thousands of files)."""

    own: frozenset[tuple[int, int]]
    copies: Mapping[tuple[int, int], tuple[tuple[str, int], ...]] = field(default_factory=dict)


def source_of(everyone: Sequence[Holdings], process: int, step: int, writer: int) -> int | None:
    """A process other than `process` that holds `writer`'s step `step`: one with a committed peer copy first
    (verifiable: its marker has every file's CRC32C) whose shared items' holders still have their own step,
    else one whose own step was written by `writer` (a job restarted with other indices). None if there is
    none."""
    for holder, held in enumerate(everyone):
        if holder != process and _copy_usable(everyone, process, step, held.copies.get((writer, step))):
            return holder
    for holder, held in enumerate(everyone):
        if holder != process and (step, writer) in held.own:
            return holder
    return None


def _item_of(listing: StepFiles, item: str) -> tuple[tuple[str, int], ...]:
    """The files of `item` (paths and sizes) in a step directory's `listing`."""
    return tuple(f for f in listing.files if f[0].startswith(item + "/"))


def _copy_usable(everyone: Sequence[Holdings], process: int, step: int,
                 shared: tuple[tuple[str, int], ...] | None) -> bool:
    """Whether a held copy (`shared`: the items it left out and their holders; None: no copy) can serve `process`:
    every left-out item's holder is another process that still has its own step."""
    return shared is not None and all(q != process and (step, q) in everyone[q].own for _, q in shared)


class PeerCopies:
    """The peer copies in this process's local tier at `local_root`, for resuming (`resume`): what it holds,
    and the collectives that bring a missing or damaged step from peers."""

    def __init__(self, local_root: str, step_of: Callable[[str], int | None]):
        self.root, self._step_of = local_root, step_of

    def held(self) -> dict[tuple[int, int], tuple[str, StepFiles]]:
        """The committed copies here, (writer, step) -> (directory, manifest); partial ones removed."""
        return held_copies(self.root, self._step_of)

    def holdings(self, own: frozenset[tuple[int, int]]) -> Holdings:
        return Holdings(own, {key: manifest.shared for key, (_, manifest) in self.held().items()})

    def fetch(self, coordinator: Coordinator, step: int, step_name: str, own_writer: Mapping[int, int],
              sources: Mapping[int, int], holdings: Sequence[Holdings]) -> int:
        """Every process `t` of `sources` receives the step `step` of writer `t` from ``sources[t]`` (and the items
        its copy left out from the processes holding them identical) and commits it as its local step
        ``step_name`` (a temporary directory renamed into place; a crash leaves only a partial directory, removed
        later). `own_writer`: the writer of this process's own step `step`, if it serves from it. `holdings`:
        every process's, as `resume` gathered them (a source serves a copy it holds first). Returns the
        bytes received here. Raises `CorruptCheckpointError` on the receiver if what arrived does not match the
        CRC32Cs (nothing is committed then). Collective, but only the processes that send or receive files
        exchange messages: the holdings tell every process who sends what to whom, and each sender tells its
        receiver alone which files come (no collective gathers the file lists, which grow with the job)."""
        me = coordinator.index
        own_dir = os.path.join(self.root, step_name)
        held = self.held()
        # A source serves its copy where `source_of` chose it for that (its left-out items' holders have their own
        # step), else its own step; every process tells which from the holdings alone.
        copied = {t for t, s in sources.items() if _copy_usable(holdings, t, step, holdings[s].copies.get((t, step)))}
        served: dict[int, tuple[str, StepFiles]] = {}
        unserved: dict[int, str] = {}  # target -> why this process cannot say what it serves it
        for target, source in sources.items():  # a copy or step may be gone since the holdings were gathered
            if source != me:
                continue
            if target in copied:
                copy = held.get((target, step))
                if copy is None:
                    unserved[target] = f"process {me} no longer holds its copy of step {step} of process {target}"
                else:
                    served[target] = copy
            elif me not in own_writer:
                unserved[target] = f"process {me} no longer holds its step {step} ({own_dir})"
            else:
                try:
                    served[target] = (own_dir, list_files(own_dir, own_writer[me], step))
                except OSError as exc:
                    unserved[target] = f"process {me} cannot list its step {step} ({own_dir}): {exc!r}"
        needs = sorted((t, item, q) for t, s in sources.items() if t in copied
                       for item, q in holdings[s].copies[(t, step)])
        main, items, refused = self._send_lists(coordinator, step, own_dir, served, unserved, sources, needs)
        transfers = [Transfer(s, t, main[t], tuple(path for path, _ in main[t].files))
                     for t, s in sorted(sources.items())]
        dirs = [served[t][0] if t in served else None for t, s in sorted(sources.items())]
        for t, item, q in needs:
            files = items[(t, item)]
            transfers.append(Transfer(q, t, files, tuple(path for path, _ in files.files)))
            dirs.append(own_dir if q == me else None)
        return self._move(coordinator, step, transfers, dirs, own_dir, replace_files=False, refused=refused)

    @staticmethod
    def _send_lists(coordinator: Coordinator, step: int, own_dir: str, served: Mapping[int, tuple[str, StepFiles]],
                    unserved: Mapping[int, str], sources: Mapping[int, int], needs: Sequence[tuple[int, str, int]]
                    ) -> tuple[dict[int, StepFiles], dict[tuple[int, str], StepFiles], list[str]]:
        """Each source sends its target the manifest of what it serves, and each holder of an item a copy left
        out sends the item's files in its own step, point to point (two exchanges: lengths, then JSON). A process
        that cannot list what it was to send (`unserved`, or its own step for the items) sends why instead,
        and both sides count those files as none: the transfers stay paired, nobody waits for lists that never
        come. Returns the manifests and item lists (target, item) this process sends or receives (the others are
        empty stand-ins that keep every process's list of transfers in the same order), and why its senders
        could not list theirs."""
        me = coordinator.index

        def letter(target: int) -> dict:
            return outgoing.setdefault(target, {"main": None, "items": {}, "error": None})

        outgoing: dict[int, dict] = {}
        for target, (_, files) in served.items():
            letter(target)["main"] = _record(files)
        for target, why in unserved.items():
            letter(target)["error"] = why
        own_files: StepFiles | None = None
        unlisted = None
        for target, item, holder in needs:
            if holder != me:
                continue
            if own_files is None and unlisted is None:
                try:
                    own_files = list_files(own_dir, me, step)
                except OSError as exc:
                    unlisted = f"process {me} cannot list its step {step} ({own_dir}): {exc!r}"
            if unlisted is not None:
                letter(target)["error"] = unlisted
            else:
                letter(target)["items"][item] = _record(StepFiles(me, step, _item_of(own_files, item)))
        senders = sorted({sources[me]} | {q for t, _, q in needs if t == me}) if me in sources else []
        blobs = {t: np.frombuffer(json.dumps(message).encode(), dtype=np.uint8) for t, message in outgoing.items()}
        lengths = {p: [np.zeros(1, dtype=np.int64)] for p in senders}
        coordinator.exchange({t: [np.array([blob.size], dtype=np.int64)] for t, blob in blobs.items()}, lengths,
                             lambda _: f"the file lists of step {step}")
        received = {p: [np.empty(int(length[0][0]), dtype=np.uint8)] for p, length in lengths.items()}
        coordinator.exchange({t: [blob] for t, blob in blobs.items()}, received,
                             lambda _: f"the file lists of step {step}")
        main = {t: StepFiles(t, step, ()) for t in sources}
        main.update({t: files for t, (_, files) in served.items()})
        items = {(t, item): StepFiles(q, step, ()) for t, item, q in needs}
        for t, item, q in needs:
            if q == me and item in outgoing.get(t, {}).get("items", {}):
                items[(t, item)] = _from_record(outgoing[t]["items"][item], f"the file lists of step {step}")
        refused = []
        for sender, (blob,) in received.items():
            try:
                message = json.loads(blob.tobytes())
                where = f"the file lists of step {step} from process {sender}"
                if message["main"] is not None:
                    main[me] = _from_record(message["main"], where)
                for item, record in message["items"].items():
                    items[(me, item)] = _from_record(record, where)
                if message["error"] is not None:
                    refused.append(str(message["error"]))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CorruptCheckpointError(f"the file lists of step {step} from process {sender} are not "
                                             f"ones: {exc}") from exc
        return main, items, refused

    def repair(self, coordinator: Coordinator, step: int, step_name: str, writers: Mapping[int, int],
               sources: Mapping[int, int]) -> int:
        """Every process `t` of `sources` replaces the files of its local step ``step_name`` that differ from the
        peer copy of writer ``writers[t]`` held by ``sources[t]`` (and, for the items that copy left out, from the
        own steps of the processes holding them identical), checked by CRC32C: only those files travel. Returns
        the bytes received here. Raises `CorruptCheckpointError` as `fetch` does. Collective."""
        me = coordinator.index
        own_dir = os.path.join(self.root, step_name)
        held = self.held()
        served = {t: held[(writers[t], step)] for t, s in sources.items() if s == me}
        manifests = coordinator.all_gather({t: files for t, (_, files) in served.items()}, f"repairing step {step}")
        main = {t: manifests[s][t] for t, s in sources.items()}
        needs = sorted((t, item, q) for t, files in main.items() for item, q in files.shared)
        lists = self._item_files(coordinator, needs, own_dir, step)
        wanted: list[list[str]] = []
        whole: set[str] = set()  # shared items this process replaces whole: another process's files are named
        if me in sources:      # after it (its OCDBT files), so they come all together or not at all
            wanted.append([path for (path, _), crc, good in
                           zip(main[me].files, file_crcs(own_dir, main[me].files), main[me].crcs or ()) if crc != good])
            for t, item, q in needs:
                if t == me:
                    ref = lists[q][(t, item)]
                    intact = file_crcs(own_dir, ref.files) == list(ref.crcs or ())
                    wanted.append([] if intact else [path for path, _ in ref.files])
                    whole |= set() if intact else {item}
        requests = coordinator.all_gather(wanted, f"repairing step {step}")
        transfers, dirs = [], []
        for t, s in sorted(sources.items()):
            transfers.append(Transfer(s, t, main[t], tuple(requests[t][0])))
            dirs.append(served[t][0] if s == me else None)
        position = {t: 1 for t in sources}
        for t, item, q in needs:
            transfers.append(Transfer(q, t, lists[q][(t, item)], tuple(requests[t][position[t]])))
            dirs.append(own_dir if q == me else None)
            position[t] += 1
        return self._move(coordinator, step, transfers, dirs, own_dir, replace_files=True, whole_items=whole)

    @staticmethod
    def _item_files(coordinator: Coordinator, needs: list[tuple[int, str, int]], own_dir: str,
                    step: int) -> list[dict[tuple[int, str], StepFiles]]:
        """For each (target, item, holder) of `needs` (the same on every process): the files of `item` in the
        holder's own step, with their CRC32Cs, listed by the holder. Collective if `needs`."""
        if not needs:
            return [{} for _ in range(coordinator.count)]
        mine = {}
        for target, item, holder in needs:
            if holder == coordinator.index:
                files = _item_of(list_files(own_dir, holder, step), item)
                crcs = tuple(crc or 0 for crc in file_crcs(own_dir, files))
                mine[(target, item)] = StepFiles(holder, step, files, crcs)
        return coordinator.all_gather(mine, f"listing the items of step {step}")

    def _move(self, coordinator: Coordinator, step: int, transfers: list[Transfer], dirs: list[str | None],
              final: str, *, replace_files: bool, whole_items: Collection[str] = (), refused: Sequence[str] = ()
              ) -> int:
        """Run `transfers` (their sources read from `dirs`), check what this process received against the
        CRC32Cs the sources read and those recorded, then put it in place: the step directory `final` replaced
        whole, or (`replace_files`) the files received replaced one by one, the item directories of
        `whole_items` first emptied. With `refused` (why senders could not list what they were to send), nothing
        received is kept and a `StorageError` saying so is raised once the transfers are done."""
        me = coordinator.index
        mine = [i for i, t in enumerate(transfers) if t.target == me]
        partial = os.path.join(copies_root(self.root), f"{_PARTIAL}{time.time_ns()}") if mine else None
        crcs_of, unwritten = transfer(coordinator, transfers, {i: d for i, d in enumerate(dirs) if d is not None},
                                      {i: partial for i in mine}, f"step {step}")
        # Files that come with the CRC32Cs of a copy's marker are checked against those; only files read from a
        # step directory (no marker) need what their sender read, which it sends its receiver alone.
        unrecorded = {i for i, t in enumerate(transfers) if t.files.crcs is None and me in (t.source, t.target)}
        sent: dict[int, list[np.ndarray]] = {}
        truth: dict[int, list[np.ndarray]] = {}
        for i in sorted(unrecorded):
            t = transfers[i]
            if t.source == me:
                sent.setdefault(t.target, []).append(np.array(crcs_of[i], dtype=np.int64))
            else:
                truth.setdefault(t.source, []).append(np.empty(len(t.paths), dtype=np.int64))
        coordinator.exchange(sent, truth, lambda _: f"the CRC32Cs of step {step}")
        received = {i: [int(crc) for crc in truth[transfers[i].source].pop(0)] for i in sorted(unrecorded)
                    if transfers[i].target == me}
        if partial is None:
            return 0
        if unwritten is not None:
            shutil.rmtree(partial, ignore_errors=True)
            raise unwritten
        if refused:
            shutil.rmtree(partial, ignore_errors=True)
            raise StorageError(f"step {step} could not be fetched: {'; '.join(refused)}; nothing of it was kept")
        damaged = []
        for i in mine:
            t = transfers[i]
            if t.files.crcs is None:
                expected = received[i]
            else:
                recorded = dict(zip((path for path, _ in t.files.files), t.files.crcs))
                expected = [recorded[path] for path in t.paths]
            damaged += [f"{path} from process {t.source}" for path, got, want in
                        zip(t.paths, crcs_of[i], expected) if got != want]
        if damaged:
            shutil.rmtree(partial, ignore_errors=True)
            raise CorruptCheckpointError(f"step {step} arrived damaged, or its copy is damaged where it came from "
                                         f"(CRC32C mismatch: {', '.join(damaged)}); nothing of it was kept")
        # Not synced: the restore that follows reads from the page cache and checks every chunk's CRC32C, and
        # after a power loss a torn file is damage that the next resume repairs from the copy again.
        if replace_files:  # file by file: each is whole, old or new, whenever a crash comes
            for item in whole_items:
                shutil.rmtree(os.path.join(final, item), ignore_errors=True)
            for i in mine:
                for path in transfers[i].paths:
                    os.makedirs(os.path.dirname(os.path.join(final, path)), exist_ok=True)
                    os.replace(os.path.join(partial, path), os.path.join(final, path))
            shutil.rmtree(partial, ignore_errors=True)
        elif os.path.isdir(partial):
            _commit_dir(partial, final, None, fsync=False)
        sizes = {(i, path): size for i in mine for path, size in transfers[i].files.files}
        return sum(sizes[(i, path)] for i in mine for path in transfers[i].paths)
