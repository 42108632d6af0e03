"""The command-line side of the views: ``xtckpt show --layout``, ``stats`` (quantiles, sparsity, histograms),
``diff`` (per tensor and per layer) and ``report``; their arguments and what they print. Registered by `cli`;
each command blocks and returns the exit status; errors propagate to `cli.main` (one line)."""

from __future__ import annotations

import argparse

from ..core.errors import UsageError
from ..tools import inspection
from ..tools.cli_text import add_target_arguments, human_bytes, parse_size, print_json, progress_bar
from . import diff as diff_view
from . import histogram, layout, report, text


def add_show_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", action="store_true", help="draw the stored chunk grid (two largest dimensions) with "
                   "the devices that held each chunk and its bytes, from metadata alone; with the restore target "
                   "arguments of `xtckpt plan` (--mesh, --spec, --processes, --target), the shards each process "
                   "would read on that restore, as `xtckpt plan` plans it")
    add_target_arguments(p)


def show_layout(args: argparse.Namespace) -> int:
    checkpoint = inspection.open_checkpoint(args.path)
    target = inspection.RestoreTarget.of(args)
    if target == inspection.RestoreTarget():
        view = layout.saved_layout(checkpoint, args.key)
        plans = ()
    else:
        view, plans = layout.restore_layout(checkpoint, args.key, target)
    if args.json:
        print_json({**view.to_json(), "plans": [{"process": i, **p.to_json()} for i, p in enumerate(plans)]})
        return 0
    print(text.draw_layout(view))
    for process, plan in enumerate(plans):
        state = plan.problem or ("lossy cast" if plan.lossy_cast else "ok")
        print(f"process {process}: reads {human_bytes(plan.read_bytes)} in {plan.chunks} stored chunks ({state})")
    return 0


def add_stats_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--histogram", choices=("linear", "log"), help="draw each array's value histogram: equal bins of "
                   "the value, or of log10 |value| (zeros counted apart)")
    p.add_argument("--bins", type=int, default=20, help="histogram bins (default 20)")
    p.add_argument("--max-host-bytes", type=parse_size, default=histogram.DEFAULT_MAX_BYTES,
                   help="chunks in flight at most (default 64MiB; one chunk if larger)")


def stats(args: argparse.Namespace) -> int:
    budget = args.max_host_bytes
    if not 1 <= args.bins <= 1000:
        raise UsageError(f"--bins {args.bins}: between 1 and 1000")
    checkpoint = inspection.open_checkpoint(args.path)
    arrays = ([inspection.array_metadata(checkpoint, k) + (k,) for k in args.keys] if args.keys else
              [(inspection.split_key(r.key, checkpoint)[0], r.meta, r.key) for r in inspection.tree_rows(checkpoint)
               if r.meta is not None])
    draw = progress_bar("stats")
    summaries = []
    for summary in histogram.summaries(checkpoint, arrays, bins=args.bins, scale=args.histogram or "linear",
                                       max_bytes=budget):
        summaries.append(summary)
        if draw:
            draw(len(summaries), len(arrays))
    if args.json:
        print_json([s.to_json() for s in summaries])
        return 0
    print(text.stats_table(summaries))
    if args.histogram:
        for s in summaries:
            print(f"\n{s.key}: {s.dtype}{list(s.shape)}, {args.histogram} histogram")
            print(text.draw_histogram(s.histogram))
    print(f"quantiles: nearest rank; values within {100 * histogram.RELATIVE_ERROR:.2f}% (relative; below 1.2e-38, "
          "within 9.2e-41), exact for bfloat16/8-bit types")
    return 0


def add_diff_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sort", choices=diff_view.SORTS, default="key", help="order: by key (default), by relative "
                   "change (largest first), or grouped by layer")
    p.add_argument("--key-map", metavar="JSON|FILE", help="rename A's keys to B's names before comparing: a JSON "
                   "object (or a file holding one), e.g. '{\"params.*\": \"model/*\"}'; null drops a key")
    p.add_argument("--all", action="store_true", help="list equal arrays and values too")


def diff(args: argparse.Namespace) -> int:
    a, b = inspection.open_checkpoint(args.a), inspection.open_checkpoint(args.b)
    diffs = diff_view.diff_tensors(a, b, key_map=args.key_map, sort=args.sort, include_equal=args.all,
                                   progress=progress_bar("diff"))
    if args.json:
        print_json([d.to_json() for d in diffs])
        return 0
    if not diffs:
        print("no differences")
        return 0
    print(text.diff_table(diffs, group=args.sort == "layer"))
    return 0


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="ROOT (every step), ROOT/STEP or an item directory (or a Hugging Face file or "
                   "directory)")
    p.add_argument("-o", "--out", required=True, help="the HTML file to write")
    p.add_argument("--diff", nargs=2, metavar=("STEP_A", "STEP_B"), help="the two steps of ROOT to compare "
                   "(default: the last two)")
    p.add_argument("--step", help="the step of ROOT whose tree, layouts and statistics are shown (default: latest)")
    p.add_argument("--no-stats", action="store_true", help="metadata only: no statistics, histograms or diff")
    p.add_argument("--max-arrays", type=int, default=report.DEFAULT_MAX_STAT_ARRAYS,
                   help=f"statistics for at most this many arrays, the largest (default "
                   f"{report.DEFAULT_MAX_STAT_ARRAYS})")
    p.add_argument("--overwrite", action="store_true", help="replace an existing file")


def report_command(args: argparse.Namespace) -> int:
    options = report.ReportOptions(step=args.step, diff_steps=tuple(args.diff) if args.diff else None,
                                   stats=not args.no_stats, max_stat_arrays=args.max_arrays)
    path = report.write_report(args.path, args.out, options, overwrite=args.overwrite,
                               progress=progress_bar("report"))
    if args.json:
        print_json({"report": path})
    else:
        print(path)
    return 0
