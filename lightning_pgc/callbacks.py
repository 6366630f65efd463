"""PGCDiagnostics: what the coordinator saw each step, logged through the Trainer's logger (W&B included).

Every step (on the coordinator's rank, where the records are): the decoded training loss, admitted ranks,
per-rank arrival times, coordinator wait, step wall time, gradient ages, coefficient range and the squared
norm of the aggregate. Every ``every_n_steps`` steps, on a fixed probe batch: the parameter displacement to
the oldest version in use and the local smoothness estimate ``L_hat = |g(b_t) - g(b_u)| / (|b_t - b_u| + eps)``,
so the staleness term ``L_hat^2 * displacement`` can be compared with ``|g_hat|^2``.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor


class PGCDiagnostics(Callback):
    """Logs the runtime's per-step record under ``pgc/...`` (attached by :class:`PGCStrategy` by default).

    Args:
        every_n_steps: steps between probe-batch measurements (displacement, ``L_hat``, staleness term).
        per_rank: also log one scalar per rank (arrival time, admitted flag) for up to this many ranks.
        eps: the ``eps`` in ``L_hat``.
    """

    def __init__(self, every_n_steps: int = 25, per_rank: int = 16, eps: float = 1e-12) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.per_rank = per_rank
        self.eps = eps
        self.history: list[dict[str, float]] = []  # what was logged, kept for benchmarks and tests
        self._last_end: Optional[float] = None
        self._snapshots: deque[tuple[int, Tensor]] = deque()
        self._probe: Any = None
        self._last_probe: Optional[tuple[int, Tensor, Tensor]] = None  # (version, params, probe gradient)

    # ------------------------------------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_end = None
        self._snapshots.clear()
        self._last_probe = None
        self.history = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        strategy = trainer.strategy
        if not _is_coordinator(strategy):
            return
        if self._probe is None:
            self._probe = apply_to_collection(batch, Tensor, lambda t: t.detach().clone())
        version = trainer.global_step
        params = _flat_params(pl_module)
        c = getattr(strategy.scheme, "c", 1)
        self._snapshots.append((version, params))
        while len(self._snapshots) > max(c, 1) + 16:  # enough to reach the oldest version in use
            self._snapshots.popleft()
        if version % self.every_n_steps == 0:
            gradient = self._probe_gradient(pl_module)
            self._pending_probe = (version, params, gradient)
        else:
            self._pending_probe = None

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
        info = getattr(strategy, "last_step", None)
        now = time.monotonic()
        if info is None or not _is_coordinator(strategy):
            self._last_end = now
            return
        metrics: dict[str, float] = {"pgc/train_loss": info.loss, "pgc/skipped_steps": float(strategy.skipped_steps)}
        if self._last_end is not None:
            metrics["pgc/step_time_s"] = now - self._last_end
        self._last_end = now
        metrics["pgc/worker_wait_s"] = info.worker_wait_s
        aggregate_sq = float(info.aggregate.to(torch.float64).pow(2).sum())
        metrics["pgc/agg_sqnorm"] = aggregate_sq

        coordinator = strategy.runtime.coordinator if strategy.runtime is not None else None
        record = _find_record(coordinator, info.version)
        max_age = 0
        if record is not None:
            metrics.update(self._record_metrics(strategy, record))
            max_age = int(metrics.get("pgc/max_age", 0))
            metrics["pgc/late_codes"] = float(coordinator.late_codes)

        pending = getattr(self, "_pending_probe", None)
        if pending is not None:
            metrics.update(self._probe_metrics(pending, max_age, aggregate_sq))
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True, batch_size=1)
        self.history.append({"step": float(info.version), **metrics})
        if record is not None and info.version % self.every_n_steps == 0:
            self._log_histogram(trainer, record, info.version)

    # ------------------------------------------------------------------------------------------ measurements
    def _record_metrics(self, strategy: Any, record: Any) -> dict[str, float]:
        scheme = strategy.scheme
        n = scheme.n
        out: dict[str, float] = {
            "pgc/admitted": float(len(record.admitted)),
            "pgc/coordinator_wait_s": record.wait_s,
        }
        for r in range(min(n, self.per_rank)):
            out[f"pgc/admitted/rank{r}"] = float(r in record.admitted)
            if r in record.arrivals:
                out[f"pgc/arrival_s/rank{r}"] = record.arrivals[r]
        ages = [a for r in record.admitted if record.weights.get(r, 0.0) != 0.0 for a in record.ages.get(r, ())]
        if ages:
            out["pgc/max_age"] = float(max(ages))
            out["pgc/mean_age"] = sum(ages) / len(ages)
        coefficients = scheme.coefficients(record.admitted).to(torch.float64) * n
        out["pgc/coef_min"] = float(coefficients.min())  # relative to the ideal 1/n
        out["pgc/coef_max"] = float(coefficients.max())
        copies = scheme.copy_coefficients(record.admitted).to(torch.float64).abs() * n
        out["pgc/copy_coef_max"] = float(copies.max())
        return out

    def _probe_metrics(self, pending: tuple[int, Tensor, Tensor], max_age: int, aggregate_sq: float) -> dict[str, float]:
        version, params, gradient = pending
        out: dict[str, float] = {"pgc/probe_grad_sqnorm": float(gradient.pow(2).sum())}
        oldest = next((p for v, p in self._snapshots if v == version - max_age), None)
        displacement = float((params - oldest).pow(2).sum()) if oldest is not None else 0.0
        out["pgc/displacement_sq"] = displacement
        if self._last_probe is not None:
            _, old_params, old_gradient = self._last_probe
            l_hat = float((gradient - old_gradient).norm() / ((params - old_params).norm() + self.eps))
            out["pgc/L_hat"] = l_hat
            out["pgc/staleness_term"] = l_hat**2 * displacement
            out["pgc/staleness_ratio"] = l_hat**2 * displacement / max(aggregate_sq, self.eps)
        self._last_probe = pending
        return out

    def _probe_gradient(self, pl_module: LightningModule) -> Tensor:
        """Gradient of the training loss on the fixed probe batch, leaving no trace (grads, buffers, RNG, logs)."""
        params = [p for p in pl_module.parameters() if p.requires_grad]
        buffers = [b.detach().clone() for b in pl_module.buffers()]
        probe = apply_to_collection(self._probe, Tensor, lambda t: t.to(pl_module.device))
        with torch.random.fork_rng(devices=[]), torch.enable_grad(), _muted(pl_module):
            output = pl_module.training_step(probe, 0)
            loss = output["loss"] if isinstance(output, Mapping) else output
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        for b, saved in zip(pl_module.buffers(), buffers):
            b.data.copy_(saved)
        return torch.cat(
            [(g if g is not None else torch.zeros_like(p)).detach().reshape(-1).double().cpu() for g, p in zip(grads, params)]
        )

    def _log_histogram(self, trainer: Trainer, record: Any, version: int) -> None:
        try:
            from lightning.pytorch.loggers import WandbLogger
        except ImportError:  # pragma: no cover
            return
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                import wandb

                ages = [a for r in record.admitted for a in record.ages.get(r, ())]
                logger.experiment.log({"pgc/age_histogram": wandb.Histogram(ages), "trainer/global_step": version})


def _is_coordinator(strategy: Any) -> bool:
    runtime = getattr(strategy, "runtime", None)
    return runtime is not None and runtime.is_coordinator


def _find_record(coordinator: Any, version: int) -> Any:
    return None if coordinator is None else coordinator.record(version)


def _flat_params(module: torch.nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in module.parameters() if p.requires_grad])


@contextmanager
def _muted(module: LightningModule) -> Iterator[None]:
    """Silence ``self.log`` inside a probe call of the user's training_step."""
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log
        del module.log_dict
