"""The implementations compared by the benchmarks, behind one small interface.

Each contender saves a state dict of sharded XLA tensors under `root/<step>` and restores it onto a target of
the same keys sharded on another mesh. `save` returns when the data is written (and fsynced where the
contender does so: see `fsync`); `save_blocking` is the time the caller waits in the asynchronous variants.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch
import torch_xla

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import storage


class Contender:
    name = ""
    fsync = False

    def __init__(self, root: str):
        self.root = root

    def save(self, step: int, state: dict) -> None:
        raise NotImplementedError

    def restore(self, step: int, target: dict, place: Callable[[str, torch.Tensor], torch.Tensor]) -> dict:
        raise NotImplementedError

    def delete(self, step: int) -> None:
        """Remove a saved step (outside any timing), on local disk or gs://."""
        path = os.path.join(self.root, str(step))
        storage.delete_tree(storage.location(path))
        if os.path.exists(path + ".pt"):
            os.remove(path + ".pt")

    def close(self) -> None:
        pass


class Xtc(Contender):
    """This library, synchronous item save."""

    def __init__(self, root: str, *, fsync: bool = True):
        super().__init__(root)
        self.fsync = fsync
        self.name = "xtc" if fsync else "xtc-nofsync"

    def save(self, step, state):
        xtc.save(os.path.join(self.root, str(step)), state, options=xtc.SaveOptions(fsync=self.fsync))

    def restore(self, step, target, place):
        return xtc.restore(os.path.join(self.root, str(step)), target)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TorchXlaManager(Contender):
    """torch_xla.experimental.distributed_checkpoint.CheckpointManager (DCP + SPMD planners), its defaults."""

    name = "torch_xla"
    fsync = True  # DCP's FsspecWriter syncs files by default

    def __init__(self, root: str):
        super().__init__(root)
        import torch.distributed as dist
        from torch_xla.experimental.distributed_checkpoint import CheckpointManager

        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            dist.init_process_group("gloo", rank=0, world_size=1)
        self.manager = CheckpointManager(root, save_interval=1, chkpt_on_preemption=False)

    def save(self, step, state):
        self.manager.save(step, state, force=True)

    def restore(self, step, target, place):
        self.manager.restore(step, target)
        torch_xla.sync()
        return target


class TorchSave(Contender):
    """torch.save of the state gathered to CPU; restore = torch.load, then place each tensor on the target mesh."""

    name = "torch.save"
    fsync = False

    def _path(self, step):
        return os.path.join(self.root, f"{step}.pt")

    def save(self, step, state):
        gathered = {k: v.cpu() for k, v in state.items()}
        os.makedirs(self.root, exist_ok=True)
        torch.save(gathered, self._path(step))

    def restore(self, step, target, place):
        loaded = torch.load(self._path(step), weights_only=True)
        out = {k: place(k, v) for k, v in loaded.items()}
        torch_xla.sync()
        return out


CONTENDERS = {"xtc": Xtc, "xtc-nofsync": lambda root: Xtc(root, fsync=False), "torch_xla": TorchXlaManager,
              "torch.save": TorchSave}
