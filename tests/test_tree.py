"""State-tree flattening and the JSON structure encoding."""

from __future__ import annotations

import collections
import json
import math

import pytest

from xla_tensorstore_ckpt.core import tree
from xla_tensorstore_ckpt.core.errors import CorruptCheckpointError, UnsupportedValueError


def _roundtrip(value):
    encoded = tree.encode(value, lambda _p, v: tree.encode_value(v))
    text = json.dumps(encoded, allow_nan=False)
    return tree.decode(json.loads(text), lambda _p, n: tree.decode_value(n, where="t"), where="t")


def test_structure_round_trips_with_int_keys_tuples_and_empty_containers():
    value = {"state": {0: {"step": 3}, 1: {}}, "param_groups": [{"params": [0, 1], "betas": (0.9, 0.99),
                                                                  "foreach": None, "name": "g"}], "l": [], "t": ()}
    assert _roundtrip(value) == value
    assert isinstance(_roundtrip(value)["param_groups"][0]["betas"], tuple)


def test_non_finite_floats_round_trip():
    out = _roundtrip({"a": float("inf"), "b": float("-inf"), "c": float("nan"), "d": 1.0, "e": 1})
    assert out["a"] == math.inf and out["b"] == -math.inf and math.isnan(out["c"])
    assert isinstance(out["d"], float) and isinstance(out["e"], int)


def test_flatten_lists_key_paths():
    assert tree.flatten({"a": [1, {"b": 2}], 3: "x"}) == [(("a", 0), 1), (("a", 1, "b"), 2), ((3,), "x")]


@pytest.mark.parametrize("bad", [{(1, 2): 1}, {True: 1}, {1.5: 2}], ids=["tuple", "bool", "float"])
def test_unsupported_keys_are_rejected(bad):
    with pytest.raises(UnsupportedValueError):
        tree.flatten(bad)


def test_root_must_be_a_container():
    with pytest.raises(UnsupportedValueError):
        tree.flatten(3)


def test_rebuild_keeps_container_types():
    Point = collections.namedtuple("Point", "x y")
    value = collections.OrderedDict(a=Point(1, 2), b=[3])
    out = tree.rebuild(value, lambda _p, v: v * 10)
    assert type(out) is collections.OrderedDict and type(out["a"]) is Point
    assert out == collections.OrderedDict(a=Point(10, 20), b=[30])


@pytest.mark.parametrize("node", [[], {"dict": 3}, {"dict": [[1.5, {"value": 1}]]}, {"bogus": 1},
                                  {"dict": [["a", {"value": 1}], ["a", {"value": 2}]]}, {"value": [1]}],
                         ids=["list", "dict-body", "float-key", "kind", "dup-key", "non-scalar"])
def test_malformed_structure_is_corrupt(node):
    with pytest.raises(CorruptCheckpointError):
        tree.decode(node, lambda _p, n: tree.decode_value(n, where="t"), where="t")


def test_deep_nesting_is_rejected():
    node = {"value": 1}
    for _ in range(tree.MAX_DEPTH + 5):
        node = {"list": [node]}
    with pytest.raises(CorruptCheckpointError):
        tree.decode(node, lambda _p, n: tree.decode_value(n, where="t"), where="t")
