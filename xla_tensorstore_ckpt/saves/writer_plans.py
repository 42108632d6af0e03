"""Who holds which chunks of a save, derived alike on every process from the shardings (`save_plan` chooses the
writers from it): no process needs the others' chunk lists where the layout of a value tells every process's
shards.

A holding (`holdings`) comes from each value's target (`Target.holding`); a scalar leaf is the primary's. Not
derivable: a `ShardedArray` without a `mesh` (it tells only its own shards). A process checks that what it derives
for itself is what it holds; the processes agree on a `digest` of what they derived; what is not derivable, or not
agreed, is gathered. Pure functions; no collectives.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from .. import targets
from ..core import grid
from ..core.tensor_layout import Index, TensorLayout, full_index
from ..targets import holdings
from ..targets.holdings import Holding


def holding(value: Any, lay: TensorLayout, count: int, *, scalar: bool = False) -> Holding | None:
    """Every process's regions of `value` (laid out as `lay` on this process) among `count` processes
    (`Target.holding`), or None where its layout does not tell them. `scalar`: a JSON scalar leaf, written by
    the primary."""
    if scalar:
        return (((full_index(lay.shape),), (0,)),)
    return targets.of_layout(lay).holding(value, lay, count)


@lru_cache(maxsize=4096)
def chunk_holders(shape: tuple[int, ...], chunk_shape: tuple[int, ...],
                  groups: Holding) -> Mapping[Index, tuple[int, ...]] | None:
    """The processes holding each chunk of the grid (a chunk lies inside a region of theirs), or None if a
    chunk would have no holder (then the holding is not what the processes hold: it is gathered). Cached: the
    arrays of a model share a few shapes and shardings. Do not modify the result."""
    held: dict[Index, set[int]] = {}
    for regions, procs in groups:
        for region in regions:
            for _, chunk in grid.chunks_in(region, chunk_shape, shape):
                if grid.contains(region, chunk):
                    held.setdefault(chunk, set()).update(procs)
    if not shape:  # a 0-d array: one chunk, the empty index
        held = {(): {p for _, procs in groups for p in procs}}
    chunks = grid.regions(shape, chunk_shape)
    if any(chunk not in held for chunk in chunks):
        return None
    return {chunk: tuple(sorted(held[chunk])) for chunk in chunks}


def holds_own(holders: Mapping[Index, tuple[int, ...]], me: int, own: Sequence[Index]) -> bool:
    """Whether the chunks `holders` gives process `me` are exactly `own` (the chunks it holds)."""
    mine = {chunk for chunk, procs in holders.items() if me in procs}
    return mine == set(own)


def digest(entries: Sequence[tuple[str, tuple[int, ...], str, tuple[int, ...], Holding | None]]) -> int:
    """A 62-bit digest of what a process derived: per array its name, shape, dtype, chunk shape and holding (None:
    to be gathered). Equal on two processes iff, but for a collision, they derived alike. Each distinct holding
    object is hashed once."""
    hasher = hashlib.blake2b(digest_size=8)
    seen: dict[int, bytes] = {}
    for path, shape, dtype, chunk_shape, groups in entries:
        hasher.update(repr((path, shape, dtype, chunk_shape)).encode())
        if groups is None:
            hasher.update(b"\0gathered")
            continue
        if id(groups) not in seen:
            seen[id(groups)] = holdings.fingerprint(groups)
        hasher.update(seen[id(groups)])
    return int.from_bytes(hasher.digest(), "little") >> 2
