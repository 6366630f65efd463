"""Real-rank jobs behind the "works" rows of the compatibility table in ``docs/guide.md``.

``python -m tests.compat_job CASE OUT`` trains a tiny module on 2 CPU ranks under ``PGCStrategy`` (Lightning's own
launcher re-runs this command for rank 1) and writes ``OUT/rank{k}.json`` per rank (parameter checksum, step, what
each feature did) and, on rank 0, ``OUT/logged.json`` (every ``log_metrics`` call: step and keys).

- ``features``: BackboneFinetuning (unfreezes at epoch 1), BatchNorm, gradient clipping, LR schedulers stepped per
  step, per epoch and on plateau, torchmetrics in training_step (unsynced) and in validation (synced),
  ``sync_dist=True`` in validation, ModelCheckpoint and EarlyStopping on ``val_loss``, ``val_check_interval=0.5``,
  and dict batches holding a nested dict, a ``list[str]`` and a list of variable-length tensors;
  ``log_every_n_steps=1``.
- ``timed``: ``precision="bf16-mixed"``, ``max_time`` (rank 0's clock, broadcast by Lightning's Timer) and
  ``log_every_n_steps=50``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.callbacks import BackboneFinetuning, EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from lightning_pgc import PGCDiagnostics, PGCStrategy

CLIP = 0.05  # gradient_clip_val of the features job: well below the gradient norms of this model
DIAGNOSTICS = {"every_n_steps": 4, "loss_every_n_steps": 2}


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call (step and keys) in memory: what reached the logger, and when."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append({"step": step, "keys": sorted(metrics)})


class DictSamples(Dataset):
    """Dict samples: features, a nested dict with the label, the index and a name, and a variable-length tensor."""

    def __init__(self, size: int = 96) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 4, generator=g)
        self.y = (self.x[:, 0] > 0).long() + (self.x[:, 1] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "meta": {"y": self.y[i], "id": i, "name": f"s{i}"}, "seq": torch.full((i % 3 + 1,), i)}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Default collation, except the variable-length ``seq``: a list of tensors."""
    batch = default_collate([{k: v for k, v in s.items() if k != "seq"} for s in samples])
    batch["seq"] = [s["seq"] for s in samples]
    return batch


class FeatureModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, 3)
        self.train_acc = torchmetrics.Accuracy("multiclass", num_classes=3, sync_on_compute=False)
        self.val_acc = torchmetrics.Accuracy("multiclass", num_classes=3)
        self.seen: dict[str, Any] = {"pre_clip_norms": [], "applied_norms": [], "chunks_checked": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        ids = batch["meta"]["id"]
        # every per-sample entry of this partition's chunk belongs to the same samples as its tensors
        assert batch["meta"]["name"] == [f"s{int(i)}" for i in ids], (batch["meta"]["name"], ids)
        assert [int(s[0]) for s in batch["seq"]] == ids.tolist() and len(batch["seq"]) == len(ids)
        self.seen["chunks_checked"] += 1
        logits = self(batch["x"])
        loss = nn.functional.cross_entropy(logits, batch["meta"]["y"])
        self.train_acc(logits, batch["meta"]["y"])
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        self.log("train_loss_local", loss)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        logits = self(batch["x"])
        self.log("val_loss", nn.functional.cross_entropy(logits, batch["meta"]["y"]), sync_dist=True)
        self.val_acc(logits, batch["meta"]["y"])
        self.log("val_acc", self.val_acc)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.seen["pre_clip_norms"].append(_grad_norm(self))

    def configure_optimizers(self) -> Any:
        optimizer = ClippedRecorder([p for p in self.parameters() if p.requires_grad], self, lr=0.2, momentum=0.9)
        return [optimizer], [
            {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.95), "interval": "step"},
            {"scheduler": torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9), "interval": "epoch"},
            {
                "scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5),
                "monitor": "val_loss",
                "interval": "epoch",
            },
        ]


class ClippedRecorder(torch.optim.SGD):
    """SGD that records the norm of the gradient it applies (after Lightning's clipping, inside the closure)."""

    def __init__(self, params: Any, module: FeatureModule, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.module = module

    def step(self, closure: Any = None) -> Any:
        with torch.enable_grad():
            loss = closure()
        self.module.seen["applied_norms"].append(_grad_norm(self.module))
        super().step()
        return loss


def _grad_norm(module: nn.Module) -> float:
    grads = [p.grad.detach().reshape(-1) for p in module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.cat(grads))) if grads else 0.0


class BackboneWatch(pl.Callback):
    """The backbone's first weight when training starts, when epoch 0 ends (still frozen) and at the end."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.sums["start"] = float(pl_module.backbone[0].weight.sum())

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if trainer.current_epoch == 0:
            self.sums["epoch0_end"] = float(pl_module.backbone[0].weight.sum())

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.sums["end"] = float(pl_module.backbone[0].weight.sum())


class TinyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss_local", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def checksum(module: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(case: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    logger = RecordingLogger()
    common = dict(
        accelerator="cpu",
        devices=2,
        strategy=PGCStrategy(liveness={"timeout": 60.0}, diagnostics={"enabled": False}),
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    extra: dict[str, Any] = {}
    if case == "features":
        module: pl.LightningModule = FeatureModule()
        checkpoint = ModelCheckpoint(dirpath=out / "checkpoints", monitor="val_loss", save_top_k=1)
        watch = BackboneWatch()
        callbacks = [
            PGCDiagnostics(**DIAGNOSTICS),
            BackboneFinetuning(unfreeze_backbone_at_epoch=1),
            checkpoint,
            EarlyStopping(monitor="val_loss", patience=3, min_delta=10.0),
            watch,
        ]
        trainer = pl.Trainer(
            max_epochs=4,
            val_check_interval=0.5,
            gradient_clip_val=CLIP,
            log_every_n_steps=1,
            callbacks=callbacks,
            **common,
        )
        data = DictSamples()
        train = DataLoader(data, batch_size=8, shuffle=True, collate_fn=collate)
        val = DataLoader(data, batch_size=16, collate_fn=collate)
        trainer.fit(module, train, val)
        extra = {
            "seen": module.seen,
            "backbone": watch.sums,
            "best_model_path": checkpoint.best_model_path,
            "lrs": [g["lr"] for g in trainer.optimizers[0].param_groups],
            "param_groups": len(trainer.optimizers[0].param_groups),
        }
    elif case == "timed":
        module = TinyModule()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(256, 4, generator=g)
        data = TensorDataset(x, (x[:, 0] > 0).long())
        trainer = pl.Trainer(
            max_steps=100_000,
            max_time={"seconds": 5},
            precision="bf16-mixed",
            log_every_n_steps=50,
            callbacks=[PGCDiagnostics(**DIAGNOSTICS)],
            enable_checkpointing=False,
            **common,
        )
        trainer.fit(module, DataLoader(data, batch_size=8, shuffle=True))
    else:
        raise SystemExit(f"unknown case {case!r}")
    rank = trainer.global_rank
    result = {
        "rank": rank,
        "global_step": trainer.global_step,
        "checksum": checksum(module),
        "skipped_steps": trainer.strategy.skipped_steps,
        "should_stop": trainer.should_stop,
        **extra,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        (out / "logged.json").write_text(json.dumps(logger.calls))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
