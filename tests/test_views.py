"""The inspection views (`xla_tensorstore_ckpt.views`): quantiles, sparsity and histograms against numpy, diffs per
tensor and per layer against torch, layouts against saved shardings and restore plans, the report's data and
escaping; on our steps, Hugging Face files, Orbax items and DCP directories. No torch_xla."""

from __future__ import annotations

import json
import math
import os

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import object_store
from hf_files import write_hf_dir

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import cli, storage, views
from xla_tensorstore_ckpt.core import buffers, tunables
from xla_tensorstore_ckpt.core.errors import UsageError
from xla_tensorstore_ckpt.core.records import SavedSharding
from xla_tensorstore_ckpt.tools import convert, inspection
from xla_tensorstore_ckpt.views import histogram, layout, report, sketch

GOLDEN_ORBAX = os.path.join(os.path.dirname(__file__), "golden", "orbax-0.11", "item")


def model(step: int) -> dict:
    g = torch.Generator().manual_seed(0)
    state = {"layers": [{"w": torch.randn(64, 32, generator=g), "b": torch.zeros(32)} for _ in range(3)],
             "norm": torch.ones(32, dtype=torch.bfloat16), "<script>": torch.arange(6.0)}
    if step == 2:
        state["layers"][1]["w"][:8] += 0.5
    return state


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("views") / "ckpt"
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=None, async_save=False, save_rng=False)
    with xtc.CheckpointManager(root, options) as manager:
        for step in (1, 2):
            manager.save(step, model=model(step), extra={"note": "</script><script>alert(1)</script>"})
    return root


def run(*argv, capsys):
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def nearest_rank(values: np.ndarray, q: float) -> float:
    ordered = np.sort(values[np.isfinite(values)])
    return float(ordered[max(1, math.ceil(q * ordered.size)) - 1])


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32", "int8", "uint8", "bool",
                                   "float8_e4m3fn"])
def test_sketch_quantiles_are_within_the_bound_and_counts_exact(dtype):
    rng = np.random.default_rng(1)
    values = (rng.standard_normal(50_001) * 30).astype(np.float64)
    values[:5000] = 0
    values = values.astype(getattr(ml_dtypes, dtype, None) or np.dtype(dtype))
    as_float = values.astype(np.float64)
    if dtype.startswith("float"):
        values[7], values[8] = np.nan, np.inf
        as_float = values.astype(np.float64)
    whole, halves = histogram.ValueSketch(), [histogram.ValueSketch(), histogram.ValueSketch()]
    whole.add(values)
    halves[0].add(values[:20_000])
    halves[1].add(values[20_000:])
    halves[0].merge(halves[1])
    summary = histogram.summarize("k", dtype, values.shape, halves[0])
    assert np.array_equal(halves[0].counts, whole.counts)
    finite = as_float[np.isfinite(as_float)]
    assert (summary.count, summary.zeros) == (finite.size, int((finite == 0).sum()))
    assert (summary.nan, summary.inf) == (int(np.isnan(as_float).sum()), int(np.isinf(as_float).sum()))
    assert summary.min == finite.min() and summary.max == finite.max()
    assert summary.mean == pytest.approx(finite.mean()) and summary.std == pytest.approx(finite.std())
    assert summary.sparsity == int((finite == 0).sum()) / finite.size
    exact = dtype in ("bfloat16", "int8", "uint8", "bool", "float8_e4m3fn")
    assert summary.quantile_error == (0.0 if exact else 2.0 ** -8)
    for q, value in summary.quantiles:
        expected = nearest_rank(as_float, q)
        if exact:
            assert value == expected, (q, value, expected)
        else:
            assert abs(value - expected) <= 2.0 ** -8 * abs(expected) + (0.5 if dtype == "int32" else 0), q
    assert sum(summary.histogram.counts) == finite.size
    log = halves[0].histogram(10, "log")
    assert sum(log.counts) + log.zeros == finite.size and log.zeros == int((finite == 0).sum())


