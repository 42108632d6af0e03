"""CheckpointManager in one process: resume rules, retention, commits, fresh-optimizer restore, bad input."""

from __future__ import annotations

import json
import os
import random
import warnings

import numpy as np
import pytest
import torch
from helpers import Net, cpu_state, options, train_steps, xla_net
from xla_stack import torch_xla

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import formats
from xla_tensorstore_ckpt.checkpoint_manager import policies
from xla_tensorstore_ckpt.core import layout


def spec(t):
    return torch_xla._XLAC._get_xla_sharding_spec(t)


# ------------------------------------------------------------------------------------------- resume rules


def test_resume_rules(tmp_path):
    with xtc.CheckpointManager(tmp_path, options()) as mgr:
        assert mgr.restore("latest", extra={"v": 0}) is None  # nothing committed
        for step in (1, 2, 3):
            mgr.save(step, extra={"v": step})
        extra = {"v": -1}
        assert mgr.restore(None, extra=extra) is None and extra["v"] == -1
        assert mgr.restore("latest", extra=extra) == 3 and extra["v"] == 3
        assert mgr.restore(2, extra=extra) == 2 and extra["v"] == 2
        with pytest.warns(UserWarning, match="step 7 is not committed.*newest committed step, 3"):
            assert mgr.restore(7, extra=extra) == 3
        assert extra["v"] == 3
        with pytest.raises(ValueError):
            mgr.restore("earliest", extra=extra)


def test_restore_warns_and_returns_none_when_requested_step_missing_and_nothing_committed(tmp_path):
    with xtc.CheckpointManager(tmp_path, options()) as mgr, pytest.warns(UserWarning, match="nothing"):
        assert mgr.restore(5, extra={"v": 0}) is None


# ------------------------------------------------------------------------------------ whole training state


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.Adam(p, lr=1e-2),
    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
], ids=["sgd-momentum", "adam", "adamw"])
@pytest.mark.xla
def test_fresh_optimizer_restores_with_parameter_sharding(tmp_path, mesh_4x2, mesh_2x4, make_opt):
    net = xla_net(mesh_4x2)
    opt = make_opt(net.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train_steps(net, opt, 2)
    sched.step()
    with xtc.CheckpointManager(tmp_path, options()) as mgr:
        mgr.save(2, model=net, optimizer=opt, lr_scheduler=sched)
    # A new model on another mesh, and an optimizer that has never stepped (no priming step).
    net2 = xla_net(mesh_2x4, seed=5)
    opt2 = make_opt(net2.parameters())
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    params_before = [id(p) for p in net2.parameters()]
    with xtc.CheckpointManager(tmp_path, options()) as mgr:
        assert mgr.restore("latest", model=net2, optimizer=opt2, lr_scheduler=sched2) == 2
    assert [id(p) for p in net2.parameters()] == params_before
    assert spec(net2.a.weight) == spec(xla_net(mesh_2x4).a.weight)  # kept its own (new) sharding
    for key, value in cpu_state(net).items():
        assert torch.equal(cpu_state(net2)[key], value), key
    for p, p2 in zip(net.parameters(), net2.parameters()):
        for name, value in opt.state[p].items():
            restored = opt2.state[p2][name]
            assert torch.equal(restored.cpu(), value.cpu()), name
            if restored.shape == p2.shape and restored.dim() > 0:
                assert restored.device.type == "xla" and spec(restored) == spec(p2), name
    assert sched2.state_dict() == sched.state_dict() and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    # Training continues identically.
    train_steps(net, opt, 1, seed=9)
    train_steps(net2, opt2, 1, seed=9)
    for key, value in cpu_state(net).items():
        torch.testing.assert_close(cpu_state(net2)[key], value, rtol=1e-5, atol=1e-6)


def draws():
    """One value of each generator the manager keeps; Python's and numpy's normal variates come in pairs, so the
    saved states hold a cached one."""
    import torch_xla.core.xla_model as xm

    return (torch.rand(3), random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(),
            torch.rand(2, device="xla").cpu(), xm.get_rng_state())


def seed_all(seed):
    import torch_xla.core.xla_model as xm

    torch.manual_seed(seed)
    random.seed(seed + 1)
    np.random.seed(seed + 2)
    xm.set_rng_state((1 << 63) + seed)  # XLA seeds use all 64 bits
    random.gauss(0, 1)
    np.random.randn()  # leave a cached normal variate in both


@pytest.mark.xla
def test_rng_states_are_saved_and_restored(tmp_path):
    with xtc.CheckpointManager(tmp_path, options()) as mgr:
        seed_all(3)
        mgr.save(1, extra={"x": 1})
        expected = draws()
        seed_all(99)
        mgr.restore("latest", extra={"x": 0})
        got = draws()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[5], expected[5])
    assert got[1:5] == expected[1:5] and got[6] == expected[6]
    info = xtc.metadata(tmp_path / "1" / "rng")
    assert info["torch"].shape[0] == 1 and info["torch"].chunk_shape[0] == 1  # one row per process


