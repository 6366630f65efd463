"""One training job from a JSON spec, on real processes: what the demo, the benchmarks and the tests launch.

``python -m lightning_pgc.job spec.json`` trains the digits CNN with the spec's strategy (any Lightning
strategy name, ``ddp`` included) and straggler model, and writes into ``spec["out"]``:

- ``rank{k}.json`` from every rank: final step, a checksum of the parameters, steps skipped while catching up,
  injected sleep;
- ``curve.csv`` from rank 0: wall-clock seconds since the first step, step, training loss on the mean scale
  of all ranks (the decoded aggregate under PGC, the all-rank mean under other strategies);
- ``summary.json`` from rank 0: the spec, final validation metrics, fit wall time and the diagnostics history.

Lightning's launcher re-runs this same command for ranks 1..n-1, as it does for any ``ddp`` script.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

import lightning_pgc  # noqa: F401  (registers the strategy names)
from lightning_pgc.callbacks import PGCDiagnostics
from lightning_pgc.digits import DigitsCNN, DigitsDataModule
from lightning_pgc.strategy import PGCStrategy
from lightning_pgc.stragglers import StragglerInjector

DEFAULTS: dict[str, Any] = {
    "strategy": "pgc",
    "strategy_kwargs": {},
    "devices": 4,
    "delay": "none",
    "delay_seed": 0,
    "max_steps": 100,
    "max_epochs": -1,
    "batch_size": 16,
    "lr": 0.05,
    "seed": 0,
    "threads": 1,
    "val_check_interval": None,
    "check_val_every_n_epoch": 1,
    "limit_val_batches": 1.0,
    "ckpt_path": None,
    "save_checkpoint": None,
    "checkpoint_every_n_steps": None,
    "final_validation": False,
    "sync_loss": True,  # ddp & co: average the logged loss over ranks (one all-reduce per step); False for timing
    "out": "outputs/job",
}


def parameter_checksum(module: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes: equal only for bit-identical replicas."""
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def build_callbacks(spec: dict[str, Any], out: Path) -> list[Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks: list[Any] = [LossRecorder(out, sync=spec["sync_loss"]), StragglerInjector(spec["delay"], seed=spec["delay_seed"])]
    if spec["checkpoint_every_n_steps"]:
        callbacks.append(
            ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=spec["checkpoint_every_n_steps"],
                            save_top_k=-1, save_last=True)
        )
    return callbacks


class LossRecorder(pl.Callback):
    """Records (wall time, step, mean-scale training loss) and the fit's wall time."""

    def __init__(self, out: Path, sync: bool = True) -> None:
        self.out = out
        self.sync = sync
        self.rows: list[tuple[float, int, float]] = []
        self.batch_sizes: list[int] = []
        self.t0: float | None = None
        self.fit_start: float | None = None
        self.fit_end: float | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.fit_start = time.monotonic()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.batch_sizes.append(len(batch[0]))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is None:
            return
        loss = loss.detach().float()
        if self.sync and not isinstance(trainer.strategy, PGCStrategy) and trainer.world_size > 1:
            loss = trainer.strategy.reduce(loss, reduce_op="mean")  # DDP's mean of the local losses
        now = time.monotonic()
        if self.t0 is None:
            self.t0 = now
        self.rows.append((now - self.t0, trainer.global_step, float(loss)))
        if trainer.global_rank == 0 and trainer.global_step % 10 == 0:
            (self.out / "progress.txt").write_text(str(trainer.global_step))  # read by the demo's progress bars

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.fit_end = time.monotonic()
        if trainer.global_rank == 0:
            with open(self.out / "curve.csv", "w") as f:
                f.write("wall_s,step,train_loss\n")
                for t, step, loss in self.rows:
                    f.write(f"{t:.6f},{step},{loss:.6g}\n")


def run(spec: dict[str, Any]) -> None:
    spec = {**DEFAULTS, **spec}
    torch.set_num_threads(int(spec["threads"]))
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(spec["seed"], workers=True, verbose=False)

    strategy: Any = spec["strategy"]
    if spec["strategy_kwargs"]:
        from lightning.pytorch.strategies import StrategyRegistry

        kwargs = dict(spec["strategy_kwargs"])
        if strategy in StrategyRegistry and StrategyRegistry[strategy]["strategy"] is PGCStrategy:
            kwargs = {**StrategyRegistry[strategy]["init_params"], **kwargs}
        strategy = PGCStrategy(**kwargs)

    callbacks = build_callbacks(spec, out)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=spec["devices"],
        strategy=strategy,
        max_steps=spec["max_steps"],
        max_epochs=spec["max_epochs"],
        val_check_interval=spec["val_check_interval"],
        check_val_every_n_epoch=spec["check_val_every_n_epoch"],
        limit_val_batches=spec["limit_val_batches"],
        callbacks=callbacks,
        logger=pl.loggers.CSVLogger(out, name="logs"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(spec["checkpoint_every_n_steps"]),
        num_sanity_val_steps=0,
        deterministic=False,
    )
    model = DigitsCNN(lr=spec["lr"], sync_train_loss=spec["sync_loss"])
    data = DigitsDataModule(batch_size=spec["batch_size"], seed=spec["seed"])
    trainer.fit(model, datamodule=data, ckpt_path=spec["ckpt_path"])
    if spec["save_checkpoint"]:
        trainer.save_checkpoint(spec["save_checkpoint"])
    if spec["final_validation"]:
        trainer.validate(model, datamodule=data, verbose=False)

    recorder = callbacks[0]
    injector = callbacks[1]
    rank = trainer.global_rank
    result = {
        "rank": rank,
        "global_step": trainer.global_step,
        "checksum": parameter_checksum(model),
        "skipped_steps": getattr(trainer.strategy, "skipped_steps", 0),
        "injected_sleep_s": injector.total_sleep_s,
        "fit_wall_s": (recorder.fit_end or 0.0) - (recorder.fit_start or 0.0),
        "batch_sizes": recorder.batch_sizes,
        "pgc_threads_after_fit": [t.name for t in threading.enumerate() if t.name.startswith("pgc-")],
        "buffers": getattr(trainer.strategy, "buffer_stats", {}),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        diagnostics = next((cb for cb in trainer.callbacks if isinstance(cb, PGCDiagnostics)), None)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        summary = {
            "spec": spec,
            "metrics": metrics,
            "fit_wall_s": result["fit_wall_s"],
            "global_step": trainer.global_step,
            "diagnostics": diagnostics.history if diagnostics is not None else [],
        }
        (out / "summary.json").write_text(json.dumps(summary))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m lightning_pgc.job SPEC.json")
    spec = json.loads(Path(argv[0]).read_text())
    os.environ.setdefault("WANDB_MODE", "offline")
    run(spec)


if __name__ == "__main__":
    main()
