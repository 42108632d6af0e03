"""Per-array value statistics in one streaming pass: count, min, max, mean, std, NaN/Inf, sparsity, quantiles and
a histogram (linear or log), chunk by chunk in bounded memory.

Quantiles and histograms come from `ValueSketch`, a fixed-size mergeable sketch: a count per bfloat16 value
(65,536 bins, 512 KiB), each value binned by the top 16 bits of its float32 form (sign, exponent and the top 7
mantissa bits; one shift of the bits, no logarithm). A bin spans a relative width of 2^-7, so a quantile is
reported at the rank exactly (nearest rank) and its value within a relative error of 2^-8 (0.39 %): the bin's
midpoint, clamped to the exact min and max. Values that bfloat16 holds exactly (bfloat16, float8, int8, uint8,
bool arrays) are exact. float64 magnitudes beyond float32's range fall in its extreme bins. Count, min, max,
mean, std (over finite values) and the zero count are exact. Sketches merge by adding counts.

Every chunk is read once (`scans.iter_chunks`, checksums verified); in flight at most `max_bytes` of chunks (or
one chunk, if larger), processed in slabs of `SLAB` elements; a large array's chunks on `THREADS` threads, each
into a sketch of its own, merged at the end. Used by ``xtckpt stats``, the report and
`views.array_summary`; blocks; no torch_xla.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import queue
from dataclasses import dataclass

import numpy as np

from .. import dtypes, layout, scans
from ..errors import CorruptCheckpointError, UsageError
from ..inspection import Checkpoint, array_metadata
from ..records import ArrayMetadata

BINS = 1 << 16
SLAB = 1 << 21  # elements converted at a time: temporaries stay near 16 MiB per thread
QUANTILES = (0.01, 0.10, 0.25, 0.50, 0.75, 0.90, 0.99)
DEFAULT_MAX_BYTES = 64 << 20
THREADS = 2  # arrays of several chunks and at least PARALLEL_BYTES are added on this many threads
PARALLEL_BYTES = 8 << 20
RELATIVE_ERROR = 2.0 ** -8
_EXACT_IN_BF16 = {"bfloat16", "bool", "int8", "uint8", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                  "float8_e5m2fnuz"}
_F32_MAX = float(np.finfo(np.float32).max)
_BFLOAT16 = dtypes.by_name("bfloat16").numpy


def _bin_values() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lower edge, midpoint, order) of the 65,536 bins; `order` lists the finite bins by increasing value."""
    codes = np.arange(BINS, dtype=np.uint32)
    with np.errstate(invalid="ignore"):  # the NaN bins' values
        low = (codes << 16).view(np.float32).astype(np.float64)
        high = ((codes << 16) | 0xFFFF).view(np.float32).astype(np.float64)
    middle = np.where(np.isfinite(high), (low + high) / 2, low)
    middle[[0, 0x8000]] = 0.0  # zero's bin: zeros, and denormals below 2^-133
    order = np.concatenate([np.arange(0xFF7F, 0x7FFF, -1), np.arange(0, 0x7F80)])
    return low, middle, order


_LOW, _MIDDLE, _ORDER = _bin_values()


