"""The Lightning side of tests/test_lightning.py: a LightningModule, a callback with state, data, a Trainer.
Imported by the tests themselves, so that test_lightning.py imports (and its tests are deselected) without
Lightning."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, _index):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)}


class Counter(Callback):
    """A callback with state of its own (a count and a tensor), saved and restored by Lightning."""

    def __init__(self) -> None:
        self.batches, self.total = 0, torch.zeros(3)

    def on_train_batch_end(self, trainer, module, outputs, batch, index):
        self.batches += 1
        self.total += batch[0][0, :3]

    def state_dict(self):
        return {"batches": self.batches, "total": self.total.clone()}

    def load_state_dict(self, state):
        self.batches, self.total = state["batches"], state["total"]


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def trainer(root, plugin, epochs: int, counter: Counter) -> pl.Trainer:
    return pl.Trainer(default_root_dir=str(root), max_epochs=epochs, accelerator="cpu", devices=1,
                      plugins=[plugin], callbacks=[counter, ModelCheckpoint(dirpath=str(root / "ckpt"),
                                                                            save_top_k=-1)],
                      logger=False, enable_progress_bar=False, enable_model_summary=False)
