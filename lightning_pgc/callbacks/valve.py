"""StalenessValve: lower the learning rate (or the bounded window) when the measured staleness term grows.

Every rank measures the same quantity on the same probe batch and takes the same decision, with no collective;
``docs/results/safety_valve.md`` shows what it does to a run whose learning rate is too high for its staleness.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_pgc.callbacks.probe import collate, flat_params, log_at, loss_gradient, partition_loader
from lightning_pgc.codes.bounded import BoundedScheme, adapt_step

log = logging.getLogger(__name__)

__all__ = ["StalenessValve"]


class StalenessValve(Callback):
    """Safety valve: lower the learning rate when the measured staleness term is a large part of ``|g_hat|^2``.

    Every ``check_every_n_steps`` steps, at step ``t``, every rank computes the gradient of the training loss on a
    fixed probe batch (the same ``probe_size`` training samples on every rank) at ``beta_t`` and at
    ``beta_{t-a}``, ``a = scheme.max_staleness`` (``c - 1``: the oldest a gradient in a code can be), and

        ``L_hat = |g(beta_t) - g(beta_{t-a})| / (|beta_t - beta_{t-a}| + eps)``,
        ``ratio = L_hat^2 |beta_t - beta_{t-a}|^2 / mean |g_hat|^2``

    where the mean runs over the gradients applied since the previous check (``param.grad`` when the optimizer
    steps: under PGC the decoded aggregate, identical on every rank). When ``ratio > threshold`` it
    multiplies every optimizer param group's ``lr`` by ``factor`` (down to ``min_scale`` times the original),
    records the event and warns (rank 0) that ``c`` may be too large for this learning rate.

    Replicas stay bit-identical without any collective: the inputs (parameters, aggregates, the probe batch and
    ``scheme.max_staleness``) are identical on every rank and the computation is deterministic, so every rank takes
    the same decision at the same step. That requires the same torch build and thread settings on every rank, as
    Lightning's launchers give. Off unless added to the Trainer's callbacks.

    Args:
        threshold: act when ``ratio`` exceeds this.
        factor: multiply ``lr`` by this on each action (``0 < factor < 1``).
        check_every_n_steps: steps between checks (two probe gradients per check, on every rank).
        min_scale: never scale ``lr`` below this fraction of its value when training started.
        probe_size: samples in the probe batch (drawn once, seeded, from the training set).
        probe_seed: seed of that draw.
        action: ``"lr"`` lowers the learning rate; ``"window"`` (``scheme="bounded"`` only) lowers the staleness
            window ``c`` by one instead (down to ``min_window``; the leader then closes versions only with younger
            entries, waiting more for coverage); ``"warn"`` only warns and records.
        recover_below: if set, undo one action (``lr`` times ``1/factor`` or ``c`` plus one, up to the original)
            when ``ratio`` falls below this.
        staleness: the age ``a`` to measure over; default ``scheme.max_staleness`` (the valve is inert when 0),
            read once at the start of fit.
        eps: the ``eps`` in ``L_hat``.
        min_window: the smallest ``c`` the ``"window"`` action lowers to. Raise it if coverage waits
            (``pgc/bounded/coverage_wait_s``) grow after the valve acted.
    """

    def __init__(
        self,
        threshold: float = 0.5,
        factor: float = 0.5,
        check_every_n_steps: int = 10,
        min_scale: float = 1.0 / 64,
        probe_size: int = 256,
        probe_seed: int = 0,
        action: str = "lr",
        recover_below: Optional[float] = None,
        staleness: Optional[int] = None,
        eps: float = 1e-12,
        min_window: int = 1,
    ) -> None:
        if not threshold >= 0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        if not 0.0 < factor < 1.0:
            raise ValueError(f"factor must be in (0, 1), got {factor}")
        if check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be >= 1, got {check_every_n_steps}")
        if not 0.0 < min_scale <= 1.0:
            raise ValueError(f"min_scale must be in (0, 1], got {min_scale}")
        if probe_size < 1:
            raise ValueError(f"probe_size must be >= 1, got {probe_size}")
        if action not in ("lr", "warn", "window"):
            raise ValueError(f"action must be 'lr', 'window' or 'warn', got {action!r}")
        if min_window < 1:
            raise ValueError(f"min_window must be >= 1, got {min_window}")
        if recover_below is not None and not 0 <= recover_below < threshold:
            raise ValueError(f"recover_below must be in [0, threshold), got {recover_below}")
        if staleness is not None and staleness < 0:
            raise ValueError(f"staleness must be >= 0 or None, got {staleness}")
        self.threshold = float(threshold)
        self.factor = float(factor)
        self.check_every_n_steps = check_every_n_steps
        self.min_scale = float(min_scale)
        self.probe_size = probe_size
        self.probe_seed = probe_seed
        self.action = action
        self.recover_below = recover_below
        self.staleness = staleness
        self.eps = eps
        self.min_window = min_window
        self.window: Optional[int] = None  # current c under action="window" (checkpointed)
        self._initial_window = 0
        self.scale = 1.0  # current lr / lr at the start of training (checkpointed)
        self.events: list[dict[str, float]] = []  # every lr change (checkpointed)
        self.history: list[dict[str, float]] = []  # every check of this fit
        self._age = 0
        self._probe: Any = None
        self._anchors: dict[int, tuple[Tensor, Tensor]] = {}
        self._agg_sq: list[float] = []
        self.rank = 0
        self.final_lrs: list[float] = []  # every param group's lr at the end of fit

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "events": list(self.events), "window": self.window}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scale = float(state_dict.get("scale", 1.0))
        self.events = list(state_dict.get("events", []))
        self.window = state_dict.get("window")

    # ------------------------------------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.history = []
        self._anchors = {}
        self._agg_sq = []
        self.rank = trainer.global_rank
        scheme = getattr(trainer.strategy, "scheme", None)
        if self.action == "window":
            if not isinstance(scheme, BoundedScheme):
                raise ValueError(
                    "StalenessValve(action='window') lowers the window c of scheme='bounded'; this "
                    f"strategy's scheme is {getattr(scheme, 'name', None)!r}: use action='lr'"
                )
            self._initial_window = scheme.window
            if self.window is not None:  # resumed: the checkpointed window, identical on every rank
                scheme.window = self.window
            self.window = scheme.window
        self._age = int(self.staleness if self.staleness is not None else getattr(scheme, "max_staleness", 0) or 0)
        if self._age == 0:
            if self.rank == 0:
                log.info("StalenessValve: no staleness to measure (max_staleness = 0); the valve is inert")
            return
        loader = trainer.train_dataloader
        found = partition_loader(trainer)
        if found is not None:
            loader = found[0]
        dataset = getattr(loader, "dataset", None)
        if dataset is None or not hasattr(dataset, "__len__"):
            raise ValueError("StalenessValve needs a map-style training dataset to draw its probe batch from")
        size = min(self.probe_size, len(dataset))
        indices = np.random.default_rng(self.probe_seed).permutation(len(dataset))[:size].tolist()
        self._probe = collate(loader, indices)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._age == 0 or self._probe is None:
            return
        t, a, every = trainer.global_step, self._age, self.check_every_n_steps
        is_anchor = (t + a) % every == 0
        is_check = t % every == 0 and (t - a) in self._anchors
        if not (is_anchor or is_check):
            return
        params = flat_params(pl_module)
        gradient = loss_gradient(pl_module, self._probe)
        if is_check:
            old_params, old_gradient = self._anchors.pop(t - a)
            self._check(trainer, pl_module, t, params, gradient, old_params, old_gradient)
        if is_anchor:
            self._anchors[t] = (params, gradient)
        for v in [v for v in self._anchors if v < t - a]:
            del self._anchors[v]

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        """``|g_hat|^2`` of the gradient about to be applied: under PGC the decoded aggregate, the same on every rank."""
        if self._age == 0:
            return
        total = 0.0
        for p in pl_module.parameters():
            if p.requires_grad and p.grad is not None:
                total += float(p.grad.detach().to(torch.float64).pow(2).sum())
        self._agg_sq.append(total)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.final_lrs = [float(g["lr"]) for opt in trainer.optimizers for g in opt.param_groups]

    # ------------------------------------------------------------------------------------------- decision
    def _check(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        t: int,
        params: Tensor,
        gradient: Tensor,
        old_params: Tensor,
        old_gradient: Tensor,
    ) -> None:
        if not self._agg_sq:
            return
        agg_sq = sum(self._agg_sq) / len(self._agg_sq)
        self._agg_sq = []
        step = float((params - old_params).norm())
        l_hat = float((gradient - old_gradient).norm()) / (step + self.eps)
        term = l_hat**2 * step**2
        ratio = term / max(agg_sq, self.eps)
        new_scale, new_window = self.scale, self.window
        if self.action == "lr":
            new_scale = adapt_step(
                ratio,
                threshold=self.threshold,
                recover_below=self.recover_below,
                value=self.scale,
                factor=self.factor,
                lowest=self.min_scale,
                highest=1.0,
            )
        elif self.action == "window" and self.window is not None:
            new_window = int(
                adapt_step(
                    ratio,
                    threshold=self.threshold,
                    recover_below=self.recover_below,
                    value=self.window,
                    factor=-1,
                    lowest=min(self.min_window, self.window),
                    highest=self._initial_window,
                )
            )
        entry = {
            "step": float(t),
            "ratio": ratio,
            "staleness_term": term,
            "agg_sqnorm": agg_sq,
            "L_hat": l_hat,
            "displacement_sq": step**2,
            "lr_scale": new_scale,
        }
        if new_window is not None:
            entry["window"] = float(new_window)
        self.history.append(entry)
        if new_window != self.window:
            scheme: Any = getattr(trainer.strategy, "scheme")  # a BoundedScheme: checked at on_train_start
            scheme.window = self.window = new_window
            self.events.append(entry)
        changed = new_scale != self.scale
        if changed:
            change = new_scale / self.scale
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] = group["lr"] * change
            self.scale = new_scale
            self.events.append(entry)
        if ratio > self.threshold and self.rank == 0:
            if self.action == "window":
                did = f"staleness window c is now {self.window}. "
            elif self.action != "lr":
                did = ""
            elif changed:
                did = f"learning rate scaled to {self.scale:g} x its initial value. "
            else:
                did = f"learning rate already at its floor ({self.scale:g} x its initial value). "
            rank_zero_warn(
                f"PGC staleness valve at step {t}: L_hat^2 * |beta_t - beta_(t-{self._age})|^2 = {term:.3g} is "
                f"{ratio:.2f} x |g_hat|^2 (threshold {self.threshold:g}); {did}"
                f"Gradients up to c-1 = {self._age} steps stale move this far: consider a smaller c (PGC: fewer "
                f"tolerated stragglers, c = s+1 = {self._age + 1}; bounded: `staleness`) or a lower learning rate."
            )
        if self.rank == 0:  # at the step measured, once (not at Lightning's log_every_n_steps cadence)
            log_at(
                trainer,
                {
                    "pgc/valve/ratio": ratio,
                    "pgc/valve/lr_scale": self.scale,
                    "pgc/valve/L_hat_staleness": l_hat,
                    "pgc/valve/staleness_term": term,
                    **({"pgc/valve/window": float(self.window)} if self.window else {}),
                },
                t,
            )
