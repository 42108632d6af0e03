"""CheckpointManager: step directories with atomic commits, retention, latest-step discovery and resume of the
whole training state (model, optimizer, LR scheduler, data position, RNGs, metrics).

Layout: ``<root>/<step>/<item>/`` per saved object plus ``<root>/<step>/_CHECKPOINT_METADATA``, the commit marker,
written last (`commit`). The steps of the root, its lock, retention and commits: `tier.Tier`. Saving and
restoring training objects: `training_state`. With `local_directory`, a second tier on each host (same layout,
each process's own shards) saves more often; which step a restart resumes from: `resume`.

Saves are asynchronous by default: `save` blocks only while shards are copied off the devices (once, when a step
is due for both tiers), and one background thread per tier finishes the save (writes, sync, manifests, marker):
a slow persistent copy never delays the local tier's next save. Retention deletes run on that thread after
the commit, in both modes, so they never stall training. Background errors are re-raised at the next `save`,
`restore`, `wait_until_finished` or `close`. The manager is meant to be driven by one thread of one
training job; the public methods are not safe to call concurrently from several threads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import formats, layout, resume, saving, step_save, storage, training_state
from .async_save import BackgroundCommitter
from .distributed import Coordinator
from .errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError, StepNotFoundError, UsageError
from .formats import StepMetadata
from .gc_pause import paused_gc
from .options import CheckpointManagerOptions
from .policies import RetentionPolicy, SavePolicy
from .preemption import PreemptionWatch
from .restoring import KeyMap
from .resume import LOCAL, PERSISTENT, Candidate
from .tier import PendingSave, Tier

log = logging.getLogger("xla_tensorstore_ckpt")

RNG_ITEM = training_state.RNG_ITEM
_OBJECT_ITEMS = ("model", "optimizer", "lr_scheduler", "extra", "data_loader")


@dataclass
class _Lane:
    """A tier as the manager drives it: its steps, when it saves, the background thread finishing its saves, and
    the coordinator of its commits (the job's for the persistent tier, this process alone for the local one)."""

    name: str
    tier: Tier
    policy: SavePolicy
    committer: BackgroundCommitter
    coordinator: Coordinator
    on_commit: Callable[[int], None] | None
    in_flight: int | None = None
    plan_caches: dict[str, saving.PlanCache] = field(default_factory=dict)  # item name -> its last plan

    def last_saved(self) -> int | None:
        """The newest step this tier has or is saving, as every process sees it: the persistent tier's shared
        listing, but for a local tier only the saves of this manager (local listings differ between processes,
        and every process must decide alike whether a step is due)."""
        if self.name == LOCAL:
            return self.in_flight
        latest = max(self.tier.committed(), default=None)
        return latest if self.in_flight is None else max(latest or 0, self.in_flight)


class CheckpointManager:
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
        _check_root(root, options.create)
        retention = RetentionPolicy(
            max_to_keep=options.max_to_keep, keep_period=options.keep_period, best_fn=options.best_fn,
            best_mode=options.best_mode, keep_checkpoints_without_metrics=options.keep_checkpoints_without_metrics)
        # Two groups: collectives of the caller's thread and of the background commits never interleave.
        self._coordinator = Coordinator.from_environment(options.coordination_timeout_s)
        self._persistent = _Lane(
            PERSISTENT, Tier(root, step_prefix=options.step_prefix, retention=retention,
                             lock_timeout_s=options.lock_timeout_s),
            SavePolicy(interval=options.save_interval_steps, steps=options.save_on_steps),
            BackgroundCommitter(options.max_pending_saves),
            Coordinator.from_environment(options.coordination_timeout_s), options.on_commit)
        self._local: _Lane | None = None
        if options.local_directory is not None:
            local_root = storage.location(options.local_directory)
            if str(local_root) == str(root):
                raise UsageError(f"local_directory {local_root} is the manager's directory: the local tier needs a "
                                 "directory of its own")
            _check_root(local_root, create=True)
            self._local = _Lane(
                LOCAL, Tier(local_root, step_prefix=options.step_prefix,
                            retention=RetentionPolicy(max_to_keep=options.local_max_to_keep),
                            lock_timeout_s=options.lock_timeout_s),
                SavePolicy(interval=options.local_save_interval_steps, steps=options.local_save_on_steps),
                BackgroundCommitter(options.max_pending_saves), Coordinator.single(), options.on_local_commit)
        # The local tier first: it commits sooner, and its staging serves the persistent one.
        self._lanes = [lane for lane in (self._local, self._persistent) if lane is not None]
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
            self._ignore_foreign_local_steps()

    def _ignore_foreign_local_steps(self) -> None:
        """Leave out of the local tier's bookkeeping the steps there that are not this run's local steps: written
        for another persistent root or by a job of another size, or not by a local tier at all (Orbax's, format
        1). They are never candidates, never count as saved, and retention leaves them alone (a save of the same
        step number replaces one)."""
        assert self._local is not None
        tier = self._local.tier
        foreign = {step: marker for step, marker in tier.committed().items()
                   if marker.writer is None or marker.persistent_root != self.directory
                   or marker.process_count != self._coordinator.count}
        for step in foreign:
            tier.forget(step)
        if foreign:
            warnings.warn(f"ignoring steps {sorted(foreign)} of the local tier {tier.root}: not local steps of this "
                          f"run (another persistent root, another number of processes, or another writer)",
                          stacklevel=4)

    def all_steps(self, tier: str | None = None) -> list[int]:
        """Committed steps, oldest first: of every tier (None), or of the given one ("local": this process's
        local tier; "persistent"). `metadata(step).tiers` tells where a step is. An asynchronous save appears
        here once its commit has landed."""
        return sorted({step for lane in self._lanes_named(tier) for step in lane.tier.committed()})

    def latest_step(self, tier: str | None = None) -> int | None:
        """The newest committed step of every tier (None) or of the given one. What `restore("latest")` takes
        can be older: a local step must be intact on every process."""
        return max(self.all_steps(tier), default=None)

    def best_step(self) -> int | None:
        """The best committed step of the persistent tier by `best_fn` (None without `best_fn` or metrics)."""
        tier = self._persistent.tier
        metrics = {s: m.metrics for s, m in tier.committed().items()}
        return tier.retention.best_step(list(metrics), metrics)

    def metadata(self, step: int) -> StepMetadata:
        """The commit marker of a committed step (the persistent tier's where it is in both), with `tiers` naming
        every tier that holds it: items, times, metrics, versions. `StepNotFoundError` if not committed."""
        found = {lane.name: lane.tier.committed().get(step) for lane in self._lanes}
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

    def _due(self, step: int, *, force: bool) -> list[_Lane]:
        if force:
            return list(self._lanes)
        if self._preemption.pending:
            return [lane for lane in self._lanes if (step != lane.in_flight if lane.name == LOCAL
                                                     else step not in lane.tier.committed())]
        return [lane for lane in self._lanes if lane.policy.should_save(step, lane.last_saved())]

    def reached_preemption(self, step: int) -> bool:
        """True once a SIGTERM arrived (with `save_on_preemption`) and the state up to `step` is committed:
        the training loop should exit now and resume later from this step."""
        return self._preemption.reached(step)

    def step_path(self, step: int, tier: str = PERSISTENT) -> str:
        """Where a step lives (committed or not) in the given tier."""
        return str(self._lanes_named(tier)[0].tier.index.location(step))

    def _caller_side(self, lane: _Lane) -> Coordinator:
        """The coordinator for `lane`'s collectives on the caller's thread (its own serves its commits)."""
        return self._coordinator if lane is self._persistent else lane.coordinator

    def _lanes_named(self, tier: str | None) -> list[_Lane]:
        if tier is None:
            return list(self._lanes)
        lanes = [lane for lane in self._lanes if lane.name == tier]
        if not lanes:
            raise ValueError(f"tier must be None, {PERSISTENT!r} or (with local_directory) {LOCAL!r}, got {tier!r}")
        return lanes

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
        local step of the same number is always replaced), `UnsupportedValueError` before anything is written if
        a value cannot be stored. Every failure before the commits is raised on every process.
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
        lanes = self._due(step, force=force)
        if not lanes:
            return False
        objects = {name: obj for name, obj in zip(_OBJECT_ITEMS, (model, optimizer, lr_scheduler, extra,
                                                                  data_loader)) if obj is not None}
        marker = StepMetadata(step=step, items=(), created_at=time.time(), committed_at=0.0,
                              metrics=training_state.metrics_json(dict(metrics) if metrics is not None else None),
                              custom=dict(custom_metadata) if custom_metadata is not None else None,
                              versions=formats.writer_versions(), process_count=self._coordinator.count,
                              format_version=formats.WRITE_VERSION, persistent_root=self.directory)
        self._save(step, lanes, objects, marker)
        if self._preemption.pending:
            self.wait_until_finished()  # the process is about to be killed: the commits must land first
            self._preemption.saved_on_notice(step)
            warnings.warn(f"SIGTERM received: step {step} is committed at {self.step_path(step)}; the trainer "
                          "should exit", stacklevel=2)
        return True

    def _save(self, step: int, lanes: list[_Lane], objects: Mapping[str, Any], marker: StepMetadata) -> None:
        """Stage `objects` once for every lane of `lanes`, then commit each lane (in the background in async
        mode). Every failure before the commits is raised on every process (collective)."""
        self._coordinator.everywhere(f"taking the roots for step {step}", lambda: self._take_roots(step, lanes))
        states = {name: training_state.state_of(obj) for name, obj in objects.items()}
        reserved: list[_Lane] = []
        try:
            for lane in lanes:
                lane.committer.reserve()
                reserved.append(lane)
            # The saves these waited for may have failed meanwhile (on any process).
            self._coordinator.everywhere(f"checking the saves before step {step}", self._check_background)
            destinations = [step_save.Destination(lane.tier, self._caller_side(lane), own_copy=lane is self._local,
                                                  plan_caches=lane.plan_caches) for lane in lanes]
            pendings = step_save.stage(
                step, destinations, states, marker, coordinator=self._coordinator,
                options=self._options.save_options, save_rng=self._options.save_rng,
                async_save=self._options.async_save, max_host_bytes=self._options.max_host_bytes)
        except BaseException:
            for lane in reserved:
                lane.committer.release()
            raise
        for lane, pending in zip(lanes, pendings):
            lane.in_flight = step
            if self._options.async_save:
                lane.committer.submit(step, lambda lane=lane, pending=pending: self._finish(lane, pending))
        if not self._options.async_save:
            errors: list[Exception] = []
            try:
                with paused_gc():  # staging happens here in sync mode (never on the background thread: gc is global)
                    for lane, pending in zip(lanes, pendings):
                        try:  # a local tier failing on one process must not keep it from the collective commit
                            self._finish(lane, pending)
                        except Exception as exc:  # noqa: BLE001 - raised below, on every process
                            errors.append(exc)
            finally:
                for lane in lanes:
                    lane.committer.release()
            self._coordinator.everywhere(f"committing step {step}", lambda: _raise_first(errors))

    def _take_roots(self, step: int, lanes: list[_Lane]) -> None:
        for lane in lanes:
            lock = lane.tier.lock
            if lane.coordinator.is_primary and not lock.acquire():
                raise CheckpointError(
                    f"cannot save step {step}: {lock.root} is owned by another checkpoint manager ({lock.holder}); "
                    f"this one can only restore. If that process is gone, delete "
                    f"{lock.root.child(layout.MANAGER_LOCK)} (or wait lock_timeout_s).")

    def _check_background(self) -> None:
        """Raise the error of a failed background save of any tier (once). Does not block."""
        for lane in self._lanes:
            lane.committer.check()

    def _finish(self, lane: _Lane, save: PendingSave) -> None:
        """Commit `save` in `lane`'s tier (on every process of the job for the persistent tier), then retention
        (deletes deferred to the lane's background thread), then its commit callback. Collective for the
        persistent tier."""
        coordinator = lane.coordinator
        doomed = lane.tier.commit(coordinator, save, fsync=self._options.save_options.fsync,
                                  committed_at=time.time())
        if doomed and coordinator.is_primary:
            # Deleting is off the critical path: it never delays this save's return or the next staging.
            lane.committer.defer(f"deleting {lane.name} steps {doomed} (retention after step {save.step})",
                                 save.step, lambda: [lane.tier.delete(old) for old in doomed])
        if lane.on_commit is not None:
            lane.on_commit(save.step)

    def delete(self, step: int) -> None:
        """Delete a committed step from every tier that holds it (waits for pending saves first).
        `StepNotFoundError` if not committed. With several processes, call it on every process: the primary
        deletes the persistent step, every process its local one."""
        self._check_open()
        self.wait_until_finished()
        self.metadata(step)  # raises StepNotFoundError if not committed
        for lane in self._lanes:
            if step in lane.tier.committed():
                lane.tier.forget(step)
                self._caller_side(lane).on_primary(f"deleting step {step}", lambda lane=lane: lane.tier.delete(step))

    # ---------------------------------------------------------------------------------------- restore

    def restore(self, resume_from: int | str | None = "latest", *, model: Any = None, optimizer: Any = None,
                lr_scheduler: Any = None, extra: Any = None, data_loader: Any = None, restore_rng: bool = True,
                strict: bool = True, key_map: KeyMap | None = None, init_from: str | None = None) -> int | None:
        """Restore the given objects in place from a step chosen by `resume_from`; return that step.

        `resume_from`: None → restore nothing, return None; an int → that step, or, if it is not committed, a
        warning and the newest committed step; "latest" → the newest committed step. With nothing committed,
        returns None and leaves the objects untouched. Modules' parameters and buffers keep their identity,
        device and sharding; optimizers (fresh ones too) and schedulers are restored with
        ``load_state_dict``; a dict or list passed as `extra` is updated in place. `key_map` renames the
        checkpoint's keys of every item before they are matched (`xtc.restore`): for steps Orbax wrote, whose
        names differ from torch's. Steps of an Orbax root restore like ours. Each process gets back the
        RNG states it saved (`rng_state`). Waits for pending saves first and raises their errors. Raises
        `KeyMismatchError`, `ShapeMismatchError` or `CheckpointError` (naming step, item and path) when the
        objects do not match the checkpoint.

        With a local tier, the step comes from `resume.candidates`: the newest step committed in every process's
        local tier, if it is at least as new as the persistent tier's newest, else that persistent step (an int
        `resume_from` is looked up in the local tier first). A local step that any process finds damaged or
        incomplete is skipped with a warning naming it, and every process falls back to the next candidate,
        restoring every object again; the choice is logged (logger ``xla_tensorstore_ckpt``). A local step
        whose persistent copy was due but never committed (the run was killed while copying) is saved to the
        persistent tier again, in the background, when the objects restored are all its items. Collective with
        several processes.

        `init_from` starts a run from other weights when no step is committed (and `resume_from` is not None):
        `model` is restored from that checkpoint instead (a Hugging Face safetensors file or directory, an item
        `xtc.save` or Orbax wrote), with `strict` and `key_map` as above, and None is returned, as no step was
        restored. Once a step is committed, it wins: a restarted run resumes from its own checkpoints.

        Tensors are swapped in batch by batch (`RestoreOptions.read_batch_bytes`), so the restore needs about
        one batch of device memory beyond the state. Mismatches are found before anything changes; damaged
        data found part-way leaves the tensors of the batches before it restored.
        """
        self._check_open()
        if init_from is not None and model is None:
            raise UsageError("init_from initialises the model: pass model= as well")
        self._coordinator.everywhere("finishing earlier saves", self.wait_until_finished)
        if resume_from is None:
            return None
        wanted = self._resolve(resume_from)
        choices = resume.candidates(self._coordinator, self._local and self._local.tier, self._persistent.tier,
                                    wanted)
        if wanted is not None and not choices:
            choices = resume.candidates(self._coordinator, self._local and self._local.tier, self._persistent.tier,
                                        None)
            latest = choices[0].step if choices else None
            warnings.warn(f"step {wanted} is not committed under {self.directory}; resuming from "
                          f"{'nothing' if latest is None else f'the newest committed step, {latest}'}", stacklevel=2)
        requested = {name: obj for name, obj in zip(
            _OBJECT_ITEMS, (model, optimizer, lr_scheduler, extra, data_loader)) if obj is not None}
        restored = None
        for choice in choices:
            lane = self._local if choice.tier == LOCAL else self._persistent
            assert lane is not None  # candidates only names the local tier when there is one
            location = lane.tier.index.location(choice.step)
            if choice.tier == PERSISTENT:
                self._restore_step(lane, choice.step, requested, restore_rng, strict, key_map)
            else:
                error = None
                try:
                    self._restore_step(lane, choice.step, requested, restore_rng, strict, key_map)
                except Exception as exc:  # noqa: BLE001 - every process learns of it in `agree`, which raises
                    error = exc
                if not resume.agree(self._coordinator, choice, str(location), error):
                    continue
            log.info("restored step %d from the %s tier (%s)", choice.step, choice.tier, location)
            restored = choice
            break
        if choices and restored is None:
            raise CheckpointError(f"no intact step to resume from: the local steps {[c.step for c in choices]} of "
                                  f"{self.local_directory} are damaged and {self.directory} has no candidate step "
                                  "as new as them")
        self._discard_local_steps_after(None if restored is None else restored.step)
        if restored is None:
            if init_from is not None:
                training_state.restore_object(storage.location(init_from), model, strict=strict,
                                              options=self._options.restore_options, key_map=key_map)
            return None
        if restored.redo_persistent:
            self._redo_persistent_copy(restored, requested, restore_rng)
        return restored.step

    def _discard_local_steps_after(self, step: int | None) -> None:
        """Delete this process's local steps newer than the step the job resumed from (all, if it resumed from
        nothing): the run continues from there, and a step it saves again must not meet them (they are of the
        abandoned timeline, or damaged, or missing on another process)."""
        if self._local is None:
            return
        tier = self._local.tier
        newer = sorted(s for s in tier.committed() if step is None or s > step)
        if newer:
            warnings.warn(f"deleting steps {newer} of the local tier {tier.root}: the job resumed from "
                          f"{'nothing' if step is None else f'step {step}'}, so they will be saved again", stacklevel=4)
        for old in newer:
            tier.delete(old)

    def _restore_step(self, lane: _Lane, step: int, requested: Mapping[str, Any], restore_rng: bool, strict: bool,
                      key_map: KeyMap | None) -> None:
        own = lane is self._local  # a local step holds its writer's generator states alone, as a single row
        training_state.restore_step(
            lane.tier.index.location(step), lane.tier.marker(step), requested, strict=strict, key_map=key_map,
            options=self._options.restore_options,
            rng=(0, 1) if own else (self._coordinator.index, self._coordinator.count),
            restore_rng=restore_rng and self._options.save_rng)

    def _redo_persistent_copy(self, choice: Candidate, requested: Mapping[str, Any], restore_rng: bool) -> None:
        """Save a restored local step to the persistent tier, whose copy a killed run never committed, if the
        objects just restored are the whole step."""
        assert self._local is not None
        marker = self._local.tier.marker(choice.step)
        items = set(marker.items) - {RNG_ITEM}
        if items - set(requested) or (RNG_ITEM in marker.items and not (restore_rng and self._options.save_rng)):
            warnings.warn(f"step {choice.step} was due for {self.directory} but its copy never committed; it is "
                          f"not redone because the restore did not cover all its items ({sorted(marker.items)})",
                          stacklevel=3)
            return
        log.info("saving step %d to %s again: its copy there never committed", choice.step, self.directory)
        base = dataclasses.replace(marker, items=(), created_at=time.time(), writer=None, persistent_copy=False,
                                   persistent_root=None, versions=formats.writer_versions())
        try:
            self._save(choice.step, [self._persistent], requested, base)
        except CheckpointError as exc:  # raised on every process alike: the restore itself succeeded
            warnings.warn(f"step {choice.step} was restored, but its copy to {self.directory}, which never "
                          f"committed, could not be redone ({exc}); the next persistent save makes a new one",
                          stacklevel=3)

    def _resolve(self, resume_from: int | str) -> int | None:
        """None for "latest", else the step asked for."""
        if isinstance(resume_from, str):
            if resume_from != "latest":
                raise ValueError(f"resume_from must be None, a step or 'latest', got {resume_from!r}")
            return None
        if isinstance(resume_from, bool) or not isinstance(resume_from, int):
            raise TypeError(f"resume_from must be None, a step or 'latest', got {resume_from!r}")
        return resume_from

    # -------------------------------------------------------------------------------------- lifecycle

    def wait_until_finished(self) -> None:
        """Block until every pending save of every tier is committed; raise the error of a failed one."""
        for lane in self._lanes:
            lane.committer.wait()

    def close(self) -> None:
        """Wait for pending saves (raising their errors), release the background threads, the roots and the
        process groups. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._preemption.close()
        try:
            self._close_lanes(list(self._lanes))
        finally:
            self._coordinator.close()

    def _close_lanes(self, lanes: list[_Lane]) -> None:
        lane = lanes.pop()
        try:
            try:
                lane.committer.close()
            finally:
                try:
                    lane.tier.lock.release()
                finally:
                    lane.coordinator.close()
        finally:
            if lanes:
                self._close_lanes(lanes)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the checkpoint manager for {self.directory} is closed")


def _raise_first(errors: list[Exception]) -> None:
    if errors:
        raise errors[0]


def _check_root(root: storage.Location, create: bool) -> None:
    for marker, what in ((layout.CHECKPOINT_METADATA, "a step"), (layout.ITEM_METADATA, "an item")):
        if root.read(marker) is not None:
            raise CheckpointError(f"{root} is {what} directory, not a checkpoint root; "
                                  "pass the directory that holds the steps")
    if not create and not root.exists():
        raise CheckpointNotFoundError(f"checkpoint root {root} does not exist (and create=False)")

