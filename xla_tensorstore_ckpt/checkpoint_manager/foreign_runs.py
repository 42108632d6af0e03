"""Resuming a run from another tool's checkpoints: the newest step of a torch_xla CheckpointManager root, or one
torch.distributed.checkpoint (DCP) directory. Called by `CheckpointManager.restore(init_from=...)`; blocks.

A torch_xla manager (``torch_xla.experimental.distributed_checkpoint.CheckpointManager``, 2.9) saves step ``s``
into ``<root>/<s>/`` with DCP and its SPMD planner, then, on the first process, writes ``.manager_metadata``
there (a pickle of its ``_CheckpointMetadata(step, ts)``): that file is its commit point, and a step directory
without one is a save that did not finish (torch_xla's own manager ignores it too). Each step holds whatever
state dict the user passed, flattened by DCP; by convention ``{"model": ..., "optim" or "optimizer": ...,
"scheduler" or "lr_scheduler": ..., "step": ...}``.

Each object of the restore comes from the top-level entry of its name (`ALIASES`, or ``items={"optimizer":
"opt"}``); a model with no entry of its own is restored from the whole state dict (a ``model.state_dict()``
saved as is). An optimizer's state may be keyed by parameter index (``optimizer.state_dict()``) or by parameter
name (DCP's ``get_optimizer_state_dict``): either way its parameters are matched by position in the saved
param groups, as ``Optimizer.load_state_dict`` matches them, and a fresh optimizer that never stepped is
restored. What torch_xla's manager does not save cannot be carried over: random generator states and the data
position start fresh (unless the user's state dict held them, under `extra` / `data_loader`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import checkpointer, formats
from ..core import layout, torch_pickle
from ..core.errors import CheckpointNotFoundError, CorruptCheckpointError, ItemNotFoundError
from ..core.events import Emitter
from ..formats import dcp
from ..multihost.distributed import Coordinator
from ..options import RestoreOptions
from ..restores.restoring import KeyMap
from ..storage import Location
from . import training_state

TORCH_XLA_MARKER = ".manager_metadata"  # torch_xla's CheckpointManager: written once a step is complete
MAX_MARKER_BYTES = 1 << 16
# Where each of the manager's objects is looked for in the saved state dict, in order.
ALIASES = {"model": ("model",), "optimizer": ("optimizer", "optim"), "lr_scheduler": ("lr_scheduler", "scheduler"),
           "extra": ("extra",), "data_loader": ("data_loader",)}

log = logging.getLogger("xla_tensorstore_ckpt")


@dataclass(frozen=True)
class ForeignStep:
    """A DCP directory to resume from, and its step (torch_xla's manager's, else the saved ``step`` entry)."""

    loc: Location
    step: int | None


@dataclass(frozen=True)
class TorchXlaStep:
    """One step directory of a torch_xla manager root: complete (``problem`` is None) or why not."""

    step: int
    name: str
    committed_at: float | None  # the save time its marker records
    problem: str | None


def find(loc: Location) -> ForeignStep | None:
    """The step to resume from if `loc` is a DCP directory or a torch_xla manager root (its newest complete
    step), else None (another kind of checkpoint). Raises `CheckpointNotFoundError` for a torch_xla root whose
    steps are all incomplete. Blocks on a listing and a few small reads."""
    if dcp.claims_item(loc, None):
        recorded, _, problem = _marker(loc)
        if problem is not None:
            log.warning("%s: %s; its step is taken from its state", loc, problem)
        return ForeignStep(loc, recorded)
    if formats.is_item(loc):
        return None
    steps = torch_xla_steps(loc)
    if steps is None:
        return None
    for found in reversed(steps):
        if found.problem is None:
            return ForeignStep(loc.child(found.name), found.step)
        log.warning("skipping %s: %s", loc.child(found.name), found.problem)
    raise CheckpointNotFoundError(f"{loc} is a torch_xla CheckpointManager root with no complete step (steps "
                                  f"{', '.join(s.name for s in steps[-10:])} are not)")


def torch_xla_steps(loc: Location) -> list[TorchXlaStep] | None:
    """The step directories of a torch_xla manager root, oldest first; None if `loc` is not one (no
    step-numbered directory with torch_xla's marker or a DCP ``.metadata``). Called by `find` and by
    ``xtckpt steps``; blocks on a listing and a small read or two per step; a hostile marker is a step's
    problem, not an error."""
    names = sorted((step, name) for name in loc.list() if (step := layout.parse_step_name(name, None)) is not None)
    out = []
    for step, name in names:
        child = loc.child(name)
        has_dcp = dcp.claims_item(child, None)
        recorded, committed_at, problem = _marker(child)
        if recorded is None and not has_dcp and problem is None:
            continue  # a directory of something else
        if problem is None and recorded is None:
            problem = f"no {TORCH_XLA_MARKER} (a save that did not finish)"
        elif problem is None and recorded != step:
            problem = f"its {TORCH_XLA_MARKER} records step {recorded}"
        elif problem is None and not has_dcp:
            problem = "no DCP .metadata"
        out.append(TorchXlaStep(step, name, committed_at, problem))
    return out or None


def _marker(loc: Location) -> tuple[int | None, float | None, str | None]:
    """(step, save time, problem) of the torch_xla marker in `loc`; all None without one."""
    data = loc.read(TORCH_XLA_MARKER)
    if data is None:
        return None, None, None
    if len(data) > MAX_MARKER_BYTES:
        return None, None, f"{TORCH_XLA_MARKER}: {len(data)} bytes, not torch_xla's marker"
    try:
        step, committed_at = torch_pickle.load_manager_marker(data, str(loc.child(TORCH_XLA_MARKER)))
    except CorruptCheckpointError as exc:
        return None, None, str(exc)
    return step, committed_at, None


def restore(found: ForeignStep, objects: Mapping[str, Any], *, strict: bool, key_map: KeyMap | None,
            items: Mapping[str, str] | None, options: RestoreOptions, events: Emitter,
            coordinator: Coordinator | None) -> int | None:
    """Restore `objects` (the manager's names -> objects) in place from the DCP directory of `found`, each from
    its entry (see the module); `key_map` renames the model's keys (after its entry's name is taken off).
    Returns the step resumed from: `found.step`, else an integer ``step`` entry, else None. Raises
    `ItemNotFoundError` naming the path and the entries it holds for an object with no entry (before anything
    is restored), and what `checkpointer.restore_item` raises."""
    manifest = checkpointer.read_manifest(found.loc)
    top = manifest.tree if isinstance(manifest.tree, dict) else {}
    where = str(found.loc)
    entries = {name: _entry(name, top, items, objects, where, found.step) for name in objects}
    for name, obj in objects.items():
        entry = entries[name]
        bound = events.bound(item=entry or "")
        if isinstance(obj, torch.optim.Optimizer):
            _restore_optimizer(found.loc, obj, top[entry], entry, strict, options, bound, coordinator)
            continue
        rename = _under(entry, key_map if name == "model" else None)
        if isinstance(obj, torch.nn.Module) or not callable(getattr(obj, "load_state_dict", None)):
            training_state.restore_object(found.loc, obj, strict=strict, options=options, key_map=rename,
                                          events=bound, coordinator=coordinator)
        else:  # a scheduler: its saved state, matched against the state it has now
            obj.load_state_dict(checkpointer.restore_item(found.loc, obj.state_dict(), strict=strict,
                                                          key_map=rename, options=options, events=bound,
                                                          coordinator=coordinator))
    step = found.step if found.step is not None else top.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _entry(name: str, top: dict, items: Mapping[str, str] | None, objects: Mapping[str, Any], where: str,
           step: int | None) -> str | None:
    """The top-level entry `name` is restored from; None: the whole state dict (a model saved as is)."""
    wanted = (items[name],) if items and name in items else ALIASES[name]
    for entry in wanted:
        if isinstance(top.get(entry), (dict, list)):
            return entry
    if name == "model" and not (items and name in items) and not any(
            isinstance(top.get(a), (dict, list)) for names in ALIASES.values() for a in names):
        return None
    raise ItemNotFoundError(f"{where} has no {' or '.join(repr(w) for w in wanted)} entry for {name}= (it holds "
                            f"{', '.join(sorted(map(str, top))) or 'nothing'}); pass items={{{name!r}: <entry>}}",
                            step=-1 if step is None else step, item=wanted[0], items=tuple(map(str, top)))


def _under(entry: str | None, key_map: KeyMap | None) -> KeyMap | None:
    """A key map taking the leaves under `entry` with that name taken off (then through `key_map`), and
    dropping every other leaf."""
    if entry is None:
        return key_map
    prefix = entry + "."

    def rename(name: str) -> str | None:
        if not name.startswith(prefix):
            return None
        rest = name[len(prefix):]
        if key_map is None:
            return rest
        return key_map(rest) if callable(key_map) else key_map.get(rest, rest)

    return rename


def _restore_optimizer(loc: Location, optimizer: torch.optim.Optimizer, saved: Any, entry: str, strict: bool,
                       options: RestoreOptions, events: Emitter, coordinator: Coordinator | None) -> None:
    """The optimizer's state from `saved` (its subtree of ArrayMetadata and values), keyed by parameter index or
    name, matched by position in the saved param groups."""
    where = f"{loc} [{entry}]"
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups):
        raise CorruptCheckpointError(f"{where}: no param_groups with params")
    order = [str(p) for g in groups for p in g["params"]]
    position = {key: i for i, key in enumerate(order)}
    state = saved.get("state") or {}
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{where}: its state is not keyed by parameter")
    unknown = [str(k) for k in state if str(k) not in position]
    if unknown:
        raise CorruptCheckpointError(f"{where}: state for {', '.join(unknown[:5])}, which its param groups do not "
                                     f"list")
    by_index = {"state": {position[str(k)]: v for k, v in state.items()},
                "param_groups": [dict(g, params=[position[str(p)] for p in g["params"]]) for g in groups]}
    target = training_state.optimizer_target(optimizer, by_index, where)
    names = {layout.key_name((entry, "state", key, *rest)): layout.key_name(("state", position[str(key)], *rest))
             for key, entries in state.items() for rest in _paths(entries)}
    restored = checkpointer.restore_item(loc, {"state": target["state"]}, strict=strict, key_map=names.get,
                                         options=options, events=events, coordinator=coordinator)
    optimizer.load_state_dict({"state": restored["state"], "param_groups": by_index["param_groups"]})


def _paths(node: Any) -> list[tuple]:
    """The key paths of the leaves under `node`."""
    if isinstance(node, dict):
        return [(k, *rest) for k, v in node.items() for rest in _paths(v)]
    if isinstance(node, list):
        return [(i, *rest) for i, v in enumerate(node) for rest in _paths(v)]
    return [()]
