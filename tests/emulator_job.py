"""A short digits job on 4 real ranks through the pgc strategy that records its schedule for the emulator.

Usage: ``python tests/emulator_job.py OUT SCHEME STEPS [CORRECTION [DC_LAMBDA]]`` (run as a script: Lightning forks
the ranks from it; CORRECTION is a ``staleness_correction``, default ``none``).
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl

import lightning_pgc  # noqa: F401
from lightning_pgc import PGCStrategy
from lightning_pgc.examples.digits import DigitsCNN, DigitsDataModule
from pgc_lab.map.record import ScheduleRecorder
from lightning_pgc.callbacks import StragglerInjector

DELAY = "lognormal(median=0.01, sigma=1.0)"  # varies the admitted sets from version to version
BATCH = 16
LR, MOMENTUM = 0.05, 0.9

if __name__ == "__main__":
    out, scheme, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    correction = sys.argv[4] if len(sys.argv) > 4 else "none"
    dc_lambda = float(sys.argv[5]) if len(sys.argv) > 5 else None
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        strategy=PGCStrategy(
            scheme=scheme,
            **({} if scheme == "bounded" else {"stragglers": 1}),  # bounded: replication 2, staleness 2
            start_method="fork",
            diagnostics={"enabled": False},
            coding={"staleness_correction": correction, "dc_lambda": dc_lambda},
        ),
        callbacks=[ScheduleRecorder(out, trajectory=True), StragglerInjector(DELAY, seed=0)],
    )
    trainer.fit(DigitsCNN(lr=LR, momentum=MOMENTUM, sync_train_loss=False), DigitsDataModule(batch_size=BATCH))
