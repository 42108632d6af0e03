"""A self-contained HTML report of a checkpoint root, step or item: the steps and their sizes over time, the tree
with parameter totals (collapsed, searchable), layouts, statistics with histograms, and the diff between two
steps per layer. One file: the data as JSON in the page (every ``<``, ``>`` and ``&`` escaped, so no string can
end the script), drawn by inline JavaScript into SVG with ``textContent`` only (a key named ``<script>`` stays
text); nothing is fetched when it is viewed. Written under a temporary name and swapped in (`outputs`).

Reads each byte once: with a diff, both steps by `scans.diff`, the shown step's statistics taken from the same
reads (when it is one of the two); then the arrays left by `histogram.summaries`, in the tree's order (the order
they were stored in: near sequential reads), shown largest first. Used by ``xtckpt report`` and
`views.report_html`; blocks; no torch_xla.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np

from .. import storage
from ..core.errors import CheckpointNotFoundError, UsageError
from ..core.records import ArrayMetadata
from ..storage import outputs
from ..storage.local import fsync_path
from ..tools import inspection
from ..tools.cli_text import json_finite
from ..tools.inspection import Checkpoint, Progress
from . import diff as diff_view
from . import histogram, layout

DEFAULT_MAX_STAT_ARRAYS = 100_000
MAX_LAYOUTS = 64  # the largest arrays get a drawn layout
MAX_VALUE_CHARS = 200
_TEMPLATE = "report_template.html"


@dataclass(frozen=True)
class ReportOptions:
    """step: the step of a root to show (default: the latest committed); diff_steps: the two steps to compare
    (default: the last two committed); stats: read the data (statistics, histograms, diff) or metadata only;
    max_stat_arrays: statistics for at most this many arrays (the largest); bins: histogram bins."""

    step: str | None = None
    diff_steps: tuple[str, str] | None = None
    stats: bool = True
    max_stat_arrays: int = DEFAULT_MAX_STAT_ARRAYS
    bins: int = 30


def report_data(path: str, options: ReportOptions | None = None, progress: Progress | None = None) -> dict:
    """Everything the report shows, as JSON-ready data (see the module). Blocks. Raises
    `CheckpointNotFoundError` if `path` is no checkpoint, `UsageError` for a step it lacks,
    `CorruptCheckpointError` for damaged data."""
    options = options or ReportOptions()
    steps, checkpoint, root = _resolve(path, options.step)
    rows = inspection.tree_rows(checkpoint)
    arrays = [r for r in rows if r.meta is not None]
    largest = sorted(arrays, key=lambda r: -r.meta.nbytes)
    data: dict[str, Any] = {
        "title": str(checkpoint.location), "source": str(storage.location(path)),
        "steps": [{"step": s.step, "status": s.status, "committed_at": s.committed_at, "bytes": s.nbytes}
                  for s in steps],
        "tree": [tree_entry(r) for r in rows],
        "layouts": [layout.saved_layout(checkpoint, r.key).to_json() for r in largest[:MAX_LAYOUTS]
                    if r.meta.num_chunks <= layout.MAX_CHUNKS],
        "stats": [], "diff": None,
    }
    if not options.stats:
        return data
    chosen = [(inspection.split_key(r.key, checkpoint)[0], r.meta, r.key)
              for r in largest[:max(0, options.max_stat_arrays)]]
    found: dict[str, dict] = {}
    pair = _diff_pair(steps, options.diff_steps)
    if pair is not None and root is not None:
        a, b = (inspection.open_checkpoint(root.child(s.name)) for s in pair)
        shown = str(b.location) == str(checkpoint.location)  # its arrays' statistics from the diff's reads of them
        observer = _Observer({key: meta for _, meta, key in chosen}, options.bins) if shown else None
        try:
            diffs = diff_view.diff_tensors(a, b, include_equal=True, observe_b=observer)
            found = observer.finish() if observer is not None else {}
        finally:
            if observer is not None:
                observer.cancel()
        data["diff"] = {"a": pair[0].step, "b": pair[1].step,
                        "layers": [g.to_json() for g in diff_view.by_layer(diffs)],
                        "tensors": [d.to_json() for d in diffs]}
    # read in the tree's order (the order the arrays were stored in, so reads stay near sequential), shown largest
    # first
    order = {r.key: i for i, r in enumerate(arrays)}
    rest = sorted((array for array in chosen if array[2] not in found), key=lambda array: order[array[2]])
    for done, summary in enumerate(histogram.summaries(checkpoint, rest, bins=options.bins), 1):
        found[summary.key] = summary.to_json()
        if progress:
            progress(done, len(rest))
    data["stats"] = [found[key] for _, _, key in chosen]
    return data


class _Observer:
    """Statistics of the shown step's arrays taken from the regions a diff reads of them, array after array
    (`scans.diff`'s `observe_b`), so that each of their bytes is read once; binned on `histogram`'s threads
    (`histogram.Binning`, its bounded memory) while the diff goes on with the next regions."""

    def __init__(self, arrays: dict[str, ArrayMetadata], bins: int):
        self.arrays = arrays
        self.binning = histogram.Binning(max(1, histogram.DEFAULT_MAX_BYTES // 2), bins, "linear")
        self.key: str | None = None
        self.entry: histogram.Entry | None = None
        self.done: dict[str, dict] = {}

    def __call__(self, key: str, data: np.ndarray) -> None:
        if key != self.key:
            self._close()
            self.key = key
            self.entry = self.binning.start(key, self.arrays[key]) if key in self.arrays else None
        if self.entry is not None:
            self.binning.put(self.entry, data)
            self._collect()

    def _close(self) -> None:
        if self.entry is not None:
            self.entry.walked = True
        self.entry = None

    def _collect(self, wait: bool = False) -> None:
        for summary in self.binning.finished(wait):
            self.done[summary.key] = summary.to_json()

    def finish(self) -> dict[str, dict]:
        """The summaries (as JSON) of the arrays the diff read whole, by key (waits for their binning)."""
        self._close()
        self._collect(wait=True)
        return self.done

    def cancel(self) -> None:
        """Drop the binning not yet started (the diff failed)."""
        self.binning.cancel()


def _resolve(path: str, step: str | None) -> tuple[list, Checkpoint, storage.Location | None]:
    """(the root's steps, the checkpoint shown, the root) of a root, or ([], it, None) of a step or item."""
    try:
        checkpoint = inspection.open_checkpoint(path)
    except CheckpointNotFoundError:
        steps = inspection.list_steps(path)
        committed = [s for s in steps if s.status == "committed"]
        if not committed:
            raise
        root = storage.location(path)
        chosen = committed[-1] if step is None else next(
            (s for s in committed if s.name == step or str(s.step) == step), None)
        if chosen is None:
            raise UsageError(f"{root} has no committed step {step!r}") from None
        return steps, inspection.open_checkpoint(root.child(chosen.name)), root
    if step is not None:
        raise UsageError(f"--step picks a step of a root; {path} is a step or an item")
    return [], checkpoint, None


def _diff_pair(steps: list, wanted: tuple[str, str] | None) -> tuple | None:
    committed = [s for s in steps if s.status == "committed"]
    if wanted is None:
        return tuple(committed[-2:]) if len(committed) >= 2 else None
    found = []
    for name in wanted:
        match = next((s for s in committed if s.name == name or str(s.step) == name), None)
        if match is None:
            raise UsageError(f"no committed step {name!r} to compare")
        found.append(match)
    return tuple(found)


def tree_entry(row: inspection.TreeRow) -> dict:
    """A leaf as the report lists it: key, shape, dtype, bytes, parameters, chunk, sharding; or its value."""
    if row.meta is None:
        value = json.dumps(row.value, default=str)
        return {"key": row.key, "value": value[:MAX_VALUE_CHARS] + ("…" if len(value) > MAX_VALUE_CHARS else "")}
    meta = row.meta
    return {"key": row.key, "shape": list(meta.shape), "dtype": meta.dtype, "bytes": meta.nbytes,
            "params": math.prod(meta.shape), "chunk": list(meta.chunk_shape),
            "sharding": meta.sharding.describe() if meta.sharding else ""}


def report_html(data: dict) -> str:
    """The page for `report_data`'s data: the template with the data embedded as escaped JSON."""
    template = resources.files(__package__).joinpath(_TEMPLATE).read_text(encoding="utf-8")
    payload = json.dumps(json_finite(data), allow_nan=False, default=_json_default, separators=(",", ":"))
    payload = payload.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
    payload = payload.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    fills = {"TITLE": html.escape(str(data.get("title", ""))), "DATA": payload}
    return re.sub(r"\{\{(TITLE|DATA)\}\}", lambda m: fills[m.group(1)], template)


def _json_default(value: Any) -> Any:
    return str(value)


def write_report(path: str, out: str, options: ReportOptions | None = None, *, overwrite: bool = False,
                 progress: Progress | None = None) -> str:
    """Write the report of `path` to the local file `out` (its directory made if missing): under a temporary
    name beside it, renamed into place at the end (an existing file is kept unless `overwrite`). Returns the
    final path. Blocks; raises as `report_data` does, `CheckpointExistsError` for an existing file."""
    final = os.path.abspath(out)
    destination = storage.location(final)
    if os.path.isdir(final):
        raise UsageError(f"{final} is a directory; give the report a file name")
    outputs.check_vacant(destination, overwrite=overwrite)
    page = report_html(report_data(path, options, progress))  # first: a failed report leaves no directory
    directory = os.path.dirname(final)
    os.makedirs(directory, exist_ok=True)
    staged = outputs.StagedFiles(directory)
    try:
        with open(staged.path(os.path.basename(final)), "w", encoding="utf-8") as f:
            f.write(page)
            f.flush()
            os.fsync(f.fileno())
        staged.publish()
    except BaseException:
        staged.discard()
        raise
    fsync_path(directory)
    return final

