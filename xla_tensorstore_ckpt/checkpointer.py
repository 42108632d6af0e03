"""The item-level API: one state tree to and from one directory (``<dir>/_METADATA`` and the arrays, an Orbax
PyTree checkpoint). `save` plans, stages and writes (`save_plan`, `staging`, `writing`), `restore` matches and
reads (`restoring`).

An item counts as written only once its ``_METADATA`` exists, so a crashed save leaves a directory that `restore`
refuses. With several processes (torch.distributed), `save` must be called by every process with its own shards;
each writes the chunks it is assigned and the primary writes ``_METADATA`` once all have succeeded.
"""

from __future__ import annotations

import time
from typing import Any

from . import formats, storage
from .core import events, tree
from .core.events import Emitter
from .core.records import ItemManifest
from .formats import checksums
from .multihost.distributed import Coordinator, default_coordinator
from .options import RestoreOptions, SaveOptions
from .restores.restoring import KeyMap, PathLike, read_item
from .saves import commit
from .saves.save_plan import plan_save
from .saves.writing import prepare_directory, stage_and_write


def save(path: PathLike, state: Any, *, overwrite: bool = False, options: SaveOptions | None = None,
         coordinator: Coordinator | None = None) -> None:
    """Save one state tree into the directory `path` (local, ``gs://``, ``s3://`` or ``memory://``). Blocks until every
    chunk and ``_METADATA`` are stored (durably, with `options.fsync`).

    `state` nests dicts, lists and tuples; leaves are torch tensors (XLA SPMD-sharded, XLA unsharded or CPU),
    `ShardedArray`s, or JSON scalars. Each distinct shard is written once into its chunk of the array; the save
    causes no XLA compilation or execution beyond materializing pending computations. In a job of several
    processes (`coordinator`, by default the torch.distributed world) every process must call it.

    Raises `UnsupportedValueError` before writing anything if a leaf cannot be stored,
    `CheckpointExistsError` if `path` already holds data and `overwrite` is False, `StorageError` /
    `CorruptCheckpointError` if storage fails and `CoordinationError` if another process fails (then no
    ``_METADATA`` is written; `CoordinationTimeoutError`, naming the phase and the processes that did not
    arrive, past `options.coordination_timeout_s`). With `overwrite`, the new item is written beside the old
    one and replaces it once committed: a failed save leaves the old item as it was. A failed save deletes
    what it wrote (a path that was empty is empty again).
    """
    options = options or SaveOptions()
    coordinator = coordinator or default_coordinator()
    coordinator.take_costs()  # the committed event reports this save's agreements alone
    with coordinator.deadline(options.coordination_timeout_s):
        _save(storage.location(path), state, overwrite, options, coordinator)


def _save(loc: storage.Location, state: Any, overwrite: bool, options: SaveOptions, coordinator: Coordinator) -> None:
    item_events = Emitter(options.listeners, path=str(loc), process=coordinator.index)
    begun = time.perf_counter()
    item_events.emit(events.SAVE_STARTED)
    plan = plan_save(state, options, coordinator)
    temporary = coordinator.on_primary(f"preparing {loc}", lambda: prepare_directory(loc, overwrite=overwrite),
                                     share=True)
    target = loc if temporary is None else loc.resolved().parent.child(temporary)
    publish = None if temporary is None else lambda: target.replace(
        loc.resolved(), commit_files=formats.writer(options.format).ITEM_COMMIT_FILES)
    try:
        # Nothing needs the staged data once written: hold at most the batch being written and the next.
        writes = commit.finish_writes(coordinator, target, lambda: stage_and_write(
            target, plan, options, writer=coordinator.index, max_host_bytes=2 * options.host_batch_bytes),
            fsync=options.fsync, what=str(loc))
        written = time.perf_counter()
        item_events.emit(events.SAVE_WRITTEN, seconds=written - begun, nbytes=plan.write_bytes,
                         files=len(writes.files) + len(writes.trees),
                         details={"chunks": writes.chunks, "chunk_bytes": writes.chunk_bytes,
                                  "peak_staged_bytes": writes.peak_staged_bytes})
        commit.commit(coordinator, target, {"": plan}, [], fsync=options.fsync, what=str(loc), publish=publish)
        item_events.emit(events.SAVE_COMMITTED, seconds=time.perf_counter() - written,
                         details={"total_seconds": time.perf_counter() - begun,
                                  "agreements": coordinator.take_costs()})
    except BaseException:
        if coordinator.is_primary:  # every process is past its writes: the failure was agreed
            # The replacement that failed (the old item is untouched), or what the failed save wrote into a
            # path that was empty: a full disk gets its room back and a retry finds the path as it was.
            commit.discard(target, str(loc))
        raise



