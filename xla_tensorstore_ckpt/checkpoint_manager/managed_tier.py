"""A tier as the manager drives it (`ManagedTier`): its steps (`tier.Tier`: root, lock, bookkeeping, retention),
when it saves, the background thread finishing its saves, and the coordinator of its commits (the job's for the
persistent tier, this process alone for a local one).

The manager holds one `ManagedTier` per tier and composes them; a managed tier knows nothing of training objects.
Methods run on the caller's thread unless they say otherwise; `finish` runs on its background thread in async
mode.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import storage
from ..core import events, layout
from ..core.errors import CheckpointError, CheckpointNotFoundError, UsageError
from ..multihost.distributed import Coordinator
from ..options import CheckpointManagerOptions
from ..saves import save_plan, writing
from ..saves.async_save import BackgroundCommitter
from . import policies
from .peer_copies import PeerReplicator, item_keys
from .tier import PendingSave, Tier
from .training_state import RNG_ITEM

log = logging.getLogger("xla_tensorstore_ckpt")

LOCAL, PERSISTENT = "local", "persistent"  # the tiers' names, as `all_steps(tier)` and `metadata().tiers` say


@dataclass
class ManagedTier:
    """One tier of a manager. Not thread-safe beyond what `Tier` and `BackgroundCommitter` are."""

    name: str  # LOCAL or PERSISTENT
    tier: Tier
    decision: policies.SaveDecision
    committer: BackgroundCommitter
    coordinator: Coordinator
    events: events.Emitter  # bound to this tier
    in_flight: int | None = None  # the newest step this manager saved (or is saving) here
    plan_caches: dict[str, save_plan.PlanCache] = field(default_factory=dict)  # item name -> its last plan
    replicator: PeerReplicator | None = None  # a local tier's, with local_replication

    @property
    def is_local(self) -> bool:
        return self.name == LOCAL

    def describe(self) -> str:
        """The tier and its root, for messages: ``the local tier (/mnt/ssd/ckpt)``."""
        return f"the {self.name} tier ({self.tier.root})"

    def last_saved(self) -> int | None:
        """The newest step this tier has or is saving, as every process sees it: the persistent tier's shared
        listing, but for a local tier only the saves of this manager (local listings differ between processes,
        and every process must decide alike whether a step is due)."""
        if self.is_local:
            return self.in_flight
        latest = max(self.tier.committed(), default=None)
        return latest if self.in_flight is None else max(latest or 0, self.in_flight)

    def take_root(self, step: int) -> None:
        """Own the tier's root before saving `step` into it (the primary of its coordinator takes the
        lock). Raises `CheckpointError` naming the lock's holder and file if another live manager owns it."""
        lock = self.tier.lock
        if self.coordinator.is_primary and not lock.acquire():
            raise CheckpointError(
                f"cannot save step {step}: {lock.root} is owned by another checkpoint manager ({lock.holder}); "
                f"this one can only restore. If that process is gone, delete "
                f"{lock.root.child(layout.MANAGER_LOCK)} (or wait lock_timeout_s).")

    def submit(self, save: PendingSave, *, fsync: bool, started: float, agreements: Mapping[str, Any]) -> None:
        """Hand `save` to its background thread (`finish`); its error is re-raised later, naming the
        step and this tier. Uses the slot `committer.reserve` took. Does not block."""
        self.committer.submit(f"asynchronous save of step {save.step} to {self.describe()}", save.step,
                              lambda: self.finish(save, fsync=fsync, started=started, agreements=agreements))

    def finish(self, save: PendingSave, *, fsync: bool, started: float, agreements: Mapping[str, Any]) -> None:
        """Commit `save` in the tier (on every process of the job for the persistent tier), then retention (its
        deletes deferred to its background thread, off the critical path), telling the listeners as each
        phase ends (`events`; `started`: when the save began, `time.perf_counter`; `agreements`: the costs of
        the collectives that staged it, `Coordinator.take_costs`, reported with the commit's). Collective for
        the persistent tier. Blocks."""
        step_events = self.events.bound(step=save.step, path=str(save.final))
        begun = time.perf_counter()
        phases = {}

        def written(writes: writing.Writes) -> None:
            phases["written"] = time.perf_counter()
            step_events.emit(events.SAVE_WRITTEN, seconds=phases["written"] - begun, nbytes=save.write_bytes,
                             files=len(writes.files) + len(writes.trees),
                             details={"chunks": writes.chunks, "chunk_bytes": writes.chunk_bytes,
                                      "peak_staged_bytes": writes.peak_staged_bytes,
                                      **({"written_whole": dict(writes.whole)} if writes.whole else {})})

        try:
            doomed, held = self.tier.commit(self.coordinator, save, fsync=fsync, committed_at=time.time(),
                                      on_written=written)
        except BaseException:
            if self.replicator is not None:  # the peers still expect this process in the step's replication
                self.replicator.replicate(save.step, save.final.name, None, {})
            if not self.is_local and self.in_flight == save.step:
                # The step may be saved again (once there is room, say). The persistent tier's commit fails on
                # every process alike, so they still agree on what is due; a local tier's need not, and stays.
                self.in_flight = None
            raise
        if self.replicator is not None:
            self.replicator.replicate(save.step, save.final.name, save.final.path,
                                      item_keys(save.plans, per_process=(RNG_ITEM,)))
        done = time.perf_counter()
        committed = self.tier.committed().get(save.step)
        bases = {"bases": list(committed.bases)} if committed is not None and committed.bases else {}
        step_events.emit(events.SAVE_COMMITTED, seconds=done - phases.get("written", begun),
                         details={"total_seconds": done - started, **bases,
                                  **({"kept_as_bases": held} if held else {}),
                                  "agreements": {**agreements, **self.coordinator.take_costs()}})
        if doomed and self.coordinator.is_primary:
            # Behind the step's replication, which may still be reading a step retention lets go.
            queue = self.committer if self.replicator is None else self.replicator
            queue.defer(f"deleting steps {doomed} of {self.describe()} (retention after step {save.step})",
                                 save.step, lambda: self._retire(doomed, step_events))

    def _retire(self, doomed: list[int], step_events: events.Emitter) -> None:
        begun = time.perf_counter()
        for old in doomed:
            self.tier.delete(old)
        step_events.emit(events.RETENTION_REMOVED, seconds=time.perf_counter() - begun,
                         details={"steps": list(doomed)})

    def close(self) -> None:
        """Wait for its saves (raising their errors), then release its root and its coordinator, each
        also when the one before failed. Idempotent for the parts already closed."""
        try:
            self.committer.close()
        finally:
            try:
                if self.replicator is not None:
                    self.replicator.close()
            finally:
                try:
                    self.tier.lock.release()
                finally:
                    self.coordinator.close()

    def check(self) -> None:
        """Raise (once) the error of a failed background save or replication. Does not block."""
        self.committer.check()
        if self.replicator is not None:
            self.replicator.check()

    def wait(self) -> None:
        """Block until its background saves, and the replications they started, have finished; raise their
        first error."""
        self.committer.wait()
        if self.replicator is not None:
            self.replicator.wait()


