"""torch_xla for the tests that need it, resolved on first use, so that every test module also imports on the
newest stack, where torch_xla is not installed and the tests that need it (marker `xla`) are deselected."""

from __future__ import annotations

import importlib
import importlib.util

HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None


class _Module:
    """A module imported when an attribute of it is first read."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str):
        return getattr(importlib.import_module(self._name), attribute)


torch_xla = _Module("torch_xla")
xs = _Module("torch_xla.distributed.spmd")
xr = _Module("torch_xla.runtime")
xm = _Module("torch_xla.core.xla_model")
met = _Module("torch_xla.debug.metrics")
sharding = _Module("xla_tensorstore_ckpt.sharding")  # the library's torch_xla module
