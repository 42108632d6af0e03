"""The views drawn as terminal text: layout grids, histogram bars, statistics and diff tables. Pure Python; used
by the command line (`views.commands`)."""

from __future__ import annotations

from ..tools.cli_text import fmt_number, human_bytes, table
from .diff import TensorDiff
from .histogram import ArraySummary, Histogram
from .layout import Box, Layout

MAX_ROWS, MAX_COLS = 16, 10


def holders_text(layout: Layout, box: Box) -> str:
    """``d0 +d4`` (a saved chunk's devices, replica 0 first), ``p1`` (a process reading), ``?`` if unknown."""
    if not box.holders:
        return "host" if layout.sharding == "unsharded" else "?"
    prefix = "p" if layout.kind == "restore" else "d"
    first = f"{prefix}{box.holders[0]}"
    if layout.kind == "saved" and layout.device_processes:
        first = f"p{layout.device_processes[box.holders[0]]}:{first}"
    rest = box.holders[1:]
    if not rest:
        return first
    if len(rest) <= 2:
        return first + " " + " ".join(f"+{prefix}{h}" for h in rest)
    return f"{first} +{len(rest)} replicas" if layout.kind == "saved" else f"{first} +{len(rest)}"


def draw_layout(layout: Layout) -> str:
    """The boxes as a grid of labelled cells (rows: the first drawn dimension, columns: the second)."""
    dims = f"dims {' x '.join(map(str, layout.dims))}" if layout.dims else "a scalar"
    head = (f"{layout.key}: {layout.dtype}{list(layout.shape)}, {layout.kind} layout over {dims}, "
            f"{layout.grid_shape[0]}x{layout.grid_shape[1]} boxes; {layout.sharding}")
    if not layout.boxes:  # a zero-size array: no chunk is stored
        return "\n".join([head, "(no elements: nothing is stored)", *(f"note: {n}" for n in layout.notes)])
    rows = sorted({b.rows for b in layout.boxes})
    cols = sorted({b.cols for b in layout.boxes})
    by_cell = {(b.rows, b.cols): b for b in layout.boxes}
    shown_rows, shown_cols = rows[:MAX_ROWS], cols[:MAX_COLS]
    cells = {}
    for r in shown_rows:
        for c in shown_cols:
            b = by_cell.get((r, c))
            cells[r, c] = ("", "") if b is None else (holders_text(layout, b), _size_text(b, layout.kind))
    width = max([8] + [len(t) + 2 for pair in cells.values() for t in pair])
    rule = lambda left, mid, right: left + mid.join("─" * width for _ in shown_cols) + right
    lines = [head, rule("┌", "┬", "┐")]
    for i, r in enumerate(shown_rows):
        for part in (0, 1):
            lines.append("│" + "│".join(cells[r, c][part].center(width) for c in shown_cols) + "│")
        lines.append(rule("├", "┼", "┤") if i < len(shown_rows) - 1 else rule("└", "┴", "┘"))
    if len(rows) > MAX_ROWS or len(cols) > MAX_COLS:
        lines.append(f"(first {len(shown_rows)} of {len(rows)} rows and {len(shown_cols)} of {len(cols)} columns)")
    lines.extend(f"note: {n}" for n in layout.notes)
    return "\n".join(lines)


def _size_text(box: Box, kind: str) -> str:
    if kind == "restore":
        return f"{human_bytes(box.nbytes)}, {box.chunks} chunk{'s' if box.chunks != 1 else ''}"
    return human_bytes(box.nbytes) + (f" ({box.chunks} chunks)" if box.chunks > 1 else "")


def draw_histogram(histogram: Histogram, width: int = 40) -> str:
    """One bar per bin, longest `width` characters, with the bin's range and count."""
    if not histogram.counts:
        return f"  zeros: {histogram.zeros}" if histogram.zeros else "  (no finite values)"
    top = max(histogram.counts) or 1
    lines = []
    for (low, high), count in zip(zip(histogram.edges, histogram.edges[1:]), histogram.counts):
        bar = "█" * round(width * count / top) if count else ""
        if histogram.scale == "log":
            label = f"|x| 1e{low:+.2f}..1e{high:+.2f}"
        else:
            label = f"{low:>11.4g} .. {high:<11.4g}"
        lines.append(f"  {label} {bar:<{width}} {count}")
    if histogram.scale == "log":
        lines.append(f"  zeros: {histogram.zeros}")
    return "\n".join(lines)


def stats_table(summaries: list[ArraySummary]) -> str:
    rows = []
    for s in summaries:
        q = dict(s.quantiles)
        rows.append((s.key, s.count, fmt_number(s.min), *(fmt_number(q[p]) for p in (0.01, 0.25, 0.5, 0.75, 0.99)),
                     fmt_number(s.max), fmt_number(s.mean), fmt_number(s.std),
                     "-" if s.sparsity is None else f"{100 * s.sparsity:.2f}%", s.nan, s.inf))
    return table(("key", "finite", "min", "p1", "p25", "p50", "p75", "p99", "max", "mean", "std", "zeros", "nan",
                  "inf"), rows, right=tuple(range(1, 14)))


def diff_table(diffs: list[TensorDiff], group: bool) -> str:
    rows = []
    last_group = None
    for d in diffs:
        if group and d.group != last_group:
            rows.append((f"[{d.group}]", "", "", "", "", "", ""))
            last_group = d.group
        if d.change != "values":
            rows.append((d.key, d.change, d.detail_text(), "", "", "", ""))
            continue
        rows.append((d.key, d.change, fmt_number(d.delta_l2), fmt_number(d.relative),
                     f"{100 * d.differ_fraction:.2f}%", fmt_number(d.max_abs), d.elements))
    return table(("key", "change", "|Δ|₂", "|Δ|₂/|a|₂", "differ", "max |Δ|", "elements"), rows,
                 right=(2, 3, 4, 5, 6))
