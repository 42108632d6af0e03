"""The implementations compared by the benchmarks, behind one small interface.

Each contender saves a state dict of sharded XLA tensors under `root/<step>` and restores it onto a target of the
same keys sharded on another mesh. `save` returns when the caller may continue (the blocked time); `wait` returns
when the data is written (and fsynced where the contender does so: see `fsync`). Orbax runs in its own process
and virtual environment (orbax_worker.py).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch
import torch_xla

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import storage
from xla_tensorstore_ckpt.core import events


class Contender:
    name = ""
    fsync = False

    def __init__(self, root: str):
        self.root = root

    def save(self, step: int, state: dict) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        pass

    def restore(self, step: int, target: dict, place: Callable[[str, torch.Tensor], torch.Tensor]) -> dict:
        raise NotImplementedError

    def path(self, step: int) -> str:
        return os.path.join(self.root, str(step))

    def delete(self, step: int) -> None:
        """Remove a saved step (outside any timing), on local disk or an object store."""
        (storage.location(self.path(step))).delete_tree()
        if os.path.exists(self.path(step) + ".pt"):
            os.remove(self.path(step) + ".pt")

    def close(self) -> None:
        pass


def _listeners() -> tuple:
    """With ``XTC_BENCH_EVENTS=<file>`` (run.py's ``--events``), this library's contenders write every event to
    that JSON-lines file: the cost of listening, measured beside the same run without."""
    path = os.environ.get("XTC_BENCH_EVENTS")
    return (events.JsonLinesListener(path),) if path else ()


class Xtc(Contender):
    """This library: the synchronous item save (`xtc.save`), with or without fsync."""

    def __init__(self, root: str, *, fsync: bool = True):
        super().__init__(root)
        self.fsync = fsync
        self.name = "xtc" if fsync else "xtc-nofsync"

    def save(self, step, state):
        xtc.save(self.path(step), state, options=xtc.SaveOptions(fsync=self.fsync, listeners=_listeners()))

    def restore(self, step, target, place):
        return xtc.restore(self.path(step), target, options=xtc.RestoreOptions(listeners=_listeners()))


class XtcAsync(Contender):
    """This library's CheckpointManager with asynchronous saves (the default); restores in place into the
    target, like torch_xla's manager."""

    name = "xtc-async"
    fsync = True

    def __init__(self, root: str):
        super().__init__(root)
        self.manager = xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(
            save_interval_steps=1, max_to_keep=None, save_rng=False, listeners=_listeners()))

    def save(self, step, state):
        self.manager.save(step, model=state)

    def wait(self):
        self.manager.wait_until_finished()

    def restore(self, step, target, place):
        self.manager.restore(step, model=target, restore_rng=False)
        return target

    def delete(self, step):
        if step in self.manager.all_steps():
            self.manager.delete(step)

    def close(self):
        self.manager.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TorchXlaManager(Contender):
    """torch_xla.experimental.distributed_checkpoint.CheckpointManager (DCP + SPMD planners), its defaults;
    `save` (synchronous) or `save_async`."""

    fsync = True  # DCP's FsspecWriter syncs files by default

    def __init__(self, root: str, *, asynchronous: bool = False):
        super().__init__(root)
        import torch.distributed as dist
        from torch_xla.experimental.distributed_checkpoint import CheckpointManager

        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            dist.init_process_group("gloo", rank=0, world_size=1)
        self.manager = CheckpointManager(root, save_interval=1, chkpt_on_preemption=False)
        self.asynchronous = asynchronous
        self.name = "torch_xla-async" if asynchronous else "torch_xla"

    def save(self, step, state):
        if self.asynchronous:
            self.manager.save_async(step, state, force=True)
        else:
            self.manager.save(step, state, force=True)

    def wait(self):
        self.manager.join()

    def restore(self, step, target, place):
        self.manager.restore(step, target)
        torch_xla.sync()
        return target


class TorchSave(Contender):
    """torch.save of the state gathered to CPU; restore = torch.load, then place each tensor on the target mesh."""

    name = "torch.save"
    fsync = False

    def path(self, step):
        return os.path.join(self.root, f"{step}.pt")

    def save(self, step, state):
        gathered = {k: v.cpu() for k, v in state.items()}
        os.makedirs(self.root, exist_ok=True)
        torch.save(gathered, self.path(step))

    def restore(self, step, target, place):
        loaded = torch.load(self.path(step), weights_only=True)
        out = {k: place(k, v) for k, v in loaded.items()}
        torch_xla.sync()
        return out

    def delete(self, step):
        if os.path.exists(self.path(step)):
            os.remove(self.path(step))


CONTENDERS = {
    "xtc": Xtc,
    "xtc-nofsync": lambda root: Xtc(root, fsync=False),
    "xtc-async": XtcAsync,
    "torch_xla": TorchXlaManager,
    "torch_xla-async": lambda root: TorchXlaManager(root, asynchronous=True),
    "torch.save": TorchSave,
}
