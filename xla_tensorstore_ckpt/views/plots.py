"""The views as matplotlib figures, for notebooks: the one module that imports matplotlib (the ``views`` extra),
imported only when a plot is asked for. Each function returns the `Figure`; raises `UsageError` if matplotlib
is not installed."""

from __future__ import annotations

from typing import Any

from ..core.errors import UsageError
from .diff import LayerDiff
from .histogram import ArraySummary
from .layout import Layout


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("plots need matplotlib: pip install 'xla_tensorstore_ckpt[views]'") from None
    return plt


def histogram(summary: ArraySummary) -> Any:
    """The value histogram of one array (bins of the value, or of log10 |value|)."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6, 3))
    h = summary.histogram
    if h.counts:
        widths = [b - a for a, b in zip(h.edges, h.edges[1:])]
        axes.bar(h.edges[:-1], h.counts, width=widths, align="edge")
    axes.set_title(f"{summary.key} ({summary.dtype}{list(summary.shape)})")
    axes.set_xlabel("log10 |value|" if h.scale == "log" else "value")
    axes.set_ylabel("count")
    return figure


def layers(layer_diffs: list[LayerDiff]) -> Any:
    """|Δ|₂ / |a|₂ per layer, one horizontal bar each."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 0.25 * max(4, len(layer_diffs))))
    axes.barh([g.group for g in layer_diffs], [g.relative if g.a_l2 else 0.0 for g in layer_diffs])
    axes.invert_yaxis()
    axes.set_xlabel("|Δ|₂ / |a|₂")
    return figure


def layout(view: Layout) -> Any:
    """The boxes of a layout, coloured by their first holder."""
    plt = _pyplot()
    from matplotlib.patches import Rectangle

    figure, axes = plt.subplots(figsize=(5, 5))
    colours = plt.get_cmap("tab10")
    for box in view.boxes:
        axes.add_patch(Rectangle((box.cols[0], box.rows[0]), box.cols[1] - box.cols[0], box.rows[1] - box.rows[0],
                                 facecolor=colours((box.holders or (0,))[0] % 10), edgecolor="white"))
        label = ("p" if view.kind == "restore" else "d") + (str(box.holders[0]) if box.holders else "?")
        axes.text((box.cols[0] + box.cols[1]) / 2, (box.rows[0] + box.rows[1]) / 2, label, ha="center",
                  va="center")
    axes.set_xlim(0, max((b.cols[1] for b in view.boxes), default=1))
    axes.set_ylim(max((b.rows[1] for b in view.boxes), default=1), 0)
    axes.set_title(view.key)
    return figure
