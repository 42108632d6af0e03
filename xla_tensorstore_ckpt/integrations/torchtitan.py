"""torchtitan's checkpoint-manager contract, implemented with this library: a trainer selects it with one line of
job config (``checkpoint=XtcCheckpointManager.Config(enable=True, ...)``), and ``config.checkpoint.build(...)``
constructs it where torchtitan's own DCP manager would be.

With `titan_qkv`, the only modules that import torchtitan. The trainer calls the public methods of
`torchtitan.components.checkpointer.base.BaseCheckpointManager`; each runs on every process, blocks as said in
its hook's docstring, and raises this library's errors (`errors`), which name the step, key and path.

What is saved, each step an item of one of our steps (``<folder>/step_<n>/``): ``model`` (the model parts'
flattened state dict, fused QKV weights as ``wq``/``wk``/``wv`` sharded like them (`titan_qkv`), DTensors
restored in place and then through `ModelWrapper.load_state_dict`, as torchtitan's manager does),
``optimizer`` (the container's flattened state dict), ``lr_scheduler``, ``data_loader`` (the serialised
position of every data-parallel rank, one row each: `opaque_rows`), ``extra`` (every other state the trainer
hands over, ``train_state`` among them, by name) and ``rng`` (every process's generators).
"""

from __future__ import annotations

import copy
import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem

from .. import checkpointer, formats, storage
from ..checkpoint_manager import foreign_runs, training_state
from ..checkpoint_manager.manager import CheckpointManager
from ..core import tree
from ..core.errors import CheckpointNotFoundError, StepNotFoundError, UsageError
from ..formats import safetensors
from ..multihost.distributed import Coordinator
from ..options import CheckpointManagerOptions, RestoreOptions
from . import hf_export, opaque_rows, titan_qkv

log = logging.getLogger("xla_tensorstore_ckpt")

STEP_PREFIX = "step"  # step directories are step_<n>
HF_SUFFIX = "-hf"  # the last step's Hugging Face export: <folder>/step_<n>-hf/


