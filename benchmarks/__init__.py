"""The benchmarks, run by one harness (benchmarks/harness.py):

    python -m benchmarks --list                       # the cases and their options
    python -m benchmarks NAME [--repeats N] [--scale S] [--quick] [--set KEY=VALUE ...] [--output FILE]
    python -m benchmarks --all                        # every case `make bench` runs
    python -m benchmarks.report [--check]             # docs/performance.md's generated tables from the JSON

A reference run (the case's default repeats and scale, no --quick, no --set) writes benchmarks/results/NAME.json
and NAME.txt; any other run writes to the temporary directory (or --output) and says where.

Adding a benchmark (the whole API; see harness.py for the details):

1. A module ``bench_NAME.py`` with ``run(settings: harness.Settings) -> harness.Result``. `settings` carries
   ``repeats``, ``scale``, ``quick``, ``workdir`` (a temporary directory), ``output`` (the result set's JSON;
   ``beside(".png")`` names another file of the set) and ``option(key, default)`` for the case's own ``--set``
   keys. A case whose raw measurements another case reuses (side-by-side runs several) keeps them in
   ``measure(settings) -> dict``, and ``run`` summarises that.
2. Measure in fresh processes: ``harness.fresh(__file__, *args)`` runs this script's ``worker(*args)`` (strings)
   in a new process and returns its JSON answer; end the module with ``harness.worker_main(worker)``.
   Alternate contenders with ``harness.alternated(contenders, settings.repeats, run_one)`` (ABBA; returns each
   contender's answers), or order them yourself with ``harness.alternate``. In the worker, measure a call with
   ``footprint.measure(fn)`` (wall, CPU user/system, fresh memory, bytes read and written).
3. Summarise: ``harness.footprint_row(label, answers, nbytes, group=...)`` (the footprint columns, per byte of
   state when `nbytes` is given) or ``harness.Row(label, {"metric": harness.series(values, unit)}, group, params)``;
   ``harness.median`` and ``harness.spread`` for prose. Return ``harness.Result(rows, text, raw, files)``.
4. One line in benchmarks/cases.py: ``Case("NAME", "bench_NAME", "what it measures", repeats=7, quick_repeats=1,
   quick_scale=0.1, options={...}, quick_options={...})``.
5. To put a table in docs/performance.md, mark a block (benchmarks/report.py) and run ``python -m benchmarks.report``.

Modules import each other by plain name (``import harness``, ``import footprint``): the workers run as scripts from
this directory, and ``python -m benchmarks`` puts it on the import path.
"""
