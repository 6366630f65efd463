"""The emulator's proxy tasks, by name (``Cell.task``): model, data, samples per partition, optimizer, targets and
horizon.

- ``mlp``: the digits data set, a 64-64-10 MLP, 8 samples per partition evaluation, SGD (the original proxy).
- ``cnn``: the digits CNN of the real 4-rank runs, 16 samples, SGD.
- ``lm``: a byte-level transformer (2 layers, width 32, context 32) on Python's own standard library sources
  (:mod:`lightning_pgc.examples.stdlib_lm`), 4 windows per partition, AdamW; the loss is next-byte cross-entropy
  on 128 held-out windows.
- ``bncnn``: a CNN with BatchNorm on the perturbed digits (:mod:`lightning_pgc.examples.shifted_digits`), 8 images
  per partition, SGD; the validation loss is the eval-mode model's (running statistics) on 512 held-out images.

A task's ``optimizer`` applies to every arm alike. Under AdamW a setting ``(lr, momentum)`` means ``lr`` and
``betas = (momentum, beta2)`` (the momentum accounting correction lowers ``betas[0]``, as the strategy does), so a
task with AdamW has its own learning-rate grid (:attr:`TaskSpec.lrs`). ``targets`` (early, late) are validation
losses, ``horizon`` the versions a run may apply (``budget_steps`` ideal steps for the clock); both were fixed from
ddp's runs on the tuning seeds (``benchmarks/task_sensitivity.py``), not from evaluation seeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from lightning_pgc.emulator.train import Task

__all__ = ["TASKS", "TaskSpec", "make_task", "task_info"]


@dataclass(frozen=True)
class TaskSpec:
    """A proxy task's constants (what a record states about it)."""

    name: str
    batch_size: int
    optimizer: str
    targets: tuple[float, float]  # validation loss: early, late
    horizon: int  # versions (ideal steps) of a run
    lrs: tuple[float, ...]  # the learning-rate grid for this task's optimizer
    momenta: tuple[float, ...]
    weight_decay: float = 0.0
    beta2: float = 0.99
    val_size: Optional[int] = None  # held-out samples used (None: all)


_SGD_LRS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)
_MOMENTA = (0.0, 0.5, 0.7, 0.8, 0.9)

TASKS: dict[str, TaskSpec] = {
    "mlp": TaskSpec("mlp", 8, "sgd", (0.5, 0.3), 300, _SGD_LRS, _MOMENTA),
    "cnn": TaskSpec("cnn", 16, "sgd", (0.5, 0.3), 300, _SGD_LRS, _MOMENTA),
    "lm": TaskSpec(
        "lm",
        4,
        "adamw",
        (2.8, 2.55),
        400,
        (1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2),
        (0.0, 0.5, 0.8, 0.9, 0.95),
        weight_decay=0.01,
        val_size=128,
    ),
    "bncnn": TaskSpec("bncnn", 8, "sgd", (1.5, 1.1), 400, (0.0125, 0.025, 0.05, 0.1, 0.2), _MOMENTA, val_size=512),
}


_DATA: dict[str, tuple[torch.Tensor, ...]] = {}


def _data(name: str) -> tuple[torch.Tensor, ...]:
    if name not in _DATA:
        if name in ("mlp", "cnn"):
            from lightning_pgc.examples.digits import load_digits_tensors

            train, val = load_digits_tensors()
            _DATA[name] = (*train.tensors, *val.tensors)
        elif name == "lm":
            from lightning_pgc.examples.stdlib_lm import lm_tensors

            _DATA[name] = lm_tensors(32)
        else:
            from lightning_pgc.examples.shifted_digits import shifted_digits_tensors

            _DATA[name] = shifted_digits_tensors()
    return _DATA[name]


def _model(name: str) -> nn.Module:
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    if name == "cnn":
        from lightning_pgc.examples.digits import DigitsCNN

        return DigitsCNN().net
    if name == "lm":
        from lightning_pgc.examples.stdlib_lm import ByteTransformer

        return ByteTransformer(context=32, width=32, heads=4, layers=2)
    from lightning_pgc.examples.shifted_digits import BNCNN

    return BNCNN(16)


def spec(name: str) -> TaskSpec:
    """The constants of task ``name``.

    Raises:
        ValueError: an unknown task.
    """
    if name not in TASKS:
        raise ValueError(f"unknown proxy task {name!r}; valid: {', '.join(TASKS)}")
    return TASKS[name]


def make_task(name: str, seed: int) -> Task:
    """Task ``name`` with its model's initial weights drawn from ``seed`` (``torch.manual_seed(seed)``, then the
    model is built), its data (the same for every seed) and its optimizer."""
    s = spec(name)
    x, y, xv, yv = _data(name)
    if s.val_size is not None:
        xv, yv = xv[: s.val_size], yv[: s.val_size]
    torch.manual_seed(seed)
    model = _model(name)
    return Task(model, x, y, xv, yv, s.batch_size, optimizer=s.optimizer, weight_decay=s.weight_decay, beta2=s.beta2)


def task_info(name: str) -> dict[str, Any]:
    """What a result records about task ``name``: its constants, and for ``lm`` the corpus (Python's version and
    the corpus's sha256)."""
    s = spec(name)
    out: dict[str, Any] = {
        "name": s.name,
        "batch_size": s.batch_size,
        "optimizer": s.optimizer,
        "targets": list(s.targets),
        "horizon": s.horizon,
        "lrs": list(s.lrs),
        "momenta": list(s.momenta),
        "weight_decay": s.weight_decay,
        "val_size": s.val_size,
    }
    if s.optimizer == "adamw":
        out["beta2"] = s.beta2
    if name == "lm":
        from lightning_pgc.examples.stdlib_lm import corpus_info

        out["corpus"] = corpus_info()
    return out
