"""Restoring a checkpoint Orbax wrote: this library onto torch_xla against Orbax itself in JAX, same checkpoint,
same run.

Orbax (in a JAX process, 8 CPU devices) saves a manager step of float32 arrays (OCDBT, its default), then each
contender restores it `--repeats` times onto a (2, 4) mesh with the axes' roles changed: Orbax with
StandardCheckpointer and NamedShardings, this library onto torch_xla SPMD tensors on 8 devices, twice: with
`xtc.restore` (new tensors beside the target) and, as a trainer resumes, with its CheckpointManager restoring the
step in place into the built model. Each restore runs in a fresh process, after the checkpoint's files have
been evicted from the page cache (a resume); the reported figure is the time of the restore call alone. Prints
one JSON line.

    python benchmarks/bench_orbax_interop.py [--gib 1.0] [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fresh_process import evict, run_json  # noqa: E402

TOOL = os.path.join(HERE, "..", "tests", "scripts", "orbax_tool.py")

_OURS = r"""
import json, os, sys, time
sys.path.insert(0, os.path.join({tests!r}))
import numpy as np, torch, torch_xla, torch_xla.distributed.spmd as xs, torch_xla.runtime as xr
xr.use_spmd()
import orbax_trees
import xla_tensorstore_ckpt as xtc
mesh = xs.Mesh(np.arange(8), (2, 4), ("a", "b"))
target = {{}}
for name, shape in orbax_trees.large_shapes({gib}).items():
    t = torch.empty(shape, dtype=torch.float32, device="xla")
    xs.mark_sharding(t, mesh, ("b", "a"))
    target[name] = t
torch_xla.sync()
start = time.perf_counter()
if {in_place!r}:  # as a trainer resumes: the manager restores the step into the built model
    with xtc.CheckpointManager({root!r}, xtc.CheckpointManagerOptions(save_rng=False)) as manager:
        manager.restore(1, model=target, restore_rng=False)
    out = target
else:
    out = xtc.restore({item!r}, target)  # returns once every shard is on its device
seconds = time.perf_counter() - start
shapes = orbax_trees.large_shapes({gib})
for name in out:
    expected = orbax_trees.large_block(int(name[1:]), shapes[name], (2, 4))
    assert torch.equal(out[name][:2, :4].cpu(), torch.from_numpy(expected))
print(json.dumps({{"seconds": seconds}}))
"""


def measure(gib: float, repeats: int, directory: str) -> dict:
    jax_env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS")}
    xla_env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8", TF_CPP_MIN_LOG_LEVEL="3")
    root = os.path.join(directory, "orbax-root")
    run_json([sys.executable, TOOL, "large", root, str(gib)], jax_env, "Orbax writing")
    item = os.path.join(root, "1", "model")
    scripts = {mode: _OURS.format(tests=os.path.join(HERE, "..", "tests"), gib=gib, item=item, root=root,
                                  in_place=mode == "in_place") for mode in ("new", "in_place")}
    orbax_s, ours_s, in_place_s = [], [], []
    for _ in range(repeats):  # alternated, so that all see the same machine
        evict(root)
        orbax_s.append(run_json([sys.executable, TOOL, "restore_sharded", item], jax_env, "Orbax restore")["seconds"])
        evict(root)
        ours_s.append(run_json([sys.executable, "-c", scripts["new"]], xla_env, "our restore")["seconds"])
        evict(root)
        in_place_s.append(run_json([sys.executable, "-c", scripts["in_place"]], xla_env, "our manager's restore")
                          ["seconds"])
    orbax = statistics.median(orbax_s)
    return {"gib": gib, "orbax_restore_s": orbax_s, "xtc_restore_s": ours_s, "xtc_in_place_restore_s": in_place_s,
            "orbax_over_xtc": orbax / statistics.median(ours_s),
            "orbax_over_xtc_in_place": orbax / statistics.median(in_place_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="xtc-orbax-interop-", dir=args.dir) as directory:
        print(json.dumps(measure(args.gib, args.repeats, directory)))


if __name__ == "__main__":
    main()
