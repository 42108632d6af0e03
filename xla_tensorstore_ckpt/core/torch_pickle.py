"""Pickles that other tools write into checkpoints, read without running code from them: DCP's ``.metadata``,
the ``data.pkl`` record of a ``torch.save`` blob (how a DCP tensor entry describes its storage), the plain values
DCP stores as bytes (learning rates, betas, step counters), and torch_xla's ``.manager_metadata``.

Each reader is an unpickler whose `find_class` knows a short list of names and answers each with a stand-in of
this module (a `Record` holding the attributes the pickle sets, a dtype name, a tuple), never with the class the
pickle names: nothing is imported, constructed or called on the pickle's behalf (one exception: a naive
``datetime`` is rebuilt from its 10 bytes by the standard library's own constructor). Any other name is a
`CorruptCheckpointError` naming the class and the file. Records are data: callers validate every field before
using it. No torch here.
"""

from __future__ import annotations

import datetime
import io
import pickle
import pickletools
import struct
from dataclasses import dataclass
from typing import Any

from ..core.errors import CorruptCheckpointError

# torch.save's legacy storage classes and the element each holds (zarr dtype names).
STORAGE_DTYPES = {"DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
                  "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
                  "ByteStorage": "uint8", "BoolStorage": "bool", "BFloat16Storage": "bfloat16",
                  "ComplexDoubleStorage": "complex128", "ComplexFloatStorage": "complex64"}
TORCH_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "uint16",
                "uint32", "uint64", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
                "float8_e4m3fnuz", "float8_e5m2fnuz")


class Record:
    """A stand-in for an instance of a known class: the attributes its pickle sets, nothing run."""

    kind = "record"

    def __init__(self, *args: Any):
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and all(isinstance(p, (dict, type(None))) for p in state):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots) of a class with __slots__
        if isinstance(state, dict):
            self.__dict__.update({k: v for k, v in state.items() if isinstance(k, str) and k != "args"})
        else:
            self.__dict__["state"] = state  # a class's own __getstate__ (TensorProperties: a tuple)

    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)

    def __repr__(self) -> str:
        return f"{self.kind}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


def _record(kind: str) -> type[Record]:
    return type(kind, (Record,), {"kind": kind})


@dataclass(frozen=True)
class DType:
    """A torch dtype a pickle named (``torch.float32``), by its zarr name."""

    name: str


@dataclass(frozen=True)
class StorageRef:
    """The persistent id of a ``torch.save`` storage: element type, the archive record holding its bytes, and
    its size in elements (legacy typed storages) or bytes (``UntypedStorage``, dtype None)."""

    dtype: str | None
    key: str
    numel: int


@dataclass(frozen=True)
class TensorRecord:
    """A tensor of a ``torch.save`` blob: where its elements are in its storage."""

    storage: StorageRef
    dtype: str
    storage_offset: int  # in elements
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _size(*args: Any) -> tuple:
    return tuple(args[0]) if args and isinstance(args[0], (tuple, list)) else ()


def _identity(*args: Any) -> Any:
    return args[0] if len(args) == 1 else args


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any) -> TensorRecord:
    if not isinstance(storage, StorageRef) or storage.dtype is None:
        raise CorruptCheckpointError("a tensor record whose storage is not a typed storage")
    return TensorRecord(storage, storage.dtype, offset, _tuple(size), _tuple(stride))


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, _grad: Any, _hooks: Any, dtype: Any,
                *_rest: Any) -> TensorRecord:
    if not isinstance(storage, StorageRef) or not isinstance(dtype, DType):
        raise CorruptCheckpointError("a tensor record without a storage and a dtype")
    return TensorRecord(storage, dtype.name, offset, _tuple(size), _tuple(stride))


def _tuple(value: Any) -> tuple:
    if not isinstance(value, (tuple, list)):
        raise CorruptCheckpointError(f"a tensor record with size or stride {type(value).__name__}")
    return tuple(value)


def _datetime(*args: Any) -> datetime.datetime | None:
    # A naive datetime pickles as its 10-byte state; anything else (a time zone object) is not rebuilt.
    if len(args) == 1 and isinstance(args[0], bytes) and len(args[0]) == 10:
        try:
            return datetime.datetime(args[0])
        except (TypeError, ValueError):
            return None
    return None


def _ordered_dict(*args: Any) -> dict:
    return dict(*args[:1]) if args and isinstance(args[0], (list, tuple, dict)) else {}


