"""Per-array value statistics: count, min, max, mean, std, NaN/Inf, sparsity, quantiles and a histogram (linear or
log), over one array or every array of a checkpoint in one streaming pass, in bounded memory.

The values go into a `sketch.ValueSketch` (a count per bfloat16 value): quantiles are reported at the rank
exactly (nearest rank) and their value within a relative error of 2^-8 (0.39 %; the bin's midpoint, clamped to
the exact min and max; below float32's normal range, 2^-126, within 2^-133 absolute: such values share bins),
exact for the types bfloat16 holds exactly (bfloat16, float8, int8, uint8, bool);
count, min, max, NaN/Inf and zero counts are exact; mean and std within about 1e-7 of the values' magnitudes.

`summaries` reads each chunk once (`scans.iter_chunks`, checksums verified) and reads ahead while the chunks
already read are binned on `THREADS` long-lived threads (numpy releases the GIL), across array boundaries:
the next array's first chunks are read while the last ones of this array are binned. At most `max_bytes` of
chunks are held (half read ahead, half waiting to be binned; one chunk, if larger), and a chunk's buffer is
handed to the next read of as many bytes once it is binned (`Recycled`, kept within the same bound). Chunks under
``histogram_inline_bytes`` (`tunables`) are binned on the reading thread (a job costs more than they do). Used by
``xtckpt stats``, the report and `views.stats_view`; blocks; no torch_xla.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from ..core import buffers, dtypes, layout, threads, tunables
from ..core.errors import CorruptCheckpointError, UsageError
from ..core.records import ArrayMetadata
from ..tools import scans
from ..tools.inspection import Checkpoint, array_metadata
from .sketch import EXACT_DTYPES, Histogram, ValueSketch

QUANTILES = (0.01, 0.10, 0.25, 0.50, 0.75, 0.90, 0.99)
DEFAULT_MAX_BYTES = 64 << 20
THREADS = threads.count("binning")
MAX_JOBS = 4 * THREADS  # chunks waiting to be binned, at most
READ_AHEAD = 8  # chunks of one array read ahead, at most
RELATIVE_ERROR = 2.0 ** -8
_POOL = threads.pool("binning", "xtckpt-stats")

Array = tuple[str, ArrayMetadata, str]  # (item, metadata, key)


@dataclass(frozen=True)
class ArraySummary:
    """What `array_summary` found for one array (counts exact; quantiles within `quantile_error`, relative)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    count: int  # finite values
    min: float | None
    max: float | None
    mean: float | None
    std: float | None
    nan: int
    inf: int
    zeros: int
    quantiles: tuple[tuple[float, float | None], ...]
    quantile_error: float
    histogram: Histogram

    @property
    def sparsity(self) -> float | None:
        """The fraction of the finite values that are exactly zero."""
        return self.zeros / self.count if self.count else None

    def to_json(self) -> dict:
        return {"key": self.key, "dtype": self.dtype, "shape": list(self.shape), "count": self.count,
                "min": self.min, "max": self.max, "mean": self.mean, "std": self.std, "nan": self.nan,
                "inf": self.inf, "zeros": self.zeros, "sparsity": self.sparsity,
                "quantiles": {f"{q:g}": v for q, v in self.quantiles}, "quantile_error": self.quantile_error,
                "histogram": self.histogram.to_json()}


def array_summary(checkpoint: Checkpoint, key: str, *, bins: int = 40, scale: str = "linear",
                  max_bytes: int = DEFAULT_MAX_BYTES) -> ArraySummary:
    """Statistics, quantiles and a histogram of the array `key` (see `summaries`). Blocks. Raises `UsageError`
    for an unknown key or scale, `CorruptCheckpointError` naming the chunk for damaged data."""
    item, meta = array_metadata(checkpoint, key)
    return next(summaries(checkpoint, [(item, meta, key)], bins=bins, scale=scale, max_bytes=max_bytes))


