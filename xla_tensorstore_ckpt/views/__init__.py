"""Views of checkpoints people would rather look at, from Python (notebooks) and the command line: layouts (the
stored chunk grid with the devices that held each chunk, or the shards each process reads on a restore),
statistics with quantiles, sparsity and histograms, per-tensor and per-layer diffs, and a self-contained HTML
report. Every function takes a path (local, ``gs://``, ``s3://``: a step, an item, a Hugging Face file or
directory, a DCP or torch_xla CheckpointManager checkpoint) and returns data records (with ``to_json``); the
report also as HTML. Plots with matplotlib live in `views.plots` (an optional extra). Everything blocks; no
torch_xla.

    >>> from xla_tensorstore_ckpt import views
    >>> views.stats_view("ckpt/100", "model/w").quantiles
    >>> views.diff_view("ckpt/100", "ckpt/200", sort="change")[:5]
    >>> views.report_html("ckpt")            # a notebook: IPython.display.HTML(...)
"""

from __future__ import annotations

from typing import Any

from ..tools import inspection
from ..tools.inspection import Checkpoint, RestoreTarget
from .diff import KeyMap, LayerDiff, TensorDiff, by_layer, diff_tensors, layer_of
from .histogram import ArraySummary, Histogram, ValueSketch, array_summary, summaries
from .layout import Box, Layout, restore_layout, saved_layout
from .report import ReportOptions, report_data, tree_entry, write_report
from .report import report_html as _page


def _open(path: str | Checkpoint) -> Checkpoint:
    return path if isinstance(path, Checkpoint) else inspection.open_checkpoint(path)


def layout_view(path: str | Checkpoint, key: str, target: RestoreTarget | None = None) -> Layout:
    """The saved layout of `key` (no `target`), or the shards each process reads on a restore onto `target` (a
    mesh, partition spec and process count, as ``xtckpt plan`` takes them)."""
    checkpoint = _open(path)
    if target is None or target == RestoreTarget():
        return saved_layout(checkpoint, key)
    return restore_layout(checkpoint, key, target)[0]


def stats_view(path: str | Checkpoint, key: str | None = None, *, bins: int = 40, scale: str = "linear"
          ) -> ArraySummary | list[ArraySummary]:
    """The statistics of `key`, or of every array (a list) when `key` is None."""
    checkpoint = _open(path)
    if key is not None:
        return array_summary(checkpoint, key, bins=bins, scale=scale)
    arrays = [(inspection.split_key(r.key, checkpoint)[0], r.meta, r.key) for r in inspection.tree_rows(checkpoint)
              if r.meta is not None]
    return list(summaries(checkpoint, arrays, bins=bins, scale=scale))


def diff_view(a: str | Checkpoint, b: str | Checkpoint, *, key_map: KeyMap | str | None = None, sort: str = "key",
         include_equal: bool = False) -> list[TensorDiff]:
    """Per-tensor differences from `a` to `b` (`by_layer` totals them per layer)."""
    return diff_tensors(_open(a), _open(b), key_map=key_map, sort=sort, include_equal=include_equal)


def report_html(path: str, options: ReportOptions | None = None) -> str:
    """The report of `path` as one self-contained HTML page (e.g. for ``IPython.display.HTML``)."""
    return _page(report_data(path, options))


def tree_view(path: str | Checkpoint) -> list[dict[str, Any]]:
    """Every leaf with its shape, dtype, bytes and parameter count (arrays) or value, as the report lists them."""
    return [tree_entry(r) for r in inspection.tree_rows(_open(path))]


__all__ = ["ArraySummary", "Box", "Histogram", "KeyMap", "LayerDiff", "Layout", "ReportOptions", "RestoreTarget",
           "TensorDiff", "ValueSketch", "array_summary", "by_layer", "diff_view", "layer_of", "layout_view",
           "report_data", "report_html", "stats_view", "summaries", "tree_view", "write_report"]
