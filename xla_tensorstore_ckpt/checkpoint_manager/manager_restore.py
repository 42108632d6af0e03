"""`CheckpointManager.restore` and what it alone uses (`RestoreSide`, a base of `CheckpointManager`): the step a
restart resumes from, chosen with `resume` (peer copies fetched or repaired first, with `local_replication`),
restored in place with `training_state`; with no step committed, `init_from`'s other weights or another tool's run
(`foreign_runs`). The manager's state (`_options`, `_coordinator`, its tiers, `_restore_events`) is set by
`CheckpointManager.__init__`; a separate module so that the manager's module stays the saving facade it composes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .. import storage
from ..core import events
from ..core.errors import UsageError
from ..restores.restoring import KeyMap
from . import foreign_runs, local_tier, resume, training_state
from .managed_tier import LOCAL
from .peer_copies import PeerCopies
from .resume import Candidate

if TYPE_CHECKING:
    from ..multihost.distributed import Coordinator
    from ..options import CheckpointManagerOptions
    from .managed_tier import ManagedTier

log = logging.getLogger("xla_tensorstore_ckpt")

RNG_ITEM = training_state.RNG_ITEM
_OBJECT_ITEMS = training_state.OBJECT_ITEMS


class RestoreSide:
    """The restore half of `CheckpointManager` (see the module); not used alone."""

    _options: CheckpointManagerOptions
    _coordinator: Coordinator
    _persistent: ManagedTier
    _local: ManagedTier | None
    _restore_events: events.Emitter

    # ---------------------------------------------------------------------------------------- restore

    def restore(self, resume_from: int | str | None = "latest", *, model: Any = None, optimizer: Any = None,
                lr_scheduler: Any = None, extra: Any = None, data_loader: Any = None, restore_rng: bool = True,
                strict: bool = True, key_map: KeyMap | None = None, init_from: str | None = None,
                items: Mapping[str, str] | None = None) -> int | None:
        """Restore the given objects in place from a step chosen by `resume_from`; return that step.

        `resume_from`: None → restore nothing, return None; an int → that step, or, if it is not committed, a
        warning and the newest committed step; "latest" → the newest committed step. With nothing committed,
        returns None and leaves the objects untouched. Modules' parameters and buffers keep their identity,
        device and sharding; optimizers (fresh ones too) and schedulers are restored with
        ``load_state_dict``; a dict or list passed as `extra` is updated in place. Each process gets back the
        RNG states it saved (`rng_state`). Waits for pending saves first and raises their errors. Raises
        `KeyMismatchError`, `ShapeMismatchError` or `CheckpointError` (naming step, item and path) when the
        objects do not match the checkpoint, and `ItemNotFoundError` (a `KeyMismatchError`) when the step
        has no item for an object given.

        Each object is restored from the step's item of its name, unless `items` maps its name to another
        item (``items={"model": "params"}``). Steps of an Orbax root restore like ours: `key_map` renames the
        checkpoint's keys of every item before they are matched (`xtc.restore`), for names that differ from
        torch's; and when a step has no ``model`` item but exactly one other item that holds arrays (Orbax's
        ``default`` from ``StandardSave``, MaxText's ``items``, ``state``), `model` is restored from it, and a
        log line says which. A step with several such items needs `items`.

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
        restored. A torch_xla CheckpointManager root (its newest complete step) or a DCP directory resumes the run
        instead: every object given is restored from the saved state dict's entry of its name (``model``,
        ``optim`` or ``optimizer``, ``scheduler`` or ``lr_scheduler``; `items` names others; `key_map` renames
        the model's keys), and the step resumed from is returned (`foreign_runs`). Once a step is committed, it
        wins: a restarted run resumes from its own checkpoints.

        A module's tensors are replaced one by one, each old device buffer released right before its new data
        is placed, so the restore needs no device memory beyond the state. Mismatches are found before anything
        changes; damaged data found part-way leaves the tensors before it restored.
        """
        self._check_open()
        if init_from is not None and model is None:
            raise UsageError("init_from initialises the model: pass model= as well")
        requested = {name: obj for name, obj in zip(
            _OBJECT_ITEMS, (model, optimizer, lr_scheduler, extra, data_loader)) if obj is not None}
        training_state.check_items(items, requested)
        self._coordinator.everywhere("finishing earlier saves", self._wait_here)
        if resume_from is None:
            return None
        rng = restore_rng and self._options.save_rng
        choice = resume.resume(self._coordinator, self._local and self._local.tier, self._persistent.tier,
                               self._resolve(resume_from),
                               lambda candidate: self._restore_step(candidate, requested, rng, strict, key_map, items),
                               peers=self._peer_copies(), fetched=self._peer_fetched)
        if self._local is not None:
            local_tier.discard_steps_after(self._local.tier, None if choice is None else choice.step,
                                           from_local=choice is not None and choice.tier == LOCAL)
        if choice is None:
            return None if init_from is None else self._initialise(init_from, requested, strict, key_map, items)
        if choice.redo_persistent:
            assert self._local is not None  # only a local candidate has a copy to redo
            resume.redo_persistent_copy(
                choice.step, self._local.tier.marker(choice.step),
                [*((items or {}).get(name, name) for name in requested), *([RNG_ITEM] if rng else [])],
                self._persistent.tier, lambda base: self._save(choice.step, [self._persistent], requested, base))
        return choice.step

    def _initialise(self, init_from: str, requested: Mapping[str, Any], strict: bool, key_map: KeyMap | None,
                    items: Mapping[str, str] | None) -> int | None:
        """`restore`'s `init_from`, with no step committed: a torch_xla root or DCP directory resumes every object
        (`foreign_runs`), other weights initialise the model."""
        source = storage.location(init_from)
        found = foreign_runs.find(source)
        if found is None:
            training_state.restore_object(source, requested["model"], strict=strict,
                                          options=self._options.restore_options, key_map=key_map,
                                          events=self._restore_events.bound(item="model"),
                                          coordinator=self._coordinator)
            return None
        step = foreign_runs.restore(found, requested, strict=strict, key_map=key_map, items=items,
                                    options=self._options.restore_options,
                                    events=self._restore_events.bound(path=str(found.loc)),
                                    coordinator=self._coordinator)
        log.info("resumed %s from %s (step %s)", ", ".join(requested), found.loc, step)
        return step

    def _restore_step(self, choice: Candidate, requested: Mapping[str, Any], rng: bool, strict: bool,
                      key_map: KeyMap | None, items: Mapping[str, str] | None) -> None:
        """Restore `requested` from a candidate step on this process (not collective)."""
        managed = self._local if choice.tier == LOCAL else self._persistent
        assert managed is not None  # a local candidate exists only with a local tier
        own = managed.is_local  # a local step holds its writer's generator states alone, as a single row
        step_loc = managed.tier.index.location(choice.step)
        training_state.restore_step(
            step_loc, managed.tier.marker(choice.step), requested, strict=strict,
            key_map=key_map, options=self._options.restore_options, items=items,
            rng=(0, 1) if own else (self._coordinator.index, self._coordinator.count), restore_rng=rng,
            events=self._restore_events.bound(step=choice.step, tier=managed.name),
            coordinator=None if own else self._coordinator)  # a local step: each process reads its own

    def _peer_copies(self) -> PeerCopies | None:
        """The peer copies in this process's local tier, with local_replication."""
        if self._local is None or self._local.replicator is None:
            return None
        return PeerCopies(self._local.tier.root.path, self._local.tier.index.step_of)

    def _peer_fetched(self, step: int, nbytes: int, source: int, repair: bool) -> None:
        self._restore_events.bound(step=step, tier=LOCAL, path=str(self.step_path(step, LOCAL))).emit(
            events.PEER_FETCHED, nbytes=nbytes, details={"source": source, "repair": repair})

    def _resolve(self, resume_from: int | str) -> int | None:
        """None for "latest", else the step asked for."""
        if isinstance(resume_from, str):
            if resume_from != "latest":
                raise ValueError(f"resume_from must be None, a step or 'latest', got {resume_from!r}")
            return None
        if isinstance(resume_from, bool) or not isinstance(resume_from, int):
            raise TypeError(f"resume_from must be None, a step or 'latest', got {resume_from!r}")
        return resume_from
