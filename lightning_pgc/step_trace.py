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

When training ends (outside the steps) it also times one all-reduce of the model's gradient size (every trainable
parameter, in their dtype, on the module's device; ``allreduce_repeats`` timed calls after one warm-up, each after a
barrier): the median per rank, the largest over the ranks, is ``allreduce_s``. ``lightning-pgc advise`` divides the
typical own step by it to get the job's compute-to-communication ratio. A 1-rank run has no all-reduce to time
(``allreduce_s`` is ``null``).

Every rank then sends its times to rank 0 (one gather), which writes ``path``::

    {"format": "lightning-pgc step trace", "version": 2, "n": 4, "strategy": "DDPStrategy",
     "own_s": [[...rank 0, one per step...], [...rank 1...], ...], "step_s": [...rank 0's wall time per step...],
     "allreduce_s": 0.0021, "grad_numel": 11274, "grad_dtype": "torch.float32"}
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

__all__ = ["StepTimeTrace", "TRACE_FORMAT"]

TRACE_FORMAT = "lightning-pgc step trace"


class StepTimeTrace(Callback):
    """Records each rank's own time per step and writes them all to ``path`` (rank 0) when training ends.

    Args:
        path: the JSON file to write.
        skip: first steps left out (start-up: compilation, allocation, data loader workers).
        allreduce_repeats: timed all-reduces of the gradient's size at the end of training (after one warm-up).
    """

    def __init__(self, path: str = "trace.json", skip: int = 2, allreduce_repeats: int = 5) -> None:
        if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
            raise ValueError(f"skip must be an int >= 0, got {skip!r}")
        if isinstance(allreduce_repeats, bool) or not isinstance(allreduce_repeats, int) or allreduce_repeats < 1:
            raise ValueError(f"allreduce_repeats must be an int >= 1, got {allreduce_repeats!r}")
        self.path = Path(path)
        self.skip = skip
        self.allreduce_repeats = allreduce_repeats
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

    def _time_allreduce(self, pl_module: LightningModule) -> float:
        """This rank's median time of one all-reduce of a buffer the size of the gradient."""
        params = [p for p in pl_module.parameters() if p.requires_grad]
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        times = []
        for _ in range(self.allreduce_repeats + 1):
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(buffer)
            if buffer.is_cuda:
                torch.cuda.synchronize(buffer.device)
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        own = self.own_s[self.skip :]
        n = trainer.world_size
        params = [p for p in pl_module.parameters() if p.requires_grad]
        allreduce: Optional[float] = None
        if n > 1 and params and dist.is_available() and dist.is_initialized():
            mine = torch.tensor([self._time_allreduce(pl_module)], dtype=torch.float64)
            allreduce = float(trainer.strategy.all_gather(mine).max())
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
                        "version": 2,
                        "n": n,
                        "strategy": type(trainer.strategy).__name__,
                        "own_s": ranks,
                        "step_s": self.step_s[self.skip :],
                        "allreduce_s": allreduce,
                        "grad_numel": sum(p.numel() for p in params),
                        "grad_dtype": str(params[0].dtype) if params else None,
                    }
                )
            )