def test_sketch_sums_keep_the_digits_of_a_narrow_spread_far_from_zero():
    ones, offset = histogram.ValueSketch(), histogram.ValueSketch()
    ones.add(np.ones(40_000, np.float32))  # a norm's weights: std exactly 0, not the rounding of 1 - 1
    assert (ones.mean, ones.std) == (1.0, 0.0)
    values = (1000 + np.random.default_rng(2).standard_normal(40_000) * 1e-3).astype(np.float32)
    offset.add(values[:100])  # the first slab's middle is the shift; the next ones are re-centred onto it
    offset.add(values[100:] + np.float32(1))
    offset.add(np.array([np.inf, np.nan], np.float32))
    expected = np.concatenate([values[:100], values[100:] + np.float32(1)]).astype(np.float64)
    assert offset.mean == pytest.approx(expected.mean(), rel=1e-12)
    assert offset.std == pytest.approx(expected.std(), rel=1e-5) and (offset.nan, offset.inf) == (1, 1)


def test_sketch_counts_zeros_exactly_beside_tiny_values_in_their_bins():
    """The bins around zero also hold denormals (and -0 its own bin): the zeros are counted in the values, on the
    bincount path (more than sketch.SMALL values) and the sorting one, with the sums of values straddling zero."""
    tiny = np.array([1e-45, -1e-45, 1e-41, -1e-41], np.float32)  # denormals in the bins of +0 and -0
    rng = np.random.default_rng(4)
    for size in (100, 3 * sketch.SMALL):
        values = rng.standard_normal(size).astype(np.float32)
        values[:8] = [0.0, -0.0, 0.0, -0.0, *tiny]
        whole = histogram.ValueSketch()
        whole.add(values)
        as_float = values.astype(np.float64)
        assert (whole.count, whole.zeros) == (size, 4)
        assert whole.counts[0] == 4 and whole.counts[0x8000] == 4
        assert whole.mean == pytest.approx(as_float.mean(), abs=1e-6) and whole.std == pytest.approx(as_float.std())
        positive = histogram.ValueSketch()  # +0 and positive denormals only: the integer count of zero words
        positive.add(np.abs(values))
        assert positive.zeros == 4


def test_stats_command_quantiles_and_histograms(root, capsys):
    status, out, _ = run("stats", root / "2", "model/layers.0.w", "model/norm", "--json", capsys=capsys)
    assert status == 0
    by_key = {s["key"]: s for s in json.loads(out)}
    w = model(2)["layers"][0]["w"].double().numpy()
    assert by_key["model/layers.0.w"]["quantiles"]["0.5"] == pytest.approx(nearest_rank(w, 0.5), rel=2 ** -8)
    assert by_key["model/norm"]["quantiles"] == {f"{q:g}": 1.0 for q in histogram.QUANTILES}
    assert by_key["model/norm"]["sparsity"] == 0.0 and by_key["model/norm"]["histogram"]["counts"] == [32]
    status, out, _ = run("stats", root / "2", "model/layers.0.b", "--histogram", "log", "--bins", "4",
                         capsys=capsys)
    assert status == 0 and "model/layers.0.b" in out and "100.00%" in out and "zeros: 32" in out
    status, _, err = run("stats", root / "2", "model/norm", "--bins", "0", capsys=capsys)
    assert status == cli.EXIT_USAGE and err.startswith("xtckpt: error: --bins 0")


