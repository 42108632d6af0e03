"""Staging one step for the tiers it is due for: each tier's items planned (a local tier plans this process's own
copy, with its own RNG row), each step directory cleared, and the shards copied off the devices once for all of
them. What comes back is a `PendingSave` per tier, which the manager commits on that tier's background thread.

Collective with several processes (planning the persistent tier's items, clearing its step directory, and the
staging unless it is an asynchronous save's shared copy, whose failure the commit reports). Blocks while the
shards are copied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.gc_pause import paused_gc
from ..core.records import StepMetadata
from ..multihost.distributed import Coordinator
from ..options import SaveOptions
from ..saves import save_plan, staging, writing
from . import rng_state
from .tier import PendingSave, Tier
from .training_state import RNG_ITEM


@dataclass(frozen=True)
class Destination:
    """A tier a step goes to: its steps, the coordinator that clears its step directory from the caller's thread,
    whether it keeps this process's own copy (a local tier) rather than the job's shared one, and its plan
    caches (item name -> `save_plan.PlanCache`, kept by the caller across saves); with `incremental`, the step
    references what has not changed since the tier's newest step (`incremental`)."""

    tier: Tier
    coordinator: Coordinator
    own_copy: bool
    plan_caches: dict[str, save_plan.PlanCache]
    incremental: bool = False
    delta: bool = False
    max_chain: int = 8
    anchor_every: int | None = None  # every this many saves a full anchor step (`Tier.base_for`)
    page_cache: bool = False  # written through the page cache (`SaveOptions.page_cache`): a local tier


def stage(step: int, destinations: Sequence[Destination], states: Mapping[str, Any], marker: StepMetadata, *,
          coordinator: Coordinator, options: SaveOptions, save_rng: bool, async_save: bool,
          max_host_bytes: int | None, precondition: save_plan.Precondition | None = None) -> list[PendingSave]:
    """Plan `states` (item name -> state tree) for every destination, clear their step directories, and begin
    the writes: in async mode without `max_host_bytes` every shard is on the host when this returns, copied off
    the devices once for all destinations (`staging.stage_shared`); otherwise each destination begins as
    `writing.begin_writes` does. `marker` is completed per destination (items; for an own copy its writer, whether
    the step also goes to a shared tier, and the shared tier's root as `marker.persistent_root` names it).
    `precondition` (what the caller did before; `save_plan.Precondition`) is checked in the first
    destination's planning agreement. Raises what planning raises, and the precondition's error, on every
    process; what staging raises too, except in async mode without `max_host_bytes`, where a process does not
    wait for the others' staging: a failure there is raised when the commit starts the writes (on every process,
    by the commit's agreement)."""
    shared = any(not d.own_copy for d in destinations)
    # Incremental saves: each tier's base, pinned against retention until the save commits or fails.
    bases = [dataclasses.replace(d.tier.base_for(step, d.anchor_every), delta=d.delta, max_chain=d.max_chain)
             if d.incremental
             else None for d in destinations]
    opts = [dataclasses.replace(options, incremental=b, page_cache=options.page_cache or d.page_cache)
            for d, b in zip(destinations, bases)]
    try:
        starts, places, plans, markers = _stage(step, destinations, states, marker, shared, coordinator, opts,
                                                save_rng=save_rng, async_save=async_save,
                                                max_host_bytes=max_host_bytes, precondition=precondition)
    except BaseException:
        for d, b in zip(destinations, bases):
            if b is not None:
                d.tier.unpin(b.step)
        raise
    return [PendingSave(step, location, final, p, start, m,
                        base=None if b is None else (-1 if b.step is None else b.step))
            for (location, final), p, start, m, b in zip(places, plans, starts, markers, bases)]


def _stage(step: int, destinations: Sequence[Destination], states: Mapping[str, Any], marker: StepMetadata,
           shared: bool, coordinator: Coordinator, opts: list[SaveOptions], *, save_rng: bool, async_save: bool,
           max_host_bytes: int | None,
           precondition: save_plan.Precondition | None) -> tuple[list, list, list, list]:
    options = dataclasses.replace(opts[0], incremental=None)  # planning never depends on the base
    with paused_gc():  # many small records live until the save is planned and staged
        plans, places, markers = [], [], []
        for destination in destinations:
            items = dict(states)
            own = destination.own_copy
            if save_rng:  # an own copy holds its process's generators alone, whatever its index later
                items[RNG_ITEM] = rng_state.capture(0, 1) if own else rng_state.capture(coordinator.index,
                                                                                         coordinator.count)
            caches = destination.plan_caches
            first = precondition if not plans else None
            # The job's tier clears its step directory in the planning's agreement rather than with a broadcast
            # of its own (one collective less per save), once the state is validated; but a committed step
            # being replaced is deleted only after every process has passed the precondition.
            tier = destination.tier
            merged = (first is not None and coordinator.distributed and not own
                      and destination.coordinator is coordinator and step not in tier.committed())
            if merged:
                tier.forget(step)
                first.action = (lambda t=tier: t.clear(step)) if coordinator.is_primary else None
                first.what = f"{first.what}; preparing step {step} at {tier.index.location(step)}"
            plans.append(save_plan.plan_saves(items, options, coordinator, own_copy=own, caches={
                name: caches.setdefault(name, save_plan.PlanCache()) for name in items}, precondition=first))
            places.append(tier.places(step, first.agreed or 0) if merged
                          else tier.prepare(destination.coordinator, step))
            markers.append(dataclasses.replace(marker, items=tuple(plans[-1]), persistent_copy=own and shared,
                                               writer=coordinator.index if own else None,
                                               persistent_root=marker.persistent_root if own else None))
        writer = coordinator.index

        if async_save and max_host_bytes is None:
            # No agreement here: a process returns to training once its own copies are made. A failed staging
            # is raised by its writes' start, in the commit's agreement, on every process (`AsyncSaveError`).
            try:
                staged = staging.stage_shared(plans, options)
            except Exception as exc:  # noqa: BLE001 - raised on every process by the commit's agreement
                starts = [_failed(exc) for _ in places]
            else:
                starts = [writing.deferred_writes(location, p, s, o, writer=writer)
                          for (location, _), p, s, o in zip(places, plans, staged, opts)]
        else:
            starts = coordinator.everywhere(f"staging step {step}", lambda: [
                writing.begin_writes(location, p, o, writer=writer, background=async_save,
                                     max_host_bytes=max_host_bytes)
                for (location, _), p, o in zip(places, plans, opts)])
    return starts, places, plans, markers


def _failed(exc: Exception) -> Callable[[], writing.Writes]:
    """The start of the writes of a save whose staging failed with `exc`: raises it (on the commit's thread)."""
    def start() -> writing.Writes:
        raise exc

    return start
