"""A short digits job on 2 real ddp ranks with StepTimeTrace; rank 1 sleeps 0.1 s after every backward.

Usage: ``python tests/step_trace_job.py TRACE.json`` (Lightning forks the ranks from it).
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl

from lightning_pgc.examples.digits import DigitsCNN, DigitsDataModule
from lightning_pgc.step_trace import StepTimeTrace
from lightning_pgc.callbacks.stragglers import StragglerInjector

if __name__ == "__main__":
    out = sys.argv[1]
    t = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_fork",
        max_steps=14,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        callbacks=[StepTimeTrace(out, skip=2), StragglerInjector("slowranks(ranks=[1], seconds=0.1)")],
    )
    t.fit(DigitsCNN(), DigitsDataModule(batch_size=16))