_DCP_CLASSES = {("torch.distributed.checkpoint.metadata", name): _record(name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta")}
_DCP_CLASSES.update({
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _record("_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): _identity,
    ("torch.serialization", "_get_layout"): _identity,
    ("torch", "Size"): _size,
    ("pathlib", "PosixPath"): lambda *parts: "/".join(str(p) for p in parts),
    ("pathlib", "WindowsPath"): lambda *parts: "\\".join(str(p) for p in parts),
    ("builtins", "set"): lambda *args: list(args[0]) if args else [],  # StorageMeta.modules in some versions
})
_DTYPES = {("torch", name): DType(name) for name in TORCH_DTYPES}
_TENSOR_CLASSES = {("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
                   ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
                   ("collections", "OrderedDict"): _ordered_dict}
_VALUE_CLASSES = {("collections", "OrderedDict"): _ordered_dict, ("torch", "Size"): _size}
_MANAGER_CLASSES = {("torch_xla.experimental.distributed_checkpoint.manager", "_CheckpointMetadata"):
                    _record("_CheckpointMetadata"),
                    ("datetime", "datetime"): lambda *args: _datetime(*args)}


class _Restricted(pickle.Unpickler):
    def __init__(self, data: bytes, known: dict, where: str, *, storages: bool = False):
        super().__init__(io.BytesIO(data))
        self._known, self._where, self._storages = known, where, storages

    def find_class(self, module: str, name: str) -> Any:
        found = self._known.get((module, name))
        if found is None:
            raise CorruptCheckpointError(f"{self._where}: refusing to load class {module}.{name} (only the "
                                         f"records of the format are read, and no code from a checkpoint is run)")
        return found

    def persistent_load(self, pid: Any) -> Any:
        if not self._storages:
            raise CorruptCheckpointError(f"{self._where}: unexpected persistent id in the pickle")
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[2], str)
                and isinstance(pid[4], int) and not isinstance(pid[4], bool) and pid[4] >= 0):
            raise CorruptCheckpointError(f"{self._where}: malformed storage reference {str(pid)[:200]}")
        kind = pid[1]
        if kind == "UntypedStorage":
            dtype = None
        elif isinstance(kind, str) and kind in STORAGE_DTYPES:
            dtype = STORAGE_DTYPES[kind]
        else:
            raise CorruptCheckpointError(f"{self._where}: unknown storage type {str(kind)[:100]}")
        return StorageRef(dtype, pid[2], pid[4])


_STORAGE_NAMES = {("torch", name): name for name in STORAGE_DTYPES} | {("torch.storage", "UntypedStorage"):
                                                                       "UntypedStorage",
                                                                       ("torch", "UntypedStorage"): "UntypedStorage"}


def _check_counted_bytearrays(data: bytes, where: str) -> None:
    """`CorruptCheckpointError` for a pickle holding a BYTEARRAY8 opcode (0x96) that declares more bytes than the
    whole pickle has. CPython's unpickler allocates that size before reading, and where the allocation fails it
    leaves a bytearray whose deallocation prints "SystemError: deallocated bytearray object has exported
    buffers" on stderr (seen on damaged DCP ``.metadata`` files). Only a pickle with a 0x96 byte followed by
    such a length is walked opcode by opcode (`pickletools.genops`, which reads no more than the data holds)
    to tell an opcode from a byte inside another one's argument."""
    at = data.find(_BYTEARRAY8)
    while at >= 0 and int.from_bytes(data[at + 1:at + 9], "little") <= len(data):
        at = data.find(_BYTEARRAY8, at + 1)
    if at < 0:
        return
    try:
        for _ in pickletools.genops(data):
            pass
    except (ValueError, EOFError, OverflowError, struct.error) as exc:
        raise CorruptCheckpointError(f"{where}: not a readable pickle ({exc})"[:500]) from None


_BYTEARRAY8 = b"\x96"


def _load(data: bytes, known: dict, where: str, *, storages: bool = False) -> Any:
    _check_counted_bytearrays(data, where)
    try:
        return _Restricted(data, known, where, storages=storages).load()
    except CorruptCheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            RecursionError, OverflowError, MemoryError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{where}: not a readable pickle ({type(exc).__name__}: {exc})"[:500]) from None


def load_dcp_metadata(data: bytes, where: str) -> Record:
    """DCP's ``Metadata`` record from a ``.metadata`` file's bytes. `CorruptCheckpointError` naming `where` for
    anything but DCP's records, torch sizes, dtypes and plain values."""
    found = _load(data, {**_DCP_CLASSES, **_DTYPES}, where)
    if not isinstance(found, Record) or found.kind != "Metadata":
        raise CorruptCheckpointError(f"{where}: holds a {type(found).__name__}, not DCP's Metadata")
    return found


def load_tensor_record(data: bytes, where: str) -> TensorRecord:
    """The tensor a ``torch.save`` blob's ``data.pkl`` describes (storage, offset, size, stride, dtype)."""
    found = _load(data, {**_TENSOR_CLASSES, **_DTYPES, **_STORAGE_NAMES}, where, storages=True)
    if not isinstance(found, TensorRecord):
        raise CorruptCheckpointError(f"{where}: holds a {type(found).__name__}, not a tensor")
    return found


def load_value(data: bytes, where: str) -> Any:
    """A plain value (numbers, strings, None, bools, and tuples, lists and dicts of them) from a ``data.pkl``;
    `CorruptCheckpointError` naming the class for anything else (a tensor, an object)."""
    return _load(data, dict(_VALUE_CLASSES), where)


def load_manager_marker(data: bytes, where: str) -> tuple[int, float | None]:
    """The step a torch_xla CheckpointManager's ``.manager_metadata`` records, and its save time (seconds since
    the epoch; None if it records none)."""
    found = _load(data, dict(_MANAGER_CLASSES), where)
    step = found.get("step") if isinstance(found, Record) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CorruptCheckpointError(f"{where}: records no step")
    ts = found.get("ts")
    return step, ts.timestamp() if isinstance(ts, datetime.datetime) else None
