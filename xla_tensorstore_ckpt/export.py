"""Consolidated single-host exports of a checkpoint: safetensors (sharded as Hugging Face does) or a torch file.

Tensors are read one at a time (chunk-parallel within a tensor) and written out before the next is read, so
peak memory stays near the largest tensor. Called by the command line; blocks; no torch_xla.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from . import arrays, dtypes, tree
from .errors import UnsupportedValueError, UsageError
from .formats import ArrayMetadata
from .inspection import Checkpoint

_SAFETENSORS_DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "int32": "I32", "uint32": "U32",
    "int64": "I64", "uint64": "U64", "float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
INDEX_NAME = "model.safetensors.index.json"


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


def _read(checkpoint: Checkpoint, tensor: Tensor) -> np.ndarray:
    ref = checkpoint.array_ref(tensor.item, tensor.meta)
    store = arrays.open_existing(ref).result()
    return arrays.read(store, ref.location, tuple(slice(0, n) for n in tensor.meta.shape)).result()


def export_safetensors(checkpoint: Checkpoint, items: tuple[str, ...], out_dir: str, *,
                       max_file_bytes: int, progress: Callable[[int, int], None] | None = None) -> list[str]:
    """Write ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` files of at most `max_file_bytes`
    each plus ``model.safetensors.index.json``) into `out_dir`. Returns the files written."""
    tensors = tensors_of(checkpoint, items)
    for t in tensors:
        if t.meta.dtype not in _SAFETENSORS_DTYPES:
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
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    done = 0
    for name, group in zip(names, groups):
        header: dict = {}
        offset = 0
        for t in group:
            header[t.name] = {"dtype": _SAFETENSORS_DTYPES[t.meta.dtype], "shape": list(t.meta.shape),
                              "data_offsets": [offset, offset + t.meta.nbytes]}
            offset += t.meta.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
        encoded += b" " * (-len(encoded) % 8)  # the data must start 8-byte aligned
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for t in group:
                f.write(np.ascontiguousarray(_read(checkpoint, t)).view(np.uint8).tobytes())
                done += 1
                if progress:
                    progress(done, len(tensors))
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(t.meta.nbytes for t in tensors)},
                 "weight_map": {t.name: name for name, group in zip(names, groups) for t in group}}
        with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2)
        names.append(INDEX_NAME)
    return [os.path.join(out_dir, n) for n in names]


def export_torch(checkpoint: Checkpoint, items: tuple[str, ...], out_file: str, *,
                 progress: Callable[[int, int], None] | None = None) -> str:
    """Write a ``torch.save`` file of a flat {name: tensor} dict, loadable with ``weights_only=True``. Each
    tensor is staged in a file-backed mapping next to `out_file`, so memory holds about one tensor."""
    tensors = tensors_of(checkpoint, items)
    directory = os.path.dirname(os.path.abspath(out_file))
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".xtckpt-export-", dir=directory) as tmp:
        staged: dict[str, torch.Tensor] = {}
        for i, t in enumerate(tensors, 1):
            data = np.ascontiguousarray(_read(checkpoint, t))
            path = os.path.join(tmp, f"{i}.bin")
            data.view(np.uint8).tofile(path)
            row = dtypes.by_name(t.meta.dtype)
            numel = math.prod(t.meta.shape)
            storage_dtype = row.view_as or row.torch
            flat = torch.from_file(path, shared=False, size=numel, dtype=storage_dtype) if numel else \
                torch.empty(0, dtype=storage_dtype)
            staged[t.name] = flat.view(row.torch).reshape(t.meta.shape)
            del data
            if progress:
                progress(i, len(tensors))
        torch.save(staged, out_file)
    return out_file