def managed_persistent(root: storage.Location, options: CheckpointManagerOptions) -> ManagedTier:
    """The persistent tier at `root`: the manager's policies, the job's coordinator for its commits (a group of
    its own, so that the background commits' collectives never interleave with the caller's). Collective with
    several processes."""
    coordinator = Coordinator.from_environment(options.coordination_timeout_s)
    chosen = policies.for_tiers(options)
    tier = Tier(root, step_prefix=options.step_prefix, preservation=chosen.preserve,
                lock_timeout_s=options.lock_timeout_s)
    return ManagedTier(PERSISTENT, tier, chosen.save, BackgroundCommitter(options.max_pending_saves), coordinator,
                       save_events(options, coordinator.index).bound(tier=PERSISTENT))


def managed_local(root: storage.Location, options: CheckpointManagerOptions, process: int) -> ManagedTier:
    """This process's local tier at `root`: the local policies, committed by this process alone; with
    `local_replication`, its steps copied to peers (a group of its own for that: collective then). Raises
    `UsageError` if replication cannot be arranged (a local tier off the file system, too few processes or
    failure domains)."""
    chosen = policies.for_tiers(options)
    tier = Tier(root, step_prefix=options.step_prefix, preservation=chosen.local_preserve,
                lock_timeout_s=options.lock_timeout_s)
    emitter = save_events(options, process).bound(tier=LOCAL)
    replicator = None
    if options.local_replication > 1:
        if root.local_file(layout.MANAGER_LOCK) is None:
            raise UsageError(f"local_replication needs the local tier on a file system, not {root}")
        coordinator = Coordinator.from_environment(options.coordination_timeout_s)

        def replicated(step: int, holders: dict[int, list[int]], sent: int, received: int) -> None:
            log.info("step %d of the local tier replicated: copies of process %d on %s", step, coordinator.index,
                     holders.get(coordinator.index, []))
            emitter.bound(step=step).emit(events.PEER_COPIES_COMMITTED, nbytes=received,
                                          details={"sent_bytes": sent, "holders": holders})

        def started(step: int, sent: int, received: int) -> None:
            emitter.bound(step=step).emit(events.PEER_COPIES_STARTED, nbytes=received, details={"sent_bytes": sent})

        try:
            replicator = PeerReplicator(coordinator, root.path, options.local_replication,
                                        options.local_failure_domain, options.local_max_to_keep, replicated,
                                        started)
        except BaseException:
            coordinator.close()
            raise
    return ManagedTier(LOCAL, tier, chosen.local_save, BackgroundCommitter(options.max_pending_saves),
                       Coordinator.single(), emitter, replicator=replicator)


def save_events(options: CheckpointManagerOptions, process: int) -> events.Emitter:
    """The listeners of a manager's saves: its own (`on_commit` and `on_local_commit` among them, as listeners
    of their tier's commits) and those of its `save_options`."""
    callbacks = tuple(events.CommitCallback(callback, tier) for callback, tier in (
        (options.on_commit, PERSISTENT), (options.on_local_commit, LOCAL)) if callback is not None)
    return events.Emitter(options.listeners + options.save_options.listeners + callbacks, process=process)


def restore_events(options: CheckpointManagerOptions, process: int) -> events.Emitter:
    """The listeners of a manager's restores: its own and those of its `restore_options`."""
    return events.Emitter(options.listeners + options.restore_options.listeners, process=process)


def check_root(root: storage.Location, *, create: bool) -> None:
    """Raise `CheckpointError` if `root` is a step or item directory rather than a root, and
    `CheckpointNotFoundError` if it does not exist and `create` is False. Blocks (two small reads)."""
    for marker, what in ((layout.CHECKPOINT_METADATA, "a step"), (layout.ITEM_METADATA, "an item")):
        if root.read(marker) is not None:
            raise CheckpointError(f"{root} is {what} directory, not a checkpoint root; "
                                  "pass the directory that holds the steps")
    if not create and not root.exists():
        raise CheckpointNotFoundError(f"checkpoint root {root} does not exist (and create=False)")


def close_all(tiers: list[ManagedTier]) -> None:
    """Close every managed tier, the last first, each also when a later one failed (the first error is raised)."""
    managed = tiers.pop()
    try:
        managed.close()
    finally:
        if tiers:
            close_all(tiers)
