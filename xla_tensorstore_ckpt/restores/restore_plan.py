"""A restore planned without reading data (a dry run): what `restore` would do with a target, key by key.

For each key: whether the checkpoint and the target both have it (``present``), only the target (``missing``) or
only the checkpoint (``unexpected``); saved and target shape and dtype (a cast that can lose values is flagged);
for arrays, the bytes this process would read, the stored chunks those reads touch, and for each target shard
how many stored chunks it touches. For the whole restore: where it reads from (the item's format and store), the
bytes and chunks per process, the host memory it needs at most beyond the restored tensors' own, and whether
``strict=True`` would refuse it (with the reasons). The reads are planned by the restore's own code
(`restoring`), so the bytes are those the restore then reads (its ``restore_finished`` events say the same).

Reads only metadata; never imports torch_xla unless the target holds XLA tensors. Used by `xtc.plan_restore` and
``xtckpt plan``; blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import torch

from .. import formats, incremental, storage
from ..core import dtypes, tree
from ..core.records import ArrayMetadata, ItemManifest
from ..options import RestoreOptions
from . import read_jobs, restoring
from .read_jobs import RestoreAs, is_array_target
from .restoring import KeyMap


@dataclass(frozen=True)
class KeyPlan:
    """One key of a restore plan (see the module)."""

    key: str
    status: str  # "present", "missing" or "unexpected"
    saved_shape: tuple[int, ...] | None = None  # None: a JSON value, or not in the checkpoint
    saved_dtype: str | None = None
    target_shape: tuple[int, ...] | None = None
    target_dtype: str | None = None
    lossy_cast: bool = False
    read_bytes: int = 0
    chunks: int = 0
    chunks_per_shard: tuple[int, ...] = ()
    problem: str | None = None  # why a strict restore refuses this key

    def to_json(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class RestorePlan:
    """The plan of one item's restore on one process (`process` of `processes`)."""

    path: str
    source: str  # e.g. "xla_tensorstore_ckpt format 2, OCDBT store"
    keys: tuple[KeyPlan, ...]
    read_bytes: int
    chunks: int
    peak_host_bytes: int
    process: int = 0
    processes: int = 1
    problems: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """True if ``strict=True`` would restore it."""
        return not self.problems

    def to_json(self) -> dict:
        return {"path": self.path, "source": self.source, "process": self.process, "processes": self.processes,
                "read_bytes": self.read_bytes, "chunks": self.chunks, "peak_host_bytes": self.peak_host_bytes,
                "ok": self.ok, "problems": list(self.problems), "keys": [k.to_json() for k in self.keys]}


def plan_restore(path: str | storage.Location, target: Any = None, *, key_map: KeyMap | None = None,
                 options: RestoreOptions | None = None, process: int = 0, processes: int = 1) -> RestorePlan:
    """Plan restoring the item at `path` onto `target` as `xtc.restore` would (None: the saved tree as CPU
    tensors), reading only metadata. `process` and `processes` only label the plan (the target's shards are
    this process's). Raises what reading the manifest raises (`CheckpointNotFoundError`,
    `CorruptCheckpointError`); mismatches are reported in the plan, not raised."""
    options = options or RestoreOptions()
    loc = storage.location(path)
    manifest = formats.read_item(loc)
    saved = manifest.leaves()
    flat_target = dict(tree.flatten(target)) if target is not None else {}
    if key_map is not None:
        saved = restoring.renamed(saved, key_map, flat_target, loc)
    wanted = {p: None for p in saved} if target is None else flat_target
    keys: list[tuple[Any, KeyPlan]] = []  # (key path, its plan)
    problems: list[str] = []
    matched: dict = {}
    for path_, value in wanted.items():
        name = tree.format_key_path(path_)
        if path_ not in saved:
            keys.append((path_, KeyPlan(name, "missing", **_target_fields(value))))
            problems.append(f"{name}: missing from the checkpoint")
            continue
        key = _present(name, saved[path_], value)
        keys.append((path_, key))
        if key.problem:
            problems.append(f"{name}: {key.problem}")
        else:
            matched[path_] = value if is_array_target(value) else None
    for path_, stored in saved.items():
        if path_ not in wanted:
            name = tree.format_key_path(path_)
            keys.append((path_, KeyPlan(name, "unexpected", **_saved_fields(stored))))
            problems.append(f"{name}: not in the target")
    reader = incremental.reader(loc, manifest.store)
    amplification = read_jobs.max_amplification(reader.fetches_once, loc.capabilities.cheap_refetch)
    reader.close()  # asked only what it fetches; it opened nothing
    planned = read_jobs.jobs(saved, matched, amplification)
    jobs = {job.key_path: job for job in planned}
    return RestorePlan(str(loc), _source(manifest), tuple(_with_reads(k, jobs.get(p)) for p, k in keys),
                       sum(j.read_bytes for j in jobs.values()), sum(j.chunks_touched for j in jobs.values()),
                       read_jobs.schedule(planned, options).peak_host_bytes, process, processes, tuple(problems))


