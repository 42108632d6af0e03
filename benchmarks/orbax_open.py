"""Orbax restores a root this library wrote, in a JAX process of its own (no torch imported): the benchmarks' check
that their checkpoint is Orbax's too. `orbax.checkpoint.CheckpointManager(ROOT)` with the step prefix given
restores the items named from the newest step (`StandardRestore`, no target: the arrays as saved), and prints
one JSON line: {"step", "items": {item: {"arrays", "bytes", "digests": {dotted key: sha256 of the bytes}}}}, or
{"item": ..., "error": ...} for an item Orbax could not restore.

usage: orbax_open.py ROOT ITEM... [--prefix step]
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402


def _name(entry) -> str:
    for field in ("key", "idx", "name"):
        if hasattr(entry, field):
            return str(getattr(entry, field))
    return str(entry)


def main() -> None:
    args = sys.argv[1:]
    prefix = None
    if "--prefix" in args:
        at = args.index("--prefix")
        prefix = args[at + 1]
        del args[at:at + 2]
    root, items = args[0], args[1:]
    out: dict = {"items": {}}
    with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(step_prefix=prefix)) as manager:
        step = out["step"] = manager.latest_step()
        for item in items:
            try:
                restored = manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.StandardRestore()}))
            except Exception as exc:  # noqa: BLE001 - reported in the benchmark's table, not fatal
                out["items"][item] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
                continue
            leaves = jax.tree_util.tree_flatten_with_path(restored[item])[0]
            digests, nbytes = {}, 0
            for path, leaf in leaves:
                if isinstance(leaf, (jax.Array, np.ndarray)):
                    data = np.ascontiguousarray(np.asarray(leaf)).tobytes()
                    digests[".".join(_name(p) for p in path)] = hashlib.sha256(data).hexdigest()
                    nbytes += len(data)
            out["items"][item] = {"arrays": len(digests), "bytes": nbytes, "digests": digests}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
