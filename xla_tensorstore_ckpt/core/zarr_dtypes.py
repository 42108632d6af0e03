"""Registers the data types tensorstore writes but zarr-python 3.1 does not know (bfloat16, float8_*), so that
``zarr.open_array`` reads every array of a checkpoint.

Called once from the package ``__init__``; a no-op when zarr-python is not installed. `docs/format.md` shows the
same registration for readers without this package.
"""

from __future__ import annotations

import importlib.util
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
