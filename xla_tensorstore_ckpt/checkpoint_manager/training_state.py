"""Adapters between training objects (modules, optimizers, schedulers, data loaders) and state trees: what to
save for an object, and how to restore it in place. Called by the manager; blocks; not thread-safe.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from .. import checkpointer, formats, targets
from ..core import layout, tree
from ..core.errors import CheckpointError, CheckpointNotFoundError, ItemNotFoundError, UnsupportedValueError, UsageError
from ..core.events import Emitter
from ..core.layout import KeyPath
from ..core.records import ArrayMetadata, StepMetadata
from ..multihost.distributed import Coordinator
from ..options import RestoreOptions
from ..restores import restoring
from ..restores.read_jobs import RestoreAs
from ..restores.restoring import KeyMap
from ..storage import Location
from . import rng_state

RNG_ITEM = "rng"  # a step's item holding the random generator states (`rng_state`)
OBJECT_ITEMS = ("model", "optimizer", "lr_scheduler", "extra", "data_loader")  # the manager's objects = items
OWN_ITEMS = (*OBJECT_ITEMS, RNG_ITEM)

log = logging.getLogger("xla_tensorstore_ckpt")


def state_of(obj: Any) -> Any:
    """The state tree of an object to save: a module's or optimizer's ``state_dict()``, or a raw tree."""
    if isinstance(obj, torch.nn.Module):
        return obj.state_dict()
    if hasattr(obj, "state_dict") and callable(obj.state_dict):
        return obj.state_dict()
    return obj


def module_target(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers themselves (not detached copies), for in-place restore."""
    return dict(module.state_dict(keep_vars=True))


def optimizer_target(optimizer: torch.optim.Optimizer, saved: Any, where: str) -> dict:
    """A restore target for a (possibly fresh, never stepped) optimizer: each saved state tensor shaped like
    its parameter is restored with that parameter's sharding and dtype; other state (step counters) goes to
    the CPU. Raises `CheckpointError` if the param-group layout differs from the saved one."""
    current = optimizer.state_dict()["param_groups"]
    saved_groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(saved_groups, list) or [len(g.get("params", ())) for g in saved_groups] != [
            len(g["params"]) for g in current]:
        raise CheckpointError(
            f"optimizer at {where} has param groups of sizes "
            f"{[len(g.get('params', ())) for g in saved_groups or []]}, the optimizer being restored "
            f"{[len(g['params']) for g in current]}: another param-group layout")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state_target: dict[int, dict[str, Any]] = {}
    for index, entries in (saved.get("state") or {}).items():
        if not isinstance(index, int) or not 0 <= index < len(params) or not isinstance(entries, dict):
            raise CheckpointError(f"optimizer at {where} has state for parameter {index!r}, which does not exist")
        param = params[index]
        state_target[index] = {}
        for name, meta in entries.items():
            if isinstance(meta, ArrayMetadata) and meta.shape == tuple(param.shape):
                dtype = param.dtype if meta.torch_dtype.is_floating_point and param.is_floating_point() \
                    else meta.torch_dtype
                state_target[index][name] = RestoreAs(param, dtype)
            else:
                state_target[index][name] = None
    return {"state": state_target, "param_groups": saved_groups}


def assign_in_place(target: Any, values: dict[KeyPath, Any]) -> None:
    """Write restored `values` into the `target` tree: tensors keep their identity, device and sharding (XLA
    data is swapped without computation, CPU data and a DTensor's local tensor copied); other leaves are
    replaced in their (mutable) containers."""
    pairs, owners = [], []
    for path, value in values.items():
        container, key = _parent(target, path)
        current = container[key]
        owner = targets.of(current)
        if owner is not None and owner.ASSIGNS_IN_PLACE and targets.of(value) is owner:
            pairs.append((current, value))  # by its target, batched (`targets.assign`)
            owners.append(owner)
        elif isinstance(container, (dict, list)):
            container[key] = value
    targets.assign(pairs, owners)


def _parent(root: Any, path: KeyPath) -> tuple[Any, Any]:
    node = root
    for key in path[:-1]:
        node = node[key]
    return node, path[-1]


def restore_object(item_loc: Location, obj: Any, *, strict: bool, options: RestoreOptions,
                   key_map: KeyMap | None = None, events: Emitter | None = None,
                   coordinator: Coordinator | None = None) -> None:
    """Restore a training object in place from the item at `item_loc`: a module's parameters and buffers keep
    their identity, device and sharding (replaced one by one, each old device buffer released right before its
    new data is placed); an optimizer (a fresh one too) is rebuilt with each state tensor on its parameter's
    sharding, then ``load_state_dict``; other objects with ``load_state_dict`` get the saved tree; a dict or
    list is updated in place. `key_map` renames the checkpoint's keys (see `checkpointer.restore`); `events`
    hears of the reads (`restoring.read_item`); `coordinator` holds the processes that restore the item together
    with single-replica reads (`RestoreOptions.single_replica_reads`). Raises what `checkpointer.restore` raises."""
    if isinstance(obj, torch.nn.Module):
        _restore_in_place(item_loc, module_target(obj), strict, options, key_map, events, coordinator)
    elif isinstance(obj, torch.optim.Optimizer):
        target = optimizer_target(obj, formats.read_item(item_loc).tree, str(item_loc))
        obj.load_state_dict(checkpointer.restore_item(item_loc, target, options=options, key_map=key_map,
                                                      events=events, coordinator=coordinator))
    elif hasattr(obj, "load_state_dict") and callable(obj.load_state_dict):
        obj.load_state_dict(checkpointer.restore_item(item_loc, options=options, events=events,
                                                      coordinator=coordinator))
    else:
        _restore_in_place(item_loc, obj, strict, options, key_map, events, coordinator)


