"""Which process writes (or reads) each chunk several hold (`balance`): the least loaded holder, largest chunks
first, computed alike on every process from the same input, without a collective. Called by the save's plan
(`saves.save_plan`), single-replica reads (`restores.replica_plans`) and DCP's global plans (`dcp_storage`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def balance(holders: Sequence[tuple[Any, int, Sequence[int]]], count: int) -> dict[Any, int]:
    """Choose one writer per chunk: `holders` lists (chunk id, bytes, processes holding it). Chunks held by
    one process go to it; the others go, largest first, to the least loaded holder, so bytes written spread
    evenly. Deterministic: every process computes the same answer from the same input (in the same order)."""
    load = [0] * count
    writer: dict[Any, int] = {}
    for chunk, nbytes, procs in holders:
        if len(procs) == 1:
            writer[chunk] = procs[0]
            load[procs[0]] += nbytes
    # Ties keep the order of `holders`, the same on every process (no str() of 70,000 chunk ids at 1,000 hosts).
    shared = sorted((h for h in holders if len(h[2]) > 1), key=lambda h: -h[1])
    for chunk, nbytes, procs in shared:
        best = min(sorted(procs), key=load.__getitem__)
        writer[chunk] = best
        load[best] += nbytes
    return writer