def read_back(*trees):
    """What a restore without a target gives for the rng item saved by len(trees) processes."""
    return {name: torch.cat([t[name].shards[0][1] for t in trees]) if isinstance(trees[0][name], xtc.ShardedArray)
            else trees[0][name] for name in trees[0]}


@pytest.mark.xla
def test_rng_rows_go_to_the_process_of_the_same_index_and_new_processes_derive_theirs():
    from xla_tensorstore_ckpt.checkpoint_manager import rng_state

    seed_all(10)
    row0 = rng_state.capture(0, 2)
    after0 = draws()
    seed_all(20)
    row1 = rng_state.capture(1, 2)
    after1 = draws()
    saved = read_back(row0, row1)
    for index, expected in ((0, after0), (1, after1)):
        rng_state.apply(saved, index, 2, where="test")
        got = draws()
        assert torch.equal(got[0], expected[0]) and got[1:5] == expected[1:5]
    derived = {}
    for index in (2, 3, 3):
        with pytest.warns(UserWarning, match=f"process {index} of 4 takes those of process {index % 2}"):
            rng_state.apply(saved, index, 4, where="test")
        derived.setdefault(index, []).append(draws())
    assert torch.equal(derived[3][0][0], derived[3][1][0]) and derived[3][0][1:5] == derived[3][1][1:5]  # same rule
    assert not torch.equal(derived[2][0][0], derived[3][0][0])  # but a stream of its own
    assert not torch.equal(derived[3][0][0], after1[0])


class _FakeCuda:
    """This machine has no GPU: CUDA's generator is a mock (one 16-byte state for the current device)."""

    def __init__(self, initialised=True):
        self.state, self.initialised, self.set = torch.arange(16, dtype=torch.uint8), initialised, []

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: self.initialised)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a: self.state.clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, *a: self.set.append(state.clone()))


def test_each_process_gets_its_own_cuda_generator_back(monkeypatch):
    """A DTensor job on GPUs (one device per process): each process's CUDA generator state is a row of its own
    and goes back to the process of the same index; a restore on a host without CUDA leaves it out."""
    from xla_tensorstore_ckpt.checkpoint_manager import rng_state

    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    rows = []
    for index in range(2):
        cuda.state = torch.arange(16, dtype=torch.uint8) + 100 * index
        rows.append(rng_state.capture(index, 2))
    saved = read_back(*rows)
    assert saved["cuda"].shape == (2, 16)
    for index in (1, 0):
        rng_state.apply(saved, index, 2, where="test")
    assert [s.tolist() for s in cuda.set] == [list(range(100, 116)), list(range(16))]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rng_state.apply(saved, 0, 2, where="test")  # no CUDA here: the row is not used
    assert len(cuda.set) == 2


def test_a_process_that_never_initialised_cuda_saves_no_cuda_generator(monkeypatch):
    from xla_tensorstore_ckpt.checkpoint_manager import rng_state

    cuda = _FakeCuda(initialised=False)
    cuda.install(monkeypatch)
    assert "cuda" not in rng_state.capture(0, 1)


