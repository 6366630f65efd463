"""PGCDiagnostics: what the leader (rank 0) saw each step, logged through the Trainer's loggers (W&B included).

Every metric is logged once, at the step it was measured (``logger.log_metrics(..., step=t)``, independent of
Lightning's ``log_every_n_steps``). Every ``log_every_n_steps`` steps of its own (default: every step), on the leader's
rank, where the records are: the decoded training loss, admitted ranks, leader wait (``pgc/coordinator_wait_s``),
step wall time, gradient ages, coefficient range, and for every rank whether its code was admitted, its arrival
lag and its running totals of admitted, late and skipped steps (:meth:`PGCStrategy.rank_stats`), so the straggler
is named. Every ``loss_every_n_steps`` steps: the current model's loss on a fixed probe batch (``pgc/probe_loss``:
one model version, unlike the decoded loss, which mixes versions ``t..t-c+1``). Every ``every_n_steps`` steps, on
the probe batch: the squared norm of the aggregate, the parameter displacement to the oldest version in use and the
smoothness estimate between two probe measurements ``pgc/L_hat_probe = |g(b_t) - g(b_u)| / (|b_t - b_u| + eps)``,
so the staleness term ``L_hat^2 * displacement`` can be compared with ``|g_hat|^2``. The displacement and
``L_hat`` are measured on a fixed, seeded sample of ``sample_coordinates`` parameter coordinates (every coordinate
when the model has fewer): the leader keeps no model-sized vector for them, and logs each estimate's relative
standard error (``pgc/displacement_sq_rse``, ``pgc/L_hat_probe_rse``; see
:class:`~lightning_pgc.callbacks.probe.CoordinateSample`). The probe gradient's squared norm is exact.

Optionally (``theory_every_n_steps``, off by default) the leader's rank also measures what the convergence
theory of the paper only assumes (``docs/results/theory.md``): the staleness bias ``gamma_hat``, the noise ratio ``xi_hat``,
the extra error of the received-subset estimator over the straggler pattern, the exact decomposition of the
aggregate's error into subset-selection, sampling and staleness terms, and how correlated the copies of one
partition are (:class:`~lightning_pgc.callbacks.theory_metrics.TheoryMeter`).

Under ``scheme="bounded"`` the leader's rank also logs ``pgc/bounded/...``: every step the window ``c`` in effect,
coverage waits, widenings, table displacements, duplicated evaluations and the delay histogram ``t - s(t,i)``; at the probe cadence the
bounded-staleness error decomposition of the aggregate with its cross terms and the stale/fresh gradient correlation, both on
the probe batch (see :func:`lightning_pgc.codes.bounded.error_decomposition`).

Under ``scheme="auto"`` every step also logs the arm the version ran: ``pgc/auto_arm`` (0 ``dgd``, 1 ``ignore``; see
:data:`lightning_pgc.decisions.auto.ARM_CODES`) and ``pgc/auto_s``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Mapping, Optional

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger  # (Lightning's class: wandb itself is imported only to log to it)
from torch import Tensor

from lightning_pgc.callbacks.probe import (
    CoordinateSample,
    flat_params,
    log_at,
    loss_and_gradient,
    probe_loss,
    reduced_gradient,
    squared_norm,
)
from lightning_pgc.callbacks.theory_metrics import TheoryMeter
from lightning_pgc.codes.bounded import BoundedScheme, error_decomposition
from lightning_pgc.decisions.bounded import BoundedRecord

__all__ = ["PGCDiagnostics"]


class PGCDiagnostics(Callback):
    """Logs the runtime's per-step record under ``pgc/...`` (attached by :class:`PGCStrategy` by default).

    Args:
        every_n_steps: steps between probe-batch gradient measurements (displacement, ``L_hat_probe``, staleness
            term).
        per_rank: log the per-rank scalars for up to this many ranks (``None``: every rank). Past it, W&B gets the
            full per-rank table and histograms at the probe cadence, and every logger ``pgc/slowest_rank``.
        eps: the ``eps`` in ``L_hat``.
        log_every_n_steps: steps between the per-step records logged (every one is measured; this thins the log).
        loss_every_n_steps: steps between probe-batch losses (``pgc/probe_loss``; one forward pass without grad).
        history_size: how many logged rows :attr:`history` keeps (the newest).
        theory_every_n_steps: steps between the measurements of the theory's constants (``pgc/theory/...``, see
            ``docs/results/theory.md``); ``None`` (default) turns them off. Rank 0 only; each costs about
            one forward/backward pass over the (probe) training set per version in use (``c`` in the steady
            state) plus about ``n c`` mini-batch gradients.
        theory_probe_per_partition: samples of each partition used for ``grad F_j`` (a fixed, seeded subset, the
            same at every measurement); ``None`` uses the whole partition (exact, fine for small data sets).
        theory_window: how many recent leader records form the empirical straggler pattern.
        theory_max_patterns: received sets enumerated exactly up to this many, sampled beyond.
        theory_chunk: samples per forward pass when computing ``grad F_j``.
        sample_coordinates: parameter coordinates the displacement, ``L_hat`` and, under ``scheme="bounded"``,
            the error decomposition are measured on (a fixed, seeded subset; each estimate comes with its relative
            standard error, ``..._rse``); ``None`` measures every coordinate. The theory measurements evaluate
            gradients at past parameters, so with them the leader keeps full parameter snapshots of the versions in
            use (one model-sized vector each).
    """

    def __init__(
        self,
        every_n_steps: int = 25,
        per_rank: Optional[int] = None,
        eps: float = 1e-12,
        log_every_n_steps: int = 1,
        loss_every_n_steps: int = 5,
        history_size: int = 10_000,
        theory_every_n_steps: Optional[int] = None,
        theory_probe_per_partition: Optional[int] = None,
        theory_window: int = 64,
        theory_max_patterns: int = 5000,
        theory_chunk: int = 512,
        sample_coordinates: Optional[int] = 65536,
    ) -> None:
        for name, value in (
            ("every_n_steps", every_n_steps),
            ("log_every_n_steps", log_every_n_steps),
            ("loss_every_n_steps", loss_every_n_steps),
            ("history_size", history_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if per_rank is not None and per_rank < 0:
            raise ValueError(f"per_rank must be >= 0 or None, got {per_rank}")
        if theory_every_n_steps is not None and theory_every_n_steps < 1:
            raise ValueError(f"theory_every_n_steps must be >= 1 or None, got {theory_every_n_steps}")
        if theory_probe_per_partition is not None and theory_probe_per_partition < 1:
            raise ValueError(f"theory_probe_per_partition must be >= 1 or None, got {theory_probe_per_partition}")
        if theory_window < 1 or theory_max_patterns < 1 or theory_chunk < 1:
            raise ValueError("theory_window, theory_max_patterns and theory_chunk must be >= 1")
        if sample_coordinates is not None and (isinstance(sample_coordinates, bool) or sample_coordinates < 2):
            raise ValueError(f"sample_coordinates must be an integer >= 2 or None, got {sample_coordinates!r}")
        self.sample_coordinates = sample_coordinates
        self.every_n_steps = every_n_steps
        self.per_rank = per_rank
        self.eps = eps
        self.theory_every_n_steps = theory_every_n_steps
        self.theory_probe_per_partition = theory_probe_per_partition
        self.theory_window = theory_window
        self.theory_max_patterns = theory_max_patterns
        self.theory_chunk = theory_chunk
        self.log_every_n_steps = log_every_n_steps
        self.loss_every_n_steps = loss_every_n_steps
        self.history: deque[dict[str, float]] = deque(maxlen=history_size)  # the newest logged rows
        self._last_end: Optional[float] = None
        # version -> parameters: sampled coordinates, or (theory, or sample_coordinates=None) every coordinate
        self._snapshots: deque[tuple[int, Tensor]] = deque()
        # bounded staleness: version -> the probe gradient at that version's parameters, kept as the snapshots are
        self._probe_grads: deque[tuple[int, Tensor]] = deque()
        self._bounded = False
        self._sample: Optional[CoordinateSample] = None  # None: full snapshots
        self._probe: Any = None
        self._last_probe: Optional[tuple[int, Tensor, Tensor]] = None  # (version, params, probe gradient), sampled
        self._pending_probe: Optional[tuple[int, Optional[Tensor], Tensor]] = None
        self._probe_sq = 0.0  # the pending probe gradient's exact squared norm
        self._probe_loss: Optional[float] = None
        self._theory = TheoryMeter(theory_probe_per_partition, theory_window, theory_max_patterns, theory_chunk)
        self._delay_counts: dict[int, int] = {}  # bounded staleness: t - s(t,i) over every closed version

    # ------------------------------------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_end = None
        self._snapshots.clear()
        self._probe_grads.clear()
        self._last_probe = None
        self._theory.reset()
        self.history.clear()
        self._delay_counts = {}
        bounded = self._bounded = isinstance(getattr(trainer.strategy, "scheme", None), BoundedScheme)
        full = self.theory_every_n_steps is not None or self.sample_coordinates is None
        params = list(pl_module.parameters())
        self._sample = None if full else CoordinateSample(params, self.sample_coordinates or 0)
        if bounded and self.theory_every_n_steps:
            raise ValueError(
                "PGCDiagnostics(theory_every_n_steps=...) measures the coded schemes' theory; under "
                "scheme='bounded' the error decomposition is logged as pgc/bounded/err_* instead: "
                "set theory_every_n_steps=None"
            )
        correction = getattr(getattr(trainer.strategy, "coding", None), "staleness_correction", "none")  # ddp: none
        if correction != "none" and self.theory_every_n_steps:
            raise ValueError(
                "PGCDiagnostics(theory_every_n_steps=...) measures the uncorrected coded schemes' theory; under "
                f"coding.staleness_correction={correction!r} each gradient is taken at adjusted parameters, which the "
                "decomposition does not model: run strategy='pgc_cr' (uncorrected) or set theory_every_n_steps=None"
            )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        strategy: Any = trainer.strategy  # PGCStrategy's runtime, scheme and rank_stats (duck-typed)
        if not _is_leader(strategy):
            return
        if self._probe is None:
            self._probe = apply_to_collection(batch, Tensor, lambda t: t.detach().clone())
        version = trainer.global_step
        c = max(getattr(strategy.scheme, "c", 1), getattr(strategy.runtime.leader, "max_window", 1))
        params = self._params(pl_module) if self._snapshot_needed(version, c) else None
        if params is not None:
            self._snapshots.append((version, params))
        oldest_use = version - self._lookback(c) + 1
        for kept in (self._snapshots, self._probe_grads):
            while kept and kept[0][0] < oldest_use:  # older than any coming measurement reads
                kept.popleft()
        self._probe_loss = None
        if version % self.every_n_steps == 0:
            loss, gradient = self._gradient(pl_module)
            self._pending_probe = (version, params, gradient)
            self._probe_loss = loss
            if self._bounded:
                self._probe_grads.append((version, gradient))
        else:
            if self._bounded and params is not None:  # a version a coming decomposition may read the gradient of
                self._probe_grads.append((version, self._gradient(pl_module)[1]))
            self._pending_probe = None
            if version % self.loss_every_n_steps == 0:
                self._probe_loss = probe_loss(pl_module, self._probe)

    def _params(self, pl_module: LightningModule) -> Tensor:
        """The parameters as the measurements keep them: the sampled coordinates, or all (float64, CPU)."""
        if self._sample is None:
            return flat_params(pl_module)
        return self._sample.of_params(list(pl_module.parameters()))

    def _gradient(self, pl_module: LightningModule) -> tuple[float, Tensor]:
        """The probe batch's loss and gradient as the measurements keep it (sampled coordinates, or all); sets
        :attr:`_probe_sq` to its exact squared norm (reduced parameter by parameter as backward produces it)."""
        if self._sample is None:
            loss, gradient = loss_and_gradient(pl_module, self._probe)
            self._probe_sq = float(gradient.pow(2).sum())
            return loss, gradient
        sample, params = self._sample, list(pl_module.parameters())
        parts: dict[int, list[Tensor]] = {}
        total = [0.0]

        def reduce(i: int, g: Tensor, start: int) -> None:  # (a block of rows, in order, or the whole gradient)
            total[0] += squared_norm(g)
            parts.setdefault(i, []).append(sample.of_rows(i, g, start, params[i]))

        loss = reduced_gradient(pl_module, self._probe, reduce)
        self._probe_sq = total[0]
        zeros = {i: sample.of(i, torch.zeros(()).expand_as(p), p) for i, p in enumerate(params) if i not in parts}
        return loss, torch.cat([torch.cat(parts[i]) if i in parts else zeros[i] for i in range(len(params))])

    def _windows(self, c: int) -> list[tuple[int, int]]:
        """(every, lookback) of each measurement that reads snapshots: it runs every ``every`` versions and reads
        the parameters of the ``lookback`` versions before it, its own included."""
        windows = [(self.every_n_steps, max(c, 1))]  # probe: back to the oldest version in use, < c
        if self.theory_every_n_steps is not None:
            windows.append((self.theory_every_n_steps, max(c, 1) + 17))  # theory: every cached copy's version
        return windows

    def _lookback(self, c: int) -> int:
        """How many versions back a coming measurement reads: snapshots older than that are dropped."""
        return max(window for _, window in self._windows(c))

    def _snapshot_needed(self, version: int, c: int) -> bool:
        """Copy the parameters only at versions a coming measurement can look back to (not every step)."""
        return any((version + j) % every == 0 for every, window in self._windows(c) for j in range(window))

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy: Any = trainer.strategy  # PGCStrategy's runtime, scheme and rank_stats (duck-typed)
        info = getattr(strategy, "last_step", None)
        now = time.monotonic()
        if info is None or not _is_leader(strategy):
            self._last_end = now
            return
        metrics: dict[str, float] = {}
        if info.version % self.log_every_n_steps == 0:
            metrics = {"pgc/train_loss": info.loss, "pgc/worker_wait_s": info.worker_wait_s}
            if self._last_end is not None:
                metrics["pgc/step_time_s"] = now - self._last_end
        if (
            getattr(strategy, "scheme_name", None) == "auto"
        ):  # the arm this version ran (every version: switches are rare)
            metrics["pgc/auto_arm"] = float(strategy.auto_arm.code)
            metrics["pgc/auto_s"] = float(strategy.auto_arm.s)
        self._last_end = now
        if self._probe_loss is not None:
            metrics["pgc/probe_loss"] = self._probe_loss
        pending = getattr(self, "_pending_probe", None)
        aggregate_sq = 0.0
        if pending is not None:  # a full pass over the gradient: only at the probe cadence, not every step
            aggregate_sq = squared_norm(info.aggregate)
            metrics["pgc/agg_sqnorm"] = aggregate_sq

        runtime = strategy.runtime
        leader = runtime.leader if runtime is not None else None  # once: a frozen leader may step down meanwhile
        record = runtime.record(info.version) if leader is not None else None
        max_age = 0
        if record is not None and leader is not None:  # (a record implies a leader)
            measured = self._record_metrics(strategy, record)
            max_age = int(measured.get("pgc/max_age", 0))
            if info.version % self.log_every_n_steps == 0:
                metrics.update(measured)
                metrics["pgc/late_codes"] = float(leader.late_codes)
                metrics["pgc/alive"] = float(len(leader.alive(now)))  # ranks with heartbeats, not finished
                metrics.update(_rank_metrics(strategy.rank_stats(), leader.closed, self.per_rank))

        if pending is not None:
            metrics.update(self._probe_metrics(pending, max_age, aggregate_sq))
            if isinstance(record, BoundedRecord):
                metrics.update(self._bounded_probe_metrics(pl_module, pending, record, info, metrics))
        if (
            self.theory_every_n_steps is not None
            and record is not None
            and info.version % self.theory_every_n_steps == 0
        ):
            metrics.update(
                self._theory.measure(
                    trainer, pl_module, strategy.scheme, record, info, dict(self._snapshots), runtime.record
                )
            )
        if metrics:
            log_at(trainer, metrics, info.version)
            self.history.append({"step": float(info.version), **metrics})
        if record is not None and info.version % self.every_n_steps == 0:
            self._log_histogram(trainer, record, info.version, strategy.rank_stats())

    # ------------------------------------------------------------------------------------------ measurements
    def _record_metrics(self, strategy: Any, record: Any) -> dict[str, float]:
        if isinstance(record, BoundedRecord):
            return self._bounded_record_metrics(strategy, record)
        scheme = strategy.scheme
        n = scheme.n
        out: dict[str, float] = {
            "pgc/admitted": float(len(record.admitted)),
            "pgc/coordinator_wait_s": record.wait_s,
        }
        for r in range(n if self.per_rank is None else min(n, self.per_rank)):
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

    def _probe_metrics(
        self, pending: tuple[int, Tensor, Tensor], max_age: int, aggregate_sq: float
    ) -> dict[str, float]:
        version, params, gradient = pending
        out: dict[str, float] = {"pgc/probe_grad_sqnorm": self._probe_sq}
        sq, rse = self._sq, self._rse
        oldest = next((p for v, p in self._snapshots if v == version - max_age), None)
        displacement = sq(params - oldest) if oldest is not None else 0.0
        out["pgc/displacement_sq"] = displacement
        if oldest is not None and self._sample is not None:
            out["pgc/displacement_sq_rse"] = rse(params - oldest)
        if self._last_probe is not None:
            _, old_params, old_gradient = self._last_probe
            l_hat = sq(gradient - old_gradient) ** 0.5 / (sq(params - old_params) ** 0.5 + self.eps)
            out["pgc/L_hat_probe"] = l_hat
            if self._sample is not None:  # (delta method: each norm's error is half its square's)
                out["pgc/L_hat_probe_rse"] = (
                    0.5 * (rse(gradient - old_gradient) ** 2 + rse(params - old_params) ** 2) ** 0.5
                )
            out["pgc/staleness_term"] = l_hat**2 * displacement
            out["pgc/staleness_ratio"] = l_hat**2 * displacement / max(aggregate_sq, self.eps)
        self._last_probe = pending
        return out

    def _sq(self, x: Tensor) -> float:
        """Squared norm of a parameter-space vector as kept (estimated from the sampled coordinates)."""
        return float(x.pow(2).sum()) if self._sample is None else self._sample.sq(x)

    def _rse(self, x: Tensor) -> float:
        return 0.0 if self._sample is None else self._sample.rse(x)

    def _bounded_record_metrics(self, strategy: Any, record: BoundedRecord) -> dict[str, float]:
        """The table's view of one closed version (``pgc/bounded/...``), plus the generic age and arrival metrics."""
        leader = strategy.runtime.leader
        delays = record.delays()
        for a in delays:
            self._delay_counts[a] = self._delay_counts.get(a, 0) + 1
        out: dict[str, float] = {
            "pgc/admitted": float(len(record.admitted)),
            "pgc/coordinator_wait_s": record.wait_s,
            "pgc/max_age": float(max(delays)),
            "pgc/mean_age": sum(delays) / len(delays),
            "pgc/bounded/window": float(record.window),
            "pgc/bounded/fresh": float(record.fresh),
            "pgc/bounded/coverage_wait_s": record.coverage_wait_s,
            "pgc/bounded/coverage_waits": float(leader.coverage_waits),
            "pgc/bounded/widened": float(leader.widened),
            "pgc/bounded/displaced": float(leader.displaced),
            "pgc/bounded/duplicates": float(leader.duplicates),
            "pgc/bounded/uncovered": float(leader.uncovered),
        }
        for a, count in sorted(self._delay_counts.items()):
            out[f"pgc/bounded/delay_count/{a}"] = float(count)
        for r in range(strategy.scheme.n if self.per_rank is None else min(strategy.scheme.n, self.per_rank)):
            out[f"pgc/admitted/rank{r}"] = float(r in record.admitted)
            if r in record.arrivals:
                out[f"pgc/arrival_s/rank{r}"] = record.arrivals[r]
        return out

    def _bounded_probe_metrics(
        self,
        pl_module: LightningModule,
        pending: tuple[int, Tensor, Tensor],
        record: BoundedRecord,
        info: Any,
        metrics: Mapping[str, float],
    ) -> dict[str, float]:
        """The bounded-staleness error decomposition of this aggregate's error on the probe batch (``grad F`` := probe gradient)."""
        version, params, gradient = pending
        present = [(i, e) for i, e in enumerate(record.entries) if e is not None]  # (a partition may be left out)
        versions = [e.version for _, e in present]
        snapshots, grads = dict(self._snapshots), dict(self._probe_grads)
        if params is None or any(v not in snapshots or v not in grads for v in versions):
            return {"pgc/bounded/missing_snapshot": 1.0}
        grad_at = {v: grads[v] for v in set(versions)}
        scheme: Any = getattr(pl_module.trainer.strategy, "scheme")  # a BoundedRecord comes from a BoundedScheme
        weights = list(scheme.decoding_weights([i for i, _ in present]).values())
        sample = self._sample
        aggregate = info.aggregate if sample is None else sample.of_flat(info.aggregate)
        scale = 1.0 if sample is None else sample.scale
        parts = error_decomposition(gradient, grad_at, versions, weights, aggregate, params, snapshots, scale)
        out = {f"pgc/bounded/err_{k}": v for k, v in parts.items() if not k.startswith("cos") and k != "displacement"}
        if sample is not None:
            out["pgc/bounded/err_total_rse"] = self._rse(gradient - aggregate)
        out["pgc/bounded/displacement"] = parts["displacement"]
        out["pgc/bounded/stale_fresh_cos"] = parts["cos_min"]
        out["pgc/bounded/stale_fresh_cos_mean"] = parts["cos_mean"]
        if "pgc/L_hat_probe" in metrics:
            out["pgc/bounded/lipschitz_bound"] = metrics["pgc/L_hat_probe"] ** 2 * parts["displacement"]
        return out

    def _log_histogram(self, trainer: Trainer, record: Any, version: int, stats: list[dict[str, float]]) -> None:
        """W&B only: the age histogram and, for every rank (no cap), the per-rank table and lag histogram."""
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                import wandb

                ages = [a for r in record.admitted for a in record.ages.get(r, ())]
                row: dict[str, Any] = {"pgc/age_histogram": wandb.Histogram(ages), "trainer/global_step": version}
                if stats:
                    columns: list[Any] = ["rank", "admitted", "late", "skipped", "mean_lag_s"]
                    row["pgc/ranks"] = wandb.Table(
                        columns=columns, data=[[float(r[c]) for c in columns] for r in stats]
                    )
                    row["pgc/mean_lag_s_histogram"] = wandb.Histogram([float(r["mean_lag_s"]) for r in stats])
                logger.experiment.log(row)


