"""Orbax manager roots whose items are not named as ours: a root saved with ``StandardSave`` alone (Orbax names its
one item ``default``), a MaxText-style root (one item ``items``), and a Composite root of two array items. The
manager restores ``model=`` from a step's only array item, and ``items=`` picks one among several. The roots are
written by real Orbax in a JAX process of its own (tests/scripts/orbax_tool.py)."""

from __future__ import annotations

import logging

import orbax_trees
import pytest
import torch
from orbax_process import orbax

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt.core import dtypes

SPECS = ["default", "items", "params,opt_state"]


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("orbax-item-names")
    orbax("manager_items", base, *SPECS)
    return base


def zeros() -> dict:
    return {"embed": torch.zeros(32, 16), "head": torch.zeros(16, 4, dtype=torch.bfloat16)}


def equals_model(model: dict, step: int) -> bool:
    expected = {k: dtypes.numpy_to_tensor(v.copy()) for k, v in orbax_trees.model(step).items()}
    return all(torch.equal(model[k], v) for k, v in expected.items())


def manager(root) -> xtc.CheckpointManager:
    return xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(save_interval_steps=1, save_rng=False))


@pytest.mark.parametrize("item", ["default", "items"])
def test_a_steps_only_array_item_restores_into_model(roots, item, caplog):
    with manager(roots / item) as m:
        assert m.all_steps() == [1, 2] and m.metadata(2).items == (item,)
        model = zeros()
        with caplog.at_level(logging.INFO, logger="xla_tensorstore_ckpt"):
            assert m.restore("latest", model=model) == 2
        assert equals_model(model, 2)
        assert f"has no 'model' item: restoring model from its only item holding arrays, '{item}'" in caplog.text
        model = zeros()
        assert m.restore(1, model=model, items={"model": item}) == 1  # the same, said explicitly
        assert equals_model(model, 1)
        with pytest.raises(xtc.ItemNotFoundError, match=f"has no 'extra' item for extra= \\(it holds {item}\\)"):
            m.restore("latest", model=zeros(), extra={})  # a user error, not damage: raised


def test_several_array_items_need_items(roots):
    root = roots / "params,opt_state"
    with manager(root) as m:
        assert sorted(m.metadata(2).items) == ["opt_state", "params"]
        with pytest.raises(xtc.ItemNotFoundError, match=r"several that hold arrays \((opt_state, params|params, "
                                                        r"opt_state)\): pass items=") as err:
            m.restore("latest", model=zeros())
        assert err.value.item == "model" and str(root / "2") in str(err.value)
        model = zeros()
        assert m.restore("latest", model=model, items={"model": "opt_state"}) == 2
        assert equals_model(model, 12)  # item 1 of the spec holds model(step + 10)
        model, extra = zeros(), zeros()
        assert m.restore(2, model=model, extra=extra, items={"model": "params", "extra": "opt_state"}) == 2
        assert equals_model(model, 2) and equals_model(extra, 12)
        with pytest.raises(xtc.ItemNotFoundError, match="has no 'weights' item for model="):
            m.restore("latest", model=zeros(), items={"model": "weights"})
        with pytest.raises(xtc.UsageError, match="not an object given to restore"):
            m.restore("latest", model=zeros(), items={"optimizer": "opt_state"})
        with pytest.raises(xtc.UsageError, match="must be the name of an item"):
            m.restore("latest", model=zeros(), items={"model": "../params"})
