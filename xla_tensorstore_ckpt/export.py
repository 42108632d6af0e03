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
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from . import arrays, convert, dtypes, tree
from .errors import UnsupportedValueError, UsageError
from .formats import ArrayMetadata, safetensors
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
    ref = checkpoint.array_ref(tensor.item, meta)
    store = arrays.open_existing(ref, meta).result()
    row_bytes = math.prod(meta.shape[1:]) * dtypes.by_name(meta.dtype).itemsize
    # A zarr chunk is read and decoded whole, so blocks are whole bands of chunk rows; a raw tensor (safetensors)
    # reads exactly the block's bytes. Two blocks are in flight (the next read while one is written) when two fit
    # the budget, else one.
    band_rows = 1 if ref.store.kind == "safetensors" or not meta.shape else meta.chunk_shape[0]
    band_bytes = max(1, band_rows * row_bytes)
    in_flight = 2 if band_bytes <= max_host_bytes // (2 * convert.COPIES_IN_FLIGHT) else 1
    block_bytes = max_host_bytes // (in_flight * convert.COPIES_IN_FLIGHT)
    if meta.shape and band_bytes > block_bytes:
        raise UsageError(f"{tensor.name}: a band of its stored chunks ({band_rows} rows) takes {band_bytes} bytes, "
                         f"more than a quarter of the host-memory budget ({max_host_bytes}); raise --max-host-bytes "
                         f"to at least {band_bytes * convert.COPIES_IN_FLIGHT}")
    rows = (block_bytes // band_bytes) * band_rows if meta.shape else 1
    regions = ([tuple(slice(a, min(a + rows, meta.shape[0])) if d == 0 else slice(0, n)
                      for d, n in enumerate(meta.shape)) for a in range(0, meta.shape[0], rows)]
               if meta.shape else [()])
    pending = arrays.read(store, ref.location, regions[0])
    for k in range(len(regions)):
        following = None
        if in_flight == 2 and k + 1 < len(regions):
            following = arrays.read(store, ref.location, regions[k + 1])
        yield np.ascontiguousarray(pending.result())
        if in_flight == 1 and k + 1 < len(regions):
            following = arrays.read(store, ref.location, regions[k + 1])
        pending = following


def export_safetensors(checkpoint: Checkpoint, items: tuple[str, ...], out_dir: str, *, max_file_bytes: int,
                       max_host_bytes: int = convert.DEFAULT_MAX_HOST_BYTES,
                       progress: Progress | None = None) -> list[str]:
    """Write ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` files of at most `max_file_bytes`
    each plus ``model.safetensors.index.json``) into `out_dir`. Returns the files written.
    `progress(bytes_done, bytes_total)`."""
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
    os.makedirs(out_dir, exist_ok=True)
    names = ([safetensors.SINGLE_NAME] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    total = sum(t.meta.nbytes for t in tensors)
    done = 0
    for name, group in zip(names, groups):
        head, _ = safetensors.encode_header((t.name, t.meta.dtype, t.meta.shape) for t in group)
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(head)
            for t in group:
                for block in _blocks(checkpoint, t, max_host_bytes):
                    f.write(block.reshape(-1).view(np.uint8))
                    done += block.nbytes
                    if progress:
                        progress(done, total)
    if len(groups) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {t.name: name for name, group in zip(names, groups) for t in group}}
        with open(os.path.join(out_dir, safetensors.INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2)
        names.append(safetensors.INDEX_NAME)
    return [os.path.join(out_dir, n) for n in names]


def export_torch(checkpoint: Checkpoint, items: tuple[str, ...], out_file: str, *,
                 max_host_bytes: int = convert.DEFAULT_MAX_HOST_BYTES, progress: Progress | None = None) -> str:
    """Write a ``torch.save`` file of a flat {name: tensor} dict, loadable with ``weights_only=True``. Each
    tensor is staged in a file next to `out_file` and mapped from there, so memory holds about one block.
    `progress(bytes_done, bytes_total)`."""
    tensors = tensors_of(checkpoint, items)
    directory = os.path.dirname(os.path.abspath(out_file))
    os.makedirs(directory, exist_ok=True)
    total = sum(t.meta.nbytes for t in tensors)
    done = 0
    with tempfile.TemporaryDirectory(prefix=".xtckpt-export-", dir=directory) as tmp:
        staged: dict[str, torch.Tensor] = {}
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
            staged[t.name] = flat.view(row.torch).reshape(t.meta.shape)
        torch.save(staged, out_file)
    return out_file
