"""Names on disk: format 1's key-path escaping (reversible, one safe path segment per key, never escaping the item
directory), step names, relative paths."""

from __future__ import annotations

import pytest

from xla_tensorstore_ckpt import storage
from xla_tensorstore_ckpt.checkpoint_manager.steps import StepIndex
from xla_tensorstore_ckpt.core import layout
from xla_tensorstore_ckpt.formats import v1

ROUND_TRIP = [
    "weight", "layers.0.attn.q_proj.weight", "_orig_mod.w", 0, 7, -3, "0", "007", "-1", "", ".", "..", "...",
    "a/b", "/etc/passwd", "../../x", "a\\b", "nul\x00byte", "ünïcødé", "日本語", "%41", "%", "x%y",
    "_METADATA", "_CHECKPOINT_METADATA", "zarr.json", "c", "with space", "[0:4]", "~tilde",
]


@pytest.mark.parametrize("key", ROUND_TRIP, ids=repr)
def test_component_round_trips_and_is_one_safe_segment(key):
    name = v1.escape_component(key)
    assert v1.unescape_component(name) == key
    assert type(v1.unescape_component(name)) is type(key)
    assert "/" not in name and "\\" not in name and "\x00" not in name
    assert name not in ("", ".", "..", layout.ITEM_METADATA, layout.CHECKPOINT_METADATA, layout.ZARR_METADATA)
    assert layout.is_safe_relative_path(name)


def test_escaping_is_injective_over_the_examples():
    names = [v1.escape_component(k) for k in ROUND_TRIP]
    assert len(set(names)) == len(names)


def test_int_and_digit_string_keys_differ():
    assert v1.escape_component(0) == "0"
    assert v1.escape_component("0") != "0"


def test_long_names_are_shortened_and_stay_distinct():
    a, b = "x" * 1000, "x" * 999 + "y"
    ea, eb = v1.escape_component(a), v1.escape_component(b)
    assert len(ea) <= v1.MAX_COMPONENT_LENGTH and len(eb) <= v1.MAX_COMPONENT_LENGTH
    assert ea != eb


def test_array_path_joins_components():
    assert v1.array_path(("state", 0, "exp_avg")) == "state/0/exp_avg"


@pytest.mark.parametrize("path", ["", "/abs", "a/../b", "..", "a//b", "a/./b", "a\\b", "a\x00"], ids=repr)
def test_unsafe_relative_paths_are_rejected(path):
    assert not layout.is_safe_relative_path(path)


@pytest.mark.parametrize("name, prefix, any_prefix, step, width", [
    ("23", None, False, 23, None), ("0", None, False, 0, None), ("0023", None, False, 23, 4),
    ("00000", None, False, 0, 5), ("checkpoint_0023", "checkpoint", False, 23, 4),
    ("checkpoint_0023", None, True, 23, 4),
    ("checkpoint_23", "checkpoint", False, 23, None), ("0023", "checkpoint", False, None, None),
    ("checkpoint_0023", None, False, None, None), ("-1", None, False, None, None), ("2a", None, False, None, None),
    ("", None, False, None, None)],
    ids=["plain", "zero", "padded", "padded-zero", "prefixed-padded", "any-prefix-padded", "prefixed", "no-prefix",
         "unexpected-prefix", "negative", "letters", "empty"])
def test_step_names_plain_prefixed_and_zero_padded_as_orbax_writes_them(name, prefix, any_prefix, step, width):
    assert layout.parse_step_name(name, prefix, any_prefix=any_prefix) == step
    assert layout.step_name_width(name, prefix, any_prefix=any_prefix) == width
    if step is not None and not any_prefix:
        assert layout.step_name(step, prefix, width) == name  # the name round-trips


def test_a_step_index_names_new_steps_as_the_root_names_its_steps(tmp_path):
    root = storage.location(str(tmp_path))
    assert StepIndex(root).location(7).name == "7"  # an empty root: plain numbers
    (tmp_path / "0002").mkdir()
    assert StepIndex(root).location(7).name == "0007"  # learned from a listing
    index = StepIndex(root, "ckpt")
    (tmp_path / "ckpt_000003.orbax-checkpoint-tmp-12").mkdir()  # a save under way is named as the others
    assert [e.step for e in index.scan()] == [3] and index.location(12345678).name == "ckpt_12345678"
    assert index.location(4).name == "ckpt_000004"
