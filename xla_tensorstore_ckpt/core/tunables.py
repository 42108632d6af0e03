"""The sizes this library tunes its I/O by, in one place: each is read through `get` where it is used, so a
test (or a benchmark exploring them) can make a small checkpoint take the path of a large one with `overridden`,
and nothing else writes module constants. The defaults are what the measurements in docs/performance.md chose.

* ``inline_chunk_bytes``: stored chunks smaller than this are read by the restoring thread itself, larger ones
  on reading threads (`arrays.local_chunks`: worker threads would hold the GIL against small reads).
* ``chunk_piece_bytes``: what a reading thread reads at once when a chunk is cut up across targets (one read
  window, less its alignment slack).
* ``read_window_bytes``: each reading thread's aligned window for reads around the page cache
  (`arrays.local_reads`).
* ``merge_gap_bytes``: ranged reads of one file closer than this are fetched as one request
  (`arrays.byte_ranges`).
* ``peer_round_bytes`` and ``peer_piece_bytes``: what a peer-copy transfer moves per process per round, and in
  one piece (`peer_copies`).
* ``kept_buffer_bytes``: the largest reusable buffer kept once unused, by a thread or the free list
  (`buffers`); larger ones are freed.
* ``histogram_inline_bytes``: chunks smaller than this are binned by the scanning thread (`views.histogram`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .errors import UsageError

DEFAULTS = {
    "inline_chunk_bytes": 512 << 10,
    "chunk_piece_bytes": (8 << 20) - 2 * 4096,
    "read_window_bytes": 8 << 20,
    "merge_gap_bytes": 1 << 20,
    "peer_round_bytes": 32 << 20,
    "peer_piece_bytes": 8 << 20,
    "histogram_inline_bytes": 64 << 10,
    "kept_buffer_bytes": 32 << 20,
}
_values = dict(DEFAULTS)


def get(name: str) -> int:
    """The current value of the tunable `name` (a key of `DEFAULTS`). Called on any thread; never blocks."""
    return _values[name]


@contextlib.contextmanager
def overridden(**values: int) -> Iterator[None]:
    """Set the given tunables for the duration of the ``with`` block, then put back what they were. Meant for
    tests and benchmarks, around whole saves or restores (never while one runs on another thread). Raises
    `UsageError` for an unknown name or a value that is not a non-negative int."""
    for name, value in values.items():
        if name not in DEFAULTS:
            raise UsageError(f"no tunable {name!r} (known: {', '.join(DEFAULTS)})")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise UsageError(f"tunable {name} must be a non-negative int, got {value!r}")
    before = {name: _values[name] for name in values}
    _values.update(values)
    try:
        yield
    finally:
        _values.update(before)
