"""Tensor kinds, by registry: the one place the save and restore paths learn what kind of array a value is and
what that kind does (`base.Target`): a `ShardedArray`'s host shards (`host`), a DTensor (`dtensor`), an XLA
tensor (`xla`, the only module importing torch_xla, on first use), a CPU tensor (`cpu`).

Each target is one module whose module-level names satisfy `base.Target`; the first in `TARGETS` that claims a
value owns it, and a `TensorLayout` records its target's name, so plans and read jobs find it again
(`of_layout`). Batched calls group values by target and ask each target once. Adding a tensor kind: a module,
and its entry in `TARGETS` (before any target that would claim its values too), or, from outside the package,
`register(module)`.

Shared by the targets, the writers of a save and single-replica reads: who holds which regions of a global array,
from a sharding alone (`holdings`), and the geometry of DTensor shardings (`dtensors`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from ..core.errors import UsageError
from ..core.tensor_layout import LocalShard, TensorLayout
from . import cpu, dtensor, host, xla
from .base import Target

__all__ = ["TARGETS", "Target", "assign", "fetch", "is_global", "layouts", "local_memory", "named", "of",
           "of_layout", "register", "signatures", "unregister"]

# In the order asked: the first target that claims a value owns it (`cpu` claims any tensor: last).
TARGETS: tuple[Target, ...] = (host, dtensor, xla, cpu)  # type: ignore[assignment]
# The same by name, for `named`: asked for every array of a save or restore, several times each.
_BY_NAME: dict[str, Target] = {t.NAME: t for t in TARGETS}

T = TypeVar("T")


def register(target: Target) -> None:
    """Add a tensor kind, asked before those registered so far (the CPU target claims any tensor, so a new kind
    must come first). Called once, at import, by the code adding a kind (or by a test); not thread-safe against
    saves and restores running meanwhile. Raises `UsageError` if a kind of the same `NAME` is registered."""
    global TARGETS, _BY_NAME
    if any(t.NAME == target.NAME for t in TARGETS):
        raise UsageError(f"a tensor kind named {target.NAME!r} is already registered")
    TARGETS = (target, *TARGETS)
    _BY_NAME = {t.NAME: t for t in TARGETS}


def unregister(name: str) -> None:
    """Remove the tensor kind `name` that `register` added (a test's toy kind). Raises `UsageError` if there is
    none."""
    global TARGETS, _BY_NAME
    named(name)
    TARGETS = tuple(t for t in TARGETS if t.NAME != name)
    _BY_NAME = {t.NAME: t for t in TARGETS}


def of(value: Any) -> Target | None:
    """The target that claims `value`, None if none does (not an array)."""
    for target in TARGETS:
        if target.claims(value):
            return target
    return None


def named(name: str) -> Target:
    """The target called `name` (`TensorLayout.target`). Raises `UsageError` if none is registered."""
    target = _BY_NAME.get(name)
    if target is not None:
        return target
    raise UsageError(f"no tensor kind {name!r} is registered (known: {', '.join(t.NAME for t in TARGETS)})")


def of_layout(layout: TensorLayout) -> Target:
    return named(layout.target)


def _by_target(owners: Sequence[Target], batch: Callable[[Target, list[int]], list[T]]) -> list[T]:
    """`batch(target, positions)` once per target among `owners` (the target of each item), its results put
    back at the items' positions."""
    positions: dict[str, tuple[Target, list[int]]] = {}
    for i, target in enumerate(owners):
        positions.setdefault(target.NAME, (target, []))[1].append(i)
    out: list[Any] = [None] * len(owners)
    for target, where in positions.values():
        for i, result in zip(where, batch(target, where)):
            out[i] = result
    return out


def signatures(values: Sequence[Any], owners: Sequence[Target]) -> list[tuple]:
    """Each value's `Target.signatures` (`owners`: each value's target, from `of`); one call per target.
    Runs pending device computations (XLA)."""
    return _by_target(owners, lambda t, where: t.signatures([values[i] for i in where]))


def layouts(values: Sequence[Any], owners: Sequence[Target],
            value_signatures: Sequence[tuple] | None = None) -> list[TensorLayout]:
    """Each value's layout (`Target.layouts`), one call per target; `value_signatures` from `signatures`."""
    def batch(target: Target, where: list[int]) -> list[TensorLayout]:
        sigs = None if value_signatures is None else [value_signatures[i] for i in where]
        return target.layouts([values[i] for i in where], sigs)

    return _by_target(owners, batch)


def fetch(values: Sequence[Any], value_layouts: Sequence[TensorLayout], wanted: Sequence[Sequence[LocalShard]], *,
          copy: bool) -> list[list[torch.Tensor]]:
    """Host data of the `wanted` shards of each value (`Target.fetch`), one call per target. Blocks."""
    def batch(target: Target, where: list[int]) -> list[list[torch.Tensor]]:
        return target.fetch([values[i] for i in where], [value_layouts[i] for i in where],
                            [wanted[i] for i in where], copy=copy)

    return _by_target([of_layout(lay) for lay in value_layouts], batch)


def assign(pairs: Sequence[tuple[Any, Any]], owners: Sequence[Target]) -> None:
    """Put each restored value into its target (`Target.assign`), one call per kind of target; `owners`: each
    pair's target (`of` its first), which the caller found when it chose the pair (`assign_in_place`)."""
    def batch(target: Target, where: list[int]) -> list[None]:
        target.assign([pairs[i][0] for i in where], [pairs[i][1] for i in where])
        return [None] * len(where)

    _by_target(owners, batch)


def local_memory(value: Any) -> torch.Tensor | None:
    """The host tensor whose memory holds `value`'s data, which a restore in place may read into, or None."""
    target = of(value)
    return None if target is None else target.local_memory(value)


def is_global(layout: TensorLayout) -> bool:
    """Whether the array of `layout` is one global array processes hold parts of (`Target.is_global`)."""
    return of_layout(layout).is_global(layout)
