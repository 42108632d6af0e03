"""Runs readers and `xtckpt` commands on hostile checkpoints, one case after another, for tests/test_hostile_inputs.py.

usage: hostile_worker.py   (reads one JSON case per line on stdin; writes one JSON line per case on stdout)

A case is {"id", "ops": [[kind, args...], ...]}: kind "cli" runs ``xtckpt ARGS`` in this process, "metadata" and
"restore" call the API on a path. Each op's outcome is reported: "ok", "error" (a `CheckpointError`, or the CLI's
exit status 1/2 with a one-line message), or "escaped" with the traceback of anything else. The harness runs this
with a memory limit; a signal or a hang shows up there as a missing answer. No torch_xla is imported.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import io
import json
import sys
import traceback
import warnings


class _BlockTorchXLA(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch_xla" or name.startswith("torch_xla."):
            raise ImportError(f"{name} is blocked in this process")
        return None


sys.meta_path.insert(0, _BlockTorchXLA())
warnings.simplefilter("ignore")

import xla_tensorstore_ckpt as xtc  # noqa: E402
from xla_tensorstore_ckpt import cli  # noqa: E402


def run_op(op: list) -> dict:
    kind, *args = op
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if kind == "cli":
                status = cli.main(args)
            elif kind == "metadata":
                xtc.metadata(args[0])
                status = 0
            elif kind == "restore":
                xtc.restore(args[0])
                status = 0
            else:
                raise ValueError(f"unknown op {kind}")
    except xtc.CheckpointError as exc:
        return {"op": op, "outcome": "error", "message": str(exc)[:300]}
    except BaseException:  # noqa: BLE001 - what the harness looks for: anything escaping a reader
        return {"op": op, "outcome": "escaped", "message": traceback.format_exc()[-3000:]}
    if kind != "cli" or status == 0:
        return {"op": op, "outcome": "ok"}
    lines = err.getvalue().strip().splitlines()
    # A refusal is one line on stderr; `verify` reports what it found on stdout instead, with status 1.
    if status in (cli.EXIT_DATA, cli.EXIT_USAGE) and (
            (len(lines) == 1 and lines[0].startswith("xtckpt: error:")) or (not lines and args[0] == "verify")):
        return {"op": op, "outcome": "error", "message": (lines or out.getvalue().splitlines()[-1:] or [""])[0][:300]}
    return {"op": op, "outcome": "escaped", "message": f"status {status}, stderr: {err.getvalue()[-3000:]}"}


def main() -> None:
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        case = json.loads(line)
        results = [run_op(op) for op in case["ops"]]
        print(json.dumps({"id": case["id"], "results": results}), flush=True)


if __name__ == "__main__":
    main()
