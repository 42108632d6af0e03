"""The benchmark harness: one command line, the statistics, the footprint columns and one results schema for every
case registered in benchmarks/cases.py (the API is summarised in benchmarks/__init__.py).

A case is a function ``run(settings: Settings) -> Result``. It measures in fresh processes (`fresh` runs a
script's ``--worker`` entry and reads its JSON answer; `alternate` orders the runs ABBA), summarises each
measured series with `series` (median, spread, min, max, runs) or each list of `footprint.measure` answers with
`footprint_metrics`, and returns `Row`s plus its own prose (`Result.text`) and whatever else it measured
(`Result.raw`). The harness writes one JSON document (`SCHEMA`, checked by `validate`) and one text file per
result set: benchmarks/results/NAME.{json,txt} for a reference run (the case's default repeats and scale, no
--quick, no --set), a file in the temporary directory for any other, so that committed reference results are
never replaced by a scaled or partial run. Plain standard library (the workers import footprint/fresh_process only).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
SCHEMA = "xtc-bench/1"
WORKER_ENV = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "TF_CPP_MIN_LOG_LEVEL": "3"}
# The footprint columns every fresh-process measurement reports (benchmarks/footprint.py).
FOOTPRINT = ("wall_s", "cpu_s", "user_s", "system_s", "fresh_bytes", "page_cache_growth_bytes", "read_bytes",
             "written_bytes")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one run of a case was asked for: `repeats` (rounds, each contender once per round), `scale` (of the
    workloads), `quick` (the case's smoke-test settings), `options` (``--set KEY=VALUE``, case-specific), and
    `workdir`, a temporary directory the harness removes afterwards, and `output`, the result set's JSON path
    (empty when the caller writes no file)."""

    repeats: int
    scale: float
    quick: bool = False
    options: Mapping[str, str] = dataclasses.field(default_factory=dict)
    workdir: str = ""
    output: str = ""

    def beside(self, suffix: str) -> str:
        """A path for another file of this result set (a plot: ``.png``), beside its JSON; in the temporary
        directory when there is no `output`."""
        stem = os.path.splitext(self.output)[0] if self.output else os.path.join(tempfile.gettempdir(), "xtc-bench")
        return stem + suffix

    def option(self, name: str, default: Any) -> Any:
        """The value of ``--set NAME=...`` converted to the type of `default` (a tuple: comma-separated), or
        `default`."""
        if name not in self.options:
            return default
        value = self.options[name]
        if isinstance(default, tuple):
            return tuple(v for v in value.split(",") if v)
        if isinstance(default, bool):
            return value.lower() in ("1", "true", "yes", "on")
        return type(default)(value) if default is not None else value


