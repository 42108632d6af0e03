"""The manager's plan cache (`save_plan.PlanCache`): a save whose state keeps its keys, kinds, shapes, dtypes and
shardings reuses the array part of the last plan with the new values; anything else is planned afresh."""

from __future__ import annotations

import pytest
import torch
from conftest import sharded

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt.saves import save_plan


def state(mesh, seed: int, spec=("x", "y"), **extra) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": sharded(torch.randn(16, 8, generator=g), mesh, spec), "cpu": torch.randn(3, generator=g),
            "n": seed, "s": f"run-{seed}", **extra}


@pytest.mark.xla
def test_a_hit_reuses_layouts_and_takes_the_new_values(mesh_4x2):
    cache = save_plan.PlanCache()
    first = save_plan.plan_save(state(mesh_4x2, 1), cache=cache)
    second_state = state(mesh_4x2, 2)
    second = save_plan.plan_save(second_state, cache=cache)
    fresh = save_plan.plan_save(second_state)
    assert second.arrays[0].layout is first.arrays[0].layout  # reused, not recomputed
    assert second.manifest == fresh.manifest and second.strings == fresh.strings == {"s": "run-2"}
    assert [p.value is v for p, v in zip(second.arrays, (second_state["w"], second_state["cpu"]))] == [True, True]
    assert [(p.meta, p.writes, p.writes_metadata) for p in second.arrays] == [
        (p.meta, p.writes, p.writes_metadata) for p in fresh.arrays]
    assert second.arrays[2].value.item() == 2  # the scalar leaf "n" holds the new value


@pytest.mark.xla
def test_a_change_of_sharding_shape_or_kind_plans_afresh(mesh_4x2):
    cache = save_plan.PlanCache()
    save_plan.plan_save(state(mesh_4x2, 1), cache=cache)
    for changed in (state(mesh_4x2, 2, spec=("y", None)), state(mesh_4x2, 3, extra=torch.zeros(2)),
                    {**state(mesh_4x2, 4), "n": "four", "s": 4}):  # a scalar and a string swap kinds
        got = save_plan.plan_save(changed, cache=cache)
        fresh = save_plan.plan_save(changed)
        assert got.manifest == fresh.manifest and got.strings == fresh.strings
        assert [(p.key_path, p.meta, p.layout, p.writes) for p in got.arrays] == [
            (p.key_path, p.meta, p.layout, p.writes) for p in fresh.arrays]


@pytest.mark.xla
def test_manager_saves_with_the_cache_restore_their_own_values(tmp_path, mesh_4x2):
    with xtc.CheckpointManager(tmp_path, xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=None)) as m:
        for step in (1, 2, 3):
            m.save(step, model=state(mesh_4x2, step, spec=("x", "y") if step < 3 else (None, "x")))
    for step in (1, 2, 3):
        restored = xtc.restore(tmp_path / str(step) / "model")
        expected = state(mesh_4x2, step)
        assert torch.equal(restored["w"], expected["w"].cpu()) and torch.equal(restored["cpu"], expected["cpu"])
        assert restored["n"] == step and restored["s"] == f"run-{step}"


@pytest.mark.xla
def test_a_new_global_mesh_plans_afresh(mesh_4x2):
    import torch_xla.distributed.spmd as xs
    from conftest import make_mesh

    before = xs.get_global_mesh()
    cache = save_plan.PlanCache()
    try:
        xs.set_global_mesh(mesh_4x2)
        save_plan.plan_save(state(mesh_4x2, 1), cache=cache)
        key = cache.key
        renamed = make_mesh((4, 2), ("data", "model"))  # the same shardings; the saved mesh names differ
        xs.set_global_mesh(renamed)
        got = save_plan.plan_save(state(renamed, 2, spec=("data", "model")), cache=cache)
        assert cache.key != key
        assert got.manifest == save_plan.plan_save(state(renamed, 2, spec=("data", "model"))).manifest
    finally:
        xs.set_global_mesh(before)


def test_local_shards_cache_their_hash_but_do_not_carry_it_to_other_processes():
    import pickle

    from xla_tensorstore_ckpt.core.tensor_layout import LocalShard

    shard = LocalShard(3, "xla:3", ((0, 4), (2, 6)), 1)
    assert hash(shard) == hash(LocalShard(3, "xla:3", ((0, 4), (2, 6)), 1)) and shard.size == 16
    copied = pickle.loads(pickle.dumps(shard))  # noqa: S301 (what torch.distributed's object exchange does)
    assert copied == shard and "_hash" not in vars(copied) and "size" not in vars(copied)