def restore(path: PathLike, target: Any = None, *, strict: bool = True, key_map: KeyMap | None = None,
            options: RestoreOptions | None = None, coordinator: Coordinator | None = None) -> Any:
    """Read the item at `path`: one of ours (any format version) or one Orbax wrote. Blocks until every
    tensor is in place.

    With `target` None: the saved tree with CPU tensors of the saved dtypes. With a `target` tree: a new tree
    of the target's structure in which each tensor has the target's sharding, device and dtype (values are
    cast when the dtype differs), reading for each local shard exactly its region. Non-tensor target leaves
    take the saved value. The target is not modified.

    `key_map` renames the checkpoint's keys before they are matched with the target's: a dict or a function
    from the checkpoint's dotted names (``params.decoder.layers.0.w``) to the target's (``layers.0.weight``,
    as a ``state_dict`` names it), None dropping a key. Without a target, the result is then a flat dict by
    new name.

    Raises `KeyMismatchError` listing keys missing from the checkpoint or not in the target (with
    `strict=False` these are skipped with a warning and missing ones keep the target's leaf),
    `ShapeMismatchError` naming key, both shapes and the path, `CorruptCheckpointError` for damaged data
    (naming array and chunk, or the metadata file whose checksum does not match), `CheckpointNotFoundError`
    if `path` holds no item.

    With `options.single_replica_reads` in a job of several processes (`coordinator`, by default the
    torch.distributed world), every process must call it: each stored chunk is read by one of them and sent to
    the others that need it, and an error on any process (damage, a process that dies) raises on every one.
    """
    return restore_item(storage.location(path), target, strict=strict, key_map=key_map, options=options,
                        coordinator=coordinator)


def restore_item(loc: storage.Location, target: Any = None, *, strict: bool = True, key_map: KeyMap | None = None,
                 options: RestoreOptions | None = None, events: Emitter | None = None,
                 coordinator: Coordinator | None = None) -> Any:
    """`restore`, with the restore's events told to `events` (a manager's, bound to its step, tier and item)
    instead of `options.listeners`, and single-replica reads among `coordinator`'s processes (by default the
    torch.distributed world). Called by `restore` and by the manager; blocks."""
    manifest = read_manifest(loc)
    values = read_item(loc, target, strict=strict, options=options, manifest=manifest, key_map=key_map,
                       events=events, coordinator=coordinator)
    if target is None and key_map is not None:
        return {path[0]: value for path, value in values.items()}
    return tree.rebuild(manifest.tree if target is None else target, lambda p, v: values.get(p, v))


def read_manifest(loc: storage.Location) -> ItemManifest:
    """The manifest of the item at `loc`, for a restore: ``_METADATA`` decoded (its own checksum verified, where
    it records one) and ``_strings.json`` checked against the checksum ``_METADATA`` records. Raises what
    `formats.read_item` raises and `CorruptCheckpointError` naming a damaged file. Blocks."""
    manifest = formats.read_item(loc)
    checksums.verify_strings(loc, manifest)
    return manifest


def metadata(path: PathLike) -> Any:
    """The saved tree with an `ArrayMetadata` (shape, dtype, chunk shape, saved sharding) for each array and
    the values of JSON leaves. Reads only ``_METADATA``; never imports torch_xla."""
    return formats.read_item(storage.location(path)).tree
