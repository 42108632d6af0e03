"""A line plot as a small SVG file, log2 process counts along x and a log10 y axis, for benchmarks that run where
matplotlib is not installed (bench_coordination_sim.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")
W, H, LEFT, RIGHT, TOP, BOTTOM = 640, 400, 70, 190, 40, 50


def write(path: str, title: str, xs: Sequence[int], series: Mapping[str, Sequence[float]]) -> None:
    """Plot each of `series` (positive values, one per x) against `xs` into the SVG file `path`."""
    values = [v for ys in series.values() for v in ys if v > 0]
    lo, hi = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
    hi = hi if hi > lo else lo + 1
    x0, x1 = math.log2(xs[0]), math.log2(xs[-1])

    def px(x: float) -> float:
        return LEFT + (math.log2(x) - x0) / ((x1 - x0) or 1) * (W - LEFT - RIGHT)

    def py(y: float) -> float:
        return H - BOTTOM - (math.log10(y) - lo) / (hi - lo) * (H - TOP - BOTTOM)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="11"><rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{LEFT}" y="22" font-size="13">{title}</text>',
           f'<line x1="{LEFT}" y1="{H - BOTTOM}" x2="{W - RIGHT}" y2="{H - BOTTOM}" stroke="black"/>',
           f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{H - BOTTOM}" stroke="black"/>',
           f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 12}" text-anchor="middle">processes P</text>']
    for x in xs:
        out.append(f'<text x="{px(x):.1f}" y="{H - BOTTOM + 15}" text-anchor="middle">{x}</text>')
    for e in range(lo, hi + 1):
        out.append(f'<text x="{LEFT - 6}" y="{py(10 ** e) + 4:.1f}" text-anchor="end">1e{e}</text>')
        out.append(f'<line x1="{LEFT}" y1="{py(10 ** e):.1f}" x2="{W - RIGHT}" y2="{py(10 ** e):.1f}" '
                   'stroke="#ddd"/>')
    for k, (name, ys) in enumerate(series.items()):
        colour = COLOURS[k % len(COLOURS)]
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys) if y > 0)
        out.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"/>')
        out.append(f'<text x="{W - RIGHT + 8}" y="{TOP + 16 * k + 10}" fill="{colour}">{name}</text>')
    out.append("</svg>\n")
    with open(path, "w") as f:
        f.write("\n".join(out))