def test_diff_per_tensor_and_per_layer(root, capsys):
    status, out, _ = run("diff", root / "1", root / "2", "--json", "--sort", "change", capsys=capsys)
    assert status == 0
    entries = json.loads(out)
    assert [e["key"] for e in entries] == ["model/layers.1.w"]
    a, b = model(1)["layers"][1]["w"].double(), model(2)["layers"][1]["w"].double()
    e = entries[0]
    assert e["delta_l2"] == pytest.approx(float((b - a).norm())) and e["a_l2"] == pytest.approx(float(a.norm()))
    assert e["relative_l2"] == pytest.approx(float((b - a).norm() / a.norm()))
    assert (e["differing"], e["elements"], e["differ_fraction"]) == (256, 2048, 0.125)
    assert e["max_abs_diff"] == pytest.approx(0.5) and e["group"] == "model/layers.1"
    diffs = views.diff_view(str(root / "1"), str(root / "2"), include_equal=True, sort="layer")
    layers = {g.group: g for g in views.by_layer(diffs)}
    assert set(layers) == {"model/layers.0", "model/layers.1", "model/layers.2", "model"}
    assert layers["model/layers.1"].changed == 1 and layers["model/layers.0"].delta_l2 == 0
    status, out, _ = run("diff", root / "1", root / "2", "--sort", "layer", capsys=capsys)
    assert "[model/layers.1]" in out and "12.50%" in out


@pytest.mark.parametrize("special", [False, True])
def test_chunk_diff_counts_and_norms_as_float64_masks_do(special):
    """The finite path (b - a is 0 exactly where equal, -0 equal to 0) and the masked one (NaN equal to NaN, Inf
    to Inf) agree with the definitions computed plainly in float64."""
    from xla_tensorstore_ckpt.tools import scans

    rng = np.random.default_rng(5)
    a = rng.standard_normal(10_000).astype(np.float32)
    b = a.copy()
    b[::7] += np.float32(0.25)
    a[1], b[1] = 0.0, -0.0
    b[2] = np.nextafter(a[2], np.float32(np.inf))  # one float32 step: differs
    if special:
        a[3], b[3] = np.nan, np.nan
        a[4], b[4] = np.inf, np.inf
        b[5] = np.nan
    va, vb = a.astype(np.float64), b.astype(np.float64)
    unequal = (va != vb) & ~(np.isnan(va) & np.isnan(vb))
    delta = np.abs(vb - va)
    expected = (float(np.square(np.nan_to_num(va)).sum()), int(unequal.sum()), float(np.nanmax(delta)),
                float(np.nansum(np.square(vb - va))))
    found = scans._chunk_diff(a.reshape(100, 100), b.reshape(100, 100))
    assert found[1] == expected[1] and found[2] == expected[2]
    assert found[0] == pytest.approx(expected[0], rel=1e-12) and found[3] == pytest.approx(expected[3], rel=1e-12)


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_integer_diffs_are_exact_and_nan_values_equal(tmp_path, capsys):
    """int64 values beyond 2^53 that differ by less than float64's spacing there still differ; a NaN scalar
    equals NaN; --json writes an infinite change as null (JSON has no Infinity)."""
    from xla_tensorstore_ckpt.tools import scans

    big = 2 ** 53
    xtc.save(tmp_path / "a", {"count": torch.tensor([big, 7, -big]),
                              "small": torch.tensor([1, -128, 5], dtype=torch.int8), "loss": math.nan,
                              "grad": torch.tensor([1.0, 2.0])})
    xtc.save(tmp_path / "b", {"count": torch.tensor([big + 1, 7, 2 ** 62]),
                              "small": torch.tensor([1, 127, 5], dtype=torch.int8), "loss": math.nan,
                              "grad": torch.tensor([1.0, math.inf])})
    status, out, _ = run("diff", tmp_path / "a", tmp_path / "b", "--json", capsys=capsys)
    assert status == 0
    by_key = {e["key"]: e for e in _strict_json(out)}
    assert set(by_key) == {"count", "small", "grad"}  # the NaN loss is no difference
    assert (by_key["count"]["differing"], by_key["count"]["max_abs_diff"]) == (2, float(2 ** 62 + big))
    assert (by_key["small"]["differing"], by_key["small"]["max_abs_diff"]) == (1, 255.0)
    assert by_key["grad"]["differing"] == 1 and by_key["grad"]["max_abs_diff"] is None
    top = np.array([0, 2 ** 64 - 1], np.uint64)
    assert scans._chunk_diff(top, top[::-1].copy())[1:3] == (2, float(2 ** 64 - 1))