@pytest.mark.xla
def test_extra_dict_updated_in_place_keeping_tensor_sharding(tmp_path, mesh_4x2):
    import torch_xla.distributed.spmd as xs

    counter = torch.arange(8.0).to("xla")
    xs.mark_sharding(counter, mesh_4x2, ("x",))
    torch_xla.sync()
    extra = {"position": 17, "counter": counter, "name": "run-a", "cpu": torch.ones(2)}
    with xtc.CheckpointManager(tmp_path, options()) as mgr:
        mgr.save(1, extra=extra)
        target_counter = torch.zeros(8).to("xla")
        xs.mark_sharding(target_counter, mesh_4x2, (None,))
        torch_xla.sync()
        target = {"position": 0, "counter": target_counter, "name": "", "cpu": torch.zeros(2)}
        cpu_before = target["cpu"]
        mgr.restore("latest", extra=target)
    assert target["position"] == 17 and target["name"] == "run-a"
    assert target["counter"] is target_counter and torch.equal(target_counter.cpu(), torch.arange(8.0))
    assert spec(target_counter) == "{replicated}"
    assert target["cpu"] is cpu_before and torch.equal(cpu_before, torch.ones(2))


class Loader:
    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_data_loader_state_and_fast_forward(tmp_path):
    loader = Loader()
    loader.position = 42
    with xtc.CheckpointManager(tmp_path, options()) as mgr:
        mgr.save(1, data_loader=loader)
        fresh = Loader()
        mgr.restore("latest", data_loader=fresh)
    assert fresh.position == 42
    assert list(xtc.skip_batches(range(10), 7)) == [7, 8, 9]
    assert list(xtc.skip_batches(range(3), 5)) == []


def test_raw_state_trees_are_restored_in_place(tmp_path):
    model_state = {"w": torch.ones(3), "b": torch.zeros(2)}
    with xtc.CheckpointManager(tmp_path, options()) as mgr:
        mgr.save(1, model=model_state)
        target = {"w": torch.zeros(3), "b": torch.ones(2)}
        w = target["w"]
        mgr.restore("latest", model=target)
    assert target["w"] is w and torch.equal(w, torch.ones(3)) and torch.equal(target["b"], torch.zeros(2))


@pytest.mark.xla
def test_restore_in_place_swaps_batch_by_batch(tmp_path, mesh_4x2):
    """Each batch is swapped in as soon as it is read (old device buffers freed as the restore goes): damaged
    data in the last tensor raises after the earlier tensors are already restored, in place."""
    import torch_xla.distributed.spmd as xs

    def sharded(value):
        t = value.to("xla")
        xs.mark_sharding(t, mesh_4x2, ("x", "y"))
        return t

    saved = {f"t{i}": torch.randn(64, 64) for i in range(3)}
    one_tensor_per_batch = xtc.RestoreOptions(read_batch_bytes=64 * 64 * 4)
    plain = xtc.SaveOptions(use_ocdbt=False)
    with xtc.CheckpointManager(tmp_path, options(restore_options=one_tensor_per_batch, save_options=plain)) as mgr:
        mgr.save(1, model={k: sharded(v) for k, v in saved.items()})
        chunk = next(p for p in (tmp_path).rglob("*") if p.is_file() and "t2" in p.parts and "c" in p.parts)
        data = bytearray(chunk.read_bytes())
        data[0] ^= 0xFF
        chunk.write_bytes(bytes(data))
        target = {k: sharded(torch.zeros(64, 64)) for k in saved}
        first = target["t0"]
        with pytest.raises(xtc.CorruptCheckpointError, match="t2"):
            mgr.restore("latest", model=target)
    assert target["t0"] is first and spec(first) == spec(sharded(torch.zeros(64, 64)))
    assert torch.equal(target["t0"].cpu(), saved["t0"]) and torch.equal(target["t1"].cpu(), saved["t1"])
    assert torch.equal(target["t2"].cpu(), torch.zeros(64, 64))


def test_save_plans_and_stages_with_the_garbage_collector_paused(tmp_path):
    import gc

    from xla_tensorstore_ckpt.saves import staging

    before = staging.FETCHED.snapshot()
    for async_save in (True, False):
        with xtc.CheckpointManager(tmp_path / str(async_save), options(async_save=async_save)) as mgr:
            mgr.save(1, model={"w": torch.ones(3)})
            assert gc.isenabled()
    fetched = staging.FETCHED.since(before)
    assert fetched["batches"] >= 2 and fetched["batches_under_gc"] == 0  # every staged batch of both saves


