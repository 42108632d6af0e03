"""Replication of local steps to peers (``CheckpointManagerOptions(local_replication=k)``): after a local step
commits on every process, each process sends the files of its step directory to its k - 1 peers (`placement`),
leaving out the items another process holds identical (`sharing`), and commits the copies it receives
(`on_disk`), on a background thread of its own, over a gloo group of its own (`file_transfer`). Created and
driven by the manager's local tier (`managed_tier`); its errors are raised by `check` / `close` like those of a
background save.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Hashable, Mapping, Sequence

from ...core.errors import CoordinationError, StorageError
from ...multihost.distributed import Coordinator
from ...saves.async_save import BackgroundCommitter
from . import file_transfer, on_disk
from .file_transfer import Transfer
from .on_disk import StepFiles
from .placement import peers_of

log = logging.getLogger("xla_tensorstore_ckpt")


class PeerReplicator:
    """Sends each committed local step of this process to its peers and commits the copies it receives, on a
    background thread of its own, in the order the steps were committed (the same on every process: whether a
    step is due for the local tier depends only on the step). Errors are kept and raised by `check` / `close`
    like those of a background save. `on_started` (step, bytes this process sends, bytes it receives) is called
    there as a step's files start moving, `on_committed` (step, writer -> holders, sent, received) once its
    copies are committed; what either raises fails the step's replication on every process, once its
    collectives are done (like a full disk)."""

    def __init__(self, coordinator: Coordinator, local_root: str, k: int,
                 domain: Callable[[int], Hashable] | None, keep: int | None,
                 on_committed: Callable[[int, dict[int, list[int]], int, int], None],
                 on_started: Callable[[int, int, int], None] = lambda step, sent, received: None):
        self._coordinator, self._root, self._keep = coordinator, local_root, keep
        self._on_started = on_started
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

    def _started(self, step: int, transfers: Sequence[Transfer], partials: Mapping[int, str]) -> Exception | None:
        """Tell `on_started` that the step's files start moving; what it raised, to be raised once the step's
        collectives no longer wait for this process."""
        try:
            self._on_started(step, sum(t.files.nbytes for t in transfers if t.source == self._coordinator.index),
                             sum(transfers[i].files.nbytes for i in partials))
        except Exception as exc:  # noqa: BLE001 - a listener's error: raised on every process after the transfer
            return exc
        return None

    def _replicate(self, step: int, step_name: str, directory: str | None, keys: Mapping[str, str]) -> None:
        c = self._coordinator
        mine = None
        if directory is not None:
            mine = (on_disk.list_files(directory, c.index, step),
                    {item: (key, on_disk.file_crc(os.path.join(directory, item, "_METADATA")),
                            on_disk.file_crc(os.path.join(directory, item, "_strings.json")))
                     for item, key in keys.items()})
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
        partials = {i: on_disk.copy_dir(self._root, t.source, step_name) + f"{on_disk.PARTIAL}{time.time_ns()}"
                    for i, t in enumerate(transfers) if t.target == c.index}
        sources = {i: directory for i, t in enumerate(transfers) if t.source == c.index}
        refused = self._started(step, transfers, partials)
        crcs_of, unwritten = file_transfer.transfer(c, transfers, sources, partials, f"step {step}")
        unwritten = unwritten or refused
        # Each writer tells its receivers the CRC32Cs of what it read; a copy commits only if they match.
        truth = c.all_gather({i: crcs for i, crcs in crcs_of.items() if transfers[i].source == c.index},
                             f"checking the copies of step {step}")
        committed: list[int] = []
        for i in partials:
            t, crcs = transfers[i], crcs_of[i]
            if crcs != truth[t.source][i] or file_transfer.DAMAGED in crcs:
                differ = [path for path, got, want in zip(t.paths, crcs, truth[t.source][i])
                          if got != want or got == file_transfer.DAMAGED]
                log.warning("not keeping the copy of step %d of process %d: %d files arrived damaged or could not "
                            "be read where they came from (%s)", step, t.source, len(differ),
                            ", ".join(differ[:5]))
                shutil.rmtree(partials[i], ignore_errors=True)
                continue
            manifest = StepFiles(t.source, step, t.files.files, tuple(crcs), t.files.shared)
            try:
                on_disk.commit_dir(partials[i], on_disk.copy_dir(self._root, t.source, step_name), manifest)
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
        """Keep the newest `keep` copies of each writer (the local tier's count), and the copies of the steps
        those reference (an incremental step's bases: its copy holds only its own files, the rest is in theirs,
        as the writer's local tier keeps them)."""
        if self._keep is None:
            return
        base = on_disk.copies_root(self._root)
        for writer in os.listdir(base) if os.path.isdir(base) else []:
            if not os.path.isdir(os.path.join(base, writer)):
                continue
            entries = []
            for name in os.listdir(os.path.join(base, writer)):
                manifest = on_disk.read_copy(os.path.join(base, writer, name))
                if manifest is not None:
                    entries.append((manifest.step, name))
            entries.sort()
            kept = entries[-self._keep:]
            needed = {b for _, name in kept for b in on_disk.copy_bases(os.path.join(base, writer, name))}
            for step, name in entries[:-self._keep]:
                if step not in needed:
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