def test_sketch_histograms_of_exact_types_and_tiny_and_huge_values():
    """The types bfloat16 holds are binned at their values (negative ones included); float32 values below
    2^-133 count as nonzero in a log histogram; float64 values beyond 1e154 keep a true std."""
    def summary(values, dtype, bins):
        sk = histogram.ValueSketch()
        sk.add(values)
        return histogram.summarize("k", dtype, values.shape, sk, bins=bins)

    ints = np.arange(-5, 6, dtype=np.int8)
    assert summary(ints, "int8", 10).histogram.counts == tuple(np.histogram(ints, 10)[0])
    halves = np.array([-2, -1, 0, 1, 2], ml_dtypes.bfloat16)
    assert summary(halves, "bfloat16", 4).histogram.counts == (1, 1, 1, 2)
    tiny = np.geomspace(1e-44, 1e-39, 1001).astype(np.float32)
    sk = histogram.ValueSketch()
    sk.add(tiny)
    log = sk.histogram(6, "log")
    assert (sum(log.counts), log.zeros) == (1001, 0)
    for values in ([1e300, 1.5e300, 1e308, 1.7e308], [1e200, -1e200, 3e200]):
        huge = np.array(values)
        scale = 1e300 if huge.max() > 1e250 else 1e200
        found = summary(huge, "float64", 4)
        assert found.std == pytest.approx(np.std(huge / scale) * scale, rel=1e-12)
        assert found.mean == pytest.approx(np.mean(huge / scale) * scale, rel=1e-12)


def test_diff_across_formats_with_a_key_map(tmp_path, capsys):
    hf = str(tmp_path / "hf")
    write_hf_dir(hf)
    convert.convert_to_step(storage.location(hf), storage.location(str(tmp_path / "root" / "1")))
    step = tmp_path / "root" / "1"
    status, out, _ = run("diff", hf, step, "--json", capsys=capsys)
    assert {e["change"] for e in json.loads(out)} == {"added", "removed"}
    status, out, _ = run("diff", hf, step, "--key-map", '{"*": "model/*"}', "--all", "--json", capsys=capsys)
    entries = json.loads(out)
    assert status == 0 and {e["change"] for e in entries} == {"equal"} and len(entries) == 7
    status, _, err = run("diff", hf, step, "--key-map", "[1]", capsys=capsys)
    assert status == cli.EXIT_USAGE and "key map" in err and len(err.splitlines()) == 1
    orbax_step = tmp_path / "root" / "2"
    convert.convert_to_step(storage.location(GOLDEN_ORBAX), storage.location(str(orbax_step)))
    assert views.diff_view(GOLDEN_ORBAX, str(orbax_step), key_map={"*": "model/*"}, include_equal=True)
    assert views.diff_view(GOLDEN_ORBAX, str(orbax_step), key_map={"*": "model/*"}) == []
    mapped = views.diff_view(hf, str(step), key_map=lambda k: "model/" + k if "norm" in k else None)
    assert [d.change for d in mapped] == ["added"] * 5  # the keys the map dropped from A


