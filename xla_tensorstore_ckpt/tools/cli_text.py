"""Text for the command line (`cli`): sizes, shapes, tables, times, metrics, JSON and a progress bar. Pure
Python."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (e.g. 5GB, 500MiB)")
    number, unit = float(match.group(1)), match.group(2).upper()
    scale = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9, "T": 1e12, "TB": 1e12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}.get(unit)
    if scale is None or number <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}")
    return int(number * scale)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """Rows aligned in columns; `right` lists the indices of right-aligned (numeric) columns."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def progress_bar(label: str, *, in_bytes: bool = False) -> Callable[[int, int], None] | None:
    """A callback drawing a progress bar on stderr (counts, or byte sizes), or None when stderr is not a
    terminal."""
    if not sys.stderr.isatty():
        return None

    def draw(done: int, total: int) -> None:
        width = 30
        filled = int(width * done / total) if total else width
        amount = f"{human_bytes(done)} / {human_bytes(total)}" if in_bytes else f"{done}/{total}"
        sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {amount}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return draw


def fmt_number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.6g}"


def metrics_text(metrics: dict | None) -> str:
    if not metrics:
        return ""
    return " ".join(f"{k}={fmt_number(v) if isinstance(v, float) else v}" for k, v in metrics.items())


def time_text(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(timestamp, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def print_json(data: Any) -> None:
    print(json.dumps(json_finite(data), indent=1, default=str, allow_nan=False))


def json_finite(value: Any) -> Any:
    """`value` with NaN and infinities as null: JSON has none (Python's ``NaN`` and ``Infinity`` break every
    other reader). Called by `print_json` and the HTML report."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_finite(v) for v in value]
    return value


def parse_shape(text: str) -> tuple[int, ...]:
    """``1024,1024`` (a chunk shape) or ``4x2`` (a mesh)."""
    try:
        values = tuple(int(v) for v in re.split(r"[,x]", text.strip()) if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid shape {text!r} (e.g. 1024,1024 or 4x2)") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"invalid shape {text!r} (positive integers, e.g. 1024,1024 or 4x2)")
    return values


_SPEC_ENTRY = re.compile(r"\s*(?:\(([0-9,\s]*)\)|(None|none|-)|([0-9]+))\s*(?:,|$)")


def parse_spec(text: str) -> tuple:
    """A partition spec by mesh dimension, one entry per tensor dimension: ``0,None``, ``(0,1),None``, ``1,0``."""
    matches = list(_SPEC_ENTRY.finditer(text))
    if not matches or "".join(m.group(0) for m in matches) != text:
        raise argparse.ArgumentTypeError(f"invalid partition spec {text!r} (per tensor dimension a mesh dimension, "
                                         "None or a tuple of them, e.g. 0,None or (0,1),None)")
    return tuple(None if none else int(number) if number else tuple(int(v) for v in group.split(",") if v.strip())
                 for group, none, number in (m.groups() for m in matches))


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    """The restore target of ``xtckpt plan`` and ``xtckpt show --layout`` (`inspection.RestoreTarget.of`)."""
    p.add_argument("--mesh", type=parse_shape, help="restore onto the shards of this mesh, e.g. 4x2 (dimension i "
                   "cut into mesh[i] shards; default: whole CPU tensors)")
    p.add_argument("--spec", type=parse_spec, help="with --mesh: the partition spec, per tensor dimension the mesh "
                   "dimensions cutting it, e.g. 0,None or (0,1),None (missing entries: None); the mesh's devices, "
                   "numbered in C order and split evenly over the processes, hold the shards their coordinates "
                   "pick, replicated over unused mesh dimensions")
    p.add_argument("--processes", type=int, default=1, help="with --mesh: the shards (with --spec: the devices) "
                   "split over this many processes, contiguously in C order (a plan per process)")
    p.add_argument("--target", metavar="PATH", help="a checkpoint whose keys, shapes and dtypes stand for the "
                   "restore target (e.g. the new model's weights); default: the checkpoint's own")
