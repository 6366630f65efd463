"""The embedded default task: scikit-learn's handwritten digits (8x8 images, 10 classes) and a small CNN.

The data ships inside scikit-learn, so the demo, the tests and CI never download anything. We use
scikit-learn's loader rather than a copy of the array because it is the well-known, maintained source of
this data set (and scikit-learn is a dependency of the benchmarks anyway).
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_pgc.strategy import PGCStrategy


def load_digits_tensors(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Train/validation split of scikit-learn's digits as float images in [0, 1] with shape (N, 1, 8, 8)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_val = int(round(len(y) * val_fraction))
    val, train = perm[:n_val], perm[n_val:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


class TensorDataModule(pl.LightningDataModule):
    """A training and a validation :class:`TensorDataset` loaded once (the same on every rank); a subclass says how
    (:meth:`load`). Validation batches are 256."""

    def __init__(self, batch_size: int, num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.train_set: Optional[TensorDataset] = None
        self.val_set: Optional[TensorDataset] = None

    def load(self) -> tuple[TensorDataset, TensorDataset]:
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = self.load()

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "setup() loads the data"
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "setup() loads the data"
        return DataLoader(self.val_set, batch_size=256, num_workers=self.num_workers)


class DigitsDataModule(TensorDataModule):
    """scikit-learn's digits, split once with a fixed seed (the same split on every rank)."""

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.2, seed: int = 0, num_workers: int = 0) -> None:
        super().__init__(batch_size, num_workers)
        self.val_fraction = val_fraction
        self.seed = seed

    def load(self) -> tuple[TensorDataset, TensorDataset]:
        return load_digits_tensors(self.val_fraction, self.seed)


class DigitsCNN(pl.LightningModule):
    """Two 3x3 convolutions and two linear layers (about 38k parameters): quick on CPU, not trivial.
    ``batch_norm`` adds a BatchNorm layer (buffers that every replica must keep identical). ``width`` (first
    convolution's channels) and ``hidden`` (the first linear layer's outputs) scale it: ``width=256`` gives about
    1.7M parameters of real compute, ``hidden=8192`` about 4.2M parameters that are mostly payload (a linear layer
    costs little compute per parameter next to a convolution), for benchmarks where communication dominates."""

    def __init__(
        self,
        lr: float = 0.05,
        momentum: float = 0.9,
        width: int = 16,
        sync_train_loss: bool = True,
        batch_norm: bool = False,
        hidden: int = 64,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.BatchNorm2d(width) if batch_norm else nn.Identity(),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * width * 16, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )
        self.val_acc = MulticlassAccuracy(num_classes=10)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        log_train_loss(self, outputs, sync=self.hparams.sync_train_loss)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True, prog_bar=True)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


def log_train_loss(module: pl.LightningModule, outputs: Any, sync: bool = True) -> None:
    """Log ``train_loss`` on the mean scale of all ranks, the same value on every rank, under any strategy.

    Under :class:`~lightning_pgc.PGCStrategy` the step output already is the decoded aggregate loss, so no
    collective is needed (one would wait for stragglers); under ``ddp`` the local losses are averaged, an
    extra all-reduce per step unless ``sync=False`` (then each rank logs its own loss, as plain Lightning does).
    """
    loss = outputs["loss"] if isinstance(outputs, dict) else outputs
    if loss is None:
        return
    synced = isinstance(module.trainer.strategy, PGCStrategy)
    module.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=sync and not synced)