@dataclasses.dataclass(frozen=True)
class Case:
    """A registered benchmark: `name` (the command line's NAME), `module` and `function` (imported only when the
    case runs: many import torch_xla), `about` (one line for --list), the defaults of a reference run and of
    --quick, `options` (the ``--set`` keys it knows, with their defaults, for --list and checking), `output` (the
    result set's name when it is not `name`: a function of the settings, e.g. the storage), `reference_options`
    (the ``--set`` keys a reference run may give: those that only choose which result set it writes, e.g. the
    storage), and `in_make_bench` (false for cases `make bench` leaves out, e.g. those that need a second
    environment)."""

    name: str
    module: str
    about: str
    function: str = "run"
    repeats: int = 7
    scale: float = 1.0
    quick_repeats: int = 1
    quick_scale: float = 0.1
    quick_options: Mapping[str, str] = dataclasses.field(default_factory=dict)
    options: Mapping[str, str] = dataclasses.field(default_factory=dict)
    output: Callable[[Settings], str] | None = None
    reference_options: tuple[str, ...] = ()
    in_make_bench: bool = True

    def result_name(self, settings: Settings) -> str:
        return self.output(settings) if self.output else self.name


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of a result set's table: `label` (the contender or configuration), `group` (the workload or
    section it belongs to), `params` (plain values that describe it) and `metrics` (name -> `series`)."""

    label: str
    metrics: Mapping[str, Mapping[str, Any]]
    group: str = ""
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Result:
    """What a case returns: its `rows`, its own prose (`text`: ratios, floors, notes), anything else it measured
    (`raw`, JSON-able), and the other files it wrote (`files`, e.g. plots)."""

    rows: Sequence[Row]
    text: str = ""
    raw: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    files: Sequence[str] = ()


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def spread(values: Iterable[float]) -> float:
    """Half the range of `values`: what the tables print after the median as ``±``."""
    values = list(values)
    return (max(values) - min(values)) / 2 if values else float("nan")


def series(values: Iterable[float], unit: str = "") -> dict:
    """The summary the schema stores for one measured quantity: median, spread (half the range), min, max, n and
    the runs themselves, in `unit` (``s``, ``B``, ``B/B``, ...; empty: inferred from the name by `render`)."""
    runs = [float(v) for v in values]
    return {"median": median(runs), "spread": spread(runs), "min": min(runs, default=float("nan")),
            "max": max(runs, default=float("nan")), "n": len(runs), "runs": runs, "unit": unit}


def footprint_metrics(measured: Sequence[Mapping[str, float]], nbytes: int | None = None,
                      keys: Sequence[str] = FOOTPRINT) -> dict:
    """The footprint columns of `footprint.measure` answers as series: wall, CPU (user + system), fresh memory,
    bytes read and written; with `nbytes` (the state's size) the byte columns are per byte of state (``B/B``).
    Keys an answer lacks are left out."""
    out = {}
    for key in keys:
        if key == "cpu_s":
            if all("user_s" in m for m in measured):
                out[key] = series((m["user_s"] + m["system_s"] for m in measured), "s")
            continue
        if not measured or any(key not in m for m in measured):
            continue
        if key.endswith("_bytes") and nbytes:
            out[key] = series((m[key] / nbytes for m in measured), "B/B")
        else:
            out[key] = series((m[key] for m in measured), "s" if key.endswith("_s") else "B")
    return out


def footprint_medians(measured: Sequence[Mapping[str, float]], nbytes: int) -> dict:
    """Medians of `footprint.measure` answers as plain numbers, for prose: wall, CPU (user + system, and each),
    fresh memory, resident and page cache growth, bytes read and written, those per byte of state."""
    def med(key: str) -> float:
        return median(m[key] for m in measured)

    return {"wall_s": med("wall_s"), "cpu_s": median(m["user_s"] + m["system_s"] for m in measured),
            "user_s": med("user_s"), "system_s": med("system_s"), "fresh_per_byte": med("fresh_bytes") / nbytes,
            "rss_growth_per_byte": med("rss_growth_bytes") / nbytes,
            "page_cache_per_byte": med("page_cache_growth_bytes") / nbytes, "read_per_byte": med("read_bytes") / nbytes,
            "written_per_byte": med("written_bytes") / nbytes}


def footprint_row(label: str, measured: Sequence[Mapping[str, float]], nbytes: int | None = None, *,
                  group: str = "", **params: Any) -> Row:
    """A `Row` of `footprint_metrics`."""
    return Row(label, footprint_metrics(measured, nbytes), group, params)


def alternate(contenders: Sequence[str], rounds: int) -> list[str]:
    """ABBA order (benchmarks/fresh_process.abba): forwards in even rounds, backwards in odd ones."""
    import fresh_process

    return fresh_process.abba(list(contenders), rounds)


def alternated(contenders: Sequence[str], rounds: int, run_one: Callable[[str, int], Any]) -> dict[str, list]:
    """Call ``run_one(contender, round)`` for `rounds` rounds of every contender in ABBA order (each call
    typically one fresh process: `fresh`); returns each contender's answers in the order they ran."""
    runs: dict[str, list] = {c: [] for c in contenders}
    for i, contender in enumerate(alternate(contenders, rounds)):
        runs[contender].append(run_one(contender, i // len(contenders)))
    return runs


def fresh(script: str, *args: object, env: Mapping[str, str] | None = None, what: str = "",
          python: str | None = None) -> dict:
    """Run ``python SCRIPT --worker ARGS...`` in a fresh process (environment: this one's, `WORKER_ENV`, `env`;
    `python`: another environment's interpreter, default this one's) and return its JSON answer (the last line
    of its output; `worker_main` prints it). Blocks; raises RuntimeError naming `what` with the end of its
    stderr if it fails."""
    import fresh_process

    full = {**os.environ, **WORKER_ENV, **(env or {})}
    return fresh_process.run_json([python or sys.executable, os.path.abspath(script), "--worker", *map(str, args)],
                                  full, what or f"{os.path.basename(script)} {' '.join(map(str, args))}")


def worker_main(worker: Callable[..., Any] | None = None, case: str | None = None) -> None:
    """A script's ``__main__``: with ``--worker ARGS...`` call ``worker(*ARGS)`` (strings) and print its answer as
    one JSON line (for `fresh`); otherwise run the script's case like ``python -m benchmarks NAME``: `case`, or
    the script's name without ``bench_`` and with ``-`` for ``_``. Exits with the harness's status."""
    if sys.argv[1:2] == ["--worker"] and worker is not None:
        print(json.dumps(worker(*sys.argv[2:])), flush=True)
        return
    name = case or os.path.splitext(os.path.basename(sys.argv[0]))[0].removeprefix("bench_").replace("_", "-")
    sys.exit(main([name, *sys.argv[1:]]))


def settings_for(case: Case, *, repeats: int | None = None, scale: float | None = None, quick: bool = False,
                 options: Mapping[str, str] | None = None, workdir: str = "") -> Settings:
    """The settings of one run: explicit values win over --quick's, which win over the case's defaults. Raises
    ValueError naming an option the case does not know."""
    given = dict(options or {})
    unknown = sorted(set(given) - set(case.options))
    if unknown:
        raise ValueError(f"{case.name} has no option {', '.join(unknown)} (it knows: "
                         f"{', '.join(sorted(case.options)) or 'none'})")
    merged = {**(case.quick_options if quick else {}), **given}
    return Settings(repeats if repeats is not None else (case.quick_repeats if quick else case.repeats),
                    scale if scale is not None else (case.quick_scale if quick else case.scale), quick, merged,
                    workdir)


def is_reference(case: Case, settings: Settings) -> bool:
    """Whether a run may replace the committed results: the case's defaults, not quick, no options but its
    `reference_options`."""
    return (not settings.quick and not set(settings.options) - set(case.reference_options)
            and settings.repeats == case.repeats and settings.scale == case.scale)


def run_case(case: Case, settings: Settings) -> dict:
    """Run `case` (blocks) in a temporary working directory and return its results document."""
    import importlib

    fn = getattr(importlib.import_module(case.module), case.function)
    with tempfile.TemporaryDirectory(prefix=f"xtc-bench-{case.name}-", dir=os.environ.get("XTC_BENCH_DIR")) as wd:
        result = fn(dataclasses.replace(settings, workdir=wd))
    return document(case, settings, result)


def document(case: Case, settings: Settings, result: Result) -> dict:
    """The results document of `result` (`SCHEMA`): what ran, on what, when, the rows, the prose and the raw
    measurements."""
    return {"schema": SCHEMA, "case": case.name, "result_set": case.result_name(settings),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "settings": {"repeats": settings.repeats, "scale": settings.scale, "quick": settings.quick,
                         "options": dict(settings.options)},
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "system": platform.system()},
            "rows": [dataclasses.asdict(row) for row in result.rows], "text": result.text,
            "raw": _jsonable(result.raw), "files": [os.path.relpath(f, HERE) if f.startswith(HERE) else f
                                                    for f in result.files]}


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


_SERIES_KEYS = {"median", "spread", "min", "max", "n", "runs", "unit"}


def validate(doc: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first way `doc` is not a results document of `SCHEMA`."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"results document of {doc.get('case', '?')!r}: {what}")

    need(doc.get("schema") == SCHEMA, f"schema is {doc.get('schema')!r}, not {SCHEMA!r}")
    for key, kind in (("case", str), ("result_set", str), ("time", str), ("settings", dict), ("rows", list),
                      ("text", str), ("raw", dict), ("files", list), ("machine", dict)):
        need(isinstance(doc.get(key), kind), f"{key} is not a {kind.__name__}")
    need({"repeats", "scale", "quick", "options"} <= set(doc["settings"]), "settings lack a key")
    for i, row in enumerate(doc["rows"]):
        need(isinstance(row, dict) and isinstance(row.get("label"), str) and isinstance(row.get("group"), str)
             and isinstance(row.get("params"), dict) and isinstance(row.get("metrics"), dict),
             f"row {i} lacks label, group, params or metrics")
        for name, stat in row["metrics"].items():
            need(isinstance(stat, dict) and set(stat) == _SERIES_KEYS and stat["n"] == len(stat["runs"]),
                 f"row {i} metric {name!r} is not a series")


def _unit(name: str, stat: Mapping[str, Any]) -> str:
    return stat.get("unit") or ("s" if name.endswith("_s") else "B" if name.endswith("_bytes") else "")


def cell(name: str, stat: Mapping[str, Any], *, with_spread: bool = True) -> str:
    """A metric as text: ``1.234 ± 0.050 s``; bytes in GiB/MiB; one run without the spread."""
    if stat["median"] is None:
        return "-"
    unit, value, spread_ = _unit(name, stat), stat["median"], stat["spread"]
    if unit == "B":
        scale_, unit = (2**30, "GiB") if value >= 2**30 else (2**20, "MiB")
        value, spread_ = value / scale_, (spread_ or 0) / scale_
    digits = 3 if unit == "s" else 2
    text = f"{value:.{digits}f}"
    if with_spread and stat["n"] > 1 and spread_ is not None:
        text += f" ± {spread_:.{digits}f}"
    return f"{text} {unit}".rstrip()


def render(doc: Mapping[str, Any]) -> str:
    """The text of a results document: a header, each group's rows as an aligned table (median ± half the range
    of each metric), then the case's own prose."""
    s = doc["settings"]
    lines = [f"{doc['result_set']}: {doc['time']}, repeats {s['repeats']}, scale {s['scale']:g}"
             + (", quick" if s["quick"] else "") + "".join(f", {k}={v}" for k, v in s["options"].items())]
    for group in dict.fromkeys(r["group"] for r in doc["rows"]):
        rows = [r for r in doc["rows"] if r["group"] == group]
        names = list(dict.fromkeys(m for r in rows for m in r["metrics"]))
        table = [["", *names]] + [[r["label"], *(cell(m, r["metrics"][m]) if m in r["metrics"] else "-"
                                                 for m in names)] for r in rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
        lines += ["", group] if group else [""]
        lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                  for line in table]
    if doc["text"]:
        lines += ["", doc["text"].rstrip()]
    return "\n".join(lines) + "\n"


def write(doc: Mapping[str, Any], path: str) -> list[str]:
    """Write `doc` as JSON at `path` and its text beside it (``.txt``), each under a temporary name swapped in
    at the end; returns the two paths. Raises ValueError if `doc` is not schema-valid."""
    validate(doc)
    stem = os.path.splitext(path)[0]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    written = []
    for target, content in ((stem + ".json", json.dumps(doc, indent=1) + "\n"), (stem + ".txt", render(doc))):
        temporary = target + ".tmp"
        with open(temporary, "w") as f:
            f.write(content)
        os.replace(temporary, target)
        written.append(target)
    return written


def output_path(case: Case, settings: Settings, output: str | None = None) -> str:
    """Where a run's JSON goes: `output`, else benchmarks/results/NAME.json for a reference run, else a file in
    the temporary directory."""
    if output:
        return output
    name = case.result_name(settings)
    if is_reference(case, settings):
        return os.path.join(RESULTS, name + ".json")
    return os.path.join(tempfile.gettempdir(), f"xtc-bench-{name}-{'quick' if settings.quick else 'partial'}.json")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks``: run one case (or --list them, or --all of `make bench`'s); returns the exit
    status."""
    import argparse

    import cases

    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", nargs="?", help="a case (--list shows them)")
    parser.add_argument("--list", action="store_true", help="the registered cases and their options")
    parser.add_argument("--all", action="store_true", help="every case `make bench` runs, one after the other")
    parser.add_argument("--repeats", type=int, help="rounds (default: the case's; at least 7 for a reference)")
    parser.add_argument("--scale", type=float, help="workload scale (default: the case's, 1.0 mostly)")
    parser.add_argument("--quick", action="store_true", help="the case's smoke-test settings (seconds to minutes)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a case-specific option")
    parser.add_argument("--output", help="the JSON file to write (default: see harness.output_path)")
    args = parser.parse_args(argv)
    if args.list:
        for case in cases.CASES.values():
            opts = ", ".join(f"{k}={v}" for k, v in case.options.items())
            print(f"{case.name:22} {case.about}" + (f"\n{'':22}   --set {opts}" if opts else ""))
        return 0
    names = [c.name for c in cases.CASES.values() if c.in_make_bench] if args.all else [args.name]
    if names == [None] or (args.all and args.output):
        parser.error("give one case NAME (or --list, or --all without --output)")
    if names[0] not in cases.CASES:
        parser.error(f"no case {names[0]!r}; --list shows the {len(cases.CASES)} cases")
    options = dict(item.partition("=")[::2] for item in args.set)
    for name in names:
        case = cases.CASES[name]
        try:
            settings = settings_for(case, repeats=args.repeats, scale=args.scale, quick=args.quick, options=options)
        except ValueError as exc:  # an option the case does not know: a usage error, not a failure
            parser.error(str(exc))
        settings = dataclasses.replace(settings, output=output_path(case, settings, args.output))
        print(f"running {name} (repeats {settings.repeats}, scale {settings.scale:g}"
              f"{', quick' if settings.quick else ''}) ...", file=sys.stderr, flush=True)
        doc = run_case(case, settings)
        written = write(doc, settings.output)
        print(render(doc))
        print("written " + ", ".join([*written, *doc["files"]]), file=sys.stderr)
    return 0