def test_tile_devices_from_hlo_and_dtensor_shardings():
    hlo = SavedSharding("{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}", (4, 1), 2, 8)
    assert layout.tile_devices(hlo, 2) == {(0, 0): (0, 1), (1, 0): (2, 3), (2, 0): (4, 5), (3, 0): (6, 7)}
    iota = SavedSharding("{devices=[2,2]<=[2,2]T(1,0)}", (2, 2), 1, 4)
    assert layout.tile_devices(iota, 2) == {(0, 0): (0,), (0, 1): (2,), (1, 0): (1,), (1, 1): (3,)}
    # a DTensor on a (2, 2) mesh: Shard(0) on mesh dim 1, Replicate on mesh dim 0
    dtensor = SavedSharding("", (2, 1), 2, 4, (2, 2), None, (1, None), ("Replicate()", "Shard(dim=0)"))
    assert layout.tile_devices(dtensor, 2) == {(0, 0): (0, 2), (1, 0): (1, 3)}
    named = SavedSharding("", (4, 1), 1, 4, (2, 2), ("dp", "tp"), (("dp", "tp"), None), ("Shard(dim=0)",) * 2)
    assert layout.tile_devices(named, 2) == {(0, 0): (0,), (1, 0): (1,), (2, 0): (2,), (3, 0): (3,)}
    assert layout.tile_devices(SavedSharding("{replicated}", (1, 1), 4, 4), 2) == {(0, 0): (0, 1, 2, 3)}
    assert layout.tile_devices(SavedSharding("{devices=[9]0}", (9,), 1, 1), 1) == {}  # inconsistent: unknown
    assert layout.drawn_dims((3, 100, 7, 50)) == (1, 3) and layout.drawn_dims((5,)) == (0,)


def test_layout_of_a_zero_size_array(tmp_path, capsys):
    xtc.save(tmp_path / "z", {"z": torch.zeros(0, 4)})
    status, out, _ = run("show", tmp_path / "z", "z", "--layout", capsys=capsys)
    assert status == 0 and "0x0 boxes" in out and "(no elements: nothing is stored)" in out


def test_restore_layout_uses_the_restore_plan(root, capsys):
    status, out, _ = run("show", root / "2", "model/layers.0.w", "--layout", "--mesh", "4x2", "--processes", "2",
                         "--json", capsys=capsys)
    assert status == 0
    view = json.loads(out)
    assert view["kind"] == "restore" and view["grid"] == [4, 2]
    assert sorted((b["rows"][0], b["cols"][0], b["holders"][0]) for b in view["boxes"]) == [
        (r, c, 0 if r < 32 else 1) for r in (0, 16, 32, 48) for c in (0, 16)]
    status, out, _ = run("plan", root / "2", "model", "--mesh", "4x2", "--processes", "2", "--json", capsys=capsys)
    plans = json.loads(out)
    planned = [next(k for k in p["keys"] if k["key"] == "layers/0/w")["read_bytes"] for p in plans]
    assert [p["read_bytes"] for p in view["plans"]] == planned
    status, out, _ = run("show", root / "2", "model/layers.0.w", "--layout", capsys=capsys)
    assert status == 0 and "host" in out and "8.0 KiB" in out and "saved without a recorded sharding" in out


