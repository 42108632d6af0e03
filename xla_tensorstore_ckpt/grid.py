"""Regular chunk grids, and grouping work into batches of bounded size. Pure Python; used by planning, reading,
inspection and `ShardedArray`, so that all of them cut arrays the same way."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

Index = tuple[tuple[int, int], ...]  # [start, stop) per dimension, in global coordinates
T = TypeVar("T")


def chunks(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], Index]]:
    """(grid position, region) of every chunk of `shape` cut into `chunk_shape` chunks, in C order; edge chunks
    are partial. None if a dimension is empty; one, at position (), for a 0-d array."""
    if 0 in shape:
        return []
    axes = [[(k, (k * c, min((k + 1) * c, n))) for k in range(-(-n // c))] for n, c in zip(shape, chunk_shape)]
    return [(tuple(k for k, _ in cell), tuple(r for _, r in cell)) for cell in itertools.product(*axes)]


def regions(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> list[Index]:
    """The region of every chunk, in C order (see `chunks`)."""
    return [region for _, region in chunks(shape, chunk_shape)]


def batches(items: Iterable[T], size: Callable[[T], int], limit: int) -> Iterator[list[T]]:
    """Consecutive groups of `items` whose sizes add up to at most `limit` (an item larger than that is alone)."""
    group: list[T] = []
    total = 0
    for item in items:
        if group and total + size(item) > limit:
            yield group
            group, total = [], 0
        group.append(item)
        total += size(item)
    if group:
        yield group
