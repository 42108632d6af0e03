"""One process of a torchtitan job on CPU (gloo on 127.0.0.1; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the
environment), built from torchtitan's own parts: its llama3 debug model (two layers; torchtitan's SDPA inner
attention, as FlexAttention has no backward on CPU) sharded with FSDP2 over every process, its
`OptimizersContainer` and `LRSchedulersContainer`, its `ParallelAwareDataloader` over a small stateful token
dataset, a train state; checkpointed by a manager built from its Config, as torchtitan's trainer builds it.

usage: titan_job.py train DUMP STEPS [--manager xtc|dcp] [--interval N] [--async-mode M] [--kill-at S]
                                     [--initial PATH [--initial-hf]] [--full-initial] [--exclude NAME ...]
                                     [--load-step N] [--last-hf] [--state-at S]
  trains steps 1..STEPS (or from where a load leaves off), saving through the manager; prints per step
  {"rank", "step", "loss": float.hex}; with --kill-at S every process kills itself (SIGKILL) once step S is
  committed (its commit event); with --state-at S prints digests of the full state after step S ("state").
       titan_job.py state DUMP [--manager xtc|dcp] [--initial PATH] [--full-initial] [--exclude NAME ...]
  builds a fresh job, loads, prints {"loaded", "step", "model": {key: digest}, "optimizer": {...}, "lr", ...}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset
from torchtitan.components.checkpointer import CheckpointManager as DcpCheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from xla_tensorstore_ckpt.core.events import CommitCallback  # noqa: E402
from xla_tensorstore_ckpt.integrations.torchtitan import XtcCheckpointManager  # noqa: E402

SEQ, BATCH, VOCAB = 16, 2, 2048


class Tokens(IterableDataset):
    """Endless deterministic token sequences for one data-parallel rank; its position is its state."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank, self.position = dp_rank, 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(self.dp_rank * 1_000_003 + self.position)
            self.position += 1
            tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            yield tokens[:-1], tokens[1:]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


class TrainState:
    """The trainer's own state (torchtitan's `Trainer` is a Stateful with its step)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def model_spec():
    spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:2]
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return spec


def build(args: argparse.Namespace, steps: int):
    """The job's state and its checkpoint manager, as torchtitan's trainer builds them."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    spec = model_spec()
    torch.manual_seed(0)
    model = spec.model.build()
    with torch.no_grad():
        model.init_states()
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})],
        implementation="for-loop").build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=steps)
    rank = dist.get_rank()
    loader = ParallelAwareDataloader(Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=BATCH)
    train_state = TrainState()
    common = dict(enable=True, folder="checkpoint", interval=args.interval, keep_latest_k=0,
                  initial_load_path=args.initial, initial_load_model_only=not args.full_initial,
                  initial_load_in_hf=args.initial_hf,
                  exclude_from_loading=list(args.exclude), last_save_model_only=args.last_hf,
                  last_save_in_hf=args.last_hf)
    if args.manager == "dcp":
        config = DcpCheckpointManager.Config(**common, async_mode=args.async_mode)
    else:
        listeners = ()
        if args.kill_at is not None:
            listeners = (CommitCallback(lambda s: s == args.kill_at and os.kill(os.getpid(), signal.SIGKILL),
                                        "persistent"),)
        config = XtcCheckpointManager.Config(**common, async_mode=args.async_mode, listeners=listeners)
    checkpointer = config.build(dataloader=loader, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=lr_schedulers, states={"train_state": train_state},
                                sd_adapter=spec.state_dict_adapter(spec.model, None), base_folder=args.dump)
    return model, optimizers, lr_schedulers, loader, train_state, checkpointer


def digest(value) -> str:
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if isinstance(value, torch.Tensor):
        return hashlib.sha256(value.detach().contiguous().view(torch.uint8).numpy().tobytes()
                              if value.dim() else value.detach().reshape(1).view(torch.uint8).numpy().tobytes()
                              ).hexdigest()[:16] + str(value.dtype)
    return repr(value)


def state_digests(model, optimizers, lr_schedulers, train_state) -> dict:
    return {"model": {k: digest(v) for k, v in model.state_dict().items()},
            "optimizer": {k: digest(v) for k, v in optimizers.state_dict().items()},
            "lr": lr_schedulers.state_dict(), "train_step": train_state.step}


def emit(**record) -> None:
    print(json.dumps({"rank": dist.get_rank(), **record}), flush=True)


def train(args: argparse.Namespace) -> None:
    model, optimizers, lr_schedulers, loader, train_state, checkpointer = build(args, args.steps)
    loaded = checkpointer.load(step=args.load_step)
    emit(loaded=loaded, start=train_state.step)
    batches = iter(loader)
    while train_state.step < args.steps:
        train_state.step += 1
        inputs, labels = next(batches)
        positions = torch.arange(SEQ).repeat(inputs.shape[0], 1)
        logits = model(inputs, positions=positions)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        emit(step=train_state.step, loss=loss.item().hex())
        checkpointer.save(train_state.step, last_step=train_state.step == args.steps)
        if train_state.step == args.state_at:
            emit(state=state_digests(model, optimizers, lr_schedulers, train_state))
    checkpointer.maybe_wait_for_saving()
    if args.manager == "xtc":  # whether its saves split the fused QKV weights without gathering them
        emit(qkv_split_locally=checkpointer._splitter.local)
    checkpointer.close()


def state(args: argparse.Namespace) -> None:
    model, optimizers, lr_schedulers, loader, train_state, checkpointer = build(args, args.steps)
    loaded = checkpointer.load(step=args.load_step)
    emit(loaded=loaded, state=state_digests(model, optimizers, lr_schedulers, train_state))
    checkpointer.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("train", "state"))
    parser.add_argument("dump")
    parser.add_argument("steps", type=int, nargs="?", default=10)
    parser.add_argument("--manager", choices=("xtc", "dcp"), default="xtc")
    parser.add_argument("--interval", type=int, default=2)
    parser.add_argument("--async-mode", default="async")
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--initial")
    parser.add_argument("--full-initial", action="store_true")
    parser.add_argument("--initial-hf", action="store_true")
    parser.add_argument("--exclude", nargs="*", default=[])
    parser.add_argument("--load-step", type=int, default=-1)
    parser.add_argument("--last-hf", action="store_true")
    parser.add_argument("--state-at", type=int)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        (train if args.mode == "train" else state)(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
