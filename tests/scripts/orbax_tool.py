"""Real Orbax, in its own process (JAX on 8 CPU devices; never beside torch_xla): writes Orbax checkpoints and
reads ours, for the interop tests. Prints one JSON document on stdout.

usage: orbax_tool.py write ITEM --ocdbt 0|1 --zarr3 0|1     an item of `tree()` (2D-sharded arrays, every leaf kind)
                     [--tree slashed]                        or of `slashed()` (a key with a "/")
       orbax_tool.py manager ROOT [--prefix P] [--fixed-length N]
                                                             a CheckpointManager root: steps 1 and 2, items
                                                             "model" and "extra" (Composite), the default options
                                                             but step_prefix / step_format_fixed_length
       orbax_tool.py manager_items BASE SPEC...              one CheckpointManager root per SPEC at BASE/SPEC, steps
                                                             1 and 2: "default" by StandardSave alone (Orbax names
                                                             its item default), else Composite items named by SPEC
                                                             ("items", "params,opt_state"), item i: model(step + 10i)
       orbax_tool.py large ROOT GIB [--one-device 1]         a manager step of float32 arrays (the benchmark),
                                                             2D-sharded, or on one device (each one chunk)
       orbax_tool.py restore ITEM [--paths 1]                StandardCheckpointer().restore(ITEM), no target
                                                             (paths: keyed by the JSON list of keys, not by
                                                             the keys joined with ".")
       orbax_tool.py restore_sharded ITEM                    PyTreeCheckpointer, onto NamedShardings on a 2x4 mesh
       orbax_tool.py steps ROOT... [--prefix P] [--fixed-length N]
                                                             CheckpointManager(ROOT).all_steps() / latest_step()
       orbax_tool.py manager_restore ROOT ITEM [--prefix P] [--fixed-length N]
                                                             CheckpointManager(ROOT).restore(latest, Composite(ITEM))
Leaves are dumped as {"dtype", "shape", "data": base64 of the little-endian bytes} or {"value": ...}.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time

# Set before JAX initialises its backend, at import and again in main(): a run forked from a process that imported
# this script (tests/forked.py) starts with its batch's environment.
JAX_ENVIRONMENT = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
os.environ.update(JAX_ENVIRONMENT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import orbax_trees  # noqa: E402


def mesh(shape=(4, 2), names=("x", "y")) -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(shape), names)


def placed(tree, specs, on: Mesh):
    """numpy leaves -> jax.Arrays sharded by `specs` (same structure; None: replicated)."""
    return jax.tree_util.tree_map(
        lambda value, spec: jax.device_put(jnp.asarray(value), NamedSharding(on, P(*spec) if spec else P()))
        if isinstance(value, np.ndarray) else value, tree, specs, is_leaf=lambda x: x is None)


def dump(tree, *, paths: bool = False) -> dict:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
        key = json.dumps(keys) if paths else ".".join(keys)
        if isinstance(leaf, (jax.Array, np.ndarray)):  # 0-d arrays too (a 0-d tensor saved by us)
            array = np.asarray(leaf)
            out[key] = {"dtype": str(array.dtype), "shape": list(array.shape),
                        "data": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode(),
                        "sharding": str(getattr(leaf, "sharding", ""))}
        else:
            out[key] = {"value": leaf.item() if isinstance(leaf, np.generic) else leaf}
    return out


def restore_sharded(item: str):
    """Orbax's restore of the checkpoint item `item` onto NamedShardings of a 2x4 mesh (the dimensions that divide
    evenly split over ("b", "a")), blocking until every array is on its devices."""
    with ocp.StandardCheckpointer() as checkpointer:
        metadata = checkpointer.metadata(item)
    tree_meta = getattr(metadata, "item_metadata", metadata)
    on = mesh((2, 4), ("a", "b"))

    def abstract(meta):
        kind = type(meta).__name__
        if kind == "StringMetadata":
            return ""
        if kind == "ScalarMetadata":
            return np.zeros((), meta.dtype).item()
        shape = getattr(meta, "shape", None)
        if shape is None:
            return meta
        axes = [("b", 4), ("a", 2)][:len(shape)]  # dims split over the mesh where they divide evenly
        spec = P(*[name if n % size == 0 else None for (name, size), n in zip(axes, shape)])
        return jax.ShapeDtypeStruct(shape, meta.dtype, sharding=NamedSharding(on, spec))

    abstract_tree = jax.tree_util.tree_map(abstract, tree_meta)
    with ocp.PyTreeCheckpointer() as checkpointer:
        restored = checkpointer.restore(item, args=ocp.args.PyTreeRestore(
            item=abstract_tree, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_tree)))
        return jax.block_until_ready(restored)


def manager_options(flags: dict) -> ocp.CheckpointManagerOptions:
    """The default options, but the step naming given by --prefix and --fixed-length."""
    fixed = flags.get("--fixed-length")
    return ocp.CheckpointManagerOptions(step_prefix=flags.get("--prefix"),
                                        step_format_fixed_length=int(fixed) if fixed else None)


def main() -> None:
    os.environ.update(JAX_ENVIRONMENT)
    command, target = sys.argv[1], sys.argv[2]
    flags = dict(zip(sys.argv[3::2], sys.argv[4::2]))
    if command == "write":
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=flags["--ocdbt"] == "1", use_zarr3=flags["--zarr3"] == "1")
        with ocp.Checkpointer(handler) as checkpointer:
            tree, specs = ((orbax_trees.slashed(), orbax_trees.slashed_specs()) if flags.get("--tree") == "slashed"
                           else (orbax_trees.tree(), orbax_trees.specs()))
            checkpointer.save(target, args=ocp.args.PyTreeSave(placed(tree, specs, mesh())))
        result = {"written": target}
    elif command == "manager":
        with ocp.CheckpointManager(target, options=manager_options(flags)) as manager:
            for step in (1, 2):
                manager.save(step, args=ocp.args.Composite(
                    model=ocp.args.StandardSave(placed(orbax_trees.model(step), orbax_trees.model_specs(), mesh())),
                    extra=ocp.args.JsonSave({"position": 10 * step, "epoch": "one"})))
        result = {"written": target}
    elif command == "manager_items":
        for spec in sys.argv[3:]:
            names = spec.split(",")
            with ocp.CheckpointManager(os.path.join(target, spec)) as manager:
                for step in (1, 2):
                    trees = [placed(orbax_trees.model(step + 10 * i), orbax_trees.model_specs(), mesh())
                             for i in range(len(names))]
                    args = ocp.args.StandardSave(trees[0]) if spec == "default" else ocp.args.Composite(
                        **{name: ocp.args.StandardSave(tree) for name, tree in zip(names, trees)})
                    manager.save(step, args=args)
        result = {"written": target}
    elif command == "large":
        gib = float(sys.argv[3])
        if dict(zip(sys.argv[4::2], sys.argv[5::2])).get("--one-device") == "1":
            tree = {name: jax.device_put(jnp.asarray(value), jax.devices()[0])
                    for name, value in orbax_trees.large(gib).items()}
        else:
            tree = placed(orbax_trees.large(gib), orbax_trees.large_specs(gib), mesh())
        with ocp.CheckpointManager(target) as manager:
            manager.save(1, args=ocp.args.Composite(model=ocp.args.StandardSave(tree)))
        result = {"written": target}
    elif command == "restore":
        with ocp.StandardCheckpointer() as checkpointer:
            result = dump(checkpointer.restore(target), paths=flags.get("--paths") == "1")
    elif command == "restore_sharded":
        started = time.perf_counter()
        restored = restore_sharded(target)
        result = {"seconds": time.perf_counter() - started, "tree": dump(restored)}
    elif command == "steps":
        result = {}
        args = sys.argv[2:]
        first_flag = next((i for i, arg in enumerate(args) if arg.startswith("--")), len(args))
        roots, flags = args[:first_flag], dict(zip(args[first_flag::2], args[first_flag + 1::2]))
        for root in roots:
            with ocp.CheckpointManager(root, options=manager_options(flags)) as manager:
                result[root] = {"all_steps": sorted(manager.all_steps()), "latest": manager.latest_step()}
    elif command == "manager_restore":
        item = sys.argv[3]
        with ocp.CheckpointManager(target, options=manager_options(dict(zip(sys.argv[4::2], sys.argv[5::2])))
                                   ) as manager:
            step = manager.latest_step()
            restored = manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.StandardRestore()}))
        result = {"step": step, "tree": dump(restored[item])}
    else:
        raise SystemExit(f"unknown command {command}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
