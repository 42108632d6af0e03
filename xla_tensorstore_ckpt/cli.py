"""The offline command line, ``xtckpt`` (also ``python -m xla_tensorstore_ckpt``).

Reads checkpoints without torch_xla or the training code. Listing commands print aligned tables (``--json`` for
machine-readable output); long work shows a progress bar when stderr is a terminal. Errors are one line on
stderr: exit status 2 for a bad request (usage, unknown key, malformed slice, not a checkpoint), 1 for damaged
data (corrupt chunks, failed verification).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np

from . import storage
from .core import host_memory
from .core.errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError, UsageError
from .restores import restore_plan
from .tools import convert, export, inspection, scans
from .tools.cli_text import (
    add_target_arguments,
    human_bytes,
    metrics_text,
    parse_shape,
    parse_size,
    print_json,
    progress_bar,
    table,
    time_text,
)
from .views import commands as views

EXIT_DATA, EXIT_USAGE = 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


# ------------------------------------------------------------------------------------------------ commands


def cmd_steps(args: argparse.Namespace) -> int:
    steps = inspection.list_steps(args.root, args.local, args.processes)
    if not steps:
        raise CheckpointNotFoundError(f"{args.root} holds no checkpoint steps"
                                      + (f" and {args.local} none either" if args.local else ""))
    if args.json:
        print_json([s.to_json() for s in steps])
        return 0
    rows = [(s.step, "ignored" if s.ignored else s.status, time_text(s.committed_at), human_bytes(s.nbytes),
             s.ignored if s.ignored else _bases_text(s) + metrics_text(s.metrics) if s.status == "committed"
             else (s.problem or "no commit marker")[:80])
            for s in steps]
    if args.local is None:
        print(table(("step", "status", "committed", "size", "metrics"), rows, right=(0, 3)))
        return 0
    tiers = [s.tier if s.writer is None else f"{s.tier} (process {s.writer} of {s.process_count})" for s in steps]
    print(table(("step", "tier", "status", "committed", "size", "metrics"),
                [(row[0], tier, *row[1:]) for row, tier in zip(rows, tiers)], right=(0, 4)))
    return 0


def _bases_text(step: inspection.StepInfo) -> str:
    """An incremental step's bases (the steps holding chunks it references) and longest delta chain, and the
    steps referencing this one (which keep it), before its metrics."""
    bases = step.marker.bases if step.marker is not None else ()
    chain = step.marker.chain if step.marker is not None else 0
    text = f"references steps {', '.join(map(str, bases))}" + (f" (delta chain {chain})" if chain else "") + "  " \
        if bases else ""
    return text + (f"base of steps {', '.join(map(str, step.base_of))}  " if step.base_of else "")


def cmd_tree(args: argparse.Namespace) -> int:
    checkpoint = inspection.open_checkpoint(args.path)
    rows = inspection.tree_rows(checkpoint, args.item)
    if args.json:
        print_json([r.to_json() for r in rows])
        return 0
    lines = []
    for r in rows:
        if r.meta is None:
            lines.append((r.key, "", "value", "", "", json.dumps(r.value)))
        else:
            sharding = r.meta.sharding.describe() if r.meta.sharding else "unsharded"
            if r.meta.opaque is not None:  # bytes another tool encoded: shown, never decoded
                sharding = f"opaque ({r.meta.opaque})"
            lines.append((r.key, str(list(r.meta.shape)), r.meta.dtype, str(list(r.meta.chunk_shape)),
                          human_bytes(r.meta.nbytes), sharding))
    print(table(("key", "shape", "dtype", "chunk", "bytes", "sharding / value"), lines, right=(4,)))
    total = sum(r.meta.nbytes for r in rows if r.meta)
    print(f"{sum(1 for r in rows if r.meta)} arrays, {human_bytes(total)}; "
          f"{sum(1 for r in rows if r.meta is None)} values")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    if args.layout or args.mesh:
        return views.show_layout(args)
    checkpoint = inspection.open_checkpoint(args.path)
    key, index = inspection.parse_key_and_slice(
        args.key, lambda k: len(inspection.array_metadata(checkpoint, k)[1].shape))
    values = inspection.read_slice(checkpoint, key, index)
    if args.json:
        print_json({"key": key, "dtype": str(values.dtype), "shape": list(values.shape),
                     "values": _to_json_values(values)})
        return 0
    print(f"{key}{'[' + args.key.split('[', 1)[1] if '[' in args.key else ''}: {values.dtype} "
          f"{list(values.shape)}")
    with np.printoptions(threshold=2000, linewidth=120, edgeitems=4):
        print(values if values.dtype.kind in "biufc?" else values.astype(np.float32))
    return 0


def _to_json_values(values: np.ndarray) -> Any:
    if values.dtype.kind in "biu?":
        return values.tolist()
    if values.dtype.kind == "c":
        return [[float(v.real), float(v.imag)] for v in values.reshape(-1)]
    as_float = values.astype(np.float64)
    return [None if not math.isfinite(v) else v for v in as_float.reshape(-1).tolist()] if as_float.ndim else (
        float(as_float) if math.isfinite(float(as_float)) else None)


def cmd_verify(args: argparse.Namespace) -> int:
    report = scans.verify(args.path, progress_bar("verify"))
    if args.json:
        print_json(report.to_json())
    else:
        for p in report.problems:
            print(f"FAIL {p.where}: {p.message}")
        for note in report.notes:
            print(f"note: {note}")
        print(f"{'OK' if not report.problems else 'FAILED'}: {report.arrays} arrays checked, "
              f"{len(report.problems)} problems")
    return EXIT_DATA if report.problems else 0


def cmd_plan(args: argparse.Namespace) -> int:
    checkpoint = inspection.open_checkpoint(args.path)
    items = (args.item,) if args.item else checkpoint.items
    target = inspection.RestoreTarget.of(args)
    plans = []
    for item in items:
        if item not in checkpoint.items:
            raise UsageError(f"unknown item {item!r}; {checkpoint.location} has {', '.join(checkpoint.items)}")
        plans.extend(plan for _, plan in inspection.plan_item(checkpoint, item, target))
    if args.json:
        print_json([p.to_json() for p in plans])
    else:
        for plan in plans:
            _print_plan(plan, args.processes)
    return EXIT_DATA if any(not p.ok for p in plans) else 0


def _print_plan(plan: restore_plan.RestorePlan, processes: int) -> None:
    who = f" (process {plan.process} of {processes})" if processes > 1 else ""
    print(f"{plan.path}{who}: {plan.source}")
    rows = []
    for k in plan.keys:
        shape = k.saved_shape if k.saved_shape is not None else k.target_shape
        dtype = (k.saved_dtype if k.target_dtype in (None, k.saved_dtype) else k.target_dtype
                 if k.saved_dtype is None else f"{k.saved_dtype} -> {k.target_dtype}")
        note = k.problem or ("lossy cast" if k.lossy_cast else "")
        per_shard = f"{max(k.chunks_per_shard)}" if k.chunks_per_shard else ""
        rows.append((k.key, k.status, "" if shape is None else str(list(shape)), dtype or "value",
                     human_bytes(k.read_bytes) if k.read_bytes else "", k.chunks or "", per_shard, note))
    print(table(("key", "status", "shape", "dtype", "reads", "chunks", "max/shard", "note"), rows, right=(4, 5, 6)))
    print(f"reads {human_bytes(plan.read_bytes)} in {plan.chunks} stored chunks; host memory beyond the restored "
          f"tensors: {human_bytes(plan.peak_host_bytes)}; "
          + ("OK" if plan.ok else f"a strict restore refuses it: {len(plan.problems)} problems"))


def cmd_export(args: argparse.Namespace) -> int:
    checkpoint = inspection.open_checkpoint(args.path)
    items = tuple(args.items.split(",")) if args.items else (("model",) if "model" in checkpoint.items else
                                                             checkpoint.items)
    draw = progress_bar(args.format, in_bytes=True)
    if args.format == "safetensors":
        files = export.export_safetensors(checkpoint, items, args.out, max_file_bytes=args.max_file_size,
                                          max_host_bytes=args.max_host_bytes, overwrite=args.overwrite,
                                          progress=draw)
    else:
        files = [export.export_torch(checkpoint, items, args.out, max_host_bytes=args.max_host_bytes,
                                     overwrite=args.overwrite, progress=draw)]
    if args.json:
        print_json({"files": files})
    else:
        for f in files:
            print(f)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    if args.to in ("safetensors", "torch"):
        if args.compression is not None:  # said rather than ignored: those files are raw by their format
            raise UsageError(f"--compression applies to items and steps of ours, not to --to {args.to}")
        args.path, args.out, args.format = args.source, args.destination, args.to
        return cmd_export(args)
    source = storage.location(args.source)
    checkpoint = inspection.open_checkpoint(source)
    whole_step = checkpoint.marker is not None and args.to == "step" and args.item is None
    if checkpoint.marker is not None and not whole_step:  # a step: one of its items
        item = args.item or "model"
        if item not in checkpoint.items:
            raise UsageError(f"{source} has no item {item!r} (it holds {', '.join(checkpoint.items)}); "
                             f"choose one with --item")
        source = source.child(item)
    options = convert.ConvertOptions(max_host_bytes=args.max_host_bytes, chunk_shape=args.chunk_shape,
                                     mesh=args.mesh, use_ocdbt=not args.no_ocdbt, compression=args.compression,
                                     compression_level=args.compression_level)
    destination = storage.location(args.destination)
    draw = progress_bar("convert", in_bytes=True)
    if whole_step:  # every item, standalone (an incremental or delta step no longer needs its bases)
        convert.convert_step(source, destination, options=options, overwrite=args.overwrite, progress=draw)
    elif args.to == "step":
        convert.convert_to_step(source, destination, item=args.item or "model", options=options,
                                overwrite=args.overwrite, progress=draw)
    else:
        convert.convert_item(source, destination, options=options, overwrite=args.overwrite, progress=draw)
    if args.json:
        print_json({"destination": str(destination)})
    else:
        print(destination)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="xtckpt", description="Inspect, convert and export checkpoints offline.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(name: str, help_text: str, fn: Callable[[argparse.Namespace], int], json_flag: bool = True):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(fn=fn)
        if json_flag:
            p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    _inspection_commands(command)
    _conversion_commands(command)
    return parser


def _inspection_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    """The commands that read checkpoints: steps, tree, show, stats, diff, report, verify, plan."""
    p = command("steps", "committed steps with time, size and metrics; partial steps shown as such", cmd_steps)
    p.add_argument("root")
    p.add_argument("--local", metavar="DIR", help="also list this host's local tier (a manager's local_directory); "
                   "its steps that a manager of ROOT would ignore (another run's or writer's) are marked ignored")
    p.add_argument("--processes", type=int, metavar="N", help="with --local: the job's number of processes; local "
                   "steps written by a job of another size are marked ignored too")
    p = command("tree", "every key with shape, dtype, chunk shape, bytes, saved sharding, and JSON values",
                cmd_tree)
    p.add_argument("path", help="ROOT/STEP, or an item directory")
    p.add_argument("item", nargs="?")
    p = command("show", "values of a slice, reading only the chunks needed: KEY[0:4, :8]; or with --layout the "
                "array's chunk grid and who holds (or would read) each chunk", cmd_show)
    p.add_argument("path")
    p.add_argument("key", help="ITEM/KEY optionally followed by [slice], e.g. 'model/w[0:4, :8]'")
    views.add_show_arguments(p)
    p = command("stats", "min, max, mean, std, quantiles, sparsity, NaN and Inf counts per array and with "
                "--histogram a value histogram, chunk by chunk in bounded memory", views.stats)
    p.add_argument("path")
    p.add_argument("keys", nargs="*")
    views.add_stats_arguments(p)
    p = command("diff", "keys added/removed, shape and dtype changes, and per tensor the 2-norm of the change, its "
                "size relative to A, the share of elements that differ and the max |B-A|", views.diff)
    p.add_argument("a")
    p.add_argument("b")
    views.add_diff_arguments(p)
    views.add_report_arguments(command("report", "a self-contained HTML report: steps and sizes, the tree, layouts, "
                                       "statistics with histograms, the diff of two steps", views.report_command))
    p = command("verify", "every chunk present and every checksum valid (exit 1 otherwise)", cmd_verify)
    p.add_argument("path", help="ROOT, ROOT/STEP or an item directory")
    p = command("plan", "plan a restore without reading data: per key the bytes and chunks each process reads, "
                "and what a strict restore would refuse (exit 1)", cmd_plan)
    p.add_argument("path", help="ROOT/STEP or an item directory (or a Hugging Face file or directory)")
    p.add_argument("item", nargs="?", help="one item of a step (default: every item)")
    add_target_arguments(p)


def _conversion_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    """The commands that write: convert, export."""
    p = command("convert", "convert between formats, streaming under a host-memory budget: a Hugging Face "
                "safetensors file or directory, an item of ours or Orbax's, or one item of a step, into an item "
                "or step of ours (which Orbax restores), or into safetensors / torch files", cmd_convert)
    p.add_argument("source", help="a .safetensors file, a Hugging Face directory, an item, or ROOT/STEP")
    p.add_argument("destination", help="the new item, step (ROOT/STEP), safetensors directory or torch file")
    p.add_argument("--to", choices=("item", "step", "safetensors", "torch"), default="item",
                   help="what to write (default: item)")
    p.add_argument("--item", help="the item of a source step to convert, and the item's name in a new step "
                   "(default: model; a step converted --to step without it: every item, as a standalone step)")
    p.add_argument("--items", help="safetensors / torch: comma-separated items of a step (default: model)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--chunk-shape", type=parse_shape,
                       help="stored chunk shape of the trailing dimensions, e.g. 1024,1024")
    shape.add_argument("--mesh", type=parse_shape,
                       help="store each array in the chunks of this mesh's shards, e.g. 4x2 (dimension i cut "
                       "into mesh[i] chunks)")
    p.add_argument("--max-host-bytes", type=parse_size, default=convert.DEFAULT_MAX_HOST_BYTES,
                   help="host memory for data in flight (default 2GiB)")
    p.add_argument("--max-file-size", type=parse_size, default=parse_size("5GB"),
                   help="safetensors: largest file, e.g. 5GB (default), 500MiB")
    p.add_argument("--no-ocdbt", action="store_true", help="one zarr directory per array instead of OCDBT")
    p.add_argument("--compression", choices=("zstd",), help="compress every chunk (Orbax's zstd codec; default: raw)")
    p.add_argument("--compression-level", type=int, default=3, help="zstd's level, 1-22 (default 3)")
    p.add_argument("--overwrite", action="store_true", help="replace what the destination holds (the new output is "
                   "complete before the old one is removed)")
    p = command("export", "a consolidated single-host copy (safetensors or torch): convert --to FORMAT",
                cmd_export)
    p.add_argument("path")
    p.add_argument("out", help="output directory (safetensors) or file (torch)")
    p.add_argument("--format", choices=("safetensors", "torch"), required=True)
    p.add_argument("--items", help="comma-separated items (default: model)")
    p.add_argument("--max-file-size", type=parse_size, default=parse_size("5GB"),
                   help="largest safetensors file, e.g. 5GB (default), 500MiB")
    p.add_argument("--max-host-bytes", type=parse_size, default=convert.DEFAULT_MAX_HOST_BYTES,
                   help="host memory for data in flight (default 2GiB)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export at the destination")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``xtckpt``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (UsageError, CheckpointNotFoundError, CheckpointExistsError) as exc:
        print(f"xtckpt: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"xtckpt: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_DATA
    except KeyboardInterrupt:
        return 130


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def run() -> None:
    """Console-script wrapper: exit with `main`'s status; a closed stdout pipe (``| head``) is not an error. The
    command owns its process, so glibc is told to return large freed buffers at once (the streaming commands'
    memory budgets depend on it); `main` called inside another program leaves that program's allocator alone."""
    host_memory.release_large_buffers_at_once()
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:
        sys.stderr.close()
        status = 0
    sys.exit(status)
