"""`XtcCheckpointManager` in one process, with torchtitan's real optimizer and LR-scheduler containers around a small
module: its Config's checks, its errors (one line, naming the step or path), the last step saved model-only in
the export dtype, a Hugging Face export of the last step to gs:// (the GCS emulator), states that are plain
tensors, and a job started (``initial_load_path``) from an Orbax root written by JAX and from a root torch_xla's
own CheckpointManager wrote (tests/golden/torch_xla-2.9, made by tests/golden/make_torch_xla_manager.sh)."""

from __future__ import annotations

import os

import pytest
import torch

import xla_tensorstore_ckpt as xtc

pytestmark = pytest.mark.trainers


GOLDEN_TORCH_XLA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "torch_xla-2.9")


def _build(folder, sd_adapter=None, model=None, **config):
    """The manager built from its Config over `model` (else a small one, after one training step)."""
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from xla_tensorstore_ckpt.integrations.torchtitan import XtcCheckpointManager

    torch.manual_seed(0)
    trained = model is None
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)) if trained else model
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.1})],
        implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    if trained:
        model(torch.ones(3, 4)).sum().backward()
        optimizers.step()
        schedulers.step()
    states = {"trainer": torch.tensor([1.25])}
    manager = XtcCheckpointManager.Config(**{"enable": True, "folder": "ckpt", "interval": 2, **config}).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers, states=states,
        sd_adapter=sd_adapter, base_folder=str(folder))
    return manager, model, states


def test_config_keeps_torchtitans_checks_and_reads_remote_hf():
    from xla_tensorstore_ckpt.integrations.torchtitan import XtcCheckpointManager

    with pytest.raises(ValueError, match="at least 2 checkpoint replicas"):
        XtcCheckpointManager.Config(keep_latest_k=1)
    with pytest.raises(ValueError, match="Invalid async_mode"):
        XtcCheckpointManager.Config(async_mode="async_with_pinned_mem")
    with pytest.raises(ValueError, match="local_interval needs local_directory"):
        XtcCheckpointManager.Config(local_interval=5)
    with pytest.raises(ValueError, match="last_save_in_hf requires last_save_model_only"):
        XtcCheckpointManager.Config(folder="gs://bucket/run", last_save_in_hf=True, last_save_model_only=False)
    assert XtcCheckpointManager.Config(folder="gs://bucket/run", last_save_in_hf=True).last_save_in_hf
    config = XtcCheckpointManager.Config(folder="gs://bucket/run", initial_load_path="gs://bucket/hf",
                                         initial_load_in_hf=True, async_mode="ASYNC")
    assert config.initial_load_in_hf and config.async_mode == "async"


def test_errors_name_the_step_and_the_path(tmp_path):
    manager, _, _ = _build(tmp_path)
    try:
        assert manager.load() is False  # a fresh start
        with pytest.raises(xtc.StepNotFoundError, match=r"--checkpoint.load_step=7 is not committed under .*ckpt"):
            manager.load(step=7)
    finally:
        manager.close()
    missing = str(tmp_path / "absent")
    other, _, _ = _build(tmp_path / "second", initial_load_path=missing)
    try:
        with pytest.raises(xtc.CheckpointNotFoundError, match=f"initial_load_path {missing} does not exist"):
            other.load()
    finally:
        other.close()


def test_interval_last_step_model_only_in_export_dtype_and_plain_tensor_states(tmp_path):
    manager, model, states = _build(tmp_path, last_save_model_only=True, export_dtype="bfloat16",
                                    async_mode="disabled")
    saved_trainer = states["trainer"].clone()
    assert [manager.save(step) for step in (1, 2, 3)] == [False, True, False]
    assert manager.save(3, last_step=True) is True
    manager.close()
    root = os.path.join(tmp_path, "ckpt")
    last = xtc.restore(os.path.join(root, "step_3", "model"))
    assert {k: v.dtype for k, v in last.items()} == {k: torch.bfloat16 for k in model.state_dict()}
    assert torch.equal(last["0.weight"], model.state_dict()["0.weight"].to(torch.bfloat16))
    items = os.listdir(os.path.join(root, "step_3"))
    assert "model" in items and not {"optimizer", "lr_scheduler", "extra"} & set(items)
    resumed, resumed_model, resumed_states = _build(tmp_path, exclude_from_loading=["trainer"])
    resumed_states["trainer"].fill_(0)
    with torch.no_grad():
        resumed_model[0].weight.fill_(0)
    assert resumed.load(step=2) is True
    assert torch.equal(resumed_model[0].weight, model[0].weight)
    assert torch.equal(resumed_states["trainer"], torch.zeros(1))  # excluded: untouched
    resumed.close()
    included, _, included_states = _build(tmp_path)
    included_states["trainer"].fill_(0)
    assert included.load(step=2) is True
    assert torch.equal(included_states["trainer"], saved_trainer)  # a plain tensor state, restored in place
    included.close()


class _HFNames:
    """A model's state-dict adapter to Hugging Face names, as torchtitan's models give their manager."""

    def to_hf(self, state: dict) -> dict:
        return {f"model.layers.{key}": value for key, value in state.items()}

    def from_hf(self, state: dict) -> dict:
        return {key.removeprefix("model.layers."): value for key, value in state.items()}


