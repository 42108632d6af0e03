"""Consolidated single-host exports of a checkpoint: safetensors (sharded as Hugging Face does) or a torch file.

Tensors are streamed in row blocks (whole trailing dimensions, as many leading rows as fit in a block): the
next block is read while the previous is written where two fit the budget, each taking up to
`convert.COPIES_IN_FLIGHT` times its size, so the process's memory grows by at most `max_host_bytes` whatever
the size of a tensor; a tensor whose stored chunks are too large for that is refused, naming the budget
needed. Called by the command line (``xtckpt convert --to safetensors|torch``); blocks; no torch_xla. The
output is a local directory or file. (A torch file is staged in files mapped back for ``torch.save``: those
pages are page cache, counted in the resident size while mapped but not held by the process.)
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from .. import arrays, storage
from ..core import dtypes, tree
from ..core.errors import CheckpointError, CheckpointExistsError, UnsupportedValueError, UsageError
from ..core.records import ArrayMetadata
from ..formats import safetensors
from ..storage import outputs
from . import convert
from .inspection import Checkpoint, Progress


@dataclass(frozen=True)
class Tensor:
    name: str  # the exported name: the model's state-dict key, or <item>.<key path> for other items
    item: str
    meta: ArrayMetadata


def tensors_of(checkpoint: Checkpoint, items: tuple[str, ...]) -> list[Tensor]:
    """The arrays of `items`, named as a state dict would name them (key-path components joined by dots;
    items other than ``model`` are prefixed with their name)."""
    out = []
    for item in items:
        if item not in checkpoint.items:
            raise UsageError(f"unknown item {item!r}; {checkpoint.location} has {', '.join(checkpoint.items)}")
        for path, leaf in tree.flatten(checkpoint.manifest(item).tree):
            if isinstance(leaf, ArrayMetadata):
                name = ".".join(str(k) for k in path)
                out.append(Tensor(name if item in ("model", "") else f"{item}.{name}", item, leaf))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise UnsupportedValueError("two tensors would get the same exported name; export fewer items")
    return out


def _blocks(checkpoint: Checkpoint, tensor: Tensor, max_host_bytes: int) -> Iterator[np.ndarray]:
    """The tensor's data in C order, block after block, the next read in flight while one is handed out."""
    meta = tensor.meta
    if 0 in meta.shape:
        return
    stored = checkpoint.open(tensor.item, meta)
    row_bytes = math.prod(meta.shape[1:]) * dtypes.by_name(meta.dtype).itemsize
    # A chunk read whole (zarr) makes blocks whole bands of chunk rows; a reader of exact byte ranges reads any
    # block for its bytes. Two blocks are in flight (the next read while one is written) when two fit the
    # budget, else one.
    band_rows = meta.chunk_shape[0] if meta.shape and stored.reads_whole_chunks else 1
    band_bytes = max(1, band_rows * row_bytes)
    in_flight = 2 if band_bytes <= max_host_bytes // (2 * convert.COPIES_IN_FLIGHT) else 1
    block_bytes = max_host_bytes // (in_flight * convert.COPIES_IN_FLIGHT)
    if meta.shape and band_bytes > block_bytes:
        raise UsageError(f"{tensor.name}: a band of its stored chunks ({band_rows} rows) takes {band_bytes} bytes, "
                         f"more than a quarter of the host-memory budget ({max_host_bytes}); raise --max-host-bytes "
                         f"to at least {band_bytes * convert.COPIES_IN_FLIGHT}")
    rows = (block_bytes // band_bytes) * band_rows if meta.shape else 1
    regions = ([tuple((a, min(a + rows, meta.shape[0])) if d == 0 else (0, n) for d, n in enumerate(meta.shape))
                for a in range(0, meta.shape[0], rows)] if meta.shape else [()])

    def start(region: tuple) -> arrays.PendingRead:
        return stored.read([region])[region]

    pending = start(regions[0])
    for k in range(len(regions)):
        following = None
        if in_flight == 2 and k + 1 < len(regions):
            following = start(regions[k + 1])
        yield np.ascontiguousarray(pending.result())
        if in_flight == 1 and k + 1 < len(regions):
            following = start(regions[k + 1])
        pending = following


def export_safetensors(checkpoint: Checkpoint, items: tuple[str, ...], out_dir: str, *, max_file_bytes: int,
                       max_host_bytes: int = convert.DEFAULT_MAX_HOST_BYTES, overwrite: bool = False,
                       progress: Progress | None = None) -> list[str]:
    """Write ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` files of at most `max_file_bytes`
    each plus ``model.safetensors.index.json``) into the local directory `out_dir`. Returns the files written.
    `progress(bytes_done, bytes_total)`.

    Every file is written under a temporary name and renamed into place once all are complete (the index
    last). A directory that already holds an export (a ``model.safetensors``, an index, or shards an index
    names or named as shards are) is refused unless `overwrite`; then the previous export's files are removed,
    so that the directory holds exactly the new export beside its other files (a config, a tokenizer). Raises
    `UsageError` if `out_dir` is not local, is a file, or is, holds or lies inside the checkpoint,
    `CheckpointExistsError`, and what reading the checkpoint raises; nothing is changed then."""
    out_dir = _local_output(out_dir)
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise UsageError(f"{out_dir} is a file; safetensors are exported into a directory")
    outputs.check_separate(checkpoint.location, storage.location(out_dir), what="export")
    tensors = tensors_of(checkpoint, items)
    for t in tensors:
        if t.meta.dtype not in safetensors.FROM_ZARR:
            raise UnsupportedValueError(f"safetensors cannot store {t.name} of dtype {t.meta.dtype}")
    groups: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.meta.nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.meta.nbytes
    names = ([safetensors.SINGLE_NAME] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    previous = _previous_export(out_dir)
    taken = sorted(set(previous) | {n for n in names if os.path.lexists(os.path.join(out_dir, n))})
    if taken and not overwrite:
        raise CheckpointExistsError(f"{out_dir} already holds an export ({', '.join(taken[:3])}"
                                    f"{' and more' if len(taken) > 3 else ''}); pass --overwrite to replace it")
    created = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    staged = outputs.StagedFiles(out_dir)
    total = sum(t.meta.nbytes for t in tensors)
    done = 0
    try:
        for name, group in zip(names, groups):
            head, _ = safetensors.encode_header((t.name, t.meta.dtype, t.meta.shape) for t in group)
            with open(staged.path(name), "wb") as f:
                f.write(head)
                for t in group:
                    for block in _blocks(checkpoint, t, max_host_bytes):
                        f.write(block.reshape(-1).view(np.uint8))
                        done += block.nbytes
                        if progress:
                            progress(done, total)
                os.fsync(f.fileno())
        if len(groups) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {t.name: name for name, group in zip(names, groups) for t in group}}
            with open(staged.path(safetensors.INDEX_NAME), "w") as f:
                json.dump(index, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
        return staged.publish(remove=previous)
    except BaseException:
        staged.discard()
        if created:
            _remove_if_empty(out_dir)
        raise


def _previous_export(out_dir: str) -> list[str]:
    """The files of a Hugging Face export in `out_dir`: ``model.safetensors``, the index and the shards it
    names, and files named as shards are. A name an index gives that is not a plain ``.safetensors`` file
    name is ignored (it is never deleted)."""
    if not os.path.isdir(out_dir):
        return []
    names = set()
    for name in os.listdir(out_dir):
        if name in (safetensors.SINGLE_NAME, safetensors.INDEX_NAME) or _SHARD_NAME.fullmatch(name):
            names.add(name)
    if safetensors.INDEX_NAME in names:
        try:  # read through storage, which refuses a FIFO or a device in the file's place
            data = storage.location(out_dir).read(safetensors.INDEX_NAME) or b""
            weight_map = safetensors.weight_map_of(data, os.path.join(out_dir, safetensors.INDEX_NAME))
        except CheckpointError:  # an index that does not decode names nothing more to remove
            weight_map = {}
        names.update(n for n in weight_map.values()
                     if n.endswith(safetensors.SUFFIX) and os.path.isfile(os.path.join(out_dir, n)))
    return sorted(names)


_SHARD_NAME = re.compile(r"model-[0-9]{5}-of-[0-9]{5}\.safetensors")


def _remove_if_empty(directory: str) -> None:
    try:
        os.rmdir(directory)
    except OSError:
        pass


def export_torch(checkpoint: Checkpoint, items: tuple[str, ...], out_file: str, *,
                 max_host_bytes: int = convert.DEFAULT_MAX_HOST_BYTES, overwrite: bool = False,
                 progress: Progress | None = None) -> str:
    """Write a ``torch.save`` file of a flat {name: tensor} dict, loadable with ``weights_only=True``, to the
    local path `out_file`, under a temporary name renamed into place once complete. Each tensor is staged in
    a file next to `out_file` and mapped from there, so memory holds about one block.
    `progress(bytes_done, bytes_total)`. Raises `UsageError` if `out_file` is not local, is a directory, or is
    or lies inside the checkpoint, `CheckpointExistsError` if it exists and not `overwrite`."""
    out_file = _local_output(out_file)
    if os.path.isdir(out_file):
        raise UsageError(f"{out_file} is a directory; --to torch writes one file (give its path)")
    outputs.check_separate(checkpoint.location, storage.location(out_file), what="export")
    if os.path.lexists(out_file) and not overwrite:
        raise CheckpointExistsError(f"{out_file} already exists; pass --overwrite to replace it")
    tensors = tensors_of(checkpoint, items)
    directory = os.path.dirname(out_file)
    os.makedirs(directory, exist_ok=True)
    total = sum(t.meta.nbytes for t in tensors)
    done = 0
    staged = outputs.StagedFiles(directory)
    try:
        with tempfile.TemporaryDirectory(prefix=".xtckpt-export-", dir=directory) as tmp:
            saved: dict[str, torch.Tensor] = {}
            for i, t in enumerate(tensors, 1):
                path = os.path.join(tmp, f"{i}.bin")
                with open(path, "wb") as f:
                    for block in _blocks(checkpoint, t, max_host_bytes):
                        f.write(block.reshape(-1).view(np.uint8))
                        done += block.nbytes
                        if progress:
                            progress(done, total)
                row = dtypes.by_name(t.meta.dtype)
                numel = math.prod(t.meta.shape)
                storage_dtype = row.view_as or row.torch
                flat = torch.from_file(path, shared=False, size=numel, dtype=storage_dtype) if numel else \
                    torch.empty(0, dtype=storage_dtype)
                saved[t.name] = flat.view(row.torch).reshape(t.meta.shape)
            torch.save(saved, staged.path(os.path.basename(out_file)))
        return staged.publish()[0]
    except BaseException:
        staged.discard()
        raise


def _local_output(path: str) -> str:
    """The operating-system path of an export's output; `UsageError` for a path on another storage."""
    loc = storage.location(path)
    local = loc.local_file("")
    if local is None:
        raise UsageError(f"exports are written to local files; {loc} is not on the local file system")
    return local
