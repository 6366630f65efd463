"""CIFAR-10 with ResNet-18: the realistic recipe (the packaged ``cifar10_resnet18.yaml``).

Data comes from torchvision's own ``CIFAR10`` loader (the python-pickle release, ``cifar-10-batches-py/``).
Nothing is downloaded unless the user asks (``--data.download true``): the machines this project is tested
on have no internet, and on clusters compute nodes often have none either, so the data is fetched once on a
login node and ``data_dir`` points at it.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassAccuracy
from torchvision import transforms as T
from torchvision.datasets import CIFAR10
from torchvision.models import resnet18

from lightning_pgc.examples.digits import log_train_loss

#: Per-channel mean and standard deviation of the CIFAR-10 training images (the usual constants).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
#: The class names, in label order.
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


class UncheckedCIFAR10(CIFAR10):
    """torchvision's ``CIFAR10`` that checks only that the files exist, not their MD5.

    torchvision compares every file's MD5 with the official release's. A copy re-packed in the same format
    (a subset, or the tiny set the tests write) has other checksums; this subclass keeps the real loader and
    file layout and skips only the checksum comparison (``check_integrity(path, md5=None)`` checks existence).
    Module-level, so DataLoader workers started with spawn/forkserver can unpickle it.
    """

    train_list = [[name, None] for name, _ in CIFAR10.train_list]
    test_list = [[name, None] for name, _ in CIFAR10.test_list]
    meta = {**CIFAR10.meta, "md5": None}


class _Indexed(Dataset):
    """``base``'s raw images at ``indices`` with ``transform`` applied (train and validation views of one
    loaded array, with different transforms, without loading the files twice)."""

    def __init__(self, base: CIFAR10, indices: np.ndarray, transform: Callable[[Any], Tensor]) -> None:
        self.base = base
        self.indices = indices
        self.transform = transform

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        image, target = self.base[int(self.indices[i])]
        return self.transform(image), target


class CIFAR10DataModule(pl.LightningDataModule):
    """CIFAR-10 through ``torchvision.datasets.CIFAR10`` with the standard augmentation.

    Training images get ``RandomCrop(32, padding=4)`` and ``RandomHorizontalFlip``; all images are normalised
    with the CIFAR-10 channel means/stds. The same seeded split is computed on every rank.

    Args:
        data_dir: folder that holds (or will hold) ``cifar-10-batches-py/``.
        batch_size: per-rank mini-batch size (under PGC: per evaluated partition).
        download: fetch the data if missing (needs internet; done once per node, on local rank 0).
        num_workers: DataLoader worker processes per rank.
        val_split: fraction of the 50k training images held out for validation (seeded, disjoint from
            training); ``0`` validates on the 10k test images instead, as many CIFAR papers do.
        seed: seed of the train/validation split.
        check_integrity: compare the files' MD5 with the official release (torchvision's default). Set it to
            ``False`` for a re-packed copy in the same format (e.g. a subset); then only existence is checked.
    """

    def __init__(
        self,
        data_dir: str = "data/cifar10",
        batch_size: int = 128,
        download: bool = False,
        num_workers: int = 2,
        val_split: float = 0.1,
        seed: int = 0,
        check_integrity: bool = True,
    ) -> None:
        super().__init__()
        if not 0.0 <= val_split < 1.0:
            raise ValueError(f"val_split must be in [0, 1), got {val_split}")
        self.data_dir = data_dir
        self.batch_size = batch_size
        self.download = download
        self.num_workers = num_workers
        self.val_split = val_split
        self.seed = seed
        self.check_integrity = check_integrity
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None
        self.test_set: Optional[Dataset] = None

    @staticmethod
    def transforms(train: bool) -> Callable[[Any], Tensor]:
        """The augmentation (``train=True``) or the evaluation transform."""
        normalize = [T.ToTensor(), T.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
        if train:
            return T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), *normalize])
        return T.Compose(normalize)

    @property
    def _loader_class(self) -> type[CIFAR10]:
        return CIFAR10 if self.check_integrity else UncheckedCIFAR10

    def _dataset(self, train: bool) -> CIFAR10:
        cls = self._loader_class
        try:
            return cls(self.data_dir, train=train, download=False)
        except RuntimeError as err:
            folder = os.path.join(os.path.abspath(self.data_dir), cls.base_folder)
            problem = "missing" if not os.path.isdir(folder) else "incomplete or not the official release"
            hint = (
                ""
                if not self.check_integrity or not os.path.isdir(folder)
                else (" A re-packed copy in the same format can be used with `--data.check_integrity false`.")
            )
            raise FileNotFoundError(
                f"CIFAR-10 not found at {folder} ({problem}; torchvision said: {err}). Pass `--data.download true` "
                f"to download it (needs internet; ~170 MB), or point `--data.data_dir` at the folder that contains "
                f"an existing `cifar-10-batches-py/`.{hint}"
            ) from None

    def prepare_data(self) -> None:
        if self.download:
            self._loader_class(self.data_dir, train=True, download=True)
            self._loader_class(self.data_dir, train=False, download=True)

    def setup(self, stage: str) -> None:
        if stage in ("fit", "validate") and self.train_set is None:
            full = self._dataset(train=True)
            if self.val_split > 0:
                perm = np.random.default_rng(self.seed).permutation(len(full))
                n_val = max(1, int(round(len(full) * self.val_split)))
                self.val_set = _Indexed(full, np.sort(perm[:n_val]), self.transforms(train=False))
                self.train_set = _Indexed(full, np.sort(perm[n_val:]), self.transforms(train=True))
            else:
                self.train_set = _Indexed(full, np.arange(len(full)), self.transforms(train=True))
        if (stage == "test" or self.val_split == 0) and self.test_set is None:
            test = self._dataset(train=False)
            self.test_set = _Indexed(test, np.arange(len(test)), self.transforms(train=False))
            if self.val_split == 0:
                self.val_set = self.test_set

    def _loader(self, dataset: Optional[Dataset], shuffle: bool) -> DataLoader:
        assert dataset is not None, "setup() has not been called"
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)


def resnet18_cifar(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 adapted to 32x32 inputs: a 3x3 stride-1 first convolution and no max-pool
    (the ImageNet stem would shrink a CIFAR image to 8x8 before the first residual block)."""
    net = resnet18(num_classes=num_classes)
    net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net