class ValueSketch:
    """Accumulates values chunk by chunk (`add`); `merge` adds another sketch's counts. Fixed size."""

    def __init__(self) -> None:
        self.counts = np.zeros(BINS, dtype=np.int64)
        self.count = self.nan = self.inf = self.zeros = 0
        self.total = self.total_sq = 0.0
        self.low, self.high = math.inf, -math.inf

    def add(self, data: np.ndarray) -> None:
        """Add every value of `data` (any numeric dtype; complex: magnitudes)."""
        flat = data.reshape(-1)
        for start in range(0, flat.size, SLAB):
            self._add_slab(flat[start:start + SLAB])

    def _add_slab(self, values: np.ndarray) -> None:
        if values.dtype == _BFLOAT16:
            values = (values.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif values.dtype.kind == "c":
            values = np.abs(values)
        if values.dtype not in (np.float32, np.float64):  # exact: float16, float8, and integers as float64
            values = values.astype(np.float32 if values.dtype.itemsize <= 2 else np.float64)
        if np.isfinite(values).all():  # the common case: one cheap pass instead of two
            finite = values
        else:
            self.nan += int(np.isnan(values).sum())
            self.inf += int(np.isinf(values).sum())
            finite = values[np.isfinite(values)]
        if not finite.size:
            return
        self.count += finite.size
        self.zeros += finite.size - int(np.count_nonzero(finite))
        self.total += float(finite.sum(dtype=np.float64))
        self.total_sq += float(np.einsum("i,i->", finite, finite, dtype=np.float64))
        self.low, self.high = min(self.low, float(finite.min())), max(self.high, float(finite.max()))
        narrow = finite if finite.dtype == np.float32 else np.clip(finite, -_F32_MAX, _F32_MAX).astype(np.float32)
        # the bins: the top 16 bits of each float32 (bincount is fastest on the platform's own integers)
        self.counts += np.bincount((narrow.view(np.uint32) >> 16).astype(np.intp), minlength=BINS)

    def merge(self, other: ValueSketch) -> None:
        self.counts += other.counts
        self.count += other.count
        self.nan += other.nan
        self.inf += other.inf
        self.zeros += other.zeros
        self.total += other.total
        self.total_sq += other.total_sq
        self.low, self.high = min(self.low, other.low), max(self.high, other.high)

    def quantile(self, q: float, *, exact_bins: bool = False, integer: bool = False) -> float | None:
        """The value at rank ceil(q * count) of the finite values (see the module for the error bound);
        `exact_bins`: every value is its bin's lower edge; `integer`: the values are integers."""
        if not self.count:
            return None
        ordered = self.counts[_ORDER]
        rank = max(1, math.ceil(q * self.count))
        position = int(np.searchsorted(np.cumsum(ordered), rank))
        code = _ORDER[min(position, len(_ORDER) - 1)]
        value = float(_LOW[code] if exact_bins else _MIDDLE[code])
        value = float(round(value)) if integer else value
        return min(max(value, self.low), self.high)

    def histogram(self, bins: int = 40, scale: str = "linear") -> Histogram:
        """Counts of the finite values in `bins` equal bins: of the value between min and max (``linear``), or
        of log10 |value| between the smallest and largest nonzero magnitudes (``log``; zeros counted apart).
        Each sketch bin falls whole into the bin holding its midpoint."""
        present = np.flatnonzero(self.counts[_ORDER])
        codes = _ORDER[present]
        weights = self.counts[codes].astype(np.float64)
        middle = np.clip(_MIDDLE[codes], self.low, self.high) if self.count else _MIDDLE[codes]
        if scale == "log":
            nonzero = middle != 0
            magnitudes = np.log10(np.abs(middle[nonzero]))
            edges = _edges(magnitudes, bins)
            counts = np.histogram(magnitudes, edges, weights=weights[nonzero])[0] if magnitudes.size else []
            return Histogram("log", tuple(float(e) for e in edges), tuple(int(c) for c in counts),
                             int(weights[~nonzero].sum()))
        if scale != "linear":
            raise UsageError(f"unknown histogram scale {scale!r}: linear or log")
        edges = _edges(middle, bins)
        counts = np.histogram(middle, edges, weights=weights)[0] if middle.size else []
        return Histogram("linear", tuple(float(e) for e in edges), tuple(int(c) for c in counts), 0)


def _edges(values: np.ndarray, bins: int) -> np.ndarray:
    if not values.size:
        return np.zeros(0)
    low, high = float(values.min()), float(values.max())
    if high <= low:  # one value: one bin around it
        spread = (abs(low) or 1.0) * 1e-6
        return np.array([low - spread, low + spread])
    return np.linspace(low, high, max(1, bins) + 1)


@dataclass(frozen=True)
class Histogram:
    """Bin counts; `edges` has one more entry than `counts` (for ``log``, in log10 |value|); `zeros`: the zeros
    a ``log`` histogram leaves out."""

    scale: str
    edges: tuple[float, ...]
    counts: tuple[int, ...]
    zeros: int = 0

    def to_json(self) -> dict:
        return {"scale": self.scale, "edges": list(self.edges), "counts": list(self.counts), "zeros": self.zeros}


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
    """Statistics, quantiles and a histogram of the array `key`, reading each chunk once with at most
    `max_bytes` of chunks in flight (or one chunk, if larger). Blocks. Raises `UsageError` for an unknown key or
    scale, `CorruptCheckpointError` naming the chunk for damaged data."""
    item, meta = array_metadata(checkpoint, key)
    return summary_of(checkpoint, item, meta, key, bins=bins, scale=scale, max_bytes=max_bytes)


def summary_of(checkpoint: Checkpoint, item: str, meta: ArrayMetadata, key: str, *, bins: int = 40,
               scale: str = "linear", max_bytes: int = DEFAULT_MAX_BYTES) -> ArraySummary:
    """`array_summary` of an array whose metadata the caller holds (a walk over every array looks each up
    once)."""
    if scale not in ("linear", "log"):
        raise UsageError(f"unknown histogram scale {scale!r}: linear or log")
    chunk_bytes = math.prod(meta.chunk_shape) * dtypes.by_name(meta.dtype).itemsize
    window = max(1, min(8, max_bytes // max(1, chunk_bytes)))
    chunks = scans.iter_chunks(checkpoint, item, meta, window=window)
    if meta.num_chunks < 2 or meta.nbytes < PARALLEL_BYTES:
        sketch = ValueSketch()
        for cell, data in chunks:
            sketch.add(_checked(key, cell, data))
    else:
        sketch = _add_in_parallel(key, chunks)
    return summarize(key, meta.dtype, meta.shape, sketch, bins=bins, scale=scale)


def _checked(key: str, cell: tuple, data: np.ndarray | Exception) -> np.ndarray:
    if isinstance(data, Exception):
        raise CorruptCheckpointError(f"{key} chunk {layout.chunk_key(cell)}: {data}") from data
    return data


def _add_in_parallel(key: str, chunks) -> ValueSketch:
    """The chunks added on `THREADS` threads (numpy releases the GIL), each into a sketch of its own taken from
    a queue, at most `THREADS` chunks waiting; the sketches merged at the end."""
    free: queue.SimpleQueue[ValueSketch] = queue.SimpleQueue()
    sketches = [ValueSketch() for _ in range(THREADS)]
    for sketch in sketches:
        free.put(sketch)

    def add(data: np.ndarray) -> None:
        sketch = free.get()
        try:
            sketch.add(data)
        finally:
            free.put(sketch)

    pending: collections.deque[concurrent.futures.Future] = collections.deque()
    with concurrent.futures.ThreadPoolExecutor(THREADS, thread_name_prefix="xtckpt-stats") as pool:
        try:
            for cell, data in chunks:
                pending.append(pool.submit(add, _checked(key, cell, data)))
                if len(pending) >= THREADS:
                    pending.popleft().result()
            while pending:
                pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
    for sketch in sketches[1:]:
        sketches[0].merge(sketch)
    return sketches[0]


def summarize(key: str, dtype: str, shape: tuple[int, ...], sketch: ValueSketch, *, bins: int = 40,
              scale: str = "linear") -> ArraySummary:
    """The `ArraySummary` of a filled sketch."""
    exact = dtype in _EXACT_IN_BF16
    integer = dtypes.by_name(dtype).numpy.kind in "iub"
    quantiles = tuple((q, sketch.quantile(q, exact_bins=exact, integer=integer)) for q in QUANTILES)
    if not sketch.count:
        return ArraySummary(key, dtype, shape, 0, None, None, None, None, sketch.nan, sketch.inf, 0, quantiles,
                            0.0, sketch.histogram(bins, scale))
    mean = sketch.total / sketch.count
    std = math.sqrt(max(0.0, sketch.total_sq / sketch.count - mean * mean))
    return ArraySummary(key, dtype, shape, sketch.count, sketch.low, sketch.high, mean, std, sketch.nan, sketch.inf,
                        sketch.zeros, quantiles, 0.0 if exact else RELATIVE_ERROR, sketch.histogram(bins, scale))
