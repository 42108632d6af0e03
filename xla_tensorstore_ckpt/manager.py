"""CheckpointManager: step directories with atomic commits, retention, latest-step discovery and resume of the
whole training state (model, optimizer, LR scheduler, data position, RNGs, metrics).

Layout: ``<root>/<step>/<item>/`` per saved object plus ``<root>/<step>/_CHECKPOINT_METADATA``, the commit marker,
written last (`commit`). The steps of the root, its lock, retention and commits: `tier.Tier`. Saving and
restoring training objects: `training_state`.

Saves are asynchronous by default: `save` blocks only while shards are copied off the devices, and one
background thread finishes the save (writes, sync, manifests, marker). Retention deletes run on that thread after
the commit, in both modes, so they never stall training. Background errors are re-raised at the next `save`,
`restore`, `wait_until_finished` or `close`. The manager is meant to be driven by one thread of one
training job; the public methods are not safe to call concurrently from several threads.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Mapping
from typing import Any

from . import formats, layout, rng_state, saving, storage, training_state
from .async_save import BackgroundCommitter
from .distributed import Coordinator
from .errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError, UsageError
from .formats import StepMetadata
from .gc_pause import paused_gc
from .options import CheckpointManagerOptions
from .policies import RetentionPolicy, SavePolicy
from .preemption import PreemptionWatch
from .restoring import KeyMap
from .tier import PendingSave, Tier

RNG_ITEM = "rng"
_OBJECT_ITEMS = ("model", "optimizer", "lr_scheduler", "extra", "data_loader")


class CheckpointManager:
    """Saves and restores the training state under one root directory, one sub-directory per step.

    ``with CheckpointManager(root, options) as manager:`` closes (and waits for) the manager at the end.
    Raises `CheckpointError` if `directory` is a step or item directory rather than a root, and
    `CheckpointNotFoundError` if it does not exist and `options.create` is False.
    """

    def __init__(self, directory: str | os.PathLike | storage.Location,
                 options: CheckpointManagerOptions | None = None):
        self._options = options = options or CheckpointManagerOptions()
        root = storage.location(directory)
        _check_root(root, options.create)
        retention = RetentionPolicy(
            max_to_keep=options.max_to_keep, keep_period=options.keep_period, best_fn=options.best_fn,
            best_mode=options.best_mode, keep_checkpoints_without_metrics=options.keep_checkpoints_without_metrics)
        self._tier = Tier(root, step_prefix=options.step_prefix, retention=retention,
                          lock_timeout_s=options.lock_timeout_s)
        self._save_policy = SavePolicy(interval=options.save_interval_steps, steps=options.save_on_steps)
        self._committer = BackgroundCommitter(options.max_pending_saves)
        # Two groups: collectives of the caller's thread and of the background commits never interleave.
        self._coordinator = Coordinator.from_environment(options.coordination_timeout_s)
        self._commit_coordinator = Coordinator.from_environment(options.coordination_timeout_s)
        self._in_flight: int | None = None
        self._closed = False
        self.reload()
        self._preemption = PreemptionWatch(options.save_on_preemption)

    # ---------------------------------------------------------------------------------------- queries

    @property
    def directory(self) -> str:
        return str(self._tier.root)

    def reload(self) -> None:
        """Re-read the committed steps from storage and, unless another live manager owns the root, remove
        partial steps (saves that never committed). Called by the constructor. The primary process decides;
        every process gets the same answer. Collective with several processes. Blocks."""
        self._tier.reload(self._coordinator)

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first. An asynchronous save appears here once its commit has landed."""
        return sorted(self._tier.committed())

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        return max(self._tier.committed(), default=None)

    def best_step(self) -> int | None:
        """The best committed step by `best_fn` (None without `best_fn` or metrics)."""
        metrics = {s: m.metrics for s, m in self._tier.committed().items()}
        return self._tier.retention.best_step(list(metrics), metrics)

    def metadata(self, step: int) -> StepMetadata:
        """The commit marker of a committed step: items, times, metrics, versions. `StepNotFoundError` if the
        step is not committed."""
        return self._tier.marker(step)

    def should_save(self, step: int) -> bool:
        """True if `step` is due by the save interval / steps (or a SIGTERM arrived) and not yet saved."""
        if self._preemption.pending:
            return step not in self._tier.committed()
        latest = self.latest_step()
        last = latest if self._in_flight is None else max(latest or 0, self._in_flight)
        return self._save_policy.should_save(step, last)

    def reached_preemption(self, step: int) -> bool:
        """True once a SIGTERM arrived (with `save_on_preemption`) and the state up to `step` is committed:
        the training loop should exit now and resume later from this step."""
        return self._preemption.reached(step)

    def step_path(self, step: int) -> str:
        """Where a step lives (committed or not)."""
        return str(self._tier.index.location(step))

    # ------------------------------------------------------------------------------------------- save

    def save(self, step: int, *, model: Any = None, optimizer: Any = None, lr_scheduler: Any = None,
             extra: Any = None, data_loader: Any = None, metrics: Mapping[str, Any] | None = None,
             custom_metadata: Mapping[str, Any] | None = None, force: bool = False) -> bool:
        """Save the given objects as `step` if it is due (`should_save`) or `force` is set; return whether a
        save was started.

        `model` is an `nn.Module` or a state tree, `optimizer` a torch optimizer or a tree, `lr_scheduler`
        and `data_loader` objects with ``state_dict()`` or trees, `extra` any tree. Blocks until the shards are
        copied off the devices (async mode) or until the step is committed (sync mode). Raises
        `AsyncSaveError` for a failed earlier background save, `CheckpointExistsError` if `step` is committed
        and `force` is False (with `force` it is replaced), `UnsupportedValueError` before anything is
        written if a value cannot be stored.
        """
        self._check_open()
        self._committer.check()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if step in self._tier.committed() and not force:
            raise CheckpointExistsError(f"step {step} is already committed at {self._tier.index.location(step)}; "
                                        "pass force=True to replace it")
        if not force and not self.should_save(step):
            return False
        lock = self._tier.lock
        if self._coordinator.is_primary and not lock.acquire():
            raise CheckpointError(
                f"cannot save step {step}: {lock.root} is owned by another checkpoint manager ({lock.holder}); "
                f"this one can only restore. If that process is gone, delete "
                f"{lock.root.child(layout.MANAGER_LOCK)} (or wait lock_timeout_s).")
        marker = StepMetadata(step=step, items=(), created_at=time.time(), committed_at=0.0,
                              metrics=training_state.metrics_json(dict(metrics) if metrics is not None else None),
                              custom=dict(custom_metadata) if custom_metadata is not None else None,
                              versions=formats.writer_versions(), process_count=self._coordinator.count,
                              format_version=formats.WRITE_VERSION)
        items = {name: training_state.state_of(obj) for name, obj in zip(
            _OBJECT_ITEMS, (model, optimizer, lr_scheduler, extra, data_loader)) if obj is not None}
        if self._options.save_rng:
            items[RNG_ITEM] = rng_state.capture(self._coordinator.index, self._coordinator.count)
        self._committer.reserve()
        try:
            self._committer.check()  # the save this one waited for may have failed meanwhile
            pending = self._stage(step, items, marker)
        except BaseException:
            self._committer.release()
            raise
        self._in_flight = step
        if self._options.async_save:
            self._committer.submit(step, lambda: self._finish(pending))
        else:
            try:
                with paused_gc():  # staging happens here in sync mode (never on the background thread: gc is global)
                    self._finish(pending)
            finally:
                self._committer.release()
        if self._preemption.pending:
            self._committer.wait()  # the process is about to be killed: the commit must land first
            self._preemption.saved_on_notice(step)
            warnings.warn(f"SIGTERM received: step {step} is committed at {pending.final}; the trainer should "
                          "exit", stacklevel=2)
        return True

    def _stage(self, step: int, items: dict, marker: StepMetadata) -> PendingSave:
        """Plan every item, clear the step directory, and copy the shards off the devices (async mode)."""
        options = self._options.save_options
        with paused_gc():  # many small records live until the save is planned and staged
            plans = {name: saving.plan_save(state, options, self._coordinator) for name, state in items.items()}
            location, final = self._tier.prepare(self._coordinator, step)
            start = self._coordinator.everywhere(f"staging step {step}", lambda: saving.begin_writes(
                location, plans, options, writer=self._coordinator.index, background=self._options.async_save,
                max_host_bytes=self._options.max_host_bytes))
        return PendingSave(step, location, final, plans, start, dataclasses.replace(marker, items=tuple(plans)))

    def _finish(self, save: PendingSave) -> None:
        """Commit on every process, then retention (deletes deferred to the background thread), then
        `on_commit`. Collective."""
        coordinator = self._commit_coordinator
        doomed = self._tier.commit(coordinator, save, fsync=self._options.save_options.fsync,
                                   committed_at=time.time())
        if doomed and coordinator.is_primary:
            # Deleting is off the critical path: it never delays this save's return or the next staging.
            self._committer.defer(f"deleting steps {doomed} (retention after step {save.step})", save.step,
                                  lambda: [self._tier.delete(old) for old in doomed])
        if self._options.on_commit is not None:
            self._options.on_commit(save.step)

    def delete(self, step: int) -> None:
        """Delete a committed step (waits for pending saves first). `StepNotFoundError` if not committed.
        With several processes, call it on every process: the primary deletes, all agree."""
        self._check_open()
        self._committer.wait()
        self._tier.marker(step)  # raises StepNotFoundError if not committed
        self._tier.forget(step)
        self._coordinator.on_primary(f"deleting step {step}", lambda: self._tier.delete(step))

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
        self._committer.wait()
        step = self._resolve(resume_from)
        if step is None:
            if init_from is not None and resume_from is not None:
                training_state.restore_object(storage.location(init_from), model, strict=strict,
                                              options=self._options.restore_options, key_map=key_map)
            return None
        marker = self.metadata(step)
        location = self._tier.index.location(step)
        requested = {name: obj for name, obj in zip(
            _OBJECT_ITEMS, (model, optimizer, lr_scheduler, extra, data_loader)) if obj is not None}
        for name in requested:
            if name not in marker.items:
                raise CheckpointNotFoundError(
                    f"step {step} at {location} has no {name!r} item (it holds {', '.join(marker.items)})")
        options = self._options.restore_options
        for name, obj in requested.items():
            training_state.restore_object(location.child(name), obj, strict=strict, options=options,
                                          key_map=key_map)
        if restore_rng and self._options.save_rng and RNG_ITEM in marker.items:
            rng_state.restore(location.child(RNG_ITEM), self._coordinator.index, self._coordinator.count,
                              options=options)
        return step

    def _resolve(self, resume_from: int | str | None) -> int | None:
        if resume_from is None:
            return None
        if isinstance(resume_from, str):
            if resume_from != "latest":
                raise ValueError(f"resume_from must be None, a step or 'latest', got {resume_from!r}")
            return self.latest_step()
        if isinstance(resume_from, bool) or not isinstance(resume_from, int):
            raise TypeError(f"resume_from must be None, a step or 'latest', got {resume_from!r}")
        if resume_from in self._tier.committed():
            return resume_from
        latest = self.latest_step()
        warnings.warn(f"step {resume_from} is not committed under {self._tier.root}; resuming from "
                      f"{'nothing' if latest is None else f'the newest committed step, {latest}'}", stacklevel=3)
        return latest

    # -------------------------------------------------------------------------------------- lifecycle

    def wait_until_finished(self) -> None:
        """Block until every pending save is committed; raise the error of a failed one."""
        self._committer.wait()

    def close(self) -> None:
        """Wait for pending saves (raising their errors), release the background thread, the root and the
        process groups. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._preemption.close()
        try:
            self._committer.close()
        finally:
            try:
                self._tier.lock.release()
            finally:
                self._coordinator.close()
                self._commit_coordinator.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the checkpoint manager for {self._tier.root} is closed")


def _check_root(root: storage.Location, create: bool) -> None:
    for marker, what in ((layout.CHECKPOINT_METADATA, "a step"), (layout.ITEM_METADATA, "an item")):
        if root.read(marker) is not None:
            raise CheckpointError(f"{root} is {what} directory, not a checkpoint root; "
                                  "pass the directory that holds the steps")
    if not create and not root.exists():
        raise CheckpointNotFoundError(f"checkpoint root {root} does not exist (and create=False)")

