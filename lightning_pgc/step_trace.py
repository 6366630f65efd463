"""A callback that records every rank's own step times in a real run, under any strategy (``ddp`` included), for
``lightning-pgc advise trace.json``.

A rank's *own* time at a step is the part of the step it spends working rather than waiting for other ranks:

- the forward pass (``on_train_batch_start`` to ``on_before_backward``), which waits for nobody;
- the backward pass, estimated as twice the forward (collectives overlap the real backward under ``ddp``, so its
  wall time includes waiting for the slowest rank);
- from the end of backward to the end of the batch (callbacks, e.g. an injected delay, and the optimizer), minus
  the time the PGC strategy reports waiting for its aggregate (``pgc`` strategies only; under ``ddp`` that span
  holds no collective).

Put the callback first in ``callbacks`` so that work other callbacks do after backward counts as the rank's own.
Every rank sends its times to rank 0 when training ends (one gather, outside the steps), which writes ``path``::

    {"format": "lightning-pgc step trace", "version": 1, "n": 4, "strategy": "DDPStrategy",
     "own_s": [[...rank 0, one per step...], [...rank 1...], ...], "step_s": [...rank 0's wall time per step...]}
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

__all__ = ["StepTimeTrace", "TRACE_FORMAT"]

TRACE_FORMAT = "lightning-pgc step trace"


class StepTimeTrace(Callback):
    """Records each rank's own time per step and writes them all to ``path`` (rank 0) when training ends.

    Args:
        path: the JSON file to write.
        skip: first steps left out (start-up: compilation, allocation, data loader workers).
    """

    def __init__(self, path: str = "trace.json", skip: int = 2) -> None:
        if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
            raise ValueError(f"skip must be an int >= 0, got {skip!r}")
        self.path = Path(path)
        self.skip = skip
        self.own_s: list[float] = []
        self.step_s: list[float] = []
        self._t0: Optional[float] = None
        self._forward: Optional[float] = None
        self._after_backward: Optional[float] = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.own_s, self.step_s = [], []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()
        self._forward = self._after_backward = None

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        if self._t0 is not None and self._forward is None:
            self._forward = time.perf_counter() - self._t0

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._after_backward = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._t0 is None or self._forward is None:
            return  # e.g. a PGC rank that caught up without computing: no own work at this step
        after = now - self._after_backward if self._after_backward is not None else 0.0
        info = getattr(trainer.strategy, "last_step", None)
        waited = float(getattr(info, "worker_wait_s", 0.0) or 0.0)
        self.own_s.append(max(0.0, 3 * self._forward + after - waited))
        self.step_s.append(now - self._t0)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        own = self.own_s[self.skip :]
        n = trainer.world_size
        if n > 1:
            steps = torch.tensor([len(own)], dtype=torch.long)
            counts = trainer.strategy.all_gather(steps).reshape(-1)
            m = int(counts.min())
            gathered = trainer.strategy.all_gather(torch.tensor(own[:m], dtype=torch.float64)).reshape(n, m)
            ranks = gathered.tolist()
        else:
            ranks = [own]
        if trainer.is_global_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(
                json.dumps(
                    {
                        "format": TRACE_FORMAT,
                        "version": 1,
                        "n": n,
                        "strategy": type(trainer.strategy).__name__,
                        "own_s": ranks,
                        "step_s": self.step_s[self.skip :],
                    }
                )
            )
