"""A callback that injects straggler delays into any training run: it sleeps a seeded delay model's delay
(:mod:`lightning_pgc.delays`) once per optimizer step on the rank it runs on, with ``ddp`` as with ``pgc``."""

from __future__ import annotations

import time
from typing import Optional, Union

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_pgc.delays import DelayModel, check_seconds, delay_for, parse_delay

__all__ = ["StragglerInjector"]


class StragglerInjector(Callback):
    """Sleeps a seeded, per-rank delay once per optimizer step to emulate stragglers with any strategy.

    The delay is taken in the first ``on_after_backward`` of each ``trainer.global_step``: strategies that
    run several backward passes per step are delayed once, and a rank that skips computing a step (it never
    calls backward) is not delayed for it. Statistics (``total_sleep_s``, ``steps_delayed``, ``last_delay_s``)
    are those of the rank the callback runs on, for the current fit.

    Args:
        delay: a :class:`DelayModel` or its string form (see :func:`parse_delay`).
        seed: seed of the delay realisation; the same seed gives the same delays under every strategy.
        scale: multiplies every delay (the time-scale knob).
    """

    def __init__(self, delay: Union[DelayModel, str] = "none", seed: int = 0, scale: float = 1.0) -> None:
        self.delay = parse_delay(delay) if isinstance(delay, str) else delay
        if not isinstance(self.delay, DelayModel):
            raise ValueError(f"delay must be a DelayModel or a spec string, got {delay!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.seed = seed
        self.scale = check_seconds("scale", scale)
        self._reset()

    def _reset(self) -> None:
        self.total_sleep_s = 0.0
        self.steps_delayed = 0
        self.last_delay_s = 0.0
        self._last_step: Optional[int] = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset()

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return
        self._last_step = step
        seconds = delay_for(self.delay, self.seed, trainer.global_rank, step) * self.scale
        self.last_delay_s = seconds
        if seconds > 0:
            time.sleep(seconds)
            self.total_sleep_s += seconds
            self.steps_delayed += 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}(delay={str(self.delay)!r}, seed={self.seed}, scale={self.scale})"
