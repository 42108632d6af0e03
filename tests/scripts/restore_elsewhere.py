"""Child process for the device-count tests: restores a checkpoint in another environment and writes what it
got (as CPU tensors) to an output item for the parent to compare.

usage: restore_elsewhere.py CHECKPOINT OUTPUT MODE   (MODE: xla or no-xla; the device count comes from the
environment: CPU_NUM_DEVICES)
"""

from __future__ import annotations

import importlib.abc
import os
import sys


class _BlockTorchXLA(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch_xla" or name.startswith("torch_xla."):
            raise ImportError(f"{name} is blocked in this process")
        return None


def main() -> None:
    checkpoint, output, mode = sys.argv[1:4]
    if mode == "no-xla":
        sys.meta_path.insert(0, _BlockTorchXLA())
        import xla_tensorstore_ckpt as xtc

        restored = xtc.restore(checkpoint)
        assert "torch_xla" not in sys.modules
        xtc.save(output, restored)
        print("devices=0")
        return

    import numpy as np
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    import xla_tensorstore_ckpt as xtc
    from xla_tensorstore_ckpt.core import tree
    from xla_tensorstore_ckpt.core.records import ArrayMetadata

    n = xr.global_runtime_device_count()

    def zeros(_path, meta):  # each array on this process's devices, 2D ones sharded
        if not isinstance(meta, ArrayMetadata):
            return meta
        t = torch.zeros(meta.shape, dtype=meta.torch_dtype).to("xla")
        if n > 1 and len(meta.shape) == 2:
            mesh = xs.Mesh(np.arange(n), (n // 2, 2), ("a", "b")) if n >= 4 else xs.Mesh(np.arange(n), (n,), ("d",))
            xs.mark_sharding(t, mesh, ("b", "a") if n >= 4 else (None, "d"))
        return t

    target = tree.rebuild(xtc.metadata(checkpoint), zeros)
    torch_xla.sync()
    restored = xtc.restore(checkpoint, target)
    xtc.save(output, tree.rebuild(restored, lambda _p, v: v.cpu() if isinstance(v, torch.Tensor) else v))
    print(f"devices={n}")


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
