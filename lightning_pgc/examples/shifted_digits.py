"""A small CNN with BatchNorm on a harder, still embedded, image task: scikit-learn's digits, each image copied
several times with a random rotation, shift and pixel noise drawn once from a fixed seed (no download).

The clean digits are solved by a small network in a few dozen steps; the perturbed copies (rotations up to
:data:`MAX_ROTATION_DEG` degrees, shifts up to :data:`MAX_SHIFT` of the image's half-width, Gaussian noise of
standard deviation :data:`NOISE_STD`) take hundreds. Training and validation copies come from disjoint base images
(the digits split of :func:`~lightning_pgc.examples.digits.load_digits_tensors`), so the validation loss is held out.
The perturbation is fixed by :data:`DATA_SEED`, not by a run's seed: every run trains on the same data set.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from lightning_pgc.examples.digits import TensorDataModule, load_digits_tensors, log_train_loss

__all__ = [
    "DATA_SEED",
    "MAX_ROTATION_DEG",
    "MAX_SHIFT",
    "NOISE_STD",
    "BNCNN",
    "ShiftedDigitsCNN",
    "ShiftedDigitsDataModule",
    "shifted_digits_tensors",
]

DATA_SEED: int = 20260
MAX_ROTATION_DEG: float = 25.0
MAX_SHIFT: float = 0.25
NOISE_STD: float = 0.2
#: perturbed copies of every base image (training, validation)
COPIES: tuple[int, int] = (8, 2)


def _perturb(x: Tensor, copies: int, gen: torch.Generator) -> Tensor:
    x = x.repeat_interleave(copies, dim=0)
    n = len(x)
    angle = (torch.rand(n, generator=gen) * 2 - 1) * math.radians(MAX_ROTATION_DEG)
    shift = (torch.rand(n, 2, generator=gen) * 2 - 1) * MAX_SHIFT
    cos, sin = torch.cos(angle), torch.sin(angle)
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    out = F.grid_sample(x, grid, align_corners=False, padding_mode="zeros")
    return out + NOISE_STD * torch.randn(out.shape, generator=gen)


@lru_cache(maxsize=1)
def shifted_digits_tensors() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``x_train, y_train, x_val, y_val``: images ``[N, 1, 8, 8]`` (float32) and labels, the training copies of the
    digits' training split and the validation copies of its validation split (deterministic)."""
    train, val = load_digits_tensors()
    gen = torch.Generator().manual_seed(DATA_SEED)
    (x, y), (xv, yv) = train.tensors, val.tensors
    x_train = _perturb(x, COPIES[0], gen)
    x_val = _perturb(xv, COPIES[1], gen)
    return x_train, y.repeat_interleave(COPIES[0]), x_val, yv.repeat_interleave(COPIES[1])


class BNCNN(nn.Sequential):
    """Two 3x3 convolutions, each followed by BatchNorm and ReLU, a 2x2 max-pool and a linear layer (about 10k
    parameters): ``[b, 1, 8, 8]`` -> logits ``[b, 10]``."""

    def __init__(self, width: int = 16) -> None:
        super().__init__(
            nn.Conv2d(1, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * width * 16, 10),
        )


class ShiftedDigitsDataModule(TensorDataModule):
    """The perturbed digits (the same on every rank)."""

    def __init__(self, batch_size: int = 32, num_workers: int = 0) -> None:
        super().__init__(batch_size, num_workers)

    def load(self) -> tuple[TensorDataset, TensorDataset]:
        x, y, xv, yv = shifted_digits_tensors()
        return TensorDataset(x, y), TensorDataset(xv, yv)


class ShiftedDigitsCNN(pl.LightningModule):
    """:class:`BNCNN` on the perturbed digits with SGD (``lr``, ``momentum``); logs ``train_loss``, ``val_loss``."""

    def __init__(self, lr: float = 0.1, momentum: float = 0.9, width: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = BNCNN(width)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        log_train_loss(self, loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=self.hparams["momentum"])
