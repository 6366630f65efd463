"""The model the step-time benchmarks time: a one-hidden-layer MLP with plain SGD, so that a step is the
gradient's compute and its exchange, nothing else (``benchmarks/step_time.py``, ``benchmarks/auto.py``)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

__all__ = ["TimingMLP"]


class TimingMLP(pl.LightningModule):
    """``Linear(d_in, hidden) -> ReLU -> Linear(hidden, classes)``, cross-entropy, SGD at lr 0.01."""

    def __init__(self, d_in: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)
