"""CheckpointManager: step directories with atomic commits, retention, latest-step discovery and resume of the
whole training state (model, optimizer, LR scheduler, data position, RNGs, metrics).

The parts, each in its own module: owning a root (`root_lock`); the steps under a root — listing, markers, commits,
retention (`tier.Tier`, on `steps.StepIndex`); a tier as the manager drives it — when it saves, its background
thread, its coordinator (`managed_tier.ManagedTier`); staging a step for its tiers (`step_save`); training objects
to and from state trees (`training_state`); with `local_directory`, the local tier's own rules (`local_tier`) and
which step a restart resumes from, with fallback (`resume`). This module composes them, one `ManagedTier` per tier;
`restore` and what it alone uses are in `manager_restore` (`RestoreSide`, a base class).

Layout: ``<root>/<step>/<item>/`` per saved object plus ``<root>/<step>/_CHECKPOINT_METADATA``, the commit marker,
written last (`commit`). Saves are asynchronous by default: `save` blocks only while shards are copied off the
devices (once, when a step is due for both tiers), and one background thread per tier finishes the save
(writes, sync, manifests, marker): a slow persistent copy never delays the local tier's next save. Retention
deletes run on that thread after the commit, in both modes, so they never stall training. Background errors
are re-raised at the next `save`, `restore`, `wait_until_finished` or `close`. The manager is meant to be driven
by one thread of one training job; the public methods are not safe to call concurrently from several threads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import warnings
from collections.abc import Mapping
from typing import Any

from .. import formats, storage
from ..core import events
from ..core.errors import CheckpointError, CheckpointExistsError, StepNotFoundError, UsageError
from ..core.gc_pause import paused_gc
from ..core.records import StepMetadata
from ..multihost.distributed import Coordinator
from ..options import CheckpointManagerOptions
from ..saves import save_plan
from . import local_tier, policies, step_save, training_state
from .managed_tier import (
    LOCAL,
    PERSISTENT,
    ManagedTier,
    check_root,
    close_all,
    managed_local,
    managed_persistent,
    restore_events,
)
from .manager_restore import RestoreSide
from .preemption import PreemptionWatch

log = logging.getLogger("xla_tensorstore_ckpt")

RNG_ITEM = training_state.RNG_ITEM
_OBJECT_ITEMS = training_state.OBJECT_ITEMS


class CheckpointManager(RestoreSide):
    """Saves and restores the training state under one root directory, one sub-directory per step, and with
    `options.local_directory` in a second, local tier too.

    ``with CheckpointManager(root, options) as manager:`` closes (and waits for) the manager at the end.
    Raises `CheckpointError` if `directory` (or the local directory) is a step or item directory rather than a
    root, and `CheckpointNotFoundError` if it does not exist and `options.create` is False.
    """

    def __init__(self, directory: str | os.PathLike | storage.Location,
                 options: CheckpointManagerOptions | None = None):
        self._options = options = options or CheckpointManagerOptions()
        root = storage.location(directory)
        local_root = None if options.local_directory is None else storage.location(options.local_directory)
        if local_root is not None and local_tier.same_root(str(local_root), root):
            raise UsageError(f"local_directory {local_root} is the manager's directory: the local tier needs a "
                             "directory of its own")
        check_root(root, create=options.create)
        if local_root is not None:
            check_root(local_root, create=True)
        # Two groups: collectives of the caller's thread and of the background commits never interleave.
        self._coordinator = Coordinator.from_environment(options.coordination_timeout_s)
        self._persistent = managed_persistent(root, options)
        self._local = None if local_root is None else managed_local(local_root, options, self._coordinator.index)
        self._restore_events = restore_events(options, self._coordinator.index)
        # The local tier first: it commits sooner, and its staging serves the persistent one.
        self._tiers = [managed for managed in (self._local, self._persistent) if managed is not None]
        self._closed = False
        self.reload()
        self._preemption = PreemptionWatch(options.save_on_preemption)

    # ---------------------------------------------------------------------------------------- queries

    @property
    def directory(self) -> str:
        """The persistent tier's root."""
        return str(self._persistent.tier.root)

    @property
    def local_directory(self) -> str | None:
        """This process's local tier root, or None without one."""
        return None if self._local is None else str(self._local.tier.root)

    def reload(self) -> None:
        """Re-read the committed steps of every tier and, unless another live manager owns a root, remove its
        partial steps (saves that never committed). Called by the constructor. For the persistent tier the
        primary process decides and every process gets the same answer; each process reads its own local tier.
        Collective with several processes. Blocks."""
        self._persistent.tier.reload(self._coordinator)
        if self._local is not None:
            self._local.tier.reload(self._local.coordinator)
            # Steps of another run, job size or writer: never candidates, never counted as saved, never retained.
            local_tier.ignore_foreign_steps(self._local.tier, self._persistent.tier.root, self._coordinator.count)

    def all_steps(self, tier: str | None = None) -> list[int]:
        """Committed steps, oldest first: of every tier (None), or of the given one ("local": this process's
        local tier; "persistent"). `metadata(step).tiers` tells where a step is. An asynchronous save appears
        here once its commit has landed."""
        return sorted({step for managed in self._tiers_named(tier) for step in managed.tier.committed()})

    def latest_step(self, tier: str | None = None) -> int | None:
        """The newest committed step of every tier (None) or of the given one. What `restore("latest")` takes
        can be older: a local step must be intact on every process."""
        return max(self.all_steps(tier), default=None)

    def best_step(self) -> int | None:
        """The best committed step of the persistent tier by its preservation policy's metric (`best_fn`, or
        the first `policies.BestN` in the policy; None without one, or without metrics)."""
        tier = self._persistent.tier
        return policies.best_step(tier.preservation, tier.committed())

    def metadata(self, step: int) -> StepMetadata:
        """The commit marker of a committed step (the persistent tier's where it is in both), with `tiers` naming
        every tier that holds it: items, times, metrics, versions. `StepNotFoundError` if not committed."""
        found = {managed.name: managed.tier.committed().get(step) for managed in self._tiers}
        tiers = tuple(name for name, marker in found.items() if marker is not None)
        if not tiers:
            raise StepNotFoundError(f"step {step} is not committed under {self.directory}"
                                    + (f" nor in the local tier {self.local_directory}" if self._local else "")
                                    + f" (committed: {self.all_steps() or 'none'})", step=step)
        marker = found.get(PERSISTENT) or found[LOCAL]
        return dataclasses.replace(marker, tiers=tiers)  # type: ignore[arg-type]

    def should_save(self, step: int) -> bool:
        """True if `step` is due for some tier by its save interval / steps (or a SIGTERM arrived) and not yet
        saved there."""
        return bool(self._due(step, force=False))

    def _due(self, step: int, *, force: bool) -> list[ManagedTier]:
        if force:
            return list(self._tiers)
        return [managed for managed in self._tiers if self._is_due(managed, step)]

    def _is_due(self, managed: ManagedTier, step: int) -> bool:
        """What its save decision says of `step`, if the managed tier has not saved it (nor, without a pending
        preemption notice, a later step)."""
        preempted = self._preemption.pending
        last = managed.last_saved()
        if preempted:
            if (step == managed.in_flight) if managed.is_local else (step in managed.tier.committed()):
                return False
        elif last is not None and step <= last:
            return False
        return managed.decision.should_save(step, policies.SaveContext(last, preempted))

    def reached_preemption(self, step: int) -> bool:
        """True once a SIGTERM arrived (with `save_on_preemption`) and the state up to `step` is committed:
        the training loop should exit now and resume later from this step."""
        return self._preemption.reached(step)

    def step_path(self, step: int, tier: str = PERSISTENT) -> str:
        """Where a step lives (committed or not) in the given tier."""
        return str(self._tiers_named(tier)[0].tier.index.location(step))

    def _caller_side(self, managed: ManagedTier) -> Coordinator:
        """The coordinator for `managed`'s collectives on the caller's thread (its own serves its commits)."""
        return self._coordinator if managed is self._persistent else managed.coordinator

    def _tiers_named(self, tier: str | None) -> list[ManagedTier]:
        if tier is None:
            return list(self._tiers)
        tiers = [managed for managed in self._tiers if managed.name == tier]
        if not tiers:
            raise ValueError(f"tier must be None, {PERSISTENT!r} or (with local_directory) {LOCAL!r}, got {tier!r}")
        return tiers

    # ------------------------------------------------------------------------------------------- save

    def save(self, step: int, *, model: Any = None, optimizer: Any = None, lr_scheduler: Any = None,
             extra: Any = None, data_loader: Any = None, metrics: Mapping[str, Any] | None = None,
             custom_metadata: Mapping[str, Any] | None = None, force: bool = False) -> bool:
        """Save the given objects as `step` in every tier it is due for (`should_save`; every tier with `force`);
        return whether a save was started.

        `model` is an `nn.Module` or a state tree, `optimizer` a torch optimizer or a tree, `lr_scheduler`
        and `data_loader` objects with ``state_dict()`` or trees, `extra` any tree. Blocks until the shards are
        copied off the devices (async mode; once for both tiers unless `max_host_bytes` is set) or until the
        step is committed in each tier (sync mode). Raises `AsyncSaveError` for a failed earlier background
        save of any tier (with several processes: once a save is due, on every process), `CheckpointExistsError`
        if `step` is committed in the persistent tier and `force` is False (with `force` it is replaced; a
        local step of the same number is always replaced), `UsageError` if a step it would replace is the base of
        an incremental step or of a save in flight, `UnsupportedValueError` before anything is written if
        a value cannot be stored. Every failure before the commits is raised on every process (in async mode a
        failed copy off the devices as the commit's `AsyncSaveError`: a process does not wait for the others').
        """
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if not self._coordinator.distributed:
            self._check_background()  # with several processes, only once a save is due: it is collective then
        persistent = self._persistent.tier
        if not force and step in persistent.committed():
            raise CheckpointExistsError(f"step {step} is already committed at {persistent.index.location(step)}; "
                                        "pass force=True to replace it")
        tiers = self._due(step, force=force)
        if not tiers:
            return False
        for managed in tiers:  # an incremental step's base stays while a step or a save in flight references it
            if step in managed.tier.committed():
                managed.tier.check_unreferenced(step, "replace")
        objects = {name: obj for name, obj in zip(_OBJECT_ITEMS, (model, optimizer, lr_scheduler, extra,
                                                                  data_loader)) if obj is not None}
        marker = StepMetadata(step=step, items=(), created_at=time.time(), committed_at=0.0,
                              metrics=training_state.metrics_json(dict(metrics) if metrics is not None else None),
                              custom=dict(custom_metadata) if custom_metadata is not None else None,
                              versions=formats.writer_versions(), process_count=self._coordinator.count,
                              format_version=formats.writer(self._options.save_options.format).VERSION,
                              persistent_root=self.directory)
        self._save(step, tiers, objects, marker)
        if self._preemption.pending:
            self._wait_here()  # the process is about to be killed: the commits must land first (a notice
            # may reach some processes only: nothing collective here)
            self._preemption.saved_on_notice(step)
            warnings.warn(f"SIGTERM received: step {step} is committed at {self.step_path(step)}; the trainer "
                          "should exit", stacklevel=2)
        return True

    def _save(self, step: int, tiers: list[ManagedTier], objects: Mapping[str, Any], marker: StepMetadata) -> None:
        """Stage `objects` once for every tier of `tiers`, then commit each (in the background in async mode).
        Every failure before the commits is raised on every process (collective; an async save's staging at its
        commit)."""
        started = time.perf_counter()
        step_events = self._persistent.events.bound(tier=None, step=step, path=str(self.step_path(step)))
        step_events.emit(events.SAVE_STARTED, details={"tiers": [managed.name for managed in tiers]})
        self._coordinator.take_costs()  # the committed events report this save's agreements alone
        states = {name: training_state.state_of(obj) for name, obj in objects.items()}
        reserved: list[ManagedTier] = []

        def take_and_check() -> None:
            for managed in tiers:
                managed.take_root(step)
            for managed in tiers:
                managed.committer.reserve()
                reserved.append(managed)
            self._check_background()  # the saves these waited for may have failed meanwhile (on any process)

        try:
            # Checked in the planning's agreement (one for both: every save waits for the slowest process at each).
            failure = None
            try:
                take_and_check()
            except Exception as exc:  # noqa: BLE001 - raised on every process by the planning's agreement
                failure = exc
            precondition = save_plan.Precondition(
                f"taking the roots and checking the saves before step {step}", failure)
            destinations = [step_save.Destination(managed.tier, self._caller_side(managed), own_copy=managed.is_local,
                                                  plan_caches=managed.plan_caches,
                                                  incremental=self._incremental(managed),
                                                  delta=self._options.delta, max_chain=self._options.max_chain,
                                                  anchor_every=self._options.anchor_every,
                                                  page_cache=managed.is_local and self._options.local_page_cache)
                            for managed in tiers]
            pendings = step_save.stage(
                step, destinations, states, marker, coordinator=self._coordinator,
                options=self._options.save_options, save_rng=self._options.save_rng,
                async_save=self._options.async_save, max_host_bytes=self._options.max_host_bytes,
                precondition=precondition)
        except BaseException:
            for managed in reserved:
                managed.committer.release()
            raise
        fsync = self._options.save_options.fsync
        agreements = self._coordinator.take_costs()
        if self._options.async_save:
            step_events.emit(events.SAVE_STAGED, seconds=time.perf_counter() - started,
                             nbytes=max(sum(plan.staged_bytes for plan in p.plans.values()) for p in pendings))
        for managed, pending in zip(tiers, pendings):
            managed.in_flight = step
            if self._options.async_save:
                managed.submit(pending, fsync=fsync, started=started, agreements=agreements)
        if not self._options.async_save:
            errors: list[Exception] = []
            try:
                with paused_gc():  # staging happens here in sync mode (never on the background thread: gc is global)
                    for managed, pending in zip(tiers, pendings):
                        try:  # a local tier failing on one process must not keep it from the collective commit
                            managed.finish(pending, fsync=fsync, started=started, agreements=agreements)
                        except Exception as exc:  # noqa: BLE001 - raised below, on every process
                            errors.append(exc)
            finally:
                for managed in tiers:
                    managed.committer.release()
            self._coordinator.everywhere(f"committing step {step}", lambda: _raise_first(errors))

    def _incremental(self, managed: ManagedTier) -> bool:
        """Whether the tier's steps are incremental: with the option, on every tier (a replicated local tier's
        peers hold its bases' copies: each step is copied to the same peers, which keep the bases of the copies
        they keep; `peer_copies`)."""
        return self._options.incremental

    def _check_background(self) -> None:
        """Raise the error of a failed background save of any tier (once). Does not block."""
        for managed in self._tiers:
            managed.check()

    def delete(self, step: int) -> None:
        """Delete a committed step from every tier that holds it (waits for pending saves first).
        `StepNotFoundError` if not committed. With several processes, call it on every process: the primary
        deletes the persistent step, every process its local one."""
        self._check_open()
        self.wait_until_finished()  # collective, as delete is
        self.metadata(step)  # raises StepNotFoundError if not committed
        for managed in self._tiers:
            managed.tier.check_unreferenced(step, "delete")
        for managed in self._tiers:
            if step in managed.tier.committed():
                managed.tier.forget(step)
                self._caller_side(managed).on_primary(f"deleting step {step}",
                                                      lambda managed=managed: managed.tier.delete(step))

    # -------------------------------------------------------------------------------------- lifecycle

    def wait_until_finished(self) -> None:
        """Block until every pending save of every tier is committed; raise the error of a failed one. With
        several processes, call it on every process: a save or replication that failed on any process raises on
        every process (the others' `CoordinationError` names the process and what failed: a local tier's
        failure is otherwise known to its own process only)."""
        if not self._closed:  # a closed manager has nothing pending
            self._finish("finishing the saves", everywhere=True)

    def _wait_here(self) -> None:
        """`wait_until_finished` for this process alone. Blocks."""
        for managed in self._tiers:
            managed.wait()

    def _finish(self, what: str, *, everywhere: bool) -> None:
        """Wait for this process's pending saves; with `everywhere`, share the outcome with every process
        (collective), unless a collective of this manager already found a peer dead or silent: that failure was
        raised here already, and the peer is not waited for again. Raises the first error."""
        error = None
        try:
            self._wait_here()
        except Exception as exc:  # noqa: BLE001 - shared with every process below, then raised
            error = exc
        coordinators = [self._coordinator, *(managed.coordinator for managed in self._tiers),
                        *(managed.replicator.coordinator for managed in self._tiers if managed.replicator)]
        if everywhere and not any(c.peer_failure for c in coordinators):
            self._coordinator.raise_unless_ok(error, what)
        elif error is not None:
            raise error

    def close(self) -> None:
        """Wait for pending saves (raising their errors), release the background threads, the roots and the
        process groups. Idempotent. With several processes, call it on every process: as in
        `wait_until_finished`, a failure on any process is raised on every process (leaving a ``with`` block on
        an exception closes this process alone: its peers may not be closing; and a peer that a collective
        already found dead or silent is not waited for)."""
        self._close(everywhere=True)

    def _close(self, *, everywhere: bool) -> None:
        if self._closed:
            return
        self._closed = True
        self._preemption.close()
        try:
            self._finish("finishing the saves before closing", everywhere=everywhere)
        finally:
            try:
                close_all(list(self._tiers))
            finally:
                self._coordinator.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        self._close(everywhere=exc_type is None)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the checkpoint manager for {self.directory} is closed")


def _raise_first(errors: list[Exception]) -> None:
    if errors:
        raise errors[0]
