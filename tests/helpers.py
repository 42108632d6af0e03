"""Helpers the test modules share: random tensors of every dtype, exact tree comparison, a small sharded model
and its training steps, and the manager options most tests start from."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import threading
from collections import Counter

import pytest
import torch
from xla_stack import torch_xla

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import formats, storage
from xla_tensorstore_ckpt.core import dtypes, events, layout

CHECKSUM_BYTES = 4  # a CRC32C after each stored chunk

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64]


def random_tensor(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(shape, generator=g, dtype=torch.float32) * 3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=torch.int64).to(dtype)


def assert_trees_equal(a, b):
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_trees_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_trees_equal(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.cpu(), b.cpu())
    else:
        assert a == b or (a != a and b != b)


def options(**kw) -> xtc.CheckpointManagerOptions:
    """Manager options saving every step synchronously and keeping every step, with `kw` on top."""
    kw.setdefault("save_interval_steps", 1)
    kw.setdefault("max_to_keep", None)
    kw.setdefault("async_save", False)
    return xtc.CheckpointManagerOptions(**kw)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def xla_net(mesh, seed=0):
    torch.manual_seed(seed)
    net = Net().to("xla")
    import torch_xla.distributed.spmd as xs

    first, second = mesh.axis_names
    xs.mark_sharding(net.a.weight, mesh, (first, second))
    xs.mark_sharding(net.b.weight, mesh, (second, first))
    torch_xla.sync()
    return net


def train_steps(net, opt, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(4, 8, generator=g).to(next(net.parameters()).device)
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()


def cpu_state(net):
    return {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}


class Recorder:
    """A listener keeping every event (thread-safe: background commits call it)."""

    def __init__(self):
        self.events: list[events.Event] = []
        self._lock = threading.Lock()

    def __call__(self, event: events.Event) -> None:
        with self._lock:
            self.events.append(event)

    def kinds(self, **where) -> list[str]:
        return [e.kind for e in self.events if all(getattr(e, k) == v for k, v in where.items())]


def stored_chunk_bytes(path: str) -> int:
    """Every stored chunk of the item at `path` with its checksum: what reading it all once fetches."""
    total = 0
    for meta in formats.read_item(storage.location(path)).leaves().values():
        if hasattr(meta, "chunk_shape"):
            chunks = math.prod(-(-n // c) for n, c in zip(meta.shape, meta.chunk_shape))
            total += chunks * (math.prod(meta.chunk_shape) * dtypes.by_name(meta.dtype).itemsize + CHECKSUM_BYTES)
    return total


def ocdbt_data_files(item) -> list[str]:
    """The data files of every per-process OCDBT store of the item at `item`, largest first (the chunk data: the
    process's own stores hold it, its metadata store only the arrays' metadata)."""
    stores = [os.path.join(item, n, "d") for n in os.listdir(item) if n.startswith(layout.OCDBT_PROCESS_PREFIX)]
    files = [os.path.join(d, f) for d in stores if os.path.isdir(d) for f in os.listdir(d)]
    return sorted(files, key=os.path.getsize, reverse=True)


class Paths(Counter):
    """A listener summing the ``paths`` of each ``restore_finished`` it hears: which reads the restore made."""

    def __call__(self, event):
        if event.kind == events.RESTORE_FINISHED:
            self.update(event.details["paths"])

    def restore(self, *args, **kwargs):
        """`xtc.restore` told to this listener."""
        return xtc.restore(*args, options=xtc.RestoreOptions(listeners=(self,)), **kwargs)


# ------------------------------------------------------------------------------------- real file-system faults


@contextlib.contextmanager
def small_file_system(path, size: str = "32m"):
    """A file system of its own (tmpfs, `size`) mounted at `path` for the block: a full disk is then real
    (`fill_file_system`). Mounting needs root, as on the test machines and in CI."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True,
                   capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)


@contextlib.contextmanager
def overlay_file_system(path):
    """An overlayfs mounted at `path` for the block (its layers beside it): a file system whose page cache
    ``cachestat`` does not see, as in containers. Mounting needs root; skipped where the kernel refuses."""
    layers = [f"{path}.{name}" for name in ("lower", "upper", "work")]
    for directory in (path, *layers):
        os.makedirs(directory, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting an overlay file system needs root")
    mounted = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", "lowerdir={},upperdir={},workdir={}".format(
        *layers), str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"this kernel mounts no overlayfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def fill_file_system(directory, leave: int = 4096) -> str:
    """Fill the file system of `directory` but for `leave` bytes (ENOSPC for writes past them); the filling
    file's path: delete it to make room again."""
    ballast = os.path.join(directory, "ballast")
    st = os.statvfs(directory)
    with open(ballast, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - leave)
    return ballast


@contextlib.contextmanager
def undeletable(directory):
    """Nothing in `directory` can be removed or added for the block, not even by root (the immutable flag of
    ext4 and most Linux file systems: EPERM), while its files stay readable."""
    subprocess.run(["chattr", "+i", str(directory)], check=True, capture_output=True)
    try:
        yield directory
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True)
