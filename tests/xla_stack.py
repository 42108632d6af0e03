"""torch_xla for the tests that need it, resolved on first use, so that every test module also imports on the
newest stack, where torch_xla is not installed and the tests that need it (marker `xla`) are deselected."""

from __future__ import annotations

import importlib
import importlib.util

HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None


class _Module:
    """A module imported when an attribute of it is first read; attributes set (a test's monkeypatch) are set
    on the module itself, and `__dict__` is the module's (monkeypatch reads the old value from it)."""

    __slots__ = ("_name",)

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attribute: str):
        return getattr(importlib.import_module(self._name), attribute)

    def __setattr__(self, attribute: str, value) -> None:
        setattr(importlib.import_module(self._name), attribute, value)

    def __delattr__(self, attribute: str) -> None:
        delattr(importlib.import_module(self._name), attribute)

    @property
    def __dict__(self) -> dict:
        return importlib.import_module(self._name).__dict__


torch_xla = _Module("torch_xla")
xs = _Module("torch_xla.distributed.spmd")
xr = _Module("torch_xla.runtime")
xm = _Module("torch_xla.core.xla_model")
met = _Module("torch_xla.debug.metrics")
sharding = _Module("xla_tensorstore_ckpt.targets.xla")  # the XLA target: the library's torch_xla module