# ---------------------------------------------------------------------------------------- commit protocol


def test_step_layout_and_marker(tmp_path):
    with xtc.CheckpointManager(tmp_path, options()) as mgr:
        mgr.save(5, model={"w": torch.ones(2)}, metrics={"loss": torch.tensor(0.5)}, custom_metadata={"run": "a"})
        meta = mgr.metadata(5)
    assert sorted(os.listdir(tmp_path / "5")) == sorted([layout.CHECKPOINT_METADATA, layout.COMMIT_SUCCESS,
                                                         "model", "rng"])
    assert meta.step == 5 and meta.items == ("model", "rng") and meta.metrics == {"loss": 0.5}
    assert meta.custom == {"run": "a"} and meta.versions["torch"] == torch.__version__
    assert meta.committed_at >= meta.created_at and meta.format_version == 2
    doc = json.loads((tmp_path / "5" / layout.CHECKPOINT_METADATA).read_text())  # Orbax's schema, ours inside
    assert set(doc["item_handlers"]) == {"model", "rng"} and doc["metrics"] == {"loss": 0.5}
    assert doc["custom_metadata"]["run"] == "a"
    assert doc["custom_metadata"]["xla_tensorstore_ckpt"]["format_version"] == 2
    assert doc["custom_metadata"]["xla_tensorstore_ckpt"]["step"] == 5


def test_uncommitted_steps_are_ignored_and_removed_on_start(tmp_path):
    with xtc.CheckpointManager(tmp_path, options()) as mgr:
        mgr.save(1, extra={"v": 1})
        mgr.save(2, extra={"v": 2})
    os.remove(tmp_path / "2" / layout.CHECKPOINT_METADATA)  # as if the save of step 2 had crashed
    (tmp_path / "3" / "model").mkdir(parents=True)
    (tmp_path / "notes").mkdir()
    with xtc.CheckpointManager(tmp_path, options()) as mgr:
        assert mgr.all_steps() == [1] and mgr.latest_step() == 1
        extra = {"v": 0}
        assert mgr.restore("latest", extra=extra) == 1 and extra["v"] == 1
    assert sorted(os.listdir(tmp_path)) == ["1", "notes"]  # partial steps gone, foreign entries untouched


def test_saving_a_committed_step_needs_force_and_force_replaces_it(tmp_path):
    with xtc.CheckpointManager(tmp_path, options()) as mgr:
        mgr.save(1, extra={"v": 1})
        with pytest.raises(xtc.CheckpointExistsError, match="step 1 is already committed"):
            mgr.save(1, extra={"v": 2})
        assert mgr.save(1, extra={"v": 3}, force=True)
        extra = {"v": 0}
        mgr.restore(1, extra=extra)
        assert extra["v"] == 3 and mgr.all_steps() == [1]


def test_should_save_and_checkpointing_off(tmp_path):
    mgr = xtc.CheckpointManager(tmp_path / "root", options(save_interval_steps=10))
    assert [s for s in range(0, 31) if mgr.should_save(s)] == [0, 10, 20, 30]
    mgr.close()
    off = xtc.CheckpointManager(tmp_path / "off", options(save_interval_steps=None))
    assert not off.save(10, model={"w": torch.ones(1)})
    off.close()
    assert not (tmp_path / "off").exists()
    on = xtc.CheckpointManager(tmp_path / "off", options(save_interval_steps=None))
    assert on.save(10, model={"w": torch.ones(1)}, force=True) and on.all_steps() == [10]
    on.close()


def test_step_prefix(tmp_path):
    with xtc.CheckpointManager(tmp_path, options(step_prefix="ckpt")) as mgr:
        mgr.save(3, extra={"v": 3})
        assert mgr.all_steps() == [3]
    assert os.listdir(tmp_path) == ["ckpt_3"]
    with xtc.CheckpointManager(tmp_path, options()) as mgr:  # without the prefix, ckpt_3 is not a step
        assert mgr.all_steps() == []


# ----------------------------------------------------------------------------------------------- retention


