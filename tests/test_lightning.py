"""Lightning selects this library with one plugin (`integrations.lightning.XtcCheckpointIO`): the real Lightning on
CPU fits a LightningModule, checkpoints in our format (synchronously, and through Lightning's AsyncCheckpointIO),
and resumes with ``ckpt_path=`` with the model, optimizer and callback state exactly as saved."""

from __future__ import annotations

import os

import pytest
import torch

import xla_tensorstore_ckpt as xtc

pytestmark = pytest.mark.trainers


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_fit_and_resume_from_our_checkpoint(tmp_path, asynchronous):
    from lightning_parts import Counter, Regression, data, trainer
    from pytorch_lightning.plugins.io import AsyncCheckpointIO

    from xla_tensorstore_ckpt.integrations.lightning import XtcCheckpointIO

    def plugin():
        return AsyncCheckpointIO(XtcCheckpointIO()) if asynchronous else XtcCheckpointIO()

    module, counter = Regression(), Counter()
    trainer(tmp_path, plugin(), 2, counter).fit(module, data())
    path = tmp_path / "ckpt" / "epoch=1-step=8.ckpt"
    assert os.path.isdir(path) and xtc.metadata(str(path))["global_step"] == 8  # our item, not a pickle
    saved = XtcCheckpointIO().load_checkpoint(path)
    resumed_module, resumed_counter = Regression(), Counter()
    resumed = trainer(tmp_path / "again", plugin(), 2, resumed_counter)
    resumed.fit(resumed_module, data(), ckpt_path=str(path))  # nothing left to train: restores only
    assert resumed.global_step == 8 and resumed.current_epoch == 2
    for key, value in module.state_dict().items():
        assert torch.equal(resumed_module.state_dict()[key], value), key
    before, after = resumed.optimizers[0].state_dict(), saved["optimizer_states"][0]
    assert before["param_groups"][0]["lr"] == after["param_groups"][0]["lr"]
    for index, entries in after["state"].items():
        for name, value in entries.items():
            assert torch.equal(torch.as_tensor(before["state"][index][name]), torch.as_tensor(value)), (index, name)
    assert resumed.lr_scheduler_configs[0].scheduler.state_dict()["last_epoch"] == \
        saved["lr_schedulers"][0]["last_epoch"]
    assert resumed_counter.batches == counter.batches == 8 and torch.equal(resumed_counter.total, counter.total)


def test_training_continues_bit_for_bit(tmp_path):
    """Two epochs straight, or one, saved, then resumed for the second: the same weights, bit for bit."""
    from lightning_parts import Counter, Regression, data, trainer

    from xla_tensorstore_ckpt.integrations.lightning import XtcCheckpointIO

    straight = Regression()
    trainer(tmp_path / "straight", XtcCheckpointIO(), 2, Counter()).fit(straight, data())
    first = Regression()
    trainer(tmp_path / "first", XtcCheckpointIO(), 1, Counter()).fit(first, data())
    second = Regression()
    trainer(tmp_path / "second", XtcCheckpointIO(), 2, Counter()).fit(
        second, data(), ckpt_path=str(tmp_path / "first" / "ckpt" / "epoch=0-step=4.ckpt"))
    for key, value in straight.state_dict().items():
        assert torch.equal(second.state_dict()[key], value), key


def test_remove_checkpoint_of_nothing_names_the_path(tmp_path):
    from xla_tensorstore_ckpt.integrations.lightning import XtcCheckpointIO

    with pytest.raises(xtc.CheckpointNotFoundError, match="no checkpoint to remove"):
        XtcCheckpointIO().remove_checkpoint(tmp_path / "absent.ckpt")
