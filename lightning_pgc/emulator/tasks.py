"""The emulator's proxy tasks, by name (``MapCell.task``): model, data, samples per partition, optimizer, targets and
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
ddp's runs on the tuning seeds, not from evaluation seeds: the digits tasks' by hand, the harder tasks' by the stated
rule of :data:`TARGET_RULE` (:func:`targets_from_curve`, ``benchmarks/task_targets.py``, whose results file a test
holds these constants to).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from lightning_pgc.emulator.train import Task
from lightning_pgc.examples.digits import DigitsCNN, load_digits_tensors
from lightning_pgc.examples.shifted_digits import BNCNN, shifted_digits_tensors
from lightning_pgc.examples.stdlib_lm import ByteTransformer, corpus_info, lm_tensors

__all__ = ["TARGET_RULE", "TASKS", "TaskSpec", "make_task", "targets_from_curve", "task_info"]


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
    val_every: int = 1  # versions between validation losses
    #: the crossover map's starting grid for this task (``None``: the map's own, :data:`cells.LRS` and ``MOMENTA``)
    map_lrs: Optional[tuple[float, ...]] = None
    map_momenta: Optional[tuple[float, ...]] = None


#: How a harder task's horizon, targets and map grid are fixed, before any arm runs: ``ddp`` (n = 4, no delays) runs
#: every learning rate of the task's grid at momentum (AdamW: beta1) ``momentum`` for ``horizon`` versions on each
#: tuning seed; the chosen lr has the lowest final loss (the mean validation loss over the last ``floor_window``
#: versions, mean over seeds); the early and late targets are the running minimum of that lr's seed-mean validation
#: curve at versions ``early_at`` and ``late_at``, rounded up to 3 decimals (so ``ddp`` needs about ``late_at``
#: versions to the late target); the map's starting grid is ``lr_factors`` times the chosen lr, by ``map_momenta``.
TARGET_RULE: dict[str, Any] = {
    "tasks": ["bncnn", "lm"],
    "n": 4,
    "horizon": 500,
    "momentum": 0.9,
    "tuning_seeds": [1000, 1001],
    "val_every": 5,
    "floor_window": 20,
    "early_at": 40,
    "late_at": 220,
    "lr_factors": [0.5, 1.0, 2.0],
    "map_momenta": [0.0, 0.5, 0.9],
}


def targets_from_curve(steps: Sequence[int], loss: Sequence[float], early_at: int, late_at: int) -> tuple[float, float]:
    """The (early, late) targets of :data:`TARGET_RULE` from one validation curve (``loss`` after ``steps``
    versions): its running minimum at the last validation at or before ``early_at`` and ``late_at`` versions,
    rounded up to 3 decimals.

    Raises:
        ValueError: the curve has no validation at or before ``early_at``, or it is not finite there.
    """
    best, at = math.inf, {}
    for step, value in zip(steps, loss):
        best = min(best, value)
        for name, limit in (("early", early_at), ("late", late_at)):
            if step <= limit:
                at[name] = best
    if "early" not in at or not all(math.isfinite(v) for v in at.values()):
        raise ValueError(f"the curve has no finite validation loss at or before version {early_at}")
    return tuple(math.ceil(at[name] * 1000 - 1e-9) / 1000 for name in ("early", "late"))  # type: ignore[return-value]


_SGD_LRS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)
_MOMENTA = (0.0, 0.5, 0.7, 0.8, 0.9)

TASKS: dict[str, TaskSpec] = {
    "mlp": TaskSpec("mlp", 8, "sgd", (0.5, 0.3), 300, _SGD_LRS, _MOMENTA),
    "cnn": TaskSpec("cnn", 16, "sgd", (0.5, 0.3), 300, _SGD_LRS, _MOMENTA),
    # the harder tasks: horizon, targets, val_every and map grid from docs/results/task_targets.json (TARGET_RULE)
    "lm": TaskSpec(
        "lm",
        4,
        "adamw",
        (2.711, 2.445),
        500,
        (1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2),
        (0.0, 0.5, 0.8, 0.9, 0.95),
        weight_decay=0.01,
        val_size=128,
        val_every=5,
        map_lrs=(0.008, 0.016, 0.032),
        map_momenta=(0.0, 0.5, 0.9),
    ),
    "bncnn": TaskSpec(
        "bncnn",
        8,
        "sgd",
        (1.248, 0.669),
        500,
        (0.0125, 0.025, 0.05, 0.1, 0.2),
        _MOMENTA,
        val_size=512,
        val_every=5,
        map_lrs=(0.0125, 0.025, 0.05),
        map_momenta=(0.0, 0.5, 0.9),
    ),
}


_DATA: dict[str, tuple[torch.Tensor, ...]] = {}


def _data(name: str) -> tuple[torch.Tensor, ...]:
    if name not in _DATA:
        if name in ("mlp", "cnn"):
            train, val = load_digits_tensors()
            _DATA[name] = (*train.tensors, *val.tensors)
        elif name == "lm":
            _DATA[name] = lm_tensors(32)
        else:
            _DATA[name] = shifted_digits_tensors()
    return _DATA[name]


def _model(name: str) -> nn.Module:
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    if name == "cnn":
        return DigitsCNN().net
    if name == "lm":
        return ByteTransformer(context=32, width=32, heads=4, layers=2)
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
        out["corpus"] = corpus_info()
    return out
