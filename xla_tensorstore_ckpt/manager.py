"""CheckpointManager: step directories with atomic commits, retention, latest-step discovery and resume of the
whole training state (model, optimizer, LR scheduler, data position, RNGs, metrics).

Layout: ``<root>/<step>/<item>/`` per saved object plus ``<root>/<step>/_CHECKPOINT_METADATA``, the commit marker,
written last. A step is committed iff its marker exists and decodes; anything else under a step name is a
partial save, never restored, and removed when a manager starts. Commits never rely on rename, so the same
protocol holds on object stores and a copied step directory stays valid.

Saves are asynchronous by default: `save` blocks only while shards are copied off the devices, and one
background thread finishes the save (writes, sync, manifests, marker). Retention deletes run on that thread after
the commit, in both modes, so they never stall training. Background errors are re-raised at the next `save`,
`restore`, `wait_until_finished` or `close`. The manager is meant to be driven by one thread of one
training job; the public methods are not safe to call concurrently from several threads.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from . import arrays, checkpointer, layout, restoring, rng_state, saving, storage, training_state
from .async_save import BackgroundCommitter
from .distributed import Coordinator
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    StepNotFoundError,
    StorageError,
)
from .gc_pause import paused_gc
from .metadata import StepMetadata
from .options import RestoreOptions, SaveOptions
from .policies import RetentionPolicy, SavePolicy

RNG_ITEM = "rng"
_TAKEOVER = f"{layout.MANAGER_LOCK}.takeover."
_OBJECT_ITEMS = ("model", "optimizer", "lr_scheduler", "extra", "data_loader")


def _optional_int(name: str, value: object, minimum: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ValueError(f"{name} must be None or an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class CheckpointManagerOptions:
    """How a `CheckpointManager` decides, keeps and writes steps.

    save_interval_steps: `should_save(step)` is true every N steps (what a trainer's `save_steps` maps to);
        None saves only on `save_on_steps`, on `force=True` or on preemption.
    save_on_steps: further steps to save at.
    max_to_keep, keep_period, best_fn, best_mode, keep_checkpoints_without_metrics: retention (see
        `RetentionPolicy`); the newest committed step is never deleted.
    step_prefix: step directories are named ``<prefix>_<step>`` instead of ``<step>``.
    create: create the root on the first save; if False the root must exist.
    async_save: `save` returns once shards are copied off the devices; the rest runs in the background.
    max_pending_saves: saves in flight at once; a new save waits for the oldest before staging.
    max_host_bytes: cap on staged host memory per save; a larger state is streamed (the save blocks longer).
    save_rng: save the torch, Python, numpy and XLA RNG states with each step (restored by `restore`).
    save_on_preemption: install a SIGTERM handler (the manager must be created on the main thread); after a
        SIGTERM the next `save` call saves whatever the interval says and waits for the commit, and
        `reached_preemption(step)` tells the training loop to exit.
    coordination_timeout_s: in a job of several processes, how long a process waits for the others at a
        synchronization point before failing the save with `CoordinationError` (a dead process is usually
        detected at once, through its closed connection).
    lock_timeout_s: a manager owns its root through ``<root>/_MANAGER_LOCK`` (refreshed at every commit). Another
        manager finding a live owner's lock only reads (restores, lists) and refuses to save. A lock is stale —
        taken over — when its process is gone (same host) or it has not been refreshed for this long (other hosts).
    on_commit: called with the step number once a step is committed (its marker durable), on every process;
        in async mode on the background thread. What it raises is reported like a failed background save (the
        step stays committed). `all_steps()` and `latest_step()` show the same commits. A trainer that must
        know what survives a kill waits for this, or calls `wait_until_finished()`, before it exits.
    save_options, restore_options: item-level I/O options.
    """

    save_interval_steps: int | None = 100
    save_on_steps: frozenset[int] = field(default_factory=frozenset)
    max_to_keep: int | None = 3
    keep_period: int | None = None
    best_fn: Callable[[Mapping[str, Any]], float] | None = None
    best_mode: str = "min"
    keep_checkpoints_without_metrics: bool = True
    step_prefix: str | None = None
    create: bool = True
    async_save: bool = True
    max_pending_saves: int = 1
    max_host_bytes: int | None = None
    save_rng: bool = True
    save_on_preemption: bool = False
    coordination_timeout_s: float = 600.0
    lock_timeout_s: float = 1800.0
    on_commit: Callable[[int], None] | None = None
    save_options: SaveOptions = field(default_factory=SaveOptions)
    restore_options: RestoreOptions = field(default_factory=RestoreOptions)

    def __post_init__(self) -> None:
        _optional_int("save_interval_steps", self.save_interval_steps, 1)
        _optional_int("max_to_keep", self.max_to_keep, 1)
        _optional_int("keep_period", self.keep_period, 1)
        _optional_int("max_host_bytes", self.max_host_bytes, 1)
        _optional_int("max_pending_saves", self.max_pending_saves, 1)
        for name in ("coordination_timeout_s", "lock_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not isinstance(self.save_on_steps, frozenset) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in self.save_on_steps):
            raise ValueError(f"save_on_steps must be a frozenset of step numbers, got {self.save_on_steps!r}")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
        for name in ("best_fn", "on_commit"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ValueError(f"{name} must be callable")
        if self.step_prefix is not None and (not self.step_prefix or "/" in self.step_prefix
                                             or not layout.is_safe_relative_path(self.step_prefix)):
            raise ValueError(f"step_prefix {self.step_prefix!r} is not a plain name")
        for name in ("create", "async_save", "save_rng", "save_on_preemption", "keep_checkpoints_without_metrics"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool")


class CheckpointManager:
    """Saves and restores the training state under one root directory, one sub-directory per step.

    ``with CheckpointManager(root, options) as manager:`` closes (and waits for) the manager at the end.
    Raises `CheckpointError` if `directory` is a step or item directory rather than a root, and
    `CheckpointNotFoundError` if it does not exist and `options.create` is False.
    """

    def __init__(self, directory: str | os.PathLike, options: CheckpointManagerOptions | None = None):
        self._options = options or CheckpointManagerOptions()
        self._root = storage.location(directory)
        self._save_policy = SavePolicy(interval=self._options.save_interval_steps,
                                       steps=self._options.save_on_steps)
        self._retention = RetentionPolicy(
            max_to_keep=self._options.max_to_keep, keep_period=self._options.keep_period,
            best_fn=self._options.best_fn, best_mode=self._options.best_mode,
            keep_checkpoints_without_metrics=self._options.keep_checkpoints_without_metrics)
        self._committer = BackgroundCommitter(self._options.max_pending_saves)
        # Two groups: collectives of the caller's thread and of the background commits never interleave.
        timeout = self._options.coordination_timeout_s
        self._coordinator = Coordinator.from_environment(timeout)
        self._commit_coordinator = Coordinator.from_environment(timeout)
        self._lock = threading.Lock()  # guards _steps, which the background thread updates
        self._steps: dict[int, StepMetadata] = {}
        self._in_flight: int | None = None
        self._closed = False
        self._preempted = threading.Event()
        self._preemption_step: int | None = None
        self._previous_sigterm: Any = None
        self._check_root()
        self._owner = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex}
        self._lock_holder: dict | None = None  # another manager that owns the root, if any
        self._owns_lock = False  # taken at the first save: a manager that only restores never writes
        self._takeover_marker: str | None = None  # the stale lock this manager took over, if any
        if self._coordinator.is_primary:
            self._lock_holder = self._live_holder()
        self.reload()
        if self._options.save_on_preemption:
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._preempted.set()
        if callable(self._previous_sigterm):
            self._previous_sigterm(signum, frame)

    def reached_preemption(self, step: int) -> bool:
        """True once a SIGTERM arrived (with `save_on_preemption`) and the state up to `step` is committed:
        the training loop should exit now and resume later from this step."""
        return self._preemption_step is not None and step >= self._preemption_step

    # ---------------------------------------------------------------------------------------- queries

    @property
    def directory(self) -> str:
        return str(self._root)

    def _live_holder(self) -> dict | None:
        """The manager that owns the root and is alive, or None (a stale lock counts as none)."""
        data = storage.read(self._root, layout.MANAGER_LOCK)
        holder = _decode_lock(data) if data is not None else None
        return holder if holder is not None and self._is_live(holder) else None

    def _take_lock(self) -> bool:
        """Own the root, unless a live manager does (then remember who, for error messages).

        A free root is taken by an exclusive create (atomic on every backend). A stale lock is taken over
        through an exclusive create of ``_MANAGER_LOCK.takeover.<stale token>``: of several managers that found
        the same stale lock at once, exactly one creates it and overwrites the lock; the others then find a
        live owner. The marker stays until this manager closes, so that a contender still holding the stale
        record cannot create it again meanwhile."""
        record = self._lock_record()
        for _ in range(3):
            if storage.create_exclusive(self._root, layout.MANAGER_LOCK, record):
                self._lock_holder = None
                return True
            data = storage.read(self._root, layout.MANAGER_LOCK)
            if data is None:
                continue  # released meanwhile: try again
            holder = _decode_lock(data)
            if holder is not None and self._is_live(holder):
                self._lock_holder = holder
                return False
            stale = holder.get("token") if holder is not None else None
            if not isinstance(stale, str) or not stale.isalnum():
                stale = hashlib.sha256(data).hexdigest()[:32]  # unreadable: named by its content
            if storage.create_exclusive(self._root, f"{_TAKEOVER}{stale}", record):
                storage.write(self._root, layout.MANAGER_LOCK, record, fsync=False)
                self._takeover_marker = f"{_TAKEOVER}{stale}"
                for name in storage.list_children(self._root):
                    if name.startswith(_TAKEOVER) and name != self._takeover_marker:
                        storage.delete(self._root, name)  # of earlier takeovers by owners that died since
                self._lock_holder = None
                return True
        self._lock_holder = self._live_holder()
        return False

    def _lock_record(self) -> bytes:
        return json.dumps({**self._owner, "heartbeat": time.time()}).encode()

    def _is_live(self, holder: dict) -> bool:
        if holder.get("host") == self._owner["host"]:
            return _pid_alive(holder.get("pid"))
        heartbeat = holder.get("heartbeat")
        return isinstance(heartbeat, (int, float)) and time.time() - heartbeat < self._options.lock_timeout_s

    def reload(self) -> None:
        """Re-read the committed steps from storage and, unless another live manager owns the root, remove
        partial steps (saves that never committed). Called by the constructor. The primary process decides;
        every process gets the same answer. Collective with several processes. Blocks."""
        steps: dict[int, StepMetadata] = {}
        if self._coordinator.is_primary:
            for name in storage.list_children(self._root):
                step = layout.parse_step_name(name, self._options.step_prefix)
                if step is None:
                    continue
                marker = self._read_marker(step, name)
                if marker is not None:
                    steps[step] = marker
                elif self._lock_holder is None and storage.read(self._root.child(name),
                                                                layout.CHECKPOINT_METADATA) is None:
                    storage.delete_tree(self._root.child(name))  # a save that crashed before its commit
        steps = self._coordinator.broadcast(steps)
        with self._lock:
            self._steps = steps

    def _read_marker(self, step: int, name: str) -> StepMetadata | None:
        where = str(self._root.child(name, layout.CHECKPOINT_METADATA))
        data = storage.read(self._root.child(name), layout.CHECKPOINT_METADATA)
        if data is None:
            return None
        try:
            marker = StepMetadata.from_bytes(data, where=where)
        except (CorruptCheckpointError, FormatVersionError) as exc:
            warnings.warn(f"ignoring step {step}: {exc}", stacklevel=3)
            return None
        if marker.step != step:
            warnings.warn(f"ignoring step {step}: its marker {where} names step {marker.step}", stacklevel=3)
            return None
        return marker

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first. An asynchronous save appears here once its commit has landed."""
        with self._lock:
            return sorted(self._steps)

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        with self._lock:
            return max(self._steps, default=None)

    def best_step(self) -> int | None:
        """The best committed step by `best_fn` (None without `best_fn` or metrics)."""
        with self._lock:
            metrics = {s: m.metrics for s, m in self._steps.items()}
        return self._retention.best_step(list(metrics), metrics)

    def metadata(self, step: int) -> StepMetadata:
        """The commit marker of a committed step: items, times, metrics, versions. `StepNotFoundError` if the
        step is not committed."""
        with self._lock:
            marker = self._steps.get(step)
        if marker is None:
            raise StepNotFoundError(self._not_committed(step))
        return marker

    def should_save(self, step: int) -> bool:
        """True if `step` is due by the save interval / steps (or a SIGTERM arrived) and not yet saved."""
        if self._preempted.is_set() and self._preemption_step is None:
            with self._lock:
                return step not in self._steps
        latest = self.latest_step()
        last = latest if self._in_flight is None else max(latest or 0, self._in_flight)
        return self._save_policy.should_save(step, last)

    def step_path(self, step: int) -> str:
        """Where a step lives (committed or not)."""
        return str(self._step_location(step))

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
        with self._lock:
            committed = step in self._steps
        if committed and not force:
            raise CheckpointExistsError(f"step {step} is already committed at {self._step_location(step)}; "
                                        "pass force=True to replace it")
        if not force and not self.should_save(step):
            return False
        if self._coordinator.is_primary and not self._owns_lock:
            self._owns_lock = self._take_lock()
        if self._coordinator.is_primary and not self._owns_lock:
            raise CheckpointError(
                f"cannot save step {step}: {self._root} is owned by another checkpoint manager "
                f"({self._lock_holder}); this one can only restore. If that process is gone, delete "
                f"{self._root.child(layout.MANAGER_LOCK)} (or wait lock_timeout_s).")
        created_at = time.time()
        items = {name: training_state.state_of(obj) for name, obj in zip(
            _OBJECT_ITEMS, (model, optimizer, lr_scheduler, extra, data_loader)) if obj is not None}
        if self._options.save_rng:
            items[RNG_ITEM] = rng_state.capture(self._coordinator.index, self._coordinator.count)
        metrics_json = training_state.metrics_json(dict(metrics) if metrics is not None else None)
        custom = dict(custom_metadata) if custom_metadata is not None else None
        options = self._options.save_options
        step_loc = self._step_location(step)
        self._committer.reserve()
        try:
            self._committer.check()  # the save this one waited for may have failed meanwhile
            with paused_gc():  # many small records live until the save is planned and staged
                plans = {name: saving.plan_save(state, options, self._coordinator) for name, state in items.items()}
                error = None
                if self._coordinator.is_primary:
                    try:
                        if committed:
                            self._delete_step(step)
                        if not storage.is_empty(step_loc):
                            storage.delete_tree(step_loc)  # leftovers of a crashed save of this step
                    except StorageError as exc:
                        error = exc
                self._coordinator.raise_unless_ok(error, f"preparing step {step} at {step_loc}")
                with self._lock:
                    self._steps.pop(step, None)
                if self._options.async_save and self._options.max_host_bytes is None:
                    # Only the copy off the devices happens here; creating arrays and issuing writes (a fraction of
                    # a millisecond per chunk) is left to the background thread.
                    staged = {name: saving.stage_all(plan.arrays, options, copy_cpu=True)
                              for name, plan in plans.items()}

                    def start() -> dict[str, saving.Writes]:
                        return {name: saving.start_writes(step_loc.child(name), plan.arrays, staged.pop(name), options)
                                for name, plan in plans.items()}
                else:
                    started = {name: saving.issue_writes(
                        step_loc.child(name), plan.arrays, options, copy_cpu=self._options.async_save,
                        max_host_bytes=self._host_budget()) for name, plan in plans.items()}

                    def start() -> dict[str, saving.Writes]:
                        return started
        except BaseException:
            self._committer.release()
            raise
        self._in_flight = step

        def finish() -> None:
            self._finish(step, step_loc, plans, start, metrics_json, custom, created_at)

        if self._options.async_save:
            self._committer.submit(step, finish)
        else:
            try:
                finish()
            finally:
                self._committer.release()
        if self._preempted.is_set() and self._preemption_step is None:
            self._committer.wait()  # the process is about to be killed: the commit must land first
            self._preemption_step = step
            warnings.warn(f"SIGTERM received: step {step} is committed at {step_loc}; the trainer should exit",
                          stacklevel=2)
        return True

    def _host_budget(self) -> int | None:
        """Staged bytes a save may hold: the user's cap; in synchronous mode (where staged data is dropped as
        soon as it is written) two batches: the one being written and the one being fetched."""
        if self._options.max_host_bytes is not None or self._options.async_save:
            return self._options.max_host_bytes
        return 2 * self._options.save_options.host_batch_bytes

    def _finish(self, step: int, step_loc: storage.Location, plans: dict, start: Callable[[], dict],
                metrics: dict | None, custom: dict | None, created_at: float) -> None:
        """Start (if not started) and wait for this process's writes and make them durable; once every process
        has, the primary writes the manifests, then the commit marker; every process learns the outcome. Then
        retention."""
        coordinator = self._commit_coordinator
        options = self._options.save_options
        error = None
        try:
            writes = start()
            arrays.wait_all([p for w in writes.values() for p in w.pending])
            if options.fsync:
                storage.sync_files(step_loc, [f"{name}/{f}" for name, w in writes.items() for f in w.files])
        except Exception as exc:  # noqa: BLE001 - shared with every process, then raised
            error = exc
        coordinator.raise_unless_ok(error, f"writing step {step} to {step_loc}")
        marker = StepMetadata(step=step, items=tuple(plans), created_at=created_at, committed_at=time.time(),
                              metrics=metrics, custom=custom, versions=_versions(),
                              process_count=coordinator.count)
        doomed: list[int] = []
        if coordinator.is_primary:
            try:
                for name, plan in plans.items():
                    saving.write_manifest(step_loc.child(name), plan.manifest, options)
                storage.write(step_loc, layout.CHECKPOINT_METADATA, marker.to_bytes(), fsync=options.fsync)
                storage.write(self._root, layout.MANAGER_LOCK, self._lock_record(), fsync=False)  # heartbeat
                with self._lock:
                    metrics_by_step = {s: m.metrics for s, m in self._steps.items()}
                metrics_by_step[step] = metrics
                doomed = self._retention.steps_to_delete(list(metrics_by_step), metrics_by_step)
            except Exception as exc:  # noqa: BLE001 - shared with every process, then raised
                error = exc
        coordinator.raise_unless_ok(error, f"committing step {step} at {step_loc}")
        doomed = coordinator.broadcast(doomed)
        with self._lock:
            self._steps[step] = marker
            for old in doomed:
                self._steps.pop(old, None)
        if doomed and coordinator.is_primary:
            # Deleting is off the critical path: it never delays this save's return or the next staging.
            self._committer.defer(f"deleting steps {doomed} (retention after step {step})", step,
                                  lambda: [self._delete_step(old) for old in doomed])
        if self._options.on_commit is not None:
            self._options.on_commit(step)

    def _delete_step(self, step: int) -> None:
        """Uncommit (marker first), then delete. Retried; a step is never left committed but half deleted."""
        with self._lock:
            self._steps.pop(step, None)
        step_loc = self._step_location(step)
        for attempt in range(3):
            try:
                storage.delete(step_loc, layout.CHECKPOINT_METADATA)
                storage.delete_tree(step_loc)
                return
            except StorageError:
                if attempt == 2:
                    raise
                time.sleep(0.1 * 2**attempt)

    def delete(self, step: int) -> None:
        """Delete a committed step (waits for pending saves first). `StepNotFoundError` if not committed.
        With several processes, call it on every process: the primary deletes, all agree."""
        self._check_open()
        self._committer.wait()
        self.metadata(step)  # raises StepNotFoundError if not committed
        error = None
        if self._coordinator.is_primary:
            try:
                self._delete_step(step)
            except StorageError as exc:
                error = exc
        self._coordinator.raise_unless_ok(error, f"deleting step {step}")
        with self._lock:
            self._steps.pop(step, None)

    # ---------------------------------------------------------------------------------------- restore

    def restore(self, resume_from: int | str | None = "latest", *, model: Any = None, optimizer: Any = None,
                lr_scheduler: Any = None, extra: Any = None, data_loader: Any = None, restore_rng: bool = True,
                strict: bool = True) -> int | None:
        """Restore the given objects in place from a step chosen by `resume_from`; return that step.

        `resume_from`: None → restore nothing, return None; an int → that step, or, if it is not committed, a
        warning and the newest committed step; "latest" → the newest committed step. With nothing committed,
        returns None and leaves the objects untouched. Modules' parameters and buffers keep their identity,
        device and sharding; optimizers (fresh ones too) and schedulers are restored with
        ``load_state_dict``; a dict or list passed as `extra` is updated in place. Waits for pending saves
        first and raises their errors. Raises `KeyMismatchError`, `ShapeMismatchError` or `CheckpointError`
        (naming step, item and path) when the objects do not match the checkpoint.

        Tensors are swapped in batch by batch (`RestoreOptions.read_batch_bytes`), so the restore needs about
        one batch of device memory beyond the state. Mismatches are found before anything changes; damaged
        data found part-way leaves the tensors of the batches before it restored.
        """
        self._check_open()
        self._committer.wait()
        step = self._resolve(resume_from)
        if step is None:
            return None
        marker = self.metadata(step)
        step_loc = self._step_location(step)
        requested = {name: obj for name, obj in zip(
            _OBJECT_ITEMS, (model, optimizer, lr_scheduler, extra, data_loader)) if obj is not None}
        for name in requested:
            if name not in marker.items:
                raise CheckpointNotFoundError(
                    f"step {step} at {step_loc} has no {name!r} item (it holds {', '.join(marker.items)})")
        options = self._options.restore_options
        for name, obj in requested.items():
            item_loc = step_loc.child(name)
            if isinstance(obj, torch.nn.Module):
                target = training_state.module_target(obj)
                _restore_in_place(item_loc, target, strict, options)
            elif isinstance(obj, torch.optim.Optimizer):
                target = training_state.optimizer_target(obj, restoring.read_manifest(item_loc).tree, str(item_loc))
                obj.load_state_dict(checkpointer.restore(item_loc, target, options=options))
            elif hasattr(obj, "load_state_dict") and callable(obj.load_state_dict):
                obj.load_state_dict(checkpointer.restore(item_loc, options=options))
            else:
                _restore_in_place(item_loc, obj, strict, options)
        if restore_rng and self._options.save_rng and RNG_ITEM in marker.items:
            rng_loc = step_loc.child(RNG_ITEM)
            rng_state.restore(checkpointer.restore(rng_loc, options=options), self._coordinator.index,
                              self._coordinator.count, where=str(rng_loc))
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
        with self._lock:
            if resume_from in self._steps:
                return resume_from
        latest = self.latest_step()
        warnings.warn(f"step {resume_from} is not committed under {self._root}; resuming from "
                      f"{'nothing' if latest is None else f'the newest committed step, {latest}'}", stacklevel=3)
        return latest

    # -------------------------------------------------------------------------------------- lifecycle

    def wait_until_finished(self) -> None:
        """Block until every pending save is committed; raise the error of a failed one."""
        self._committer.wait()

    def close(self) -> None:
        """Wait for pending saves (raising their errors) and release the background thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._options.save_on_preemption:
            previous = self._previous_sigterm
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        try:
            self._committer.close()
        finally:
            try:
                if self._owns_lock:
                    self._owns_lock = False
                    storage.delete(self._root, layout.MANAGER_LOCK)
                    if self._takeover_marker is not None:
                        storage.delete(self._root, self._takeover_marker)
            finally:
                self._coordinator.close()
                self._commit_coordinator.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -------------------------------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the checkpoint manager for {self._root} is closed")

    def _check_root(self) -> None:
        for marker, what in ((layout.CHECKPOINT_METADATA, "a step"), (layout.ITEM_METADATA, "an item")):
            if storage.read(self._root, marker) is not None:
                raise CheckpointError(f"{self._root} is {what} directory, not a checkpoint root; "
                                      "pass the directory that holds the steps")
        if not self._options.create and not storage.exists(self._root):
            raise CheckpointNotFoundError(f"checkpoint root {self._root} does not exist (and create=False)")

    def _step_location(self, step: int) -> storage.Location:
        return self._root.child(layout.step_name(step, self._options.step_prefix))

    def _not_committed(self, step: int) -> str:
        return f"step {step} is not committed under {self._root} (committed: {self.all_steps() or 'none'})"


def _restore_in_place(item_loc: storage.Location, target: Any, strict: bool, options: RestoreOptions) -> None:
    """Restore an item into `target`, swapping each batch of tensors in as soon as it is placed (the old
    device buffers are freed as the restore goes)."""
    rest = restoring.read_item(item_loc, target, strict=strict, options=options,
                               take=lambda values: training_state.assign_in_place(target, values))
    training_state.assign_in_place(target, rest)


def _decode_lock(data: bytes) -> dict | None:
    try:
        holder = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _pid_alive(pid: object) -> bool:
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _versions() -> dict[str, str]:
    from . import __version__

    versions = {"xla_tensorstore_ckpt": __version__, "torch": torch.__version__}
    if "torch_xla" in sys.modules:
        versions["torch_xla"] = getattr(sys.modules["torch_xla"], "__version__", "unknown")
    return versions
