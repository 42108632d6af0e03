"""State trees: nested dicts, lists and tuples whose leaves are tensors or JSON scalars.

`flatten` lists the leaves with their key paths, `encode`/`decode` turn a tree's structure into JSON and back
(integer dict keys, tuples and empty containers included), and `rebuild` maps leaves to new values keeping the
containers' types. Pure Python; called by the checkpointer and the manager.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from .errors import CorruptCheckpointError, UnsupportedValueError
from .layout import KeyEntry, KeyPath

JSON_SCALARS = (bool, int, float, str, type(None))
MAX_DEPTH = 100


def format_key_path(path: KeyPath) -> str:
    """Human-readable key path for messages: ``state/0/exp_avg``."""
    return "/".join(str(k) for k in path) or "<root>"


def is_container(value: Any) -> bool:
    return isinstance(value, (dict, list, tuple))


def flatten(tree: Any) -> list[tuple[KeyPath, Any]]:
    """All leaves of `tree` with their key paths, in insertion order.

    Raises `UnsupportedValueError` if the root is not a container, a dict key is neither str nor int, or the
    nesting is deeper than `MAX_DEPTH`.
    """
    if not is_container(tree):
        raise UnsupportedValueError(f"a checkpoint tree must be a dict, list or tuple, not {type(tree).__name__}")
    return list(_walk(tree, ()))


def _walk(node: Any, path: KeyPath) -> Iterator[tuple[KeyPath, Any]]:
    if len(path) > MAX_DEPTH:
        raise UnsupportedValueError(f"tree nesting deeper than {MAX_DEPTH} at {format_key_path(path[:5])}/...")
    if isinstance(node, dict):
        for key, child in node.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise UnsupportedValueError(
                    f"dict key {key!r} at {format_key_path(path)} is not a str or int")
            yield from _walk(child, (*path, key))
    elif isinstance(node, (list, tuple)):
        for index, child in enumerate(node):
            yield from _walk(child, (*path, index))
    else:
        yield path, node


def rebuild(tree: Any, fn: Callable[[KeyPath, Any], Any]) -> Any:
    """A copy of `tree` whose leaves are ``fn(path, leaf)``; dicts (OrderedDict too), lists, tuples and
    namedtuples keep their types."""
    return _rebuild(tree, (), fn)


def _rebuild(node: Any, path: KeyPath, fn: Callable[[KeyPath, Any], Any]) -> Any:
    if isinstance(node, dict):
        items = [(k, _rebuild(v, (*path, k), fn)) for k, v in node.items()]
        return type(node)(items) if type(node) is not dict and _constructible(type(node)) else dict(items)
    if isinstance(node, list):
        return [_rebuild(v, (*path, i), fn) for i, v in enumerate(node)]
    if isinstance(node, tuple):
        values = [_rebuild(v, (*path, i), fn) for i, v in enumerate(node)]
        return type(node)(*values) if hasattr(node, "_fields") else tuple(values)
    return fn(path, node)


def _constructible(cls: type) -> bool:
    try:
        cls([])
    except TypeError:
        return False
    return True


def encode(tree: Any, encode_leaf: Callable[[KeyPath, Any], dict]) -> dict:
    """The JSON form of `tree`'s structure; `encode_leaf` gives each leaf's JSON node."""
    return _encode(tree, (), encode_leaf)


def _encode(node: Any, path: KeyPath, encode_leaf: Callable[[KeyPath, Any], dict]) -> dict:
    if isinstance(node, dict):
        return {"dict": [[k, _encode(v, (*path, k), encode_leaf)] for k, v in node.items()]}
    if isinstance(node, list):
        return {"list": [_encode(v, (*path, i), encode_leaf) for i, v in enumerate(node)]}
    if isinstance(node, tuple):
        return {"tuple": [_encode(v, (*path, i), encode_leaf) for i, v in enumerate(node)]}
    return encode_leaf(path, node)


def decode(node: Any, decode_leaf: Callable[[KeyPath, dict], Any], *, where: str) -> Any:
    """Inverse of `encode`. Raises `CorruptCheckpointError` naming `where` for malformed input."""
    return _decode(node, (), decode_leaf, where)


def _decode(node: Any, path: KeyPath, decode_leaf: Callable[[KeyPath, dict], Any], where: str) -> Any:
    if len(path) > MAX_DEPTH:
        raise CorruptCheckpointError(f"{where}: tree nesting deeper than {MAX_DEPTH}")
    if not isinstance(node, dict) or len(node) != 1:
        raise CorruptCheckpointError(f"{where}: malformed tree node at {format_key_path(path)}")
    (kind, body), = node.items()
    if kind == "dict":
        if not isinstance(body, list):
            raise CorruptCheckpointError(f"{where}: malformed dict at {format_key_path(path)}")
        out: dict[KeyEntry, Any] = {}
        for pair in body:
            if (not isinstance(pair, list) or len(pair) != 2 or isinstance(pair[0], bool)
                    or not isinstance(pair[0], (str, int)) or pair[0] in out):
                raise CorruptCheckpointError(f"{where}: malformed dict entry at {format_key_path(path)}")
            out[pair[0]] = _decode(pair[1], (*path, pair[0]), decode_leaf, where)
        return out
    if kind in ("list", "tuple"):
        if not isinstance(body, list):
            raise CorruptCheckpointError(f"{where}: malformed {kind} at {format_key_path(path)}")
        items = [_decode(v, (*path, i), decode_leaf, where) for i, v in enumerate(body)]
        return items if kind == "list" else tuple(items)
    return decode_leaf(path, node)


def encode_value(value: Any) -> dict:
    """JSON node of a scalar leaf; non-finite floats are spelled out because JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    return {"value": value}


def decode_value(node: dict, *, where: str) -> Any:
    """Inverse of `encode_value`."""
    if "value" in node:
        value = node["value"]
        if not isinstance(value, JSON_SCALARS):
            raise CorruptCheckpointError(f"{where}: value {value!r} is not a JSON scalar")
        return value
    if node.get("float") in ("nan", "inf", "-inf"):
        return float(node["float"])
    raise CorruptCheckpointError(f"{where}: unknown leaf node {sorted(node)}")