class XtcCheckpointManager(BaseCheckpointManager):
    """A torchtitan checkpoint manager writing and reading this library's checkpoints. Constructed by
    ``Config.build(dataloader=, model_parts=, optimizers=, lr_schedulers=, states=, sd_adapter=, base_folder=)``
    on every process of the job (collective: it opens the checkpoint root and its process groups)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's fields mean what torchtitan documents (``folder`` may be ``gs://`` or ``s3://``;
        ``keep_latest_k`` is the persistent tier's retention; an ``initial_load_path`` in Hugging Face
        safetensors and the ``last_save_in_hf`` export may be remote too), plus this library's own."""

        async_mode: Literal["disabled", "async"] = "async"
        """``async``: `save` returns once the state is copied off the devices; the writes and the commit run in
        the background. ``disabled``: `save` returns once the step is committed."""

        local_directory: str | None = None
        """A fast local tier per process (local SSD, RAM disk) besides ``folder``; None: none."""

        local_interval: int | None = None
        """The local tier's save interval in steps (with ``local_directory``)."""

        local_keep_latest_k: int | None = 2
        """How many local steps each process keeps (None: all)."""

        local_replication: int = 1
        """k > 1 keeps each local step on k processes (peer replication)."""

        single_replica_reads: bool = False
        """Each stored chunk read by one process and sent to the others that need it."""

        save_rng: bool = True
        """Save every process's random generator states with each step, and restore them."""

        max_host_bytes: int | None = None
        """Cap on staged host memory per save (None: the whole state is staged at once)."""

        listeners: tuple = field(default_factory=tuple)
        """Told of every phase of saves and restores (`events`)."""

        def __post_init__(self) -> None:
            # torchtitan's checks, but HF safetensors at a remote path are allowed: we read and write them.
            hf = (self.last_save_in_hf, self.initial_load_in_hf)
            if self.last_save_in_hf and not self.last_save_model_only:
                raise ValueError("last_save_in_hf requires last_save_model_only=True.")
            if self.initial_load_in_hf and not self.initial_load_model_only:
                raise ValueError("initial_load_in_hf requires initial_load_model_only.")
            self.last_save_in_hf = self.initial_load_in_hf = False
            try:
                BaseCheckpointManager.Config.__post_init__(self)
            finally:
                self.last_save_in_hf, self.initial_load_in_hf = hf
            self.async_mode = self.async_mode.lower()  # as torchtitan's DCP manager normalises it
            if self.async_mode not in ("disabled", "async"):
                raise ValueError(f"Invalid async_mode: {self.async_mode!r} (this manager's are 'disabled' and "
                                 "'async')")
            if self.local_directory is None and self.local_interval is not None:
                raise ValueError("local_interval needs local_directory")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module], optimizers: Any,
                 lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any, base_folder: str = "") -> None:
        self.enable = config.enable
        self.save_future: Future | None = None
        if not self.enable:
            return
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder)
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers, DATALOADER: dataloader,
                            LR_SCHEDULER: lr_schedulers})
        self.sd_adapter = sd_adapter
        if config.last_save_in_hf and sd_adapter is None:
            raise UsageError("checkpoint.last_save_in_hf is True, but the model has no sd_adapter")
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self._restore_options = RestoreOptions(single_replica_reads=config.single_replica_reads)
        self._coordinator = Coordinator.from_environment()  # the data loader rows' widths
        self._splitter = titan_qkv.Splitter(model_parts)  # fused QKV weights split without gathering them
        self._manager = CheckpointManager(self.folder, _manager_options(config, self._restore_options))
        log.info("checkpoints of %s are saved to and loaded from %s", type(self).__name__, self._manager.directory)

    def __del__(self) -> None:
        self.close()

    # -------------------------------------------------------------------------------------------- save

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Save the state as `curr_step` if it is due (torchtitan's rule: the interval, the first step with
        ``enable_first_step_checkpoint``, the last step; never with ``load_only``). Blocks until the state is
        copied off the devices (``async``) or committed; the last step always until committed."""
        config = self.config
        if config.load_only:
            return False
        first = curr_step == 1 and config.enable_first_step_checkpoint
        if last_step and config.last_save_model_only:
            self._save_model_only(curr_step)
            return True
        force = last_step or first
        if not force and not self._manager.should_save(curr_step):
            return False
        previous = self.save_future
        try:
            started = self._manager.save(curr_step, force=force, **self._saved_objects())
        except Exception as exc:
            if previous is not None and not previous.done():  # it failed (an AsyncSaveError) or never ends
                previous.set_exception(exc)
                self.save_future = None
            raise
        if started and config.async_mode == "async":
            # One save is in flight at a time: a save that started waited for the previous one's commit, whose
            # future a caller may hold (torchtitan's DCP manager resolves it at the next save too).
            if previous is not None and not previous.done():
                previous.set_result(None)
            self.save_future = Future()
        if last_step:
            self._wait_for_saving()
        return started

    def _saved_objects(self) -> dict[str, Any]:
        objects: dict[str, Any] = {"model": self._splitter.state_dict(),
                                   "optimizer": self.states[OPTIMIZER].state_dict(),
                                   "lr_scheduler": self.states[LR_SCHEDULER].state_dict()}
        if self.states[DATALOADER] is not None:
            objects["data_loader"] = opaque_rows.loader_rows(self.states[DATALOADER].state_dict(), self._coordinator)
        extra = {name: training_state.state_of(state) for name, state in self._extra_states().items()}
        if extra:
            objects["extra"] = extra
        return objects

    def _model_state(self) -> dict[str, Any]:
        """The model parts' state dicts merged, as `ModelWrapper.state_dict` computes them, without its cache:
        torchtitan keeps tensors that state-dict hooks make (a fused QKV weight split into ``wq``/``wk``/``wv``)
        in stable storage for DCP's pinned staging buffers, at the cost of copying each into it at every save;
        our staging copies what it saves anyway. Collective when a hook is (that split gathers the weight). The
        last step's model-only save uses it (its export reshapes whole tensors); the other saves take the model's
        state from `titan_qkv.Splitter`, which splits the fused weight without the gather."""
        return {key: value for part in self.states[MODEL].model for key, value in part.state_dict().items()}

    def _save_model_only(self, step: int) -> None:
        """The last step: the model alone in ``export_dtype`` (with ``last_save_in_hf``, under Hugging Face
        names, then exported as safetensors to ``<folder>/step_<n>-hf`` by the first process). Blocks until
        committed and exported."""
        model = {key: value.to(self.export_dtype) if isinstance(value, torch.Tensor) and value.is_floating_point()
                 else value for key, value in self._model_state().items()}
        if self.config.last_save_in_hf:
            model = self.sd_adapter.to_hf(model)
        self._manager.save(step, model=model, force=True)
        self._manager.wait_until_finished()
        if self.config.last_save_in_hf:
            out = f"{self._manager.step_path(step)}{HF_SUFFIX}"
            self._coordinator.on_primary(f"exporting step {step} to {out}", lambda: hf_export.export_model(
                self._manager.step_path(step), out))

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: `save` returns once the device-to-host copy is done."""

    def _wait_for_saving(self) -> None:
        """Block until every pending save is committed; raise a failed one's `AsyncSaveError`."""
        future, self.save_future = self.save_future, None
        self._manager.wait_until_finished()
        if future is not None:
            future.set_result(None)

    def _close(self) -> None:
        """Wait for pending saves (raising their errors), then release the threads and process groups."""
        self.save_future = None
        try:
            self._manager.close()
        finally:
            self._coordinator.close()

    # -------------------------------------------------------------------------------------------- load

    def _load(self, step: int = -1) -> bool:
        """Restore `step` (-1: the newest) of ``folder``; with no step there, the ``initial_load_path`` (or, with
        ``initial_load_in_hf``, the adapter's ``hf_assets_path``). Returns whether anything was loaded. Step 0,
        a seed checkpoint, restores the model alone. Collective; blocks. Raises `StepNotFoundError` for a
        `step` not committed, `CheckpointNotFoundError` for an initial path holding nothing we read."""
        committed = self._manager.all_steps()
        if step != -1 and step not in committed:
            raise StepNotFoundError(f"--checkpoint.load_step={step} is not committed under {self._manager.directory} "
                                    f"(committed: {committed or 'none'})", step=step)
        if committed:
            chosen = max(committed) if step == -1 else step
            self._restore_own(chosen, model_only=chosen == 0)
            return True
        path = self.config.initial_load_path
        if path is None and self.config.initial_load_in_hf and self.sd_adapter is not None:
            path = self.sd_adapter.hf_assets_path
        if not path:
            log.info("no checkpoint under %s and no initial_load_path: a fresh start", self._manager.directory)
            return False
        self._restore_initial(path, model_only=self.config.initial_load_model_only)
        return True

    def _restore_own(self, step: int, *, model_only: bool) -> None:
        targets = self._targets(model_only)
        restored = self._manager.restore(step, **{name: value for name, value in targets.items() if name != "loader"},
                                         data_loader=targets.get("loader"))
        log.info("restored step %s from %s", restored, self._manager.directory)
        self._apply(targets)

    def _targets(self, model_only: bool) -> dict[str, Any]:
        """What a restore reads into: trees of the objects' own tensors (restored in place), then applied."""
        targets: dict[str, Any] = {"model": self.states[MODEL].state_dict()}
        if model_only:
            return targets
        excluded = set(self.config.exclude_from_loading)
        unknown = excluded - set(self.states)
        if unknown:
            raise UsageError(f"checkpoint.exclude_from_loading names {sorted(unknown)}, which the trainer does not "
                             f"checkpoint (it does {sorted(self.states)})")
        if OPTIMIZER not in excluded:
            targets["optimizer"] = self.states[OPTIMIZER].state_dict()
        if LR_SCHEDULER not in excluded:
            targets["lr_scheduler"] = self.states[LR_SCHEDULER].state_dict()
        if DATALOADER not in excluded and self.states[DATALOADER] is not None:
            targets["loader"] = opaque_rows.LoaderTarget(self.states[DATALOADER])
        # Excluded states are read too (a step's item is read whole), into copies, and not applied.
        extra = {name: copy.deepcopy(training_state.state_of(state)) if name in excluded
                 else training_state.state_of(state) for name, state in self._extra_states().items()}
        if extra:
            targets["extra"] = extra
        return targets

    def _apply(self, targets: dict[str, Any]) -> None:
        self.states[MODEL].load_state_dict(targets["model"])
        if "optimizer" in targets:
            self.states[OPTIMIZER].load_state_dict(targets["optimizer"])
        if "lr_scheduler" in targets:
            self.states[LR_SCHEDULER].load_state_dict(targets["lr_scheduler"])
        for name, state in self._extra_states().items():
            # A state without load_state_dict (a tensor, a dict) was restored in place.
            if name not in self.config.exclude_from_loading and name in targets.get("extra", {}) and \
                    callable(getattr(state, "load_state_dict", None)):
                state.load_state_dict(targets["extra"][name])

    def _extra_states(self) -> dict[str, Any]:
        return {name: state for name, state in self.states.items()
                if name not in (MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER)}

    def _restore_initial(self, path: str, *, model_only: bool) -> None:
        """Start from `path`: a Hugging Face directory (through the model's ``sd_adapter``), a DCP directory
        (torchtitan's own checkpoints included) or a torch_xla manager root, an item or step of ours or Orbax's,
        or a root of ours or Orbax's (its newest step)."""
        loc = storage.location(path)
        if self.config.initial_load_in_hf or safetensors.is_checkpoint(loc):
            self._restore_hf(loc)
        elif (found := foreign_runs.find(loc)) is not None:
            self._restore_dcp(found.loc, model_only)
        elif formats.is_item(loc):
            targets = self._targets(True)
            targets["model"] = checkpointer.restore_item(loc, targets["model"], options=self._restore_options)
            self._apply(targets)
        elif (marker := formats.read_step(loc)) is not None:
            targets = self._targets(model_only)
            requested = {name: value for name, value in targets.items() if name != "loader"}
            if "loader" in targets:
                requested["data_loader"] = targets["loader"]
            training_state.restore_step(loc, marker, requested, strict=True, key_map=None,
                                        options=self._restore_options, rng=(0, 1), restore_rng=False,
                                        coordinator=self._coordinator)
            self._apply(targets)
        else:
            self._restore_root(loc, model_only)
        log.info("started from %s", loc)

    def _restore_root(self, loc: storage.Location, model_only: bool) -> None:
        if not loc.exists():
            raise CheckpointNotFoundError(f"checkpoint.initial_load_path {loc} does not exist")
        with CheckpointManager(loc, CheckpointManagerOptions(create=False, save_interval_steps=None,
                                                             restore_options=self._restore_options)) as source:
            if source.latest_step() is None:
                raise CheckpointNotFoundError(f"checkpoint.initial_load_path {loc} holds no committed step, "
                                              "Hugging Face, DCP or torch_xla checkpoint")
            targets = self._targets(model_only)
            source.restore("latest", **{name: value for name, value in targets.items() if name != "loader"},
                           data_loader=targets.get("loader"), restore_rng=False)
        self._apply(targets)

    def _restore_hf(self, loc: storage.Location) -> None:
        """Hugging Face safetensors: the model's state under HF names (`sd_adapter.to_hf`), each DTensor's own
        region read, mapped back with `sd_adapter.from_hf` and loaded, as torchtitan's manager does."""
        native = self.states[MODEL].state_dict()
        hf_target = native if self.sd_adapter is None else self.sd_adapter.to_hf(native)
        restored = checkpointer.restore_item(loc, hf_target, options=self._restore_options)
        self.states[MODEL].load_state_dict(restored if self.sd_adapter is None else self.sd_adapter.from_hf(restored))

    def _restore_dcp(self, loc: storage.Location, model_only: bool) -> None:
        """A DCP directory holding torchtitan's flattened state dict: the model's keys at the top, the other states
        under their names (``optimizer``, ``lr_scheduler``, ``train_state``, ...). Its data loader entry is pickled
        by DCP, which we never unpickle: the data position starts fresh (logged). A torch_xla manager's step keeps
        the model under ``model``: the model alone loads from it (`UsageError` unless ``initial_load_model_only``)."""
        targets = self._targets(model_only)
        if self._under_model_entry(loc, targets["model"]):
            if not model_only:
                raise UsageError(f"checkpoint.initial_load_path {loc} holds its model under a \"model\" entry (a "
                                 "torch_xla CheckpointManager step or a dcp.save of {\"model\": ...}): its other "
                                 "states are not torchtitan's, so only the model loads; set "
                                 "checkpoint.initial_load_model_only=True")
            wanted = set(targets["model"])
            restored = checkpointer.restore_item(
                loc, targets["model"], options=self._restore_options,
                key_map=lambda name: key if (key := name.removeprefix("model.")) != name and key in wanted else None)
            self.states[MODEL].load_state_dict(restored)
            return
        loader = targets.pop("loader", None)
        if loader is not None:
            log.warning("%s: the data loader position of a DCP checkpoint is not restored (DCP pickles it)", loc)
        flat = dict(targets["model"])
        flat.update({self._dcp_name(name): value for name, value in targets.items() if name not in ("model", "extra")})
        flat.update(targets.get("extra", {}))
        wanted = {".".join(str(k) for k in path) for path, _ in tree.flatten(flat)}
        restored = checkpointer.restore_item(loc, flat, key_map=lambda name: name if name in wanted else None,
                                             options=self._restore_options)
        targets["model"] = {key: restored[key] for key in targets["model"]}
        for name in targets:
            if name == "extra":
                targets["extra"] = {key: restored[key] for key in targets["extra"]}
            elif name != "model":
                targets[name] = restored[self._dcp_name(name)]
        self._apply(targets)

    @staticmethod
    def _under_model_entry(loc: storage.Location, model: dict[str, Any]) -> bool:
        """Whether the DCP directory at `loc` keeps the model's keys under a top-level ``model`` entry (torch_xla's
        manager saves ``{"model": ..., "optim": ...}``) rather than at the top, as torchtitan flattens them."""
        saved = {".".join(str(k) for k in path) for path, _ in tree.flatten(checkpointer.read_manifest(loc).tree)}
        return not set(model) <= saved and {f"model.{key}" for key in model} <= saved

    @staticmethod
    def _dcp_name(name: str) -> str:
        return {"optimizer": OPTIMIZER, "lr_scheduler": LR_SCHEDULER}.get(name, name)


def _manager_options(config: XtcCheckpointManager.Config, restore_options: RestoreOptions) -> CheckpointManagerOptions:
    return CheckpointManagerOptions(
        save_interval_steps=config.interval, max_to_keep=config.keep_latest_k or None, step_prefix=STEP_PREFIX,
        async_save=config.async_mode == "async", max_host_bytes=config.max_host_bytes, save_rng=config.save_rng,
        local_directory=config.local_directory, local_save_interval_steps=config.local_interval,
        local_max_to_keep=config.local_keep_latest_k, local_replication=config.local_replication,
        restore_options=restore_options, listeners=tuple(config.listeners))


__all__ = ["XtcCheckpointManager"]