def test_restore_layout_with_a_partition_spec_and_another_target(root, tmp_path, capsys):
    # mesh 2x2, dimension 0 cut by mesh dimension 1, mesh dimension 0 unused: each half replicated on a
    # device of each process, so both processes read both halves
    argv = ("--layout", "--mesh", "2x2", "--spec", "1,None", "--processes", "2", "--json")
    status, out, _ = run("show", root / "2", "model/layers.0.w", *argv, capsys=capsys)
    view = json.loads(out)
    assert status == 0 and view["grid"] == [2, 1] and "spec (1, None)" in view["sharding"]
    assert sorted((b["rows"], b["holders"], b["bytes"]) for b in view["boxes"]) == [
        ([0, 32], [0, 1], 2 * 32 * 32 * 4), ([32, 64], [0, 1], 2 * 32 * 32 * 4)]
    status, out, _ = run("plan", root / "2", "model", *argv[1:], capsys=capsys)
    planned = [next(k for k in p["keys"] if k["key"] == "layers/0/w")["read_bytes"] for p in json.loads(out)]
    assert [p["read_bytes"] for p in view["plans"]] == planned == [64 * 32 * 4] * 2
    xtc.save(tmp_path / "other", {"layers": [{"w": torch.zeros(64, 16)}]})
    status, out, _ = run("show", root / "2", "model/layers.0.w", "--layout", "--target", tmp_path / "other",
                         capsys=capsys)
    assert status == 0 and "does not match target shape (64, 16)" in out
    for bad in (("--spec", "0,None"), ("--mesh", "3", "--spec", "0", "--processes", "2"),
                ("--mesh", "2x2", "--spec", "(0,0)")):
        status, _, err = run("show", root / "2", "model/layers.0.w", "--layout", *bad, capsys=capsys)
        assert status == cli.EXIT_USAGE and len(err.splitlines()) == 1, err


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("views-dcp") / "dcp")
    dcp.save({"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.zeros(5)}}, checkpoint_id=path,
             no_dist=True)
    return path


@pytest.mark.parametrize("kind", ["hf", "orbax", "dcp"])
def test_views_on_foreign_formats(kind, dcp_dir, tmp_path, capsys):
    if kind == "hf":
        path, key = str(tmp_path / "hf"), "model.norm.weight"
        write_hf_dir(path)
    else:
        path, key = (GOLDEN_ORBAX, None) if kind == "orbax" else (dcp_dir, "model.w")
    checkpoint = inspection.open_checkpoint(path)
    key = key or next(r.key for r in inspection.tree_rows(checkpoint) if r.meta is not None)
    summary = views.stats_view(path, key)
    values = inspection.read_slice(checkpoint, key, ()).astype(np.float64)
    assert summary.count == values.size and summary.max == values.max()
    assert summary.quantiles[3][1] == pytest.approx(nearest_rank(values.reshape(-1), 0.5), rel=2 ** -8)
    assert run("show", path, key, "--layout", capsys=capsys)[0] == 0
    assert run("diff", path, path, capsys=capsys)[1] == "no differences\n"
    out = tmp_path / "report.html"
    assert run("report", path, "-o", out, capsys=capsys)[0] == 0
    data = report.report_data(path)
    assert {s["key"] for s in data["stats"]} == {r["key"] for r in data["tree"] if "shape" in r}


def test_report_escapes_and_keeps_an_existing_file(root, tmp_path, capsys):
    out = tmp_path / "report.html"
    status, printed, _ = run("report", root, "-o", out, capsys=capsys)
    assert status == 0 and printed.strip() == str(out)
    page = out.read_text()
    assert page.count("<script") == 2 and page.count("</script>") == 2  # the template's own two
    assert "\\u003cscript\\u003e" in page and "alert(1)" in page
    assert [n for n in os.listdir(tmp_path) if n != "report.html"] == []  # no temporary file left
    data = json.loads(page.split('id="report-data">', 1)[1].split("</script>", 1)[0])
    assert [s["step"] for s in data["steps"]] == [1, 2] and data["diff"]["a"] == 1
    assert {t["key"] for t in data["tree"]} >= {"model/<script>", "extra/note"}
    out.write_text("keep me")
    status, _, err = run("report", root, "-o", out, capsys=capsys)
    assert status == cli.EXIT_USAGE and "--overwrite" in err and out.read_text() == "keep me"
    assert run("report", root, "-o", out, "--overwrite", "--no-stats", capsys=capsys)[0] == 0
    assert "keep me" not in out.read_text()
    with pytest.raises(UsageError):
        report.report_data(str(root), report.ReportOptions(step="9"))
    status, _, err = run("report", root, "--diff", "1", "99", "-o", tmp_path / "new" / "r.html", capsys=capsys)
    assert status == cli.EXIT_USAGE and "99" in err and not (tmp_path / "new").exists()  # nothing left behind


def upload(local: str, remote: storage.Location) -> str:
    for top, _, names in os.walk(local):
        for name in names:
            relative = os.path.relpath(os.path.join(top, name), local).replace(os.sep, "/")
            with open(os.path.join(top, name), "rb") as f:
                remote.write(relative, f.read(), fsync=False)
    return str(remote)


def test_report_reads_each_array_of_the_shown_step_once(root):
    from xla_tensorstore_ckpt.tools import scans

    before = scans.WALKED.snapshot()
    expected = [s.to_json() for s in views.stats_view(str(root / "2"), bins=report.ReportOptions().bins)]
    alone = scans.WALKED.since(before)
    assert alone["arrays"] == len(expected)
    before = scans.WALKED.snapshot()
    data = report.report_data(str(root))
    # The diff reads steps 1 and 2 (the same arrays), and step 2's statistics come from its reads: each array of
    # either step is walked once, none again for the statistics.
    assert data["diff"]["a"] == 1 and data["diff"]["b"] == 2
    assert scans.WALKED.since(before) == {name: 2 * n for name, n in alone.items()}
    assert sorted(data["stats"], key=lambda s: s["key"]) == sorted(expected, key=lambda s: s["key"])


@pytest.mark.parametrize("scheme", ["gcs", "s3"])
def test_views_on_object_stores(scheme, request, dcp_dir, tmp_path, capsys):
    remote, _, _ = object_store(request, scheme, "views")
    hf = str(tmp_path / "hf")
    write_hf_dir(hf)
    for local in (GOLDEN_ORBAX, dcp_dir, hf):  # every foreign format, read remotely as locally
        there = upload(local, storage.location(f"{remote}-{os.path.basename(local)}"))
        assert [s.to_json() for s in views.stats_view(there)] == [s.to_json() for s in views.stats_view(local)]
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=None, async_save=False, save_rng=False)
    with xtc.CheckpointManager(remote, options) as manager:
        for step in (1, 2):
            manager.save(step, model=model(step))
    summary = views.stats_view(f"{remote}/2", "model/layers.1.w")
    assert summary.count == 2048 and summary.max == float(model(2)["layers"][1]["w"].max())
    assert [d.key for d in views.diff_view(f"{remote}/1", f"{remote}/2")] == ["model/layers.1.w"]
    assert views.layout_view(f"{remote}/2", "model/norm").boxes[0].nbytes == 64
    out = tmp_path / "report.html"
    assert run("report", remote, "-o", out, capsys=capsys)[0] == 0
    data = json.loads(out.read_text().split('id="report-data">', 1)[1].split("</script>", 1)[0])
    assert data["diff"]["b"] == 2 and len(data["stats"]) == 8


