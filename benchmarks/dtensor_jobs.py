"""Jobs of DTensor processes (gloo on 127.0.0.1, a 1-D mesh, Shard(0) as FSDP2 shards), shared by the benchmarks
that save and restore DTensor state against torch.distributed.checkpoint (bench_dtensor, bench_dcp_storage,
bench_compression's trained state via tests/scripts/titan_job.py, bench_torchtitan).

Worker side: `Process` (the process group, the mesh, the workload's state and a zeroed target of the same
layout, `timed` between two barriers, `on_primary`). Runner side: `run` (one job, each process's answer) and
`rounds` (each round of each contender over the processes, `jobs.aggregate`)."""

from __future__ import annotations

import math
import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import footprint
import jobs

PROCESSES = 4
UNSET = ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS")  # the workers (and JAX processes) run without them


def local_rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """(start, stop) of `rank`'s rows of a dimension of `n` split by Shard(0) (torch.chunk's split)."""
    size = -(-n // world)
    return min(n, rank * size), min(n, (rank + 1) * size)


def local_value(index: int, shape, dtype, rank: int, world: int):
    """The rows of tensor `index` that process `rank` holds: deterministic, from a generator of its own."""
    import torch

    start, stop = local_rows(shape[0], rank, world)
    g = torch.Generator().manual_seed(index * 1009 + rank)
    return torch.randn((stop - start, *shape[1:]), generator=g).to(dtype)


def full_value(index: int, shape, dtype, world: int):
    """Tensor `index` whole, as the processes hold it together."""
    import torch

    return torch.cat([local_value(index, shape, dtype, r, world) for r in range(world)])


def nest(flat: Mapping[str, Any]) -> dict:
    """``{"params/embed": v}`` -> ``{"params": {"embed": v}}``: the workload's names as a tree."""
    tree: dict = {}
    for name, value in flat.items():
        *parents, last = name.split("/")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[last] = value
    return tree


def leaf(tree: Mapping[str, Any], name: str):
    for part in name.split("/"):
        tree = tree[part]
    return tree


class Process:
    """One process of a DTensor job (call in the worker, after the job's environment is set): joins the gloo
    group, builds the 1-D ``fsdp`` mesh and, for `workload` at `scale` (benchmarks/workloads.py), `entries`
    (name, shape, dtype), `state` (deterministic values) and `target` (zeros, same layout)."""

    def __init__(self, workload: str, scale: float):
        import torch
        import torch.distributed as dist
        import workloads
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        self.dist, self.torch = dist, torch
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mesh = init_device_mesh("cpu", (self.world,), mesh_dim_names=("fsdp",))
        self.entries = [(name, tuple(shape), dtype) for name, shape, dtype, _, _ in workloads.specs(workload, scale)[0]]
        self.nbytes = workloads.spec_bytes(workload, scale)
        self.state = nest({name: self.dtensor(local_value(i, shape, dtype, self.rank, self.world), shape)
                           for i, (name, shape, dtype) in enumerate(self.entries)})
        self.target = nest({name: self.dtensor(torch.zeros_like(leaf(self.state, name).to_local()), shape)
                            for name, shape, _ in self.entries})

    def dtensor(self, local, shape):
        """A DTensor of global `shape` whose local rows are `local` (Shard(0))."""
        from torch.distributed.tensor import DTensor, Shard

        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False, shape=self.torch.Size(shape),
                                  stride=stride)

    def tiny(self, value: float):
        """A one-tensor state for warming up every path, untimed."""
        return {"w": self.dtensor(self.torch.full((4, 8), value), (4 * self.world, 8))}

    def zero_target(self) -> None:
        with self.torch.no_grad():
            for name, _, _ in self.entries:
                leaf(self.target, name).to_local().zero_()

    def exact(self, tree) -> bool:
        """Whether every tensor of `tree` is a Shard(0) DTensor equal to the state's, bit for bit."""
        from torch.distributed.tensor import DTensor, Shard

        return all(isinstance(leaf(tree, name), DTensor) and tuple(leaf(tree, name).placements) == (Shard(0),)
                   and self.torch.equal(leaf(tree, name).to_local(), leaf(self.state, name).to_local())
                   for name, _, _ in self.entries)

    def on_primary(self, fn: Callable[[], Any]) -> None:
        """`fn` on process 0 only, between two barriers."""
        self.dist.barrier()
        if self.rank == 0:
            fn()
        self.dist.barrier()

    def delete(self, path: str) -> None:
        self.on_primary(lambda: shutil.rmtree(path, ignore_errors=True))

    def timed(self, fn: Callable[[], Any], *, warm_memory: bool = False) -> tuple[dict, Any]:
        """`fn` measured (benchmarks/footprint.py) on every process between two barriers; with `warm_memory`,
        process 0 first touches twice the state's bytes in a throwaway process."""
        if warm_memory and self.rank == 0:
            footprint.warm_memory(2 * self.nbytes)
        self.dist.barrier()
        measures, result = footprint.measure(fn)
        self.dist.barrier()
        return measures, result


def run(script: str, args: Sequence[object], *, processes: int = PROCESSES, timeout_s: float = 4 * 3600) -> list:
    """One job of `processes` processes running ``python SCRIPT --worker ARGS...`` without torch_xla's
    environment; blocks; returns each process's answer in rank order (raises RuntimeError if one fails)."""
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    return jobs.run_job([os.path.abspath(script), "--worker", *map(str, args)], processes, env=env,
                        timeout_s=timeout_s)


def rounds(answers: Sequence[Mapping[str, Any]], rows: Mapping[str, Sequence[str]], repeats: int) -> dict:
    """``{operation: {contender: [aggregate of round i]}}`` from each process's ``runs[operation][contender]``."""
    return {op: {c: [jobs.aggregate([a["runs"][op][c][i] for a in answers]) for i in range(repeats)]
                 for c in contenders} for op, contenders in rows.items()}


def summary(measured: Sequence[Mapping[str, float]], nbytes: int) -> dict:
    """`harness.footprint_medians` of a contender's rounds, with the blocking time of async saves."""
    import harness

    out = harness.footprint_medians(measured, nbytes)
    if "blocking_s" in measured[0]:
        out["blocking_s"] = harness.median(r["blocking_s"] for r in measured)
    return out


def torch_xla_imported() -> bool:
    return "torch_xla" in sys.modules