def saved_steps(tmp_path, steps, metrics=None, **kw):
    with xtc.CheckpointManager(tmp_path, options(save_rng=False, **kw)) as mgr:
        for step in steps:
            mgr.save(step, extra={"s": step}, metrics=None if metrics is None else metrics.get(step))
        return mgr.all_steps(), mgr.best_step()


def test_max_to_keep(tmp_path):
    assert saved_steps(tmp_path, range(1, 7), max_to_keep=3)[0] == [4, 5, 6]
    assert sorted(int(n) for n in os.listdir(tmp_path)) == [4, 5, 6]


def test_keep_period_adds_to_max_to_keep(tmp_path):
    assert saved_steps(tmp_path, range(1, 11), max_to_keep=2, keep_period=4)[0] == [4, 8, 9, 10]


def test_best_fn_keeps_the_best_and_the_newest(tmp_path):
    metrics = {1: {"loss": 0.9}, 2: {"loss": 0.1}, 3: {"loss": 0.5}, 4: {"loss": 0.7}, 5: {"loss": 0.8}}
    steps, best = saved_steps(tmp_path, range(1, 6), metrics, max_to_keep=2, best_fn=lambda m: m["loss"])
    assert steps == [2, 3, 5] and best == 2  # best two (2, 3) plus the newest (5)


def test_best_mode_max_and_steps_without_metrics(tmp_path):
    metrics = {1: {"acc": 0.1}, 2: None, 3: {"acc": 0.9}, 4: {"acc": 0.5}, 5: {"acc": 0.2}}
    steps, best = saved_steps(tmp_path / "a", range(1, 6), metrics, max_to_keep=1, best_fn=lambda m: m["acc"],
                              best_mode="max")
    assert steps == [2, 3, 5] and best == 3
    steps, _ = saved_steps(tmp_path / "b", range(1, 6), metrics, max_to_keep=1, best_fn=lambda m: m["acc"],
                           best_mode="max", keep_checkpoints_without_metrics=False)
    assert steps == [3, 5]


def _markers(metrics: dict, committed_at: dict | None = None) -> dict:
    return {s: xtc.StepMetadata(step=s, items=(), created_at=0.0, committed_at=(committed_at or {}).get(s, 0.0),
                                metrics=m) for s, m in metrics.items()}


def test_retention_policy_combinations():
    options = xtc.CheckpointManagerOptions(max_to_keep=2, keep_period=3, best_fn=lambda m: m["l"])
    policy = policies.for_tiers(options).preserve
    metrics = {s: {"l": float(10 - s % 4)} for s in range(1, 10)}
    # best two by loss: steps with s % 4 == 3 (7 and 3), plus multiples of 3, plus the newest (9)
    assert policies.steps_to_delete(policy, _markers(metrics)) == [1, 2, 4, 5, 8]
    assert policies.best_step(policy, _markers(metrics)) == 7
    # Composed by hand: the newest two, or anything committed within the last hour.
    clock = lambda: 10_000.0  # noqa: E731
    recent = policies.AnyOf((policies.LatestN(2), policies.KeepFor(3600, clock=clock)))
    times = {s: 10_000.0 - 1000 * s for s in range(1, 10)}  # step 1 is the most recent here, step 9 the oldest
    assert policies.steps_to_delete(recent, _markers(metrics, times)) == [4, 5, 6, 7]


class EveryOtherSaveAfter:
    """A user's own save decision: every step divisible by 2, from `first` on."""

    def __init__(self, first):
        self.first = first

    def should_save(self, step, context):
        return step >= self.first and step % 2 == 0


def test_a_users_own_policies_drive_saving_and_retention(tmp_path):
    class KeepOdd:
        def keep(self, committed):
            return {s for s in committed if s % 2}

    opts = options(save_decision=EveryOtherSaveAfter(4), preservation=KeepOdd())
    with xtc.CheckpointManager(tmp_path, opts) as mgr:
        for step in range(1, 11):
            mgr.save(step, extra={"step": step})
        assert mgr.all_steps() == [10]  # saved 4, 6, 8, 10; kept: odd ones (none) and the newest
    with pytest.raises(ValueError, match="preservation must be a policy"):
        xtc.CheckpointManagerOptions(preservation=lambda committed: set())


