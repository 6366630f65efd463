"""Fault injection for users and tests: callbacks that kill, terminate, freeze, stall or poison one rank at one step.

They work under any strategy (``ddp`` included) and from YAML, like :class:`~lightning_pgc.StragglerInjector`::

    trainer:
      callbacks:
        - class_path: lightning_pgc.callbacks.faults.Stall
          init_args: {rank: 2, step: 10, seconds: 20}

Each fires once, at the start of training step ``step`` (``trainer.global_step``) on global rank ``rank``, and
records what it did in :attr:`Fault.fired_at` (the monotonic time, or None). With ``during="validation"`` it fires
at the first validation batch from step ``step`` on instead, and with ``during="sanity_check"`` at the first batch
of fit's sanity check.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from typing import Any, Optional

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

__all__ = ["PHASES", "Fault", "Freeze", "Kill", "NaNBuffers", "NaNGradient", "Stall", "Terminate"]

#: When a fault may fire (``Fault(during=...)``).
PHASES: tuple[str, ...] = ("train", "validation", "sanity_check")


class Fault(Callback):
    """Base class: fires :meth:`fire` once, when global rank ``rank`` starts training step ``step``.

    Args:
        rank: the global rank hit by the fault.
        step: the optimizer step (``trainer.global_step``) at which it fires.
        during: ``"train"`` (at the start of that training step), ``"validation"`` (at the first validation batch
            from that step on) or ``"sanity_check"`` (at the first batch of fit's sanity check; ``step`` must be 0).

    Raises:
        ValueError: a negative or non-integer ``rank``/``step``, an unknown ``during``, or a sanity-check fault at
            a step other than 0.
    """

    def __init__(self, rank: int, step: int, during: str = "train") -> None:
        for name, value in (("rank", rank), ("step", step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{type(self).__name__}: {name} must be a non-negative integer, got {value!r}")
        if during not in PHASES:
            raise ValueError(f"{type(self).__name__}: during must be one of {PHASES}, got {during!r}")
        if during == "sanity_check" and step != 0:
            raise ValueError(f"{type(self).__name__}: the sanity check runs before step 0; got step={step}")
        self.rank = rank
        self.step = step
        self.during = during
        self.fired_at: Optional[float] = None

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.during == "train":
            self._maybe_fire(trainer, pl_module)

    @override
    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.during == ("sanity_check" if trainer.sanity_checking else "validation"):
            self._maybe_fire(trainer, pl_module)

    def _maybe_fire(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.fired_at is None and trainer.global_rank == self.rank and trainer.global_step >= self.step:
            self.fired_at = time.monotonic()
            self.fire(trainer, pl_module)

    def fire(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """What the fault does (on the hit rank's training thread)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, step={self.step}{self._during_repr()})"

    def _during_repr(self) -> str:
        return "" if self.during == "train" else f", during={self.during!r}"


def _check_seconds(owner: str, seconds: float) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{owner}: seconds must be a finite number >= 0, got {seconds!r}")
    return float(seconds)


class Kill(Fault):
    """SIGKILL the hit rank's process: a node or process that dies without any chance to clean up."""

    @override
    def fire(self, trainer: Trainer, pl_module: LightningModule) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


class Terminate(Fault):
    """SIGTERM the hit rank's process, as a scheduler evicting one node does: Lightning's handler marks the
    trainer, and the rank stops at its next batch (under PGC alone; one per rank stops the whole job)."""

    @override
    def fire(self, trainer: Trainer, pl_module: LightningModule) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


class _LastingFault(Fault):
    """A fault that lasts ``seconds``.

    Args:
        seconds: how long it lasts.
    """

    def __init__(self, rank: int, step: int, seconds: float, during: str = "train") -> None:
        super().__init__(rank, step, during)
        self.seconds = _check_seconds(type(self).__name__, seconds)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, step={self.step}, seconds={self.seconds}{self._during_repr()})"


class Freeze(_LastingFault):
    """SIGSTOP the hit rank's process for ``seconds`` (then SIGCONT from a helper process): every thread stops,
    heartbeats included, as for a node that hangs or is swapped out."""

    @override
    def fire(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pid = os.getpid()
        # A stopped process cannot wake itself: a detached shell sends the SIGCONT.
        subprocess.Popen(
            ["/bin/sh", "-c", f"sleep {self.seconds}; kill -CONT {pid}"],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.kill(pid, signal.SIGSTOP)


class Stall(_LastingFault):
    """Sleep ``seconds`` on the hit rank's training thread: the process stays alive (its background threads keep
    beating), only its progress stops, as for a long garbage collection, I/O hiccup or noisy neighbour."""

    @override
    def fire(self, trainer: Trainer, pl_module: LightningModule) -> None:
        time.sleep(self.seconds)


class NaNGradient(Fault):
    """Make the hit rank's gradient NaN at step ``step`` (every parameter's gradient, after the backward pass;
    training only: validation computes no gradient)."""

    def __init__(self, rank: int, step: int) -> None:
        super().__init__(rank, step)
        self._armed = False

    @override
    def fire(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._armed = True

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._armed:
            self._armed = False
            for p in pl_module.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))


class NaNBuffers(NaNGradient):
    """Make the hit rank's floating-point buffers (BatchNorm running statistics) NaN at step ``step``, after the
    backward pass: statistics gone bad on one rank, its gradient intact (training only)."""

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._armed:
            self._armed = False
            for b in pl_module.buffers():
                if b.is_floating_point():
                    b.fill_(float("nan"))