def restore_step(step_loc: Location, marker: StepMetadata, objects: Mapping[str, Any], *, strict: bool,
                 key_map: KeyMap | None, options: RestoreOptions, rng: tuple[int, int], restore_rng: bool,
                 items: Mapping[str, str] | None = None, events: Emitter | None = None,
                 coordinator: Coordinator | None = None) -> None:
    """Restore `objects` (object name -> object, as `restore_object`) from the step at `step_loc` whose marker is
    `marker`, each from its item (`step_items`), then, with `restore_rng`, this process's generators from row
    ``rng = (index, count)`` of its RNG item; `events` (bound to the step) hears of each item's reads;
    `coordinator`: as `restore_object` (the RNG item, a row per process, is read by each on its own). Raises
    `ItemNotFoundError` (not damage: the request does not match the step) if an object has no item, before
    anything is restored, and what `restore_object` raises."""
    chosen = step_items(step_loc, marker, objects, items)
    events = events or Emitter(options.listeners)
    for name, obj in objects.items():
        restore_object(step_loc.child(chosen[name]), obj, strict=strict, options=options, key_map=key_map,
                       events=events.bound(item=chosen[name]), coordinator=coordinator)
    if restore_rng and RNG_ITEM in marker.items:
        rng_state.restore(step_loc.child(RNG_ITEM), *rng, options=options, events=events.bound(item=RNG_ITEM))


def step_items(step_loc: Location, marker: StepMetadata, objects: Iterable[str],
               items: Mapping[str, str] | None) -> dict[str, str]:
    """The item of the step each object (by name) is restored from: ``items[name]`` if given, else the item of
    the same name; for ``model`` in a step without a ``model`` item (an Orbax root saved with ``StandardSave``:
    ``default``; MaxText's ``items``; ``state``), its only item that holds arrays and is not one of this
    library's own (`OWN_ITEMS`), with a log line saying so. Raises `ItemNotFoundError` naming the step, the
    item and the path otherwise. Blocks (reads the manifests of the other items to find the one that holds
    arrays)."""
    chosen = {}
    for name in objects:
        item = (items or {}).get(name, name)
        if item not in marker.items and name == "model" and item == "model":
            holding = _items_holding_arrays(step_loc, marker)
            if len(holding) == 1:
                log.info("step %d at %s has no 'model' item: restoring model from its only item holding arrays, "
                         "%r", marker.step, step_loc, holding[0])
                item = holding[0]
            elif holding:
                raise ItemNotFoundError(
                    f"step {marker.step} at {step_loc} has no 'model' item and several that hold arrays "
                    f"({', '.join(holding)}): pass items={{'model': <one of them>}} to restore(...)",
                    step=marker.step, item="model", items=marker.items)
        if item not in marker.items:
            raise ItemNotFoundError(f"step {marker.step} at {step_loc} has no {item!r} item for {name}= (it "
                                    f"holds {', '.join(marker.items) or 'no items'})", step=marker.step, item=item,
                                    items=marker.items)
        chosen[name] = item
    return chosen


def _items_holding_arrays(step_loc: Location, marker: StepMetadata) -> list[str]:
    """The items of the step, other than this library's own, whose manifest has arrays (an Orbax JSON item, or
    one of scalars alone, has none)."""
    out = []
    for item in marker.items:
        if item in OWN_ITEMS:
            continue
        try:
            if formats.read_item(step_loc.child(item)).arrays():
                out.append(item)
        except CheckpointNotFoundError:  # listed by an Orbax marker but holding no item we read
            continue
    return out


def _restore_in_place(item_loc: Location, target: Any, strict: bool, options: RestoreOptions,
                      key_map: KeyMap | None, events: Emitter | None, coordinator: Coordinator | None) -> None:
    rest = restoring.read_item(item_loc, target, strict=strict, options=options, key_map=key_map, events=events,
                               coordinator=coordinator,
                               manifest=checkpointer.read_manifest(item_loc),
                               take=lambda values: assign_in_place(target, values), release_targets=True)
    assign_in_place(target, rest)


def metrics_json(metrics: dict | None) -> dict | None:
    """Metrics as JSON scalars (tensors become Python numbers, which waits for their computation; NaN and
    infinities are stored as null, as JSON has no spelling for them)."""
    if metrics is None:
        return None
    if not isinstance(metrics, dict):
        raise UnsupportedValueError(f"metrics must be a dict, not {type(metrics).__name__}")
    out = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor):
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        if not isinstance(name, str) or not isinstance(value, tree.JSON_SCALARS):
            raise UnsupportedValueError(f"metric {name!r}={value!r} is not a str -> number (or str, bool) pair")
        out[name] = value
    return out


def skip_batches(iterable: Iterable, n: int) -> Iterator:
    """An iterator over `iterable` with its first `n` items consumed: fast-forwards a data loader without
    state to where a resumed run left off (``for batch in xtc.skip_batches(loader, done_steps): ...``)."""
    iterator = iter(iterable)
    next(itertools.islice(iterator, n, n), None)
    return iterator


def check_items(items: Mapping[str, str] | None, requested: Mapping[str, Any]) -> None:
    """For `CheckpointManager.restore`: `UsageError` unless `items` maps objects given to it to item names."""
    if items is None:
        return
    if not isinstance(items, Mapping):
        raise UsageError(f"items must map object names to item names, e.g. {{'model': 'params'}}, got {items!r}")
    for name, item in items.items():
        if name not in requested:
            raise UsageError(f"items names {name!r}, which is not an object given to restore (given: "
                             f"{', '.join(requested) or 'none'})")
        if not isinstance(item, str) or not layout.is_safe_relative_path(item, single=True):
            raise UsageError(f"items[{name!r}] must be the name of an item of the step, got {item!r}")
