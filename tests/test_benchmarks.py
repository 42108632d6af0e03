"""The benchmark harness (benchmarks/harness.py) runs a case end to end and writes a schema-valid result set, and
the document generator (benchmarks/report.py) rewrites a marked block deterministically. In-process, tiny; the
command line and the case modules' imports in a subprocess each."""

import json
import os
import subprocess
import sys

import pytest
from xla_stack import HAS_TORCH_XLA

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import cases  # noqa: E402
import harness  # noqa: E402
import report  # noqa: E402

# Imports every case's module in one fresh process (several set up torch_xla's SPMD mode when imported) and
# answers, per case, None or why it did not import.
IMPORT_EVERY_CASE = r"""
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
import cases
answers = {}
for case in cases.CASES.values():
    try:
        module = importlib.import_module(case.module)
        answers[case.name] = None if callable(getattr(module, case.function, None)) else ["no function", case.function]
    except ImportError as exc:
        answers[case.name] = [type(exc).__name__, exc.name, str(exc)]
print(json.dumps(answers))
"""


def test_the_command_line_lists_every_registered_case_once():
    listed = subprocess.run([sys.executable, "-m", "benchmarks", "--list"], cwd=ROOT, capture_output=True, text=True,
                            check=True, timeout=120).stdout
    names = [line.split()[0] for line in listed.splitlines() if line and not line[0].isspace()]
    assert names == list(cases.CASES)
    assert len(names) >= 25 and len(set(names)) == len(names)
    for case in cases.CASES.values():
        assert f"{case.name:22} {case.about}" in listed


def test_every_case_module_imports_and_has_its_function():
    proc = subprocess.run([sys.executable, "-c", IMPORT_EVERY_CASE, os.path.join(ROOT, "benchmarks")],
                          env={**os.environ, **harness.WORKER_ENV}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(answers) == set(cases.CASES)
    # On the stack without torch_xla, a module that needs it may fail only for that reason.
    failed = {name: why for name, why in answers.items()
              if why is not None and (HAS_TORCH_XLA or why[:2] != ["ModuleNotFoundError", "torch_xla"])}
    assert failed == {}


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


def test_a_run_replaces_the_committed_result_set_only_with_the_case_defaults():
    side = cases.CASES["side-by-side"]
    gcs = harness.settings_for(side, options={"storage": "gcs"})
    assert harness.is_reference(side, gcs)  # the storage only names the result set
    assert harness.output_path(side, gcs) == os.path.join(harness.RESULTS, "gcs.json")
    for other in (harness.settings_for(side, options={"storage": "gcs", "resumes": "1"}),
                  harness.settings_for(side, quick=True), harness.settings_for(side, repeats=1)):
        assert not harness.is_reference(side, other)
        assert not harness.output_path(side, other).startswith(harness.RESULTS)
    placed = harness.Settings(1, 1.0, output="/somewhere/gcs.json")
    assert placed.beside(".png") == "/somewhere/gcs.png" and placed.beside("-scale.json") == "/somewhere/gcs-scale.json"


def test_a_marked_block_shows_the_rows_plain_values_after_the_metrics():
    def load(name: str) -> dict:
        rows = [harness.Row("xtc", {"save_s": harness.series([1.0, 2.0])}, "large",
                            {"fsync": True, "save_s_x_base": 2.0794, "files": 30}),
                harness.Row("torch_xla", {"save_s": harness.series([3.0])}, "large", {"fsync": False})]
        return harness.document(harness.Case(name, "unused", ""), harness.Settings(2, 1.0), harness.Result(rows))

    text = report.rewrite("<!-- bench:table demo params=fsync,save_s_x_base,files -->\n<!-- /bench:table -->\n", load)
    assert "| xtc | 1.500 ± 0.500 s | yes | 2.08 | 30 |\n| torch_xla | 3.000 s | no | – | – |\n" in text


def test_docs_performance_tables_are_those_its_results_json_generate():
    with open(report.DOC) as f:
        text = f.read()
    assert text.count("<!-- bench:table ") >= 3
    assert report.rewrite(text) == text  # `python -m benchmarks.report` was run after the JSON last changed


def test_committed_result_sets_of_the_schema_are_valid_and_their_text_is_their_rendering():
    docs = {}
    for name in sorted(os.listdir(harness.RESULTS)):
        if name.endswith(".json"):
            with open(os.path.join(harness.RESULTS, name)) as f:
                doc = json.load(f)
            if isinstance(doc, dict) and doc.get("schema") == harness.SCHEMA:
                docs[name] = doc
    assert {"incremental.json", "warm-restart.json"} <= set(docs)  # converted from the scripts' own JSON
    for name, doc in docs.items():
        harness.validate(doc)
        with open(os.path.join(harness.RESULTS, name.removesuffix(".json") + ".txt")) as f:
            assert f.read() == harness.render(doc), name


def test_only_the_harness_parses_a_command_line():
    benchmarks = os.path.join(ROOT, "benchmarks")
    parsing = []
    for name in sorted(os.listdir(benchmarks)):
        if name.endswith(".py"):
            with open(os.path.join(benchmarks, name)) as f:
                if "argparse" in f.read():
                    parsing.append(name)
    assert parsing == ["harness.py"]