class ResNet18CIFAR(pl.LightningModule):
    """ResNet-18 on CIFAR-10 with SGD (momentum, weight decay) and an optional per-step LR schedule.

    ``lr`` is logged every step. ``train_loss`` is logged through :func:`lightning_pgc.examples.digits.log_train_loss`: under PGC it is the decoded
    aggregate loss (no collective that would wait for stragglers), under ``ddp`` the mean over ranks.

    Args:
        lr: peak learning rate (0.1 is the usual value for batch 128 per step; scale it with the global batch).
        momentum: SGD momentum.
        weight_decay: L2 penalty applied by SGD.
        nesterov: Nesterov momentum.
        scheduler: ``"cosine"`` anneals to 0 over the run's optimizer steps, ``"step"`` divides the LR by 10 at
            50 % and 75 % of them, ``"none"`` keeps it constant. Both count steps, not epochs, so they follow
            ``max_steps`` as well as ``max_epochs``.
        num_classes: output classes.
    """

    def __init__(
        self,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        nesterov: bool = True,
        scheduler: Literal["cosine", "step", "none"] = "cosine",
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = resnet18_cifar(num_classes)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes)
        self.test_acc = MulticlassAccuracy(num_classes=num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        log_train_loss(self, outputs)
        # The same on every rank (identical optimizers): no collective, so nothing waits for stragglers.
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True, on_epoch=False)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_acc)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_acc)

    def _evaluate(self, batch: Any, prefix: str, accuracy: MulticlassAccuracy) -> None:
        x, y = batch
        logits = self(x)
        self.log(f"{prefix}_loss", F.cross_entropy(logits, y), sync_dist=True, prog_bar=True)
        accuracy(logits, y)  # a torchmetrics Metric: it gathers its counts over all ranks itself
        self.log(f"{prefix}_acc", accuracy, sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = torch.optim.SGD(
            self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay, nesterov=hp.nesterov
        )
        if hp.scheduler == "none":
            return optimizer
        total = max(1, int(self.trainer.estimated_stepping_batches))
        if hp.scheduler == "cosine":
            schedule: torch.optim.lr_scheduler.LRScheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
                optimizer, T_max=total
            )
        else:
            schedule = torch.optim.lr_scheduler.MultiStepLR(
                optimizer, milestones=[max(1, total // 2), max(1, (3 * total) // 4)], gamma=0.1
            )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def write_synthetic_cifar10(root: str | Path, per_batch: int = 16, seed: int = 0) -> Path:
    """A CIFAR-10-shaped set in torchvision's on-disk format (``cifar-10-batches-py/`` under ``root``) with random
    32x32x3 images and labels: ``5 * per_batch`` training and ``per_batch`` test images, for smoke runs of the
    CIFAR recipe without the real data (tests, ``benchmarks/seed_experiment.py --synthetic-data``).

    Layout and keys as in ``torchvision.datasets.CIFAR10`` (which unpickles with ``encoding="latin1"``):
    ``data_batch_1..5`` and ``test_batch`` hold ``{"data": uint8 (N, 3072), "labels": [int]}``, ``batches.meta``
    holds ``{"label_names": [...]}``. The MD5s differ from the release, so load it with ``check_integrity=False``.
    """
    root = Path(root)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {
            "batch_label": name,
            "data": rng.integers(0, 256, size=(per_batch, 3 * 32 * 32), dtype=np.uint8),
            "labels": [int(v) for v in rng.integers(0, 10, size=per_batch)],
        }
        (folder / name).write_bytes(pickle.dumps(entry))
    meta = {"label_names": list(CIFAR10_CLASSES), "num_cases_per_batch": per_batch, "num_vis": 3072}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))
    return root