# ------------------------------------------------------------------------------------------------ bad input


def test_not_a_checkpoint_root(tmp_path):
    xtc.save(tmp_path / "item", {"w": torch.ones(1)})
    with pytest.raises(xtc.CheckpointError, match="item directory, not a checkpoint root"):
        xtc.CheckpointManager(tmp_path / "item")
    with xtc.CheckpointManager(tmp_path / "root", options()) as mgr:
        mgr.save(1, extra={"v": 1})
    with pytest.raises(xtc.CheckpointError, match="step directory"):
        xtc.CheckpointManager(tmp_path / "root" / "1")
    with pytest.raises(xtc.CheckpointNotFoundError):
        xtc.CheckpointManager(tmp_path / "missing", options(create=False))


def test_corrupt_or_newer_marker_is_not_committed_and_not_deleted(tmp_path):
    with xtc.CheckpointManager(tmp_path, options()) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, extra={"v": step})
    (tmp_path / "3" / layout.CHECKPOINT_METADATA).write_text("{not json")
    doc = json.loads((tmp_path / "2" / layout.CHECKPOINT_METADATA).read_text())
    doc["custom_metadata"]["xla_tensorstore_ckpt"]["format_version"] = 7
    (tmp_path / "2" / layout.CHECKPOINT_METADATA).write_text(json.dumps(doc))
    with pytest.warns(UserWarning) as record:
        mgr = xtc.CheckpointManager(tmp_path, options())
    messages = " ".join(str(w.message) for w in record)
    assert "step 3" in messages and "not valid JSON" in messages and "format version 7" in messages
    assert mgr.all_steps() == [1] and mgr.latest_step() == 1
    with pytest.raises(xtc.StepNotFoundError):
        mgr.metadata(3)
    mgr.close()
    assert sorted(os.listdir(tmp_path)) == ["1", "2", "3"]  # nothing deleted


@pytest.mark.xla
def test_model_mismatch_and_param_group_layout_errors(tmp_path, mesh_4x2):
    net = xla_net(mesh_4x2)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    train_steps(net, opt, 1)
    with xtc.CheckpointManager(tmp_path, options()) as mgr:
        mgr.save(1, model=net, optimizer=opt)
        other = torch.nn.Linear(8, 3)
        with pytest.raises(xtc.KeyMismatchError, match="a.weight"):
            mgr.restore("latest", model=other)
        wrong_shape = Net()
        wrong_shape.a = torch.nn.Linear(8, 17)
        with pytest.raises(xtc.CheckpointError):
            mgr.restore("latest", model=wrong_shape)
        split = torch.optim.AdamW([{"params": [net.a.weight]}, {"params": [p for n, p in net.named_parameters()
                                                                           if n != "a.weight"]}], lr=1e-3)
        with pytest.raises(xtc.CheckpointError, match="param-group layout"):
            mgr.restore("latest", optimizer=split)
        with pytest.raises(xtc.ItemNotFoundError, match="no 'lr_scheduler' item"):
            mgr.restore("latest", lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
    assert sorted(os.listdir(tmp_path)) == ["1"]


def test_options_validate():
    with pytest.raises(ValueError):
        xtc.CheckpointManagerOptions(max_to_keep=0)
    with pytest.raises(ValueError):
        xtc.CheckpointManagerOptions(best_mode="median")
    with pytest.raises(ValueError):
        xtc.CheckpointManagerOptions(step_prefix="a/b")
    with pytest.raises(ValueError):
        xtc.CheckpointManagerOptions(save_on_steps={1, 2})
    with pytest.raises(ValueError):
        xtc.SaveOptions(host_batch_bytes=0)


def test_latest_step_with_many_steps_is_cached(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(200):
            (tmp_path / str(step)).mkdir()
            marker = xtc.StepMetadata(step=step, items=(), created_at=0.0, committed_at=0.0)
            (tmp_path / str(step) / layout.CHECKPOINT_METADATA).write_bytes(formats.encode_step(marker))
        with xtc.CheckpointManager(tmp_path, options()) as mgr:
            assert mgr.latest_step() == 199 and len(mgr.all_steps()) == 200
