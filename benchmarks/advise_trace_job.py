"""Record a step trace on this machine: 4 ddp CPU ranks on the digits CNN, one rank slowed.

Usage: ``python benchmarks/advise_trace_job.py TRACE.json STEPS COMPUTE_S SLOW_S`` (Lightning forks the ranks from
it). Every gradient evaluation sleeps ``COMPUTE_S`` (compute of a heavier model on a dedicated device, as in the
benchmarks); rank 3 sleeps ``SLOW_S`` more after every backward (:class:`~lightning_pgc.StragglerInjector`).
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl

from lightning_pgc.callbacks.stragglers import StragglerInjector
from lightning_pgc.examples.digits import DigitsCNN, DigitsDataModule
from pgc_lab.experiments.callbacks import SimulatedCompute
from lightning_pgc.step_trace import StepTimeTrace

if __name__ == "__main__":
    out, steps, compute_s, slow_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy="ddp_fork",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        callbacks=[
            StepTimeTrace(out, skip=3),
            SimulatedCompute(compute_s),
            StragglerInjector(f"slowranks(ranks=[3], seconds={slow_s})"),
        ],
    )
    trainer.fit(DigitsCNN(), DigitsDataModule(batch_size=16))
