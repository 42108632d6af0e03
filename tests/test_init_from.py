"""`CheckpointManager.restore(..., init_from=...)` starts a run from an item of this library or one Orbax wrote
(as from Hugging Face weights, tests/test_hf_import.py): the model is restored in place onto its own mesh while
no step is committed, and a committed step wins once there is one."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from conftest import make_mesh, sharded
from xla_stack import torch_xla

import xla_tensorstore_ckpt as xtc

sys.path.insert(0, os.path.dirname(__file__))
import orbax_trees  # noqa: E402

ORBAX_ITEM = os.path.join(os.path.dirname(__file__), "golden", "orbax-0.11", "root", "2", "model")


class Model(torch.nn.Module):
    """The model of orbax_trees.model(): a float32 parameter and a bfloat16 buffer, sharded on `mesh`."""

    def __init__(self, mesh):
        super().__init__()
        self.embed = torch.nn.Parameter(sharded(torch.zeros(32, 16), mesh, ("x", "y")))
        self.register_buffer("head", sharded(torch.zeros(16, 4, dtype=torch.bfloat16), mesh, (None, "y")))


def expected() -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(value.view("uint16")).view(torch.bfloat16) if value.dtype.itemsize == 2
            else torch.from_numpy(value) for name, value in orbax_trees.model(2).items()}


@pytest.fixture(params=["ours", "orbax"])
def source(request, tmp_path) -> str:
    """An item holding `expected()`: saved by this library from another mesh, or by Orbax 0.11 (golden)."""
    if request.param == "orbax":
        return ORBAX_ITEM
    other = make_mesh((2, 4), ("a", "b"))
    xtc.save(tmp_path / "weights", {"embed": sharded(expected()["embed"], other, ("b", "a")),
                                    "head": sharded(expected()["head"], other, ("a", None))})
    return str(tmp_path / "weights")


@pytest.mark.xla
def test_a_run_starts_from_an_item_until_a_step_is_committed(source, tmp_path, mesh_4x2):
    model = Model(mesh_4x2)
    root = tmp_path / "run"
    with xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(save_interval_steps=1)) as manager:
        assert manager.restore("latest", model=model, init_from=source) is None
        torch_xla.sync()
        for name, value in expected().items():
            got = getattr(model, name)
            assert torch_xla._XLAC._get_xla_sharding_spec(got) != "", name  # in place: its sharding kept
            assert got.dtype == value.dtype and torch.equal(got.cpu(), value), name
        with torch.no_grad():
            model.embed.add_(1.0)
        manager.save(3, model=model)
        manager.wait_until_finished()
    model = Model(mesh_4x2)
    with xtc.CheckpointManager(root) as manager:  # a committed step wins over init_from
        assert manager.restore("latest", model=model, init_from=source) == 3
    assert torch.equal(model.embed.cpu(), expected()["embed"] + 1.0)


@pytest.mark.xla
def test_init_from_reports_keys_the_model_lacks(source, tmp_path, mesh_4x2):
    class Larger(Model):
        def __init__(self, mesh):
            super().__init__(mesh)
            self.extra = torch.nn.Parameter(torch.zeros(2, device="xla"))

    with xtc.CheckpointManager(tmp_path / "run") as manager:
        with pytest.raises(xtc.KeyMismatchError) as err:
            manager.restore("latest", model=Larger(mesh_4x2), init_from=source)
    assert err.value.missing == ("extra",)