def test_plots_need_matplotlib_only_when_asked(root):
    from xla_tensorstore_ckpt.views import plots

    summary = views.stats_view(str(root / "2"), "model/layers.0.w")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(UsageError, match="matplotlib"):
            plots.histogram(summary)
        return
    import matplotlib

    matplotlib.use("Agg")
    assert plots.histogram(summary).axes and plots.layout(views.layout_view(str(root / "2"), "model/norm")).axes


def test_chunks_added_on_threads_give_the_same_summary(tmp_path):
    full = torch.randn(64, 48, generator=torch.Generator().manual_seed(3))
    full[:16] = 0
    xtc.save(tmp_path / "item", {"w": xtc.ShardedArray.from_tensor(full, (16, 24), xtc.ShardedArray.grid((64, 48),
                                                                                                        (16, 24)))})
    checkpoint = inspection.open_checkpoint(str(tmp_path / "item"))
    serial = histogram.array_summary(checkpoint, "w")  # 3 KiB chunks: binned on the reading thread
    with tunables.overridden(histogram_inline_bytes=0):
        parallel = histogram.array_summary(checkpoint, "w")
    whole = histogram.ValueSketch()
    whole.add(full.numpy())
    expected = histogram.summarize("w", "float32", (64, 48), whole)
    for summary in (serial, parallel):
        assert (summary.quantiles, summary.histogram, summary.count, summary.zeros, summary.min, summary.max) == (
            expected.quantiles, expected.histogram, 3072, 768, expected.min, expected.max)
        assert summary.mean == pytest.approx(expected.mean) and summary.std == pytest.approx(expected.std)