def summaries(checkpoint: Checkpoint, arrays: Iterable[Array], *, bins: int = 40, scale: str = "linear",
              max_bytes: int = DEFAULT_MAX_BYTES) -> Iterator[ArraySummary]:
    """The `ArraySummary` of each of `arrays` ((item, metadata, key) triples, each looked up once by the
    caller), in order, each yielded as soon as its chunks are binned; every chunk read once, at most
    `max_bytes` of chunks held (see the module). Blocks while iterated. Raises `UsageError` for an unknown
    scale, `CorruptCheckpointError` naming the chunk for damaged data."""
    if scale not in ("linear", "log"):
        raise UsageError(f"unknown histogram scale {scale!r}: linear or log")
    recycled = Recycled(max_bytes)
    binning = Binning(max(1, max_bytes // 2), bins, scale, recycled.give)
    try:
        for item, meta, key in arrays:
            entry = binning.start(key, meta)
            chunk_bytes = math.prod(meta.chunk_shape) * dtypes.by_name(meta.dtype).itemsize
            window = max(1, min(READ_AHEAD, max_bytes // 2 // max(1, chunk_bytes)))
            for cell, data in scans.iter_chunks(checkpoint, item, meta, window=window, empty=recycled.empty):
                if isinstance(data, Exception):
                    raise CorruptCheckpointError(f"{key} chunk {layout.chunk_key(cell)}: {data}") from data
                binning.put(entry, data)
                yield from binning.finished()
            entry.walked = True
            yield from binning.finished()
        yield from binning.finished(wait=True)
    finally:
        binning.cancel()


class Entry:
    """An array being summarised: its sketch, its chunks still being binned, whether all were read."""

    __slots__ = ("key", "meta", "sketch", "pending", "walked")

    def __init__(self, key: str, meta: ArrayMetadata):
        self.key, self.meta, self.sketch = key, meta, ValueSketch()
        self.pending, self.walked = 0, False


class Recycled:
    """Chunk buffers for the reader (`empty`, called on the scanning thread) given back once binned (`give`,
    with the chunk `empty` made or a view of it) and handed out again to a chunk of as many bytes: a chunk read
    into fresh memory pays a page fault per page, the kernel zeroing each first (`stats` over the 2.42 GiB model:
    18-22 thousand minor faults instead of 25-45 thousand). Buffers not in use are kept while they and the ones
    handed out come to at most `limit` bytes, the least recently given freed first. Not thread-safe: one
    scanning thread. Other arrays given (the diff's, a reader's own) are left alone."""

    def __init__(self, limit: int):
        self.limit = limit
        self.kept = 0
        self.free: list[np.ndarray] = []  # flat uint8 buffers, the least recently given first
        # by id, the buffers handed out and not yet given back (weakly: a reader that copies drops its buffer)
        self.lent: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        size = buffers.size_for(nbytes)
        for i in range(len(self.free) - 1, -1, -1):
            if self.free[i].nbytes == size:
                buffer = self.free.pop(i)
                self.kept -= size
                break
        else:
            buffer = buffers.new(nbytes)
        self.lent[id(buffer)] = buffer
        return buffer[:nbytes].view(dtype).reshape(shape)

    def give(self, data: np.ndarray) -> None:
        root = data
        while isinstance(root.base, np.ndarray):
            root = root.base
        if self.lent.pop(id(root), None) is not root:
            return
        self.free.append(root)
        self.kept += root.nbytes
        room = self.limit - sum(buffer.nbytes for buffer in self.lent.values())  # the chunks held come first
        while self.free and self.kept > room:
            self.kept -= self.free.pop(0).nbytes


class Binning:
    """Chunks binned on the pool in order of arrival, at most `budget` bytes and `MAX_JOBS` chunks waiting;
    the arrays' summaries handed out in order as they complete; each chunk handed to `done` once binned (to
    reuse its buffer). Used from one thread (`summaries`, the report's diff observer): `put` blocks while it is
    full, `finished` raises what a binning job raised."""

    def __init__(self, budget: int, bins: int, scale: str, done: Callable[[np.ndarray], None] | None = None):
        self.budget, self.bins, self.scale = budget, bins, scale
        self.done = done
        self.entries: collections.deque[Entry] = collections.deque()
        self.jobs: collections.deque[tuple[Entry, concurrent.futures.Future, np.ndarray]] = collections.deque()
        self.held = 0

    def start(self, key: str, meta: ArrayMetadata) -> Entry:
        entry = Entry(key, meta)
        self.entries.append(entry)
        return entry

    def put(self, entry: Entry, data: np.ndarray) -> None:
        """Bin `data` into `entry`'s sketch: at once if small, else on the pool once there is room."""
        if data.nbytes < tunables.get("histogram_inline_bytes"):
            entry.sketch.add(data)
            if self.done is not None:
                self.done(data)
            return
        while self.jobs and (self.held + data.nbytes > self.budget or len(self.jobs) >= MAX_JOBS):
            self._retire()
        entry.pending += 1
        self.jobs.append((entry, _POOL.submit(entry.sketch.add, data), data))
        self.held += data.nbytes

    def _retire(self) -> None:
        """Wait for the oldest job; raises what it raised."""
        entry, future, data = self.jobs.popleft()
        self.held -= data.nbytes
        entry.pending -= 1
        future.result()
        if self.done is not None:
            self.done(data)

    def finished(self, wait: bool = False) -> Iterator[ArraySummary]:
        """The summaries of the arrays at the front whose chunks are all binned (`wait`: of every array)."""
        while self.jobs and (wait or self.jobs[0][1].done()):
            self._retire()
        while self.entries and self.entries[0].walked and not self.entries[0].pending:
            entry = self.entries.popleft()
            yield summarize(entry.key, entry.meta.dtype, entry.meta.shape, entry.sketch, bins=self.bins,
                            scale=self.scale)

    def cancel(self) -> None:
        for _, future, _ in self.jobs:
            future.cancel()
        self.jobs.clear()


def summarize(key: str, dtype: str, shape: tuple[int, ...], sketch: ValueSketch, *, bins: int = 40,
              scale: str = "linear") -> ArraySummary:
    """The `ArraySummary` of a filled sketch."""
    exact = dtype in EXACT_DTYPES
    integer = dtypes.by_name(dtype).numpy.kind in "iub"
    quantiles = tuple(zip(QUANTILES, sketch.quantiles(QUANTILES, exact_bins=exact, integer=integer)))
    if not sketch.count:
        return ArraySummary(key, dtype, shape, 0, None, None, None, None, sketch.nan, sketch.inf, 0, quantiles,
                            0.0, sketch.histogram(bins, scale, exact_bins=exact))
    return ArraySummary(key, dtype, shape, sketch.count, sketch.low, sketch.high, sketch.mean, sketch.std,
                        sketch.nan, sketch.inf, sketch.zeros, quantiles, 0.0 if exact else RELATIVE_ERROR,
                        sketch.histogram(bins, scale, exact_bins=exact))
