"""The restore half of an item (`read_item`, called by `checkpointer.restore` and the manager): match the saved
tree against a target (`renamed`, `_match`), plan for each local shard of each target exactly its region (a box
covering several shards is read once, `read_jobs`), then read and place the data batch by batch (`read_batches`):
on the target's devices with its sharding (XLA), as CPU tensors, or as the shards a `ShardedArray` target asks
for.

Restoring needs no coordination between processes: each reads its own regions. Everything blocks.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import formats, incremental, storage, targets
from ..arrays.local_reads import COUNTS as LOCAL_READS
from ..core import layout, tree
from ..core.errors import (
    KeyMismatchError,
    ShapeMismatchError,
    UnsupportedValueError,
    UsageError,
)
from ..core.events import RESTORE_FINISHED, RESTORE_PLANNED, Emitter
from ..core.gc_pause import paused_gc
from ..core.records import ArrayMetadata, ItemManifest
from ..multihost.distributed import Coordinator, default_coordinator
from ..options import RestoreOptions
from . import read_jobs, replica_reads
from .read_batches import PATHS, read_arrays
from .read_jobs import RestoreAs, is_array_target

PathLike = str | storage.Location

KeyMap = Mapping[str, str | None] | Callable[[str], str | None]


def read_item(path: PathLike, target: Any = None, *, strict: bool = True, options: RestoreOptions | None = None,
              manifest: ItemManifest | None = None, key_map: KeyMap | None = None,
              take: Callable[[dict[layout.KeyPath, Any]], None] | None = None, release_targets: bool = False,
              events: Emitter | None = None, coordinator: Coordinator | None = None) -> dict[layout.KeyPath, Any]:
    """The restored value of every key path `restore` would fill: tensors placed like their target leaf
    (a tensor or a `RestoreAs`; CPU tensors for other leaves) and saved JSON values. Same errors as
    `restore`; callers that restore in place (the manager) assign the values themselves. With `key_map`, the
    checkpoint's keys are renamed first (see `renamed`); without a target the result is then keyed by
    1-tuples of the new names.

    With `take`, each restored tensor is handed to it as soon as it is placed, and not returned (the result
    holds the JSON values only): a caller that swaps them into the target at once frees the target's old
    device buffers tensor by tensor, so a restore in place needs the state plus about one tensor of device
    memory, not twice the state. With `release_targets` too (the caller replaces every target tensor with the
    value it is handed), each XLA target's device data is released once its regions are read and checked,
    right before its new value is placed: no device memory beyond the state; if placing then fails, that
    tensor is left without values. Host targets (CPU tensors, DTensors' local tensors) of the saved dtype are
    read into directly, their own memory the read's buffer: no second copy of the state, no fresh memory. Keys
    and shapes are checked before anything is read; if reading fails later (damaged data), the tensors already
    handed over stay restored, and the error names the targets left as they were and those a read had
    started writing into.

    `events` (by default `options.listeners` with the item's path) is told when the reads are planned and when
    they are done (`events.RESTORE_PLANNED`, `RESTORE_FINISHED`: the bytes this process reads, and in its
    details ``storage_bytes``, what its reader fetched from storage for them, `ArrayReader.fetched_bytes`;
    with single-replica reads also ``peer_bytes_sent`` and ``peer_bytes_received``, and ``agreements``: what
    each collective phase of the restore cost this process, `Coordinator.take_costs`).

    With `options.single_replica_reads` in a job of several processes (`coordinator`, by default the
    torch.distributed world), the restore is collective: every process must call it, and a failure on any
    process raises on every one (`replica_reads`); each collective phase waits at most
    `options.coordination_timeout_s`, then raises `CoordinationTimeoutError` naming the phase and the processes
    that did not arrive."""
    options = options or RestoreOptions()
    if release_targets and take is None:
        raise TypeError("release_targets needs take: the caller must put the new values in place")
    loc = storage.location(path)
    shared = _shared(options, coordinator)
    if shared is not None:
        shared.take_costs()  # the event reports this restore's agreements alone
    # Many small records (layouts, read plans) live until the item is read.
    with paused_gc(), contextlib.nullcontext() if shared is None else shared.deadline(options.coordination_timeout_s):
        try:
            if target is not None and not tree.is_container(target):
                raise UnsupportedValueError("the restore target must be a tree (dict, list or tuple), not a "
                                            f"{type(target).__name__}")
            manifest = manifest or formats.read_item(loc)
            saved = manifest.leaves()
            if key_map is not None:
                saved = renamed(saved, key_map, dict(tree.flatten(target)) if target is not None else {}, loc)
            elif target is not None and formats.item_format(manifest).MATCH_BY_NAME:
                saved = renamed(saved, {}, dict(tree.flatten(target)), loc)
            wanted = ({p: None for p in saved} if target is None
                      else _match(loc, saved, dict(tree.flatten(target)), strict))
            reader = incremental.reader(loc, manifest.store)
            amplification = read_jobs.max_amplification(reader.fetches_once, loc.capabilities.cheap_refetch)
            jobs = read_jobs.jobs(saved, wanted, amplification)
        except Exception as exc:
            if shared is not None:
                replica_reads.tell_failure(shared, exc)
            raise
        try:
            exchange = None if shared is None else replica_reads.plan(shared, loc, jobs,
                                                                      read_jobs.batch_bytes(options))
            events = (events or Emitter(options.listeners)).bound(path=str(loc))
            planned_bytes = sum(job.read_bytes for job in jobs)
            events.emit(RESTORE_PLANNED, nbytes=planned_bytes,
                        details={"arrays": len(jobs), "chunks": sum(job.chunks_touched for job in jobs)})
            begun = time.perf_counter()
            into = _readable_into(wanted) if release_targets else {}
            paths: Counter[str] = Counter()
            local_before, calls_before = LOCAL_READS.snapshot(), storage.CALLS.snapshot()
            values = read_arrays(loc, reader, jobs, options, take, release_targets=release_targets,
                                 exchange=exchange, into=into, events=events, paths=paths)
            fetched = reader.fetched_bytes()
        finally:
            reader.close()  # every read has finished: read_arrays waits for them, also on errors
        details = {"arrays": len(jobs), "storage_bytes": fetched,
                   "paths": {**{name: paths[name] for name in PATHS}, **LOCAL_READS.since(local_before),
                             **storage.CALLS.since(calls_before)}}
        if exchange is not None:
            details.update(peer_bytes_sent=exchange.sent_bytes, peer_bytes_received=exchange.received_bytes,
                           plan="derived" if exchange.derived else "gathered",
                           agreements=shared.take_costs() if shared is not None else {})
        events.emit(RESTORE_FINISHED, seconds=time.perf_counter() - begun, nbytes=planned_bytes, details=details)
    values.update((p, saved[p]) for p in wanted if not isinstance(saved[p], ArrayMetadata))
    return values


def _readable_into(wanted: Mapping[layout.KeyPath, Any]) -> dict[layout.KeyPath, torch.Tensor]:
    """The host target tensors of a restore in place that reads may fill directly: not those whose memory
    overlaps another target's (tied weights, overlapping views: two reads into one memory would race, and a
    chunk's checksum is computed over the memory it was read into; they are copied one after the other)."""
    spans = []
    for path, tensor in wanted.items():
        local = targets.local_memory(tensor) if isinstance(tensor, torch.Tensor) else None
        if local is not None and local.device.type == "cpu" and local.numel() > 0:
            start = local.data_ptr()  # a strided view's memory reaches its last element (strides are >= 0)
            elements = 1 + sum((n - 1) * step for n, step in zip(local.shape, local.stride()))
            spans.append((start, start + elements * local.element_size(), path, tensor))
    spans.sort(key=lambda span: span[0])
    overlapping = set()
    reach, reacher = -1, None  # the furthest end so far, and whose
    for start, end, path, _ in spans:
        if start < reach:
            overlapping.update((path, reacher))
        if end > reach:
            reach, reacher = end, path
    return {path: tensor for _, _, path, tensor in spans if path not in overlapping}


def _shared(options: RestoreOptions, coordinator: Coordinator | None) -> Coordinator | None:
    """The coordinator of the single-replica reads `options` ask for, or None (one process, or not asked)."""
    if not options.single_replica_reads:
        return None
    coordinator = coordinator or default_coordinator()
    return coordinator if coordinator.distributed else None


def renamed(saved: dict, key_map: KeyMap, target: dict, loc: storage.Location) -> dict:
    """The checkpoint's leaves under the names `key_map` gives them, keyed by the target's key path of that name
    (a 1-tuple of the name where the target has none). Names are key paths joined by ``.`` (``layers.0.w``), as
    Orbax and torch ``state_dict`` keys spell them; `key_map` is a dict (names it lacks stay as they are) or a
    function; None drops a leaf. Raises `UsageError` if two checkpoint keys get the same name."""
    by_name = {layout.key_name(p): p for p in target}
    out: dict[layout.KeyPath, Any] = {}
    origin: dict[layout.KeyPath, str] = {}
    for path, leaf in saved.items():
        name = layout.key_name(path)
        new = key_map(name) if callable(key_map) else key_map.get(name, name)
        if new is None:
            continue
        if not isinstance(new, str):
            raise UsageError(f"key_map gave {new!r} for {name!r}: not a name (str) or None")
        key = by_name.get(new, (new,))
        if key in out:
            raise UsageError(f"key_map gives {origin[key]!r} and {name!r} of {loc} the same name {new!r}")
        out[key], origin[key] = leaf, name
    return out


def _match(loc: storage.Location, saved: dict, target: dict, strict: bool) -> dict:
    """Target leaves by key path, checked against the checkpoint (keys, tensor shapes)."""
    missing = tuple(tree.format_key_path(p) for p in target if p not in saved)
    unexpected = tuple(tree.format_key_path(p) for p in saved if p not in target)
    if missing or unexpected:
        message = f"checkpoint {loc} and the restore target differ: " + "; ".join(
            part for part in (
                f"missing from the checkpoint: {', '.join(missing)}" if missing else "",
                f"not in the target: {', '.join(unexpected)}" if unexpected else "") if part)
        if strict:
            raise KeyMismatchError(message + " (pass strict=False to restore the common keys)",
                                   missing=missing, unexpected=unexpected)
        warnings.warn(message + "; restoring the common keys", stacklevel=4)
    wanted = {}
    for path, value in target.items():
        if path not in saved:
            continue
        stored = saved[path]
        array = is_array_target(value)
        if array:
            reference = value.reference if isinstance(value, RestoreAs) else value
            if not isinstance(stored, ArrayMetadata):
                raise UnsupportedValueError(
                    f"cannot restore {tree.format_key_path(path)} from {loc}: the checkpoint holds the value "
                    f"{stored!r}, the target an array")
            if tuple(reference.shape) != stored.shape:
                raise ShapeMismatchError(
                    f"cannot restore {tree.format_key_path(path)}: checkpoint shape {stored.shape} at "
                    f"{loc.child(stored.path)} does not match target shape {tuple(reference.shape)}",
                    key=tree.format_key_path(path), saved_shape=stored.shape, target_shape=tuple(reference.shape))
        wanted[path] = value if array else None
    return wanted
