"""One process of a DTensor job (gloo on 127.0.0.1; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the
environment). Never imports torch_xla: every mode reports whether it got imported anyway.

usage: dtensor_job.py save ROOT                -> saves ROOT/item: DTensors of many placements (4 processes)
       dtensor_job.py restore ROOT             -> restores ROOT/item onto other meshes and placements; on 4
                                                  processes also onto a (2, 2) mesh replicated over its first
                                                  dimension, with and without single-replica reads
       dtensor_job.py partial ROOT             -> tries to save a Partial DTensor
       dtensor_job.py from_spmd ROOT           -> restores ROOT/spmd (saved by torch_xla SPMD) as DTensors,
                                                  saves them to ROOT/back
       dtensor_job.py die ROOT KILL            -> the manager saves steps 1 and 2; rank KILL dies in step 2
       dtensor_job.py train ROOT STEPS [--stop-at S] [--resume latest|none] [--mesh fsdp|hsdp] [--async]
                                               -> FSDP2 training with the manager (see `train`)
       dtensor_job.py state ROOT STEP [--mesh fsdp|hsdp]
                                               -> restores STEP onto a fresh FSDP2 model and optimizer, prints
                                                  digests of the full state
       dtensor_job.py foreign SOURCE           -> restores SOURCE (an Orbax item) onto DTensors sharded by rows
                                                  where they divide, prints digests of every leaf
       dtensor_job.py from_hf SOURCE ROOT      -> an FSDP2 model named as SOURCE's (an HF directory) starts
                                                  from it through the manager's init_from, prints digests
Prints JSON lines: {"rank": r, ...}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fault_backends import hooked, kill_at  # noqa: E402

import xla_tensorstore_ckpt as xtc  # noqa: E402

# name -> (shape, dtype, mesh ("1d" over every process, "2d" as (2, world // 2)), placements saved, restored)
ARRAYS = {
    "even": ((8, 6), torch.float32, "1d", ("S0",), ("R",)),
    "uneven": ((7, 5), torch.float32, "1d", ("S0",), ("S1",)),
    "empty_shard": ((3, 4), torch.float32, "1d", ("S0",), ("S0",)),
    "columns": ((4, 9), torch.float32, "1d", ("S1",), ("S0",)),
    "replicated": ((1024, 512), torch.float32, "1d", ("R",), ("S0",)),
    "hsdp": ((9, 4), torch.float32, "2d", ("R", "S0"), ("S0",)),
    "nested": ((10, 3), torch.float32, "2d", ("S0", "S0"), ("S0",)),
    "two_dims": ((6, 7), torch.float32, "2d", ("S0", "S1"), ("S1",)),
    "bf16": ((5, 6), torch.bfloat16, "1d", ("S0",), ("S0",)),
}


def global_value(name: str) -> torch.Tensor:
    shape, dtype, *_ = ARRAYS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g).to(dtype)


def placements(codes) -> list:
    return [Replicate() if c == "R" else Shard(int(c[1:])) for c in codes]


def meshes(world: int) -> dict:
    out = {"1d": init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))}
    if world % 2 == 0 and world > 2:
        out["2d"] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    else:
        out["2d"] = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    return out


def stored_once(rank: int, restored: dict, events_seen: list) -> dict:
    """What one restore fetched from storage (its restore_finished event) and whether every value is exact."""
    details = next(e for e in events_seen if e.kind == "restore_finished").details
    equal = all(torch.equal(restored[name].full_tensor(), global_value(name)) for name in ARRAYS)
    return {"equal": equal, "storage_bytes": details["storage_bytes"],
            "received": details.get("peer_bytes_received", 0), "plan": details.get("plan"),
            "agreements": details.get("agreements")}


def digest(tensor: torch.Tensor) -> str:
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return hashlib.sha256(full.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                          + str((full.dtype, tuple(full.shape))).encode()).hexdigest()[:16]


def emit(rank: int, **fields) -> None:
    print(json.dumps({"rank": rank, "torch": torch.__version__, "torch_xla": "torch_xla" in sys.modules, **fields}),
          flush=True)


# ------------------------------------------------------------------------------------------------ training

VOCAB, DIM, SEQ, BATCH = 48, 16, 6, 4


class TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.up = torch.nn.Linear(DIM, 3 * DIM)
        self.down = torch.nn.Linear(3 * DIM, DIM - 3)  # 13 rows: uneven shards over 2 and 4 processes
        self.norm = torch.nn.LayerNorm(DIM - 3)
        self.head = torch.nn.Linear(DIM - 3, VOCAB, bias=False)
        self.dropout = torch.nn.Dropout(0.1)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = self.dropout(self.down(torch.nn.functional.gelu(self.up(h))))
        return self.head(self.norm(h))


def batch_at(position: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + position)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def fsdp_model(world: int, mesh_kind: str):
    """The same initial weights on every process, sharded with FSDP2 (HSDP on a (replicate, shard) mesh)."""
    if mesh_kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    torch.manual_seed(0)
    model = TinyModel()
    for block in (model.up, model.down):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3) * 0.9 ** s)
    return model, optimizer, scheduler


def state_digests(model, optimizer) -> dict:
    out = {f"model.{k}": digest(v) for k, v in model.state_dict().items()}
    for index, entries in optimizer.state_dict()["state"].items():
        out.update({f"optimizer.{index}.{k}": digest(v) for k, v in entries.items()})
    return out


def train(args, rank: int, world: int) -> None:
    """Train STEPS steps with the manager saving every step (with --local: every third step to ROOT, every step
    to a local tier of this process's own in ROOT-local/RANK)."""
    model, optimizer, scheduler = fsdp_model(world, args.mesh)
    ids = [id(p) for p in model.parameters()]
    data = {"position": 0}
    tiers = {} if not args.local else {
        "save_interval_steps": 3, "local_directory": f"{args.root}-local/{rank}", "local_save_interval_steps": 1}
    options = xtc.CheckpointManagerOptions(**{"save_interval_steps": 1, **tiers}, async_save=args.async_save)
    with xtc.CheckpointManager(args.root, options) as manager:
        resume = None if args.resume == "none" else "latest"
        restored = manager.restore(resume, model=model, optimizer=optimizer, lr_scheduler=scheduler, extra=data)
        start = restored or 0
        same_parameters = ids == [id(p) for p in model.parameters()] and all(
            p is q for p, q in zip(model.parameters(), optimizer.param_groups[0]["params"]))
        emit(rank, restored=restored, same_parameters=same_parameters, position=data["position"],
             dtensors=all(isinstance(p, DTensor) for p in model.parameters()))
        for step in range(start + 1, int(args.steps) + 1):
            batch = batch_at(data["position"] * world + rank)
            logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            data["position"] += 1
            emit(rank, step=step, loss=loss.item())
            manager.save(step, model=model, optimizer=optimizer, lr_scheduler=scheduler, extra=data,
                         metrics={"loss": loss.item()})
            if args.stop_at is not None and step == args.stop_at:
                manager.wait_until_finished()  # the step is committed: the event the parent waits for
                emit(rank, stopped=step)
                sys.stdout.flush()
                os._exit(0)  # like a preempted job: no cleanup
    emit(rank, digests=state_digests(model, optimizer), lr=scheduler.get_last_lr())


def state(args, rank: int, world: int) -> None:
    model, optimizer, scheduler = fsdp_model(world, args.mesh)
    data = {"position": 0}
    with xtc.CheckpointManager(args.root, xtc.CheckpointManagerOptions()) as manager:
        manager.restore(int(args.steps), model=model, optimizer=optimizer, lr_scheduler=scheduler, extra=data)
    emit(rank, digests=state_digests(model, optimizer), lr=scheduler.get_last_lr(), position=data["position"])


class Named(torch.nn.Module):
    """A module tree whose parameters carry the given dotted names, shapes and dtypes (a Hugging Face model's,
    without its code); 0-d entries are buffers, which FSDP2 leaves unsharded."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        super().__init__()
        for name, (shape, dtype) in shapes.items():
            owner = self
            *parents, leaf = name.split(".")
            for part in parents:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            if shape:
                owner.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape, dtype=dtype)))
            else:
                owner.register_buffer(leaf, torch.zeros(shape, dtype=dtype))


def from_hf(source: str, root: str, rank: int, world: int) -> None:
    """Every module owning parameters is its own FSDP2 unit (one dtype each), then the whole model."""
    shapes = {name: (tuple(meta.shape), meta.torch_dtype) for name, meta in xtc.metadata(source).items()}
    model = Named(shapes)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for module in list(model.modules())[1:]:
        if any(True for _ in module.parameters(recurse=False)):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    before = {name: id(p) for name, p in model.named_parameters()}
    with xtc.CheckpointManager(root, xtc.CheckpointManagerOptions()) as manager:
        start = manager.restore("latest", model=model, init_from=source)
    kept = before == {name: id(p) for name, p in model.named_parameters()}
    emit(rank, start=start, kept=kept, dtensors=all(isinstance(p, DTensor) for p in model.parameters()),
         digests={k: digest(v) for k, v in model.state_dict().items()})


def replica_reads(root: str, world: int, rank: int) -> None:
    """Restore ROOT/item onto a (2, world // 2) mesh, replicated over its first dimension, with single-replica
    reads and without."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "fsdp"))
    target = {name: distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, [Replicate(), Shard(0)])
              for name, (shape, dtype, *_) in ARRAYS.items()}
    target["meta"] = {"step": 0}
    for single in (True, False):
        seen: list = []
        options = xtc.RestoreOptions(single_replica_reads=single, listeners=(seen.append,))
        emit(rank, single=single, **stored_once(rank, xtc.restore(f"{root}/item", target, options=options), seen))


def leaves(tree, prefix: str = ""):
    """(dotted path, leaf) of a tree of dicts and lists."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from leaves(value, f"{prefix}{key}.")
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            yield from leaves(value, f"{prefix}{index}.")
    else:
        yield prefix[:-1], tree


def foreign(source: str, rank: int, world: int) -> None:
    """The target: each saved array as a DTensor sharded by rows where they divide evenly, else replicated."""
    mesh = meshes(world)["1d"]

    def placed(meta):
        if isinstance(meta, dict):
            return {k: placed(v) for k, v in meta.items()}
        if isinstance(meta, list):
            return [placed(v) for v in meta]
        if not hasattr(meta, "shape"):
            return meta
        rows = meta.shape[0] if meta.shape else 0
        return distribute_tensor(torch.zeros(meta.shape, dtype=meta.torch_dtype), mesh,
                                 [Shard(0) if rows and rows % world == 0 else Replicate()])

    out = xtc.restore(source, placed(xtc.metadata(source)))
    emit(rank, digests={k: digest(v) if isinstance(v, torch.Tensor) else v for k, v in leaves(out)},
         dtensors=sorted(k for k, v in leaves(out) if isinstance(v, DTensor)))


# ------------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode")
    parser.add_argument("root")
    parser.add_argument("steps", nargs="?", default=None)
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--resume", default="none")
    parser.add_argument("--mesh", default="fsdp")
    parser.add_argument("--async", dest="async_save", action="store_true")
    parser.add_argument("--local", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mode, root = args.mode, args.root
    if mode == "save":
        mesh = meshes(world)
        tree = {name: distribute_tensor(global_value(name), mesh[kind], placements(saved))
                for name, (_, _, kind, saved, _) in ARRAYS.items()}
        tree["meta"] = {"step": 3}
        seen: list = []
        xtc.save(f"{root}/item", tree, options=xtc.SaveOptions(split_bytes=1 << 20, listeners=(seen.append,)))
        committed = next(e for e in seen if e.kind == "save_committed")
        written = next(e for e in seen if e.kind == "save_written")  # the chunk bytes this process wrote
        emit(rank, bytes=written.details["chunk_bytes"], agreements=committed.details["agreements"])
    elif mode == "restore":
        mesh = meshes(world)
        target = {name: distribute_tensor(torch.zeros(shape, dtype=dtype), mesh["1d"], placements(other))
                  for name, (shape, dtype, _, _, other) in ARRAYS.items()}
        target["meta"] = {"step": 0}
        out = xtc.restore(f"{root}/item", target)
        equal = {name: bool(torch.equal(out[name].full_tensor(), global_value(name))) for name in ARRAYS}
        laid_out = {name: out[name].placements == target[name].placements and out[name].device_mesh is mesh["1d"]
                    for name in ARRAYS}
        local = {name: list(out[name].to_local().shape) for name in ARRAYS}
        emit(rank, equal=equal, laid_out=laid_out, local=local, meta=out["meta"])
        if world == 4:
            replica_reads(root, world, rank)
    elif mode == "partial":
        mesh = meshes(world)["1d"]
        summand = DTensor.from_local(torch.ones(4, 4), mesh, [Partial()])
        try:
            xtc.save(f"{root}/partial", {"layer": {"grad": summand}})
            emit(rank, error=None)
        except xtc.UnsupportedValueError as exc:
            emit(rank, error=str(exc), exists=os.path.exists(f"{root}/partial"))
    elif mode == "from_spmd":
        mesh = meshes(world)
        saved = xtc.metadata(f"{root}/spmd")
        target = {name: distribute_tensor(torch.zeros(meta.shape, dtype=meta.torch_dtype), mesh["2d"],
                                          [Replicate(), Shard(0)] if k % 2 else [Shard(1), Shard(0)])
                  for k, (name, meta) in enumerate(sorted(saved.items()))}
        out = xtc.restore(f"{root}/spmd", target)
        emit(rank, digests={name: digest(value) for name, value in out.items()})
        xtc.save(f"{root}/back", out, overwrite=True)
    elif mode == "die":
        kill_rank = int(args.steps)
        mesh = meshes(world)
        tree = {name: distribute_tensor(global_value(name), mesh[kind], placements(saved))
                for name, (_, _, kind, saved, _) in ARRAYS.items()}
        options = xtc.CheckpointManagerOptions(save_interval_steps=1, async_save=False, save_rng=False,
                                               coordination_timeout_s=60)
        hook = kill_at("sync_files:2") if rank == kill_rank else (lambda *_: None)
        manager = xtc.CheckpointManager(hooked(root, hook), options)
        manager.save(1, model=tree)
        try:
            manager.save(2, model=tree)
            emit(rank, step2="committed")
        except xtc.CheckpointError as exc:
            emit(rank, step2=type(exc).__name__, error=str(exc)[:500])
        emit(rank, steps=manager.all_steps())
        manager.close()
    elif mode == "foreign":
        foreign(root, rank, world)
    elif mode == "from_hf":
        from_hf(root, args.steps, rank, world)
    elif mode == "train":
        train(args, rank, world)
    elif mode == "state":
        state(args, rank, world)
    else:
        raise SystemExit(f"unknown mode {mode}")
    if mode != "die":  # no process leaves while another still connects the mesh's groups (or uses them)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
