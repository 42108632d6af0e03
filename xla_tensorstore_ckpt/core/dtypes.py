"""The dtype table: torch dtypes, zarr v3 data type names and numpy (ml_dtypes) dtypes, and zero-copy views
between torch CPU tensors and numpy arrays.

Zarr names are the on-disk truth (``zarr.json``'s ``data_type``); tensorstore and zarr-python both use them.
Called by the checkpointer, the array layer and the command line; never touches torch_xla.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import torch

from .errors import UnsupportedValueError


@dataclass(frozen=True)
class DType:
    """One row of the table. `view_as` is the same-width integer type torch uses to hand the bytes to numpy
    when numpy has no native type for it (bfloat16, float8)."""

    name: str
    torch: torch.dtype
    numpy: np.dtype
    view_as: torch.dtype | None = None

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @property
    def copy_dtype(self) -> np.dtype:
        """A plain numpy type of the element's width, for moving raw bytes: copies of ml_dtypes types
        (bfloat16, float8) would go through their Python-level element copy."""
        size = self.itemsize
        return np.dtype(f"u{size}") if size in (1, 2, 4, 8) else np.dtype(f"V{size}")


_ROWS = (
    DType("bool", torch.bool, np.dtype(np.bool_)),
    DType("int8", torch.int8, np.dtype(np.int8)),
    DType("int16", torch.int16, np.dtype(np.int16)),
    DType("int32", torch.int32, np.dtype(np.int32)),
    DType("int64", torch.int64, np.dtype(np.int64)),
    DType("uint8", torch.uint8, np.dtype(np.uint8)),
    DType("uint16", torch.uint16, np.dtype(np.uint16)),
    DType("uint32", torch.uint32, np.dtype(np.uint32)),
    DType("uint64", torch.uint64, np.dtype(np.uint64)),
    DType("float16", torch.float16, np.dtype(np.float16)),
    DType("bfloat16", torch.bfloat16, np.dtype(ml_dtypes.bfloat16), torch.int16),
    DType("float32", torch.float32, np.dtype(np.float32)),
    DType("float64", torch.float64, np.dtype(np.float64)),
    DType("complex64", torch.complex64, np.dtype(np.complex64)),
    DType("complex128", torch.complex128, np.dtype(np.complex128)),
    DType("float8_e4m3fn", torch.float8_e4m3fn, np.dtype(ml_dtypes.float8_e4m3fn), torch.uint8),
    DType("float8_e5m2", torch.float8_e5m2, np.dtype(ml_dtypes.float8_e5m2), torch.uint8),
    DType("float8_e4m3fnuz", torch.float8_e4m3fnuz, np.dtype(ml_dtypes.float8_e4m3fnuz), torch.uint8),
    DType("float8_e5m2fnuz", torch.float8_e5m2fnuz, np.dtype(ml_dtypes.float8_e5m2fnuz), torch.uint8),
)
_BY_NAME = {row.name: row for row in _ROWS}
_BY_TORCH = {row.torch: row for row in _ROWS}
_BY_NUMPY = {row.numpy: row for row in _ROWS}
_VIEW_NUMPY = {torch.int16: np.dtype(np.int16), torch.uint8: np.dtype(np.uint8)}

# Names zarr-python does not know natively; `zarr_dtypes` registers them.
EXTENDED_NAMES = tuple(row.name for row in _ROWS if row.view_as is not None)


def by_name(name: str) -> DType:
    """The row for a zarr data type name; `UnsupportedValueError` if unknown."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise UnsupportedValueError(f"unsupported data type {name!r}") from None


def by_torch(dtype: torch.dtype) -> DType:
    """The row for a torch dtype; `UnsupportedValueError` if the format cannot store it."""
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise UnsupportedValueError(f"unsupported tensor dtype {dtype}") from None


def tensor_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory with the table's numpy dtype (no copy)."""
    row = by_torch(tensor.dtype)
    if row.view_as is None:
        return tensor.numpy()
    return tensor.view(row.view_as).numpy().view(row.numpy)


def numpy_to_tensor(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor sharing `array`'s memory (no copy); the dtype comes from the array."""
    row = by_numpy(array.dtype)
    if not array.flags.writeable:
        array = array.copy()
    if row.view_as is None:
        return torch.from_numpy(array)
    return torch.from_numpy(array.view(_VIEW_NUMPY[row.view_as])).view(row.torch)


def by_numpy(dtype: np.dtype) -> DType:
    """The row for a numpy dtype; `UnsupportedValueError` if unknown."""
    try:
        return _BY_NUMPY[np.dtype(dtype)]
    except KeyError:
        raise UnsupportedValueError(f"unsupported numpy dtype {dtype}") from None
