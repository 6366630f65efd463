"""One real digits job of the end-to-end validation (benchmarks/validate_e2e.py): ``n`` CPU ranks through the PGC
strategy, a straggler pattern of the emulated map injected, its schedule and trajectory recorded for the emulator.

Usage: ``python benchmarks/validate_e2e_job.py OUT SCHEME PATTERN SEED STEPS LR MOMENTUM N COMPUTE_S`` (run as a
script: Lightning forks the ranks from it). ``SCHEME`` is a scheme name (``dgd``: ddp's mathematics through the PGC
runtime); ``PATTERN`` a key of ``lightning_pgc.emulator.cluster.PATTERNS``; every gradient evaluation sleeps
``COMPUTE_S`` (the map's compute per gradient, so the pattern's delays keep their size relative to compute).
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl

import lightning_pgc  # noqa: F401
from lightning_pgc import PGCStrategy
from lightning_pgc.callbacks import StragglerInjector
from lightning_pgc.emulator.cluster import delay_model
from pgc_lab.map.record import ScheduleRecorder
from lightning_pgc.examples.digits import DigitsCNN, DigitsDataModule
from pgc_lab.experiments.callbacks import SimulatedCompute

BATCH = 16

if __name__ == "__main__":
    out, scheme, pattern = sys.argv[1], sys.argv[2], sys.argv[3]
    seed, steps = int(sys.argv[4]), int(sys.argv[5])
    lr, momentum, n, compute_s = float(sys.argv[6]), float(sys.argv[7]), int(sys.argv[8]), float(sys.argv[9])
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=n,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        strategy=PGCStrategy(
            scheme=scheme,
            stragglers=0 if scheme == "dgd" else 1,
            start_method="fork",
            diagnostics={"enabled": False},
        ),
        callbacks=[
            ScheduleRecorder(out, trajectory=True),
            SimulatedCompute(compute_s),
            StragglerInjector(delay_model(pattern, n, seed), seed=seed),
        ],
    )
    trainer.fit(DigitsCNN(lr=lr, momentum=momentum, sync_train_loss=False), DigitsDataModule(batch_size=BATCH))