def _is_leader(strategy: Any) -> bool:
    """Whether this rank runs the leader (rank 0), where the per-version records are."""
    runtime = getattr(strategy, "runtime", None)
    return runtime is not None and runtime.is_leader


def _rank_metrics(stats: list[dict[str, float]], closed: int, cap: Optional[int] = None) -> dict[str, float]:
    """``pgc/rank{k}/admitted_rate``, ``late``, ``skipped``, ``mean_lag_s``, ``rejoined`` and
    ``pgc/rejected/rank{k}`` (non-finite codes) from :meth:`PGCStrategy.rank_stats` for the first ``cap`` ranks
    (``None``: all), and ``pgc/slowest_rank`` (the highest mean lag) over every rank."""
    out: dict[str, float] = {}
    for row in stats:
        k = int(row["rank"])
        if cap is not None and k >= cap:
            continue
        out[f"pgc/rank{k}/admitted_rate"] = row["admitted"] / max(closed, 1)
        out[f"pgc/rank{k}/late"] = float(row["late"])
        out[f"pgc/rank{k}/skipped"] = float(row["skipped"])
        out[f"pgc/rank{k}/mean_lag_s"] = float(row["mean_lag_s"])
        out[f"pgc/rank{k}/rejoined"] = float(row.get("rejoined", 0))
        out[f"pgc/rejected/rank{k}"] = float(row.get("rejected", 0))
    if stats:
        slowest = max(stats, key=lambda row: (float(row["mean_lag_s"]), -int(row["rank"])))
        out["pgc/slowest_rank"] = float(slowest["rank"])
        out["pgc/slowest_rank_mean_lag_s"] = float(slowest["mean_lag_s"])
    return out
