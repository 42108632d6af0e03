"""The benchmark harness (benchmarks/harness.py) runs a case end to end and writes a schema-valid result set, and
the document generator (benchmarks/report.py) rewrites a marked block deterministically. In-process, tiny."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import harness  # noqa: E402
import report  # noqa: E402


def test_a_quick_case_runs_end_to_end_and_writes_a_schema_valid_result_set(tmp_path, capsys):
    output = tmp_path / "hashes.json"
    assert harness.main(["chunk-hashes", "--quick", "--scale", "0.01", "--repeats", "2",
                         "--output", str(output)]) == 0
    doc = json.loads(output.read_text())
    harness.validate(doc)
    assert doc["case"] == "chunk-hashes" and doc["settings"]["repeats"] == 2 and doc["settings"]["quick"]
    crc = next(r for r in doc["rows"] if r["label"].startswith("crc32c"))
    assert crc["metrics"]["cpu_s"]["n"] == 2 and len(crc["metrics"]["cpu_s"]["runs"]) == 2
    assert (tmp_path / "hashes.txt").read_text() == harness.render(doc)
    assert sorted(os.listdir(tmp_path)) == ["hashes.json", "hashes.txt"]  # no temporary names left behind


def test_the_harness_refuses_an_invalid_document_and_an_unknown_option():
    import cases

    with pytest.raises(ValueError, match="unknown|no option zzz"):
        harness.settings_for(cases.CASES["chunk-hashes"], options={"zzz": "1"})
    doc = harness.document(cases.CASES["chunk-hashes"], harness.Settings(1, 1.0),
                           harness.Result([harness.Row("a", {"x_s": harness.series([1.0, 3.0])})]))
    harness.validate(doc)
    doc["rows"][0]["metrics"]["x_s"]["n"] = 5
    with pytest.raises(ValueError, match="is not a series"):
        harness.validate(doc)


def _fake_result(name: str) -> dict:
    case = harness.Case(name, "unused", "a test case")
    rows = [harness.Row("xtc", {"wall_s": harness.series([1.0, 2.0, 4.0]), "read_bytes": harness.series([1.0], "B/B")},
                        "large"),
            harness.Row("dcp", {"wall_s": harness.series([3.0, 3.5, 5.0])}, "large"),
            harness.Row("xtc", {"wall_s": harness.series([9.0])}, "model")]
    doc = harness.document(case, harness.Settings(3, 1.0), harness.Result(rows))
    return dict(doc, time="2026-01-02T03:04:05")


def test_the_doc_generator_rewrites_a_marked_block_deterministically():
    text = ("# Title\nprose before\n<!-- bench:table demo group=large metrics=wall_s,read_bytes -->\nstale\n"
            "<!-- /bench:table -->\nprose after\n<!-- bench:table demo labels=xtc -->\n<!-- /bench:table -->\n")
    once = report.rewrite(text, _fake_result)
    assert once == report.rewrite(text, _fake_result) == report.rewrite(once, _fake_result)
    assert once.startswith("# Title\nprose before\n<!-- bench:table demo group=large metrics=wall_s,read_bytes -->\n"
                           "|  | wall_s | read_bytes |\n|---|---|---|\n"
                           "| xtc | 2.000 ± 1.500 s | 1.00 B/B |\n| dcp | 3.500 ± 1.000 s | – |\n")
    assert "stale" not in once and "prose after\n" in once
    assert "| group |  | wall_s | read_bytes |" in once and "| model | xtc | 9.000 s | – |" in once
    assert "from benchmarks/results/demo.json (2026-01-02, 3 rounds, scale 1;" in once
    with pytest.raises(ValueError, match="unknown argument"):
        report.rewrite("<!-- bench:table demo colour=red -->\n<!-- /bench:table -->\n", _fake_result)
