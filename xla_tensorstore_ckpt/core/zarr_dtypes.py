"""Registers the data types tensorstore writes but zarr-python 3.1 does not know (bfloat16, float8_*), so that
``zarr.open_array`` reads every array of a checkpoint.

Set up once from the package ``__init__`` (`register_when_imported`): at once if zarr-python is already imported,
else when it is, so that importing this package does not import zarr-python (0.15 s) in processes that never use
it; a no-op when zarr-python is not installed. `docs/format.md` shows the same registration for readers without
this package.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from . import dtypes


def _make_zdtype(row: dtypes.DType) -> type:
    from zarr.core.dtype.common import DataTypeValidationError
    from zarr.core.dtype.npy.float import BaseFloat

    native = row.numpy

    @dataclass(frozen=True, kw_only=True)
    class _Extended(BaseFloat):
        dtype_cls: ClassVar[type] = type(native)
        _zarr_v3_name: ClassVar[str] = row.name
        _zarr_v2_names: ClassVar[tuple[str, ...]] = ()

        @classmethod
        def _check_native_dtype(cls, dtype: object) -> bool:
            return isinstance(dtype, np.dtype) and dtype == native

        @classmethod
        def from_native_dtype(cls, dtype: object) -> _Extended:
            if cls._check_native_dtype(dtype):
                return cls()
            raise DataTypeValidationError(f"invalid data type {dtype}; expected {native}")

        def to_native_dtype(self) -> np.dtype:
            return native

        @property
        def item_size(self) -> int:
            return native.itemsize

    _Extended.__name__ = _Extended.__qualname__ = "".join(p.capitalize() for p in row.name.split("_"))
    return _Extended


def register() -> None:
    """Register every extended dtype with zarr-python's data type registry (idempotent)."""
    if importlib.util.find_spec("zarr") is None:
        return
    from zarr.core.dtype import data_type_registry

    for name in dtypes.EXTENDED_NAMES:
        if name not in data_type_registry.contents:
            data_type_registry.register(name, _make_zdtype(dtypes.by_name(name)))


class _AfterZarrImport(importlib.abc.MetaPathFinder):
    """Finds zarr-python as the finders after it do, and registers the dtypes once its module has run. It stays in
    place until then: a `find_spec("zarr")` that only probes runs nothing."""

    def find_spec(self, name, path, target=None):
        if name != "zarr":
            return None
        others = (finder for finder in sys.meta_path if finder is not self and hasattr(finder, "find_spec"))
        spec = next((found for found in (f.find_spec(name, path, target) for f in others) if found), None)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module  # a loader of this spec's own: wrapping it touches no other

            def exec_then_register(module) -> None:
                exec_module(module)
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                register()

            spec.loader.exec_module = exec_then_register
        return spec


def register_when_imported() -> None:
    """Called by the package ``__init__``: register the dtypes now if zarr-python is imported, else right after
    its import (whoever imports it). Does not block; raises nothing."""
    if "zarr" in sys.modules:
        register()
    else:
        sys.meta_path.insert(0, _AfterZarrImport())
