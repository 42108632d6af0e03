"""Regular chunk grids, and grouping work into batches of bounded size. Pure Python; used by planning, reading,
inspection and `ShardedArray`, so that all of them cut arrays the same way."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

Index = tuple[tuple[int, int], ...]  # [start, stop) per dimension, in global coordinates
T = TypeVar("T")


def chunks(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], Index]]:
    """(grid position, region) of every chunk of `shape` cut into `chunk_shape` chunks, in C order; edge chunks
    are partial. None if a dimension is empty; one, at position (), for a 0-d array. Lazy: memory stays
    constant however many chunks there are (a reader walking a hostile array's grid must not hold it)."""
    if 0 in shape:
        return
    counts = [-(-n // c) for n, c in zip(shape, chunk_shape)]
    position = [0] * len(shape)
    while True:
        yield tuple(position), tuple((k * c, min((k + 1) * c, n)) for k, c, n in zip(position, chunk_shape, shape))
        d = len(shape) - 1
        while d >= 0:
            position[d] += 1
            if position[d] < counts[d]:
                break
            position[d] = 0
            d -= 1
        if d < 0:
            return


def chunks_in(region: Index, chunk_shape: tuple[int, ...],
              shape: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], Index]]:
    """(grid position, region) of every chunk of `shape` that `region` overlaps, in C order; none for an empty
    region, one at () for a 0-d array."""
    if any(b <= a for a, b in region):
        return
    ranges = [range(a // c, -(-b // c)) for (a, b), c in zip(region, chunk_shape)]
    for position in itertools.product(*ranges):
        yield position, tuple((k * c, min((k + 1) * c, n)) for k, c, n in zip(position, chunk_shape, shape))


def intersection(a: Index, b: Index) -> Index:
    """The region two regions share (empty along some dimension if they do not overlap)."""
    return tuple((max(x0, y0), max(max(x0, y0), min(x1, y1))) for (x0, x1), (y0, y1) in zip(a, b))


def contains(outer: Index, inner: Index) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def within(inner: Index, outer: Index) -> tuple[slice, ...]:
    """The numpy index of `inner` in the data of `outer` (which contains it)."""
    return tuple(slice(c - a, d - a) for (a, _), (c, d) in zip(outer, inner))


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
