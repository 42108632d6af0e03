"""Pausing Python's cyclic garbage collector around work that creates many small, long-lived objects.

Planning a save or restore of thousands of tensors creates tens of thousands of small records (shard indices,
layouts, plans) that all survive until the operation ends; each batch of them makes the collector walk every
object of the process (hundreds of thousands in a training job). Measured on 2,000 tensors: the blocking part
of an async save 0.49 -> 0.31 s, a restore 1.2 -> 1.0 s. The operations create no reference cycles.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic collector for the duration (if it is enabled), then enable it again. Nested or
    concurrent uses are harmless: at worst a collection comes a little earlier or later."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
