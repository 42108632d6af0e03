"""The engine that moves files between processes over a gloo group (`transfer`): the files of each `Transfer`
cut into pieces of at most ``peer_piece_bytes`` and sent point to point in rounds of at most ``peer_round_bytes``
(`tunables`) per process, the next round read and started while the one before is in flight, through two reused host
buffers (`core.buffers`, kept for the next transfer: a resume's fetch comes right after the process starts, and faulting
in fresh memory then was a fifth of a 64 MiB fetch here); each file's CRC32C counted as it is read or written. Files
only: what they mean is the caller's. Called by `PeerReplicator` (copies of new local steps) and `PeerCopies` (fetching
and repairing steps at a resume); collective, blocks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np

from ...arrays.local_reads import read_runs
from ...core import buffers, tunables
from ...core.errors import CoordinationError, CorruptCheckpointError, StorageError
from ...multihost.distributed import Coordinator, Exchange
from .on_disk import StepFiles

# ``peer_round_bytes`` (`tunables`): file bytes per round of a process that sends one transfer and receives one
# (half for each; a process in more transfers holds half of it for each). Two rounds are in flight at once, so
# reading, sending and writing overlap (one 64 MiB round took 19 ms to read, 63 ms to travel and 30 ms to write
# and check, one after another). ``peer_piece_bytes``: the largest piece a round is cut into.


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


DAMAGED = -1  # the CRC32C recorded for a file its source could not read whole


def _read_piece(path: str, start: int, out: np.ndarray) -> bool:
    """Fill `out` with the bytes of `path` from `start`; False if the file is missing or shorter."""
    if not out.size:  # the one piece of an empty file (an incremental item's delta file with no frames)
        return os.path.isfile(path)
    try:
        read_runs(path, [(start, memoryview(out))], path)
    except (StorageError, CorruptCheckpointError):
        return False
    return True


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
    in_flight = (buffers.Carved(align=1), buffers.Carved(align=1))  # one per round in flight: its pieces end to end

    def start(number: int) -> tuple[Exchange, list[tuple[int, str, int, np.ndarray]]]:
        sends: dict[int, list[np.ndarray]] = {}
        receives: dict[int, list[np.ndarray]] = {}
        landing: list[tuple[int, str, int, np.ndarray]] = []
        pieces = in_flight[number % 2]  # the round two before, which used it, is written
        pieces.reset(sum(length for _, _, rounds in plans if number < len(rounds) for _, _, length in rounds[number]))
        for i, t, rounds in plans:
            if number >= len(rounds):
                continue
            for path, at, length in rounds[number]:
                buffer = pieces.cut((length,))
                buffer = np.empty(0, np.uint8) if buffer is None else buffer  # an empty file's one piece
                if t.source == me:
                    read = _read_piece(os.path.join(source_dirs[i], path), at, buffer)
                    if not read:
                        # A piece that could not be read still travels (the peer expects it), as zeros marked
                        # damaged: the receiver then refuses the file instead of waiting for it.
                        buffer[:] = 0
                    sends.setdefault(t.target, []).append(buffer)
                    if t.files.crcs is None:  # else the receiver checks against the recorded ones
                        crcs[i][path] = DAMAGED if not read or crcs[i].get(path) == DAMAGED else \
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
    for pieces in in_flight:  # not after an error: a message of the failed round may still arrive in them
        pieces.give_back()
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
        self._crcs[i][path] = DAMAGED
        if self.error is None:
            self.error = StorageError(f"could not write {os.path.join(self._dirs[i], path)} of {self._what} "
                                      f"received from process {self._sources[i]}: {exc}")
