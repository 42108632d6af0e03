"""Resuming from peers: what each process holds for a resume (`Holdings`: its own local steps and the peer
copies it keeps), which process serves a step a process lacks (`source_of`), and the collectives that bring a
missing step from a peer and commit it into the local tier (`PeerCopies.fetch`) or replace the files of a
damaged one that differ from a peer copy (`PeerCopies.repair`). Files only: the bytes are the writer's, verified
against the copy's CRC32C by the receiver before it commits anything. Called by `resume` at a restart, on every
process in the same order; blocks.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ...core.errors import CorruptCheckpointError, StorageError
from ...multihost.distributed import Coordinator
from . import file_transfer, on_disk
from .file_transfer import Transfer
from .on_disk import StepFiles


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
        return on_disk.held_copies(self.root, self._step_of)

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
                    served[target] = (own_dir, on_disk.list_files(own_dir, own_writer[me], step))
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
            letter(target)["main"] = on_disk.record(files)
        for target, why in unserved.items():
            letter(target)["error"] = why
        own_files: StepFiles | None = None
        unlisted = None
        for target, item, holder in needs:
            if holder != me:
                continue
            if own_files is None and unlisted is None:
                try:
                    own_files = on_disk.list_files(own_dir, me, step)
                except OSError as exc:
                    unlisted = f"process {me} cannot list its step {step} ({own_dir}): {exc!r}"
            if unlisted is not None:
                letter(target)["error"] = unlisted
            else:
                letter(target)["items"][item] = on_disk.record(StepFiles(me, step, _item_of(own_files, item)))
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
                items[(t, item)] = on_disk.from_record(outgoing[t]["items"][item], f"the file lists of step {step}")
        refused = []
        for sender, (blob,) in received.items():
            try:
                message = json.loads(blob.tobytes())
                where = f"the file lists of step {step} from process {sender}"
                if message["main"] is not None:
                    main[me] = on_disk.from_record(message["main"], where)
                for item, record in message["items"].items():
                    items[(me, item)] = on_disk.from_record(record, where)
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
                           zip(main[me].files, on_disk.file_crcs(own_dir, main[me].files), main[me].crcs or ())
                           if crc != good])
            for t, item, q in needs:
                if t == me:
                    ref = lists[q][(t, item)]
                    intact = on_disk.file_crcs(own_dir, ref.files) == list(ref.crcs or ())
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
                files = _item_of(on_disk.list_files(own_dir, holder, step), item)
                crcs = tuple(crc or 0 for crc in on_disk.file_crcs(own_dir, files))
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
        partial = os.path.join(on_disk.copies_root(self.root), f"{on_disk.PARTIAL}{time.time_ns()}") if mine else None
        crcs_of, unwritten = file_transfer.transfer(coordinator, transfers,
                                                    {i: d for i, d in enumerate(dirs) if d is not None},
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
            on_disk.commit_dir(partial, final, None, fsync=False)
        sizes = {(i, path): size for i in mine for path, size in transfers[i].files.files}
        return sum(sizes[(i, path)] for i in mine for path in transfers[i].paths)
