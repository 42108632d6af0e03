"""The pickle-free encoding of the small records processes exchange (`Coordinator.all_gather`, `broadcast`):
tagged JSON bytes. Plain JSON values travel as they are; tuples, sets, frozensets, dicts with keys that are not
strings, and the frozen dataclasses named in `RECORDS` carry a tag. Decoding builds only these types, so a
message can never run code. Pure Python; raises `UsageError` for a value of another type (a bug of the caller).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from functools import cache
from typing import Any

from ..core.errors import CoordinationError, UsageError

# The dataclasses that may travel: name -> the module defining it, under the package's root (imported on first
# use, by name: the folders above this one import it, not the other way round).
RECORDS = {"StepMetadata": "core.records", "Holdings": "checkpoint_manager.peer_copies",
           "StepFiles": "checkpoint_manager.peer_copies", "Geometry": "restores.replica_plans"}
_ROOT = __package__.rpartition(".")[0]


@cache
def _record(name: str) -> type:
    return getattr(importlib.import_module(f"{_ROOT}.{RECORDS[name]}"), name)


def encode(value: Any) -> bytes:
    """`value` as UTF-8 JSON bytes. Raises `UsageError` for a type that may not travel."""
    return json.dumps(_tagged(value), separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """The value `encode` made `data` from. Raises `CoordinationError` if `data` is not such an encoding."""
    try:
        return _untagged(json.loads(data.decode()))
    except (ValueError, KeyError, TypeError) as exc:
        raise CoordinationError(f"a message from another process is not a record of this library: {exc}") from exc


def _tagged(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_tagged(v) for v in value]
    if isinstance(value, tuple):
        return {"t": [_tagged(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {"f": sorted((_tagged(v) for v in value), key=json.dumps)}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {"d": {k: _tagged(v) for k, v in value.items()}}
        return {"m": [[_tagged(k), _tagged(v)] for k, v in value.items()]}
    name = type(value).__qualname__
    if name in RECORDS and _record(name) is type(value):
        return {"r": name, "v": {f.name: _tagged(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    raise UsageError(f"a value of type {type(value).__name__} cannot travel between processes")


def _untagged(value: Any) -> Any:
    if not isinstance(value, (dict, list)):
        return value
    if isinstance(value, list):
        return [_untagged(v) for v in value]
    if "t" in value:
        return tuple(_untagged(v) for v in value["t"])
    if "f" in value:
        return frozenset(_untagged(v) for v in value["f"])
    if "d" in value:
        return {k: _untagged(v) for k, v in value["d"].items()}
    if "m" in value:
        return {_untagged(k): _untagged(v) for k, v in value["m"]}
    return _record(value["r"])(**{k: _untagged(v) for k, v in value["v"].items()})
