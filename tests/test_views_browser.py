"""The HTML report in a real headless Chromium (Debian's, installed by `make test`'s setup): it loads with no
console error and no uncaught exception, the tree, a histogram, a layout and the diff chart are drawn by its
scripts, the tree opens and its search finds keys, a hostile key stays text, and a screenshot is not blank.
Fails (does not skip) where chromium is missing: `make test` installs it."""

from __future__ import annotations

import base64
import os

import pytest
import torch
from browser import CHROMIUM, Browser, png_pixels

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import cli
from xla_tensorstore_ckpt.views import report as views


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    base = tmp_path_factory.mktemp("views-browser")
    root = base / "ckpt"
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=None, async_save=False, save_rng=False)
    with xtc.CheckpointManager(root, options) as manager:
        for step in (1, 2, 3):
            g = torch.Generator().manual_seed(step)
            layers = [{"w": torch.randn(32, 16, generator=g), "b": torch.full((16,), float(step))} for _ in range(4)]
            manager.save(step, model={"layers": layers, "<script>": torch.arange(4.0)},
                         extra={"note": "</script><img src=x onerror=alert(1)>"})
    out = base / "report.html"
    assert cli.main(["report", str(root), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def page(report):
    assert os.path.exists(CHROMIUM), f"no {CHROMIUM}: `make stacks` installs it (apt-get install chromium)"
    b = Browser()
    try:
        b.load(str(report))
        yield b
    finally:
        b.close()


def test_report_renders_without_errors(page):
    assert page.evaluate("document.body.getAttribute('data-rendered')") == "true"
    assert page.errors() == []
    assert page.evaluate("document.querySelectorAll('#tree .node').length") == 2  # model, extra: collapsed
    assert page.evaluate("document.querySelectorAll('#hist-svg rect.bar').length") == 30
    assert page.evaluate("document.querySelectorAll('#layout-svg rect').length") >= 1
    assert page.evaluate("document.querySelectorAll('#diff-svg rect.bar').length") == 5  # 4 layers and model/
    assert page.evaluate("document.querySelectorAll('#steps-chart rect.bar').length") == 3
    # no markup came from the data: the hostile strings are text
    assert page.evaluate("document.querySelectorAll('img').length") == 0
    assert page.evaluate("document.querySelectorAll('script').length") == 2


def test_tree_opens_and_search_finds(page):
    page.evaluate("document.querySelector('#tree .node.branch').click()")
    assert page.evaluate("document.querySelectorAll('#tree .node').length") > 2
    found = page.evaluate("""new Promise(done => {
        const box = document.getElementById('search');
        box.value = '<script>';
        box.dispatchEvent(new Event('input'));
        setTimeout(() => done([...document.querySelectorAll('#tree .node.leaf')].map(n => n.getAttribute('data-key'))),
                   500);
    })""")
    assert found == ["model/<script>"]
    assert page.evaluate("document.querySelector('#tree .node.leaf span:nth-child(2)').textContent") == "model/<script>"
    assert page.errors() == []


def test_screenshot_is_not_blank(page):
    data = page.call("Page.captureScreenshot", format="png",
                     clip={"x": 0, "y": 0, "width": 1280, "height": 1200, "scale": 0.25})["data"]
    width, height, rows = png_pixels(base64.b64decode(data))
    background = rows[-1][:3]
    drawn = sum(1 for row in rows for x in range(0, len(row), 3) if row[x:x + 3] != background)
    assert width == 320 and height == 300
    assert drawn > width * height // 10, drawn


def test_ten_thousand_arrays_stay_collapsed_and_searchable(tmp_path):
    """A report of 10,000 arrays draws only what is open (the tree collapsed, the search's first 500 matches, the
    first 2,000 rows of statistics): the page's size in DOM nodes does not grow with the arrays."""
    keys = [f"model/layers.{i // 10}.w{i % 10}" for i in range(10_000)]
    stat = {"dtype": "float32", "shape": [4], "count": 4, "min": 0.0, "max": 1.0, "mean": 0.5, "std": 0.5,
            "nan": 0, "inf": 0, "zeros": 1, "sparsity": 0.25, "quantile_error": 0.0,
            "quantiles": {f"{q:g}": 0.5 for q in (.01, .1, .25, .5, .75, .9, .99)},
            "histogram": {"scale": "linear", "edges": [0.0, 0.5, 1.0], "counts": [2, 2], "zeros": 0}}
    data = {"title": "<b>10k</b>", "source": "synthetic", "steps": [],
            "tree": [{"key": k, "shape": [4], "dtype": "float32", "bytes": 16, "params": 4, "chunk": [4],
                      "sharding": ""} for k in keys],
            "layouts": [], "stats": [{"key": k, **stat} for k in keys], "diff": None}
    page_file = tmp_path / "big.html"
    page_file.write_text(views.report_html(data))
    b = Browser()
    try:
        b.load(str(page_file))
        assert b.evaluate("document.body.getAttribute('data-rendered')") == "true" and b.errors() == []
        assert b.evaluate("document.querySelectorAll('#tree .node').length") == 1
        assert b.evaluate("document.querySelectorAll('#stats tr').length") == 2001
        found = b.evaluate("""new Promise(done => {
            const box = document.getElementById('search');
            box.value = 'layers.99.w';
            box.dispatchEvent(new Event('input'));
            setTimeout(() => done(document.querySelectorAll('#tree .node.leaf').length), 500);
        })""")
        assert found == 10
        assert b.evaluate("document.title") == "xtckpt report: <b>10k</b>"
        assert b.evaluate("document.querySelectorAll('b').length") == 0
    finally:
        b.close()