def test_sketch_adds_the_counts_of_a_slab_up_to_its_highest_bin():
    """A bincounted slab's counts end at its highest bin (positive values: below the negative ones), added to the
    sketch's first bins beside slabs whose bins reach further."""
    rng = np.random.default_rng(5)
    parts = [np.abs(rng.standard_normal(3 * sketch.SMALL)).astype(np.float32), np.full(sketch.SMALL, 1e-30, np.float32),
             rng.standard_normal(3 * sketch.SMALL).astype(np.float32)]
    whole = histogram.ValueSketch()
    for part in parts:
        whole.add(part)
    expected = np.bincount(np.concatenate(parts).view(np.uint32) >> 16, minlength=sketch.BINS)
    assert np.array_equal(whole.counts, expected)


def test_recycled_chunk_buffers_are_handed_out_again_once_given_back():
    recycled = histogram.Recycled(limit=2 * 4096)
    first = recycled.empty((32, 32), np.float32)
    again = recycled.empty((1024,), np.int32)  # the first is not given back yet: a buffer of its own
    assert not np.shares_memory(first, again)
    # page-aligned, so that a cold chunk is read straight into it (`arrays.local_reads`), not copied out of a window
    assert first.ctypes.data % buffers.PAGE == 0 and again.ctypes.data % buffers.PAGE == 0
    recycled.give(first.view(np.uint32))  # a view of it gives it back
    reused = recycled.empty((16, 64), np.float32)
    assert np.shares_memory(first, reused) and reused.shape == (16, 64)
    recycled.give(np.empty(1024, np.float32))  # not one of its own: left alone
    third = recycled.empty((1024,), np.float32)
    assert not recycled.free and not any(np.shares_memory(third, b) for b in (first, again))
    for given, kept in ((reused, 0), (again, 1), (third, 2)):  # the limit counts the buffers handed out first
        recycled.give(given)
        assert len(recycled.free) == kept and recycled.kept == kept * 4096
    assert np.shares_memory(recycled.empty((4096,), np.uint8), third)  # the most recently given


def test_summaries_of_arrays_read_into_recycled_buffers_are_each_their_own(tmp_path):
    """Arrays of one chunk size in a row: their chunks reuse the buffers of the arrays before them, each only once
    binned (a buffer handed out again while its chunk waited to be binned would mix two arrays' values)."""
    g = torch.Generator().manual_seed(6)
    state = {f"w{i}": torch.randn(64, 48, generator=g) * (i + 1) + i for i in range(6)}
    xtc.save(tmp_path / "item", {k: xtc.ShardedArray.from_tensor(v, (16, 24), xtc.ShardedArray.grid((64, 48), (16, 24)))
                                 for k, v in state.items()})
    checkpoint = inspection.open_checkpoint(str(tmp_path / "item"))
    arrays = [(inspection.split_key(r.key, checkpoint)[0], r.meta, r.key) for r in inspection.tree_rows(checkpoint)
              if r.meta is not None]
    with tunables.overridden(histogram_inline_bytes=0):
        summaries = list(histogram.summaries(checkpoint, arrays, max_bytes=4 * 16 * 24 * 4))
    assert [s.key for s in summaries] == sorted(state)
    for summary in summaries:
        whole = histogram.ValueSketch()
        whole.add(state[summary.key].numpy())
        expected = histogram.summarize(summary.key, "float32", (64, 48), whole)
        assert (summary.quantiles, summary.histogram, summary.min, summary.max) == (
            expected.quantiles, expected.histogram, expected.min, expected.max)
        assert summary.mean == pytest.approx(expected.mean) and summary.std == pytest.approx(expected.std)
