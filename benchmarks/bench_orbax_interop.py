"""Restoring a checkpoint Orbax wrote: this library onto torch_xla against Orbax itself in JAX, same checkpoint,
same run.

Orbax (in a JAX process, 8 CPU devices) saves a manager step of float32 arrays (OCDBT, its default), then each
contender restores it `--repeats` times onto a (2, 4) mesh with the axes' roles changed: Orbax with
StandardCheckpointer and NamedShardings, this library onto torch_xla SPMD tensors on 8 devices, twice: with
`xtc.restore` (new tensors beside the target) and, as a trainer resumes, with its CheckpointManager restoring the
step in place into the built model. Each restore runs in a fresh process, after the checkpoint's files have
been evicted from the page cache (a resume), the contenders taking turns ABBA; the reported figures are those of
the restore call alone (Orbax's reads the checkpoint's metadata first, as ours do): wall time and, beside it
(benchmarks/footprint.py), CPU seconds, fresh memory touched and bytes read from the disk. Prints one JSON line.

    python -m benchmarks orbax-interop [--scale 1.0 (GiB)] [--repeats 7]
"""

from __future__ import annotations

import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests")
sys.path.insert(0, HERE)
sys.path.insert(0, TESTS)
import footprint  # noqa: E402
import harness  # noqa: E402
import orbax_trees  # noqa: E402 - the step's arrays, as the Orbax tool writes them
from fresh_process import evict, run_json  # noqa: E402

CONTENDERS = ("orbax", "xtc", "xtc-in-place")

_ORBAX = r"""
import json, sys
sys.path.insert(0, {scripts!r})
sys.path.insert(0, {here!r})
import footprint
import orbax_tool  # JAX on 8 CPU devices
measures, _ = footprint.measure(lambda: orbax_tool.restore_sharded({item!r}))
print(json.dumps({{"seconds": measures["wall_s"], "footprint": measures}}))
"""

_OURS = r"""
import json, sys
sys.path.insert(0, {tests!r})
sys.path.insert(0, {here!r})
import footprint
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

def restore():
    if {in_place!r}:  # as a trainer resumes: the manager restores the step into the built model
        with xtc.CheckpointManager({root!r}, xtc.CheckpointManagerOptions(save_rng=False)) as manager:
            manager.restore(1, model=target, restore_rng=False)
        return target
    return xtc.restore({item!r}, target)  # returns once every shard is on its device

measures, out = footprint.measure(restore)
shapes = orbax_trees.large_shapes({gib})
for name in out:
    expected = orbax_trees.large_block(int(name[1:]), shapes[name], (2, 4))
    assert torch.equal(out[name][:2, :4].cpu(), torch.from_numpy(expected))
print(json.dumps({{"seconds": measures["wall_s"], "footprint": measures}}))
"""


def measure(settings: harness.Settings) -> dict:
    """Orbax writes the step, then the contenders restore it `repeats` times each, ABBA, each in a fresh process
    after the files were evicted. Returns the seconds and footprints of every run, and the speed ratios."""
    gib, repeats, directory = settings.scale, settings.repeats, settings.workdir
    jax_env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS")}
    xla_env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8", TF_CPP_MIN_LOG_LEVEL="3")
    root = os.path.join(directory, "orbax-root")
    run_json([sys.executable, os.path.join(TESTS, "scripts", "orbax_tool.py"), "large", root, str(gib)], jax_env,
             "Orbax writing")
    item = os.path.join(root, "1", "model")
    scripts = {"orbax": (_ORBAX.format(scripts=os.path.join(TESTS, "scripts"), here=HERE, item=item), jax_env)}
    for contender in ("xtc", "xtc-in-place"):
        scripts[contender] = (_OURS.format(tests=TESTS, here=HERE, gib=gib, item=item, root=root,
                                           in_place=contender == "xtc-in-place"), xla_env)
    def restore(contender: str, _round: int) -> dict:
        evict(root)
        script, env = scripts[contender]
        return run_json([sys.executable, "-c", script], env, f"{contender}'s restore")

    runs = harness.alternated(list(CONTENDERS), repeats, restore)  # alternated: all see the same machine
    seconds = {c: [r["seconds"] for r in rs] for c, rs in runs.items()}
    orbax = harness.median(seconds["orbax"])
    nbytes = sum(math.prod(shape) * 4 for shape in orbax_trees.large_shapes(gib).values())  # float32
    return {"gib": gib, "nbytes": nbytes, "orbax_restore_s": seconds["orbax"],
            "xtc_restore_s": seconds["xtc"], "xtc_in_place_restore_s": seconds["xtc-in-place"],
            "footprints": {c: [r["footprint"] for r in rs] for c, rs in runs.items()},
            "orbax_over_xtc": orbax / harness.median(seconds["xtc"]),
            "orbax_over_xtc_in_place": orbax / harness.median(seconds["xtc-in-place"])}


def describe(result: dict) -> str:
    """The result as the lines of the benchmark report."""
    median = harness.median
    lines = [f"orbax-interop: a {result['gib']:.2f} GiB step Orbax wrote (OCDBT), restored onto a (2, 4) mesh in "
             f"fresh processes, page cache evicted, ABBA (medians of {len(result['orbax_restore_s'])})",
             f"  Orbax in JAX {median(result['orbax_restore_s']):.3f} s; this library onto torch_xla: xtc.restore "
             f"{median(result['xtc_restore_s']):.3f} s ({result['orbax_over_xtc']:.2f}x Orbax's speed), the manager "
             f"in place {median(result['xtc_in_place_restore_s']):.3f} s ({result['orbax_over_xtc_in_place']:.2f}x)"]
    for contender, measured in result["footprints"].items():
        lines.append(f"  {contender:12} {footprint.summary(measured, result['nbytes'], read=True)}")
    return "\n".join(lines)


def run(settings: harness.Settings) -> harness.Result:
    """The case `orbax-interop`: a `scale` GiB step Orbax writes, restored by each contender, ABBA."""
    result = measure(settings)
    rows = [harness.footprint_row(c, measured, result["nbytes"]) for c, measured in result["footprints"].items()]
    return harness.Result(rows, describe(result), result)


if __name__ == "__main__":
    harness.worker_main()