def _target_fields(value: Any) -> dict:
    if is_array_target(value):
        reference = value.reference if isinstance(value, RestoreAs) else value
        dtype = value.dtype if isinstance(value, RestoreAs) else reference.dtype
        return {"target_shape": tuple(reference.shape), "target_dtype": dtypes.by_torch(dtype).name}
    return {}


def _saved_fields(stored: Any) -> dict:
    if isinstance(stored, ArrayMetadata):
        return {"saved_shape": stored.shape, "saved_dtype": stored.dtype}
    return {}


def _present(name: str, stored: Any, value: Any) -> KeyPlan:
    fields = {**_saved_fields(stored), **_target_fields(value)}
    problem = None
    if "target_shape" in fields and "saved_shape" not in fields:
        problem = f"the checkpoint holds the value {stored!r}, the target an array"[:200]
    elif "target_shape" in fields and fields["target_shape"] != fields["saved_shape"]:
        problem = f"checkpoint shape {fields['saved_shape']} does not match target shape {fields['target_shape']}"
    lossy = "target_dtype" in fields and "saved_dtype" in fields and _lossy(fields["saved_dtype"],
                                                                          fields["target_dtype"])
    return KeyPlan(name, "present", **fields, lossy_cast=lossy, problem=problem)


def _lossy(saved: str, target: str) -> bool:
    """True if casting `saved` to `target` can change values: the target cannot hold every saved value (by
    torch's promotion rules, or integers into a float of fewer mantissa bits)."""
    a, b = dtypes.by_name(saved).torch, dtypes.by_name(target).torch
    if a == b:
        return False
    if torch.promote_types(a, b) != b:
        return True
    if not a.is_floating_point and not a.is_complex and a != torch.bool and b.is_floating_point:
        return torch.iinfo(a).bits > ml_dtypes.finfo(dtypes.by_name(target).numpy).nmant + 1
    return False


def _with_reads(key: KeyPlan, job: Any) -> KeyPlan:
    if job is None:
        return key
    chunk = job.meta.chunk_shape
    per_shard = tuple(math.prod(-(-b // c) - a // c if b > a else 0 for (a, b), c in zip(s.index, chunk))
                      for s in job.layout.distinct_shards())
    return KeyPlan(**{**key.__dict__, "read_bytes": job.read_bytes, "chunks": job.chunks_touched,
                      "chunks_per_shard": per_shard})


def _source(manifest: ItemManifest) -> str:
    store = manifest.store
    writer = formats.item_format(manifest).DESCRIPTION
    if not store.zarr_format:  # not zarr: tensors in the format's own files
        return writer
    layout = "an OCDBT store" if store.kind == "ocdbt" else "a directory per array"
    return f"{writer}, zarr v{store.zarr_format} in {layout}"