def test_last_step_exported_as_hugging_face_safetensors_to_gcs(request):
    from conftest import object_store

    from xla_tensorstore_ckpt import storage

    root, _, _ = object_store(request, "gcs", "titan-hf")
    manager, model, _ = _build(root, sd_adapter=_HFNames(), last_save_model_only=True, last_save_in_hf=True,
                               async_mode="disabled")
    assert manager.save(3, last_step=True) is True
    manager.close()
    exported = f"{root}/ckpt/step_3-hf"
    assert storage.location(exported).list() == ["model.safetensors"]
    restored = xtc.restore(exported)
    assert sorted(restored) == sorted(f"model.layers.{key}" for key in model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(restored[f"model.layers.{key}"], value), key


class _TorchXlaNet(torch.nn.Module):
    """tests/scripts/torch_xla_manager.py's model, on the newest stack (no torch_xla here)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 8)


def test_initial_load_from_a_torch_xla_manager_root(tmp_path):
    root = os.path.join(GOLDEN_TORCH_XLA, "root")
    expected = xtc.restore(os.path.join(GOLDEN_TORCH_XLA, "expected"))["model"]
    model = _TorchXlaNet()
    manager, _, _ = _build(tmp_path / "ours", model=model, initial_load_path=root)
    try:
        assert manager.load() is True  # torchtitan's default: initial_load_model_only
    finally:
        manager.close()
    assert sorted(model.state_dict()) == sorted(expected)
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    full, _, _ = _build(tmp_path / "full", model=_TorchXlaNet(), initial_load_path=root,
                        initial_load_model_only=False)
    try:
        with pytest.raises(xtc.UsageError, match=r"initial_load_path .*torch_xla-2.9/root/6 holds its model under "
                                                 r"a \"model\" entry.*initial_load_model_only=True"):
            full.load()
    finally:
        full.close()


class _OrbaxShaped(torch.nn.Module):
    """A model whose state dict is tests/orbax_trees.py's model: ``embed`` (float32) and ``head`` (bfloat16)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(32, 16))
        self.head = torch.nn.Parameter(torch.zeros(16, 4, dtype=torch.bfloat16))


def test_initial_load_from_an_orbax_root_written_by_jax(tmp_path):
    import orbax_trees
    from orbax_process import orbax

    from xla_tensorstore_ckpt.core import dtypes

    orbax("manager", tmp_path / "orbax")  # steps 1 and 2, items "model" and "extra"
    model = _OrbaxShaped()
    manager, _, _ = _build(tmp_path / "ours", model=model, initial_load_path=str(tmp_path / "orbax"))
    try:
        assert manager.load() is True
    finally:
        manager.close()
    for key, value in orbax_trees.model(2).items():  # its newest step
        assert torch.equal(model.state_dict()[key], dtypes.numpy_to_tensor(value.copy())), key


def test_what_torchtitans_own_manager_tests_check(tmp_path):
    """The behaviours torchtitan's unit tests check of its DCP manager (tests/unit_tests/test_checkpoint.py), of
    ours: the first step saved with enable_first_step_checkpoint whatever the interval; nothing saved with
    load_only; a non-persistent buffer never saved; keep_latest_k keeping the newest steps; a committed step in
    the folder resumed rather than the initial_load_path (the fault-tolerance path); and an asynchronous save's
    future resolved once the next save has started (it waited for that commit)."""
    root = os.path.join(tmp_path, "ckpt")

    def steps() -> list[str]:
        return sorted(name for name in os.listdir(root) if name.startswith("step_")) if os.path.isdir(root) else []

    first, _, _ = _build(tmp_path, enable_first_step_checkpoint=True, async_mode="disabled")
    assert [first.save(step) for step in (1, 2, 3)] == [True, True, False]
    first.close()
    assert steps() == ["step_1", "step_2"]

    loading, _, _ = _build(tmp_path / "only", load_only=True)
    assert loading.save(2) is False and loading.save(4, last_step=True) is False
    loading.close()
    assert not os.path.exists(tmp_path / "only" / "ckpt") or not os.listdir(tmp_path / "only" / "ckpt")

    model = torch.nn.Linear(4, 2)
    model.register_buffer("cache", torch.ones(3), persistent=False)
    kept, _, _ = _build(tmp_path / "kept", model=model, interval=1, keep_latest_k=2, async_mode="async")
    futures = []
    for step in (1, 2, 3):
        assert kept.save(step) is True
        futures.append(kept.save_future)
    assert futures[0].done() and futures[1].done() and not futures[2].done()
    kept.maybe_wait_for_saving()
    assert futures[2].done() and kept.save_future is None
    kept.close()
    kept_root = os.path.join(tmp_path, "kept", "ckpt")
    assert sorted(n for n in os.listdir(kept_root) if n.startswith("step_")) == ["step_2", "step_3"]
    assert set(xtc.restore(os.path.join(kept_root, "step_3", "model"))) == {"weight", "bias"}  # no "cache"

    other = str(tmp_path / "absent")  # would raise if read: the folder's committed step comes first
    resumed, resumed_model, _ = _build(tmp_path, initial_load_path=other, initial_load_model_only=True)
    with torch.no_grad():
        resumed_model[0].weight.fill_(0)
    assert resumed.load() is True
    assert not torch.equal(resumed_model[0].weight, torch.zeros_like(resumed_model[0].weight))
    resumed.close()
