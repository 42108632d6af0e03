"""The CPU target: a host tensor, one shard covering the whole array, read and written in place. Last in the
registry's order: it claims any tensor no other target claims, and refuses to save those not on the CPU."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..core.tensor_layout import LocalShard, TensorLayout, full_index
from . import holdings
from .base import ReadJob, copy_host, host_clones, host_tensor, whole_size
from .holdings import Holding

NAME = "cpu"
DEVICE_BOUND = False
SHARDS_ARE_CHUNKS = True
ASSIGNS_IN_PLACE = True
WHOLE_ON_EVERY_PROCESS = True


def layout(shape: tuple[int, ...]) -> TensorLayout:
    """A CPU tensor (or a value restored as one): one shard covering the whole array."""
    return TensorLayout(shape, NAME, shape, (LocalShard(0, "cpu", full_index(shape), 0),))


def claims(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def unsaveable(value: torch.Tensor) -> str | None:
    if value.layout != torch.strided:
        return f"{value.layout} tensors are not supported; convert to dense first"
    if value.device.type != "cpu":
        return f"tensors on {value.device} are not supported (use CPU or XLA tensors)"
    return None


def signatures(values: Sequence[torch.Tensor]) -> list[tuple]:
    return [(NAME, tuple(v.shape), v.dtype) for v in values]


def layouts(values: Sequence[torch.Tensor], signatures: Sequence[tuple] | None = None) -> list[TensorLayout]:
    return [layout(tuple(v.shape)) for v in values]


def fetch(values: Sequence[torch.Tensor], layouts: Sequence[TensorLayout], wanted: Sequence[Sequence[LocalShard]],
          *, copy: bool) -> list[list[torch.Tensor]]:
    some = [i for i, shards in enumerate(wanted) if shards]
    data = [values[i].detach().resolve_conj().resolve_neg() for i in some]
    out: list[list[torch.Tensor]] = [[] for _ in values]
    for i, tensor in zip(some, host_clones(data) if copy else data):
        out[i] = [tensor]
    return out


def fetched_elements(layout: TensorLayout, wanted: Sequence[LocalShard]) -> int:
    return whole_size(wanted)


def placing_elements(layout: TensorLayout) -> int:
    return 0


def build(job: ReadJob, regions: dict, *, release: bool) -> torch.Tensor:
    return host_tensor(job, job.layout.shards[0].index, regions)


def settle(value: Any) -> None:
    return None


def local_memory(value: torch.Tensor) -> torch.Tensor:
    return value


def assign(targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    for target, value in zip(targets, values):
        copy_host(target, value)


def is_global(layout: TensorLayout) -> bool:
    return False


def holding(value: Any, layout: TensorLayout, count: int) -> Holding:
    return holdings.everywhere(layout.shape, count)
