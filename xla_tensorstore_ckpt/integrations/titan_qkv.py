"""torchtitan's fused QKV projection (`FusedQKVLinear`) saved without gathering it. Called by the torchtitan
manager (`integrations.torchtitan`) for each save's model state; imports torchtitan.

torchtitan keeps each attention's ``wq``/``wk``/``wv`` as one fused ``wqkv`` parameter and saves it in the stock
layout through a state-dict hook that gathers ``wqkv`` to ``Replicate`` on every process (a collective per layer
and parameter, ~70-80 ms per save of its debug model over 4 processes: most of what a save blocked the training
loop on) and splits it. Under FSDP (``Shard(0)`` over a 1-D mesh) with every process holding whole KV groups,
each process's rows of ``wq``, ``wk`` and ``wv`` are one block of its own rows of ``wqkv``: `split_locally`
makes them ``Shard(0)`` DTensors of the same global values from the local shard, with no communication. Any
other placement, mesh or split falls back to torchtitan's hook. The values are those torchtitan's hook
computes (checked against it once per manager: `Splitter`); only how they are sharded differs, which a restore
does not depend on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torchtitan.models.common.attention import FusedQKVLinear

log = logging.getLogger("xla_tensorstore_ckpt")

_HOOK = FusedQKVLinear._split_qkv_on_save  # torchtitan's gathering hook, replaced during our state dicts


def _local_blocks(module: Any, tensor: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """This process's rows of ``wq``, ``wk``, ``wv`` cut from its shard of the fused `tensor` (``[n_kv * r *
    head_dim, ...]``, rows grouped per KV head as ``hpk`` query heads, then K, then V), or None unless `tensor`
    is a DTensor sharded ``Shard(0)`` over a 1-D mesh of which every process holds the same number of whole KV
    groups."""
    if not isinstance(tensor, DTensor) or tensor.device_mesh.ndim != 1 or tuple(tensor.placements) != (Shard(0),):
        return None
    hd, hpk, r = module.head_dim, module.heads_per_kv, module.r_dim
    processes = tensor.device_mesh.size()
    local = tensor._local_tensor
    if tensor.shape[0] % (processes * r * hd) or local.shape[0] != tensor.shape[0] // processes:
        return None
    tail = tuple(tensor.shape[1:])
    grouped = local.reshape(-1, r, hd, *tail)
    return (grouped[:, :hpk].reshape(-1, *tail).contiguous(), grouped[:, hpk].reshape(-1, *tail).contiguous(),
            grouped[:, hpk + 1].reshape(-1, *tail).contiguous())


def _split_locally(module: Any, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """A state-dict post hook standing in for torchtitan's `_split_qkv_on_save` on `module`: ``wqkv``'s weight
    and bias as ``wq``/``wk``/``wv`` DTensors sharded like it, or torchtitan's hook where a tensor does not
    qualify (`_local_blocks`). No collectives on our path."""
    keys = [f"{prefix}wqkv.{param}" for param in ("weight", "bias") if f"{prefix}wqkv.{param}" in state_dict]
    blocks = [_local_blocks(module, state_dict[key]) for key in keys]
    if any(b is None for b in blocks):
        _HOOK(module, state_dict, prefix, local_metadata)
        return
    for key, parts in zip(keys, blocks):
        fused = state_dict.pop(key)
        param = key.rsplit(".", 1)[1]
        processes = fused.device_mesh.size()
        for name, part in zip(("wq", "wk", "wv"), parts):
            shape = (part.shape[0] * processes, *part.shape[1:])
            state_dict[f"{prefix}{name}.{param}"] = DTensor.from_local(
                part, fused.device_mesh, (Shard(0),), run_check=False, shape=torch.Size(shape),
                stride=torch.empty(shape, device="meta").stride())


@contextlib.contextmanager
def _hooks_replaced(parts: list[torch.nn.Module]) -> Iterator[int]:
    """Within: every `FusedQKVLinear` of `parts` splits with `_split_locally` instead of torchtitan's hook (the
    module's hook table is swapped for a copy, and put back on the way out). Yields how many were swapped."""
    swapped = []
    for part in parts:
        for module in part.modules():
            hooks = module.__dict__.get("_state_dict_hooks")
            if isinstance(module, FusedQKVLinear) and hooks and any(h is _HOOK for h in hooks.values()):
                swapped.append((module, hooks))
                module._state_dict_hooks = type(hooks)((k, _split_locally if h is _HOOK else h)
                                                       for k, h in hooks.items())
    try:
        yield len(swapped)
    finally:
        for module, hooks in swapped:
            module._state_dict_hooks = hooks


class Splitter:
    """The model parts' merged state dict, as `ModelWrapper.state_dict` computes it, but with fused QKV weights
    split without gathering (`_split_locally`). The first call of a model with one also computes torchtitan's own
    split and compares every value (collective: it gathers both); if any differs, torchtitan's hook is used from
    then on (logged).
    Called by the manager's saves on every process; blocks; collective where torchtitan's hook is used."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        self.parts = parts
        self.checked = False
        self.local = True

    def state_dict(self) -> dict[str, Any]:
        if not self.local:
            return self._merged()
        with _hooks_replaced(self.parts) as swapped:
            ours = self._merged()
        if not self.checked and swapped:
            self.checked = True
            theirs = self._merged()
            if set(ours) != set(theirs) or not all(_same(ours[k], theirs[k]) for k in theirs):
                log.warning("torchtitan's fused QKV split differs from ours: its state-dict hook is used")
                self.local = False
                return theirs
        return ours

    def _merged(self) -> dict[str, Any]:
        return {key: value for part in self.parts for key, value in part.state_dict().items()}


def _same(a: Any, b: Any) -> bool:
    """Whether two state-dict values hold the same array (DTensors compared whole: collective)."""
    if isinstance(a, DTensor):
        a = a.redistribute(a.device_mesh, [Replicate()] * a.device_mesh.ndim).to_local()
    if isinstance(b, DTensor):
        b = b.redistribute(b.device_mesh, [Replicate()] * b.device_mesh.ndim).to_local()
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return type(a) is type(b) and a == b
