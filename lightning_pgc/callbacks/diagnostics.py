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
so the staleness term ``L_hat^2 * displacement`` can be compared with ``|g_hat|^2``.

Optionally (``theory_every_n_steps``, off by default) the leader's rank also measures what the convergence
theory of the paper only assumes (``docs/theory.md``): the staleness bias ``gamma_hat``, the noise ratio ``xi_hat``,
the extra error of the received-subset estimator over the straggler pattern, the exact decomposition of the
aggregate's error into subset-selection, sampling and staleness terms, and how correlated the copies of one
partition are. :class:`StalenessValve` (every rank, off unless added) lowers the learning rate (or, under bounded
staleness, the window ``c``) when the measured staleness term becomes a large fraction of ``|g_hat|^2``, with the
same decision on every rank and no collective.

Under ``scheme="bounded"`` the leader's rank also logs ``pgc/bounded/...``: every step the window ``c`` in effect,
coverage waits, widenings, table displacements, duplicated evaluations and the delay histogram ``t - s(t,i)``; at the probe cadence the
bounded-staleness error decomposition of the aggregate with its cross terms and the stale/fresh gradient correlation, both on
the probe batch (see :func:`lightning_pgc.codes.bounded.error_decomposition`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_pgc import theory
from lightning_pgc.codes.bounded import BoundedScheme, adapt_step, error_decomposition
from lightning_pgc.runtime.bounded import BoundedRecord

log = logging.getLogger(__name__)

__all__ = ["PGCDiagnostics", "StalenessValve"]


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
            ``docs/theory.md``); ``None`` (default) turns them off. Rank 0 only; each costs about
            one forward/backward pass over the (probe) training set per version in use (``c`` in the steady
            state) plus about ``n c`` mini-batch gradients.
        theory_probe_per_partition: samples of each partition used for ``grad F_j`` (a fixed, seeded subset, the
            same at every measurement); ``None`` uses the whole partition (exact, fine for small data sets).
        theory_window: how many recent leader records form the empirical straggler pattern.
        theory_max_patterns: received sets enumerated exactly up to this many, sampled beyond.
        theory_chunk: samples per forward pass when computing ``grad F_j``.
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
        self._snapshots: deque[tuple[int, Tensor]] = deque()
        self._probe: Any = None
        self._last_probe: Optional[tuple[int, Tensor, Tensor]] = None  # (version, params, probe gradient)
        self._pending_probe: Optional[tuple[int, Tensor, Tensor]] = None
        self._probe_loss: Optional[float] = None
        self._patterns: Optional[tuple[np.ndarray, np.ndarray]] = None
        self._theory_warned = False
        self._delay_counts: dict[int, int] = {}  # bounded staleness: t - s(t,i) over every closed version

    # ------------------------------------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_end = None
        self._snapshots.clear()
        self._last_probe = None
        self._patterns = None
        self.history.clear()
        self._delay_counts = {}
        if isinstance(getattr(trainer.strategy, "scheme", None), BoundedScheme) and self.theory_every_n_steps:
            raise ValueError(
                "PGCDiagnostics(theory_every_n_steps=...) measures the coded schemes' theory; under "
                "scheme='bounded' the error decomposition is logged as pgc/bounded/err_* instead: "
                "set theory_every_n_steps=None"
            )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        strategy = trainer.strategy
        if not _is_leader(strategy):
            return
        if self._probe is None:
            self._probe = apply_to_collection(batch, Tensor, lambda t: t.detach().clone())
        version = trainer.global_step
        c = max(getattr(strategy.scheme, "c", 1), getattr(strategy.runtime.leader, "max_window", 1))
        params = _flat_params(pl_module) if self._snapshot_needed(version, c) else None
        if params is not None:
            self._snapshots.append((version, params))
        while self._snapshots and self._snapshots[0][0] < version - max(c, 1) - 16:  # older than any use
            self._snapshots.popleft()
        self._probe_loss = None
        if version % self.every_n_steps == 0:
            loss, gradient = _loss_and_gradient(pl_module, self._probe)
            self._pending_probe = (version, params, gradient)
            self._probe_loss = loss
        else:
            self._pending_probe = None
            if version % self.loss_every_n_steps == 0:
                self._probe_loss = _probe_loss(pl_module, self._probe)

    def _snapshot_needed(self, version: int, c: int) -> bool:
        """Copy the parameters only at versions a coming measurement can look back to (not every step)."""
        windows = [(self.every_n_steps, max(c, 1))]  # probe: back to the oldest version in use, < c
        if self.theory_every_n_steps is not None:
            windows.append((self.theory_every_n_steps, max(c, 1) + 17))  # theory: every cached copy's version
        return any((version + j) % every == 0 for every, window in windows for j in range(window))

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
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
        self._last_end = now
        if self._probe_loss is not None:
            metrics["pgc/probe_loss"] = self._probe_loss
        pending = getattr(self, "_pending_probe", None)
        aggregate_sq = 0.0
        if pending is not None:  # a full pass over the gradient: only at the probe cadence, not every step
            aggregate_sq = float(torch.linalg.vector_norm(info.aggregate, dtype=torch.float64)) ** 2
            metrics["pgc/agg_sqnorm"] = aggregate_sq

        runtime = strategy.runtime
        leader = runtime.leader if runtime is not None else None  # once: a frozen leader may step down meanwhile
        record = runtime.record(info.version) if leader is not None else None
        max_age = 0
        if record is not None:
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
            metrics.update(self._theory_metrics(trainer, pl_module, strategy, record, info))
        if metrics:
            _log_at(trainer, metrics, info.version)
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
        out: dict[str, float] = {"pgc/probe_grad_sqnorm": float(gradient.pow(2).sum())}
        oldest = next((p for v, p in self._snapshots if v == version - max_age), None)
        displacement = float((params - oldest).pow(2).sum()) if oldest is not None else 0.0
        out["pgc/displacement_sq"] = displacement
        if self._last_probe is not None:
            _, old_params, old_gradient = self._last_probe
            l_hat = float((gradient - old_gradient).norm() / ((params - old_params).norm() + self.eps))
            out["pgc/L_hat_probe"] = l_hat
            out["pgc/staleness_term"] = l_hat**2 * displacement
            out["pgc/staleness_ratio"] = l_hat**2 * displacement / max(aggregate_sq, self.eps)
        self._last_probe = pending
        return out

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
        snapshots = dict(self._snapshots)
        if params is None or any(v not in snapshots for v in versions):
            return {"pgc/bounded/missing_snapshot": 1.0}
        live = [p for p in pl_module.parameters() if p.requires_grad]
        grad_at = {version: gradient}
        for v in sorted(set(versions) - {version}):
            with _swapped_params(live, snapshots[v]):
                grad_at[v] = self._probe_gradient(pl_module)
        scheme = pl_module.trainer.strategy.scheme  # a BoundedRecord comes from a BoundedScheme
        weights = list(scheme.decoding_weights([i for i, _ in present]).values())
        parts = error_decomposition(gradient, grad_at, versions, weights, info.aggregate, params, snapshots)
        out = {f"pgc/bounded/err_{k}": v for k, v in parts.items() if not k.startswith("cos") and k != "displacement"}
        out["pgc/bounded/displacement"] = parts["displacement"]
        out["pgc/bounded/stale_fresh_cos"] = parts["cos_min"]
        out["pgc/bounded/stale_fresh_cos_mean"] = parts["cos_mean"]
        if "pgc/L_hat_probe" in metrics:
            out["pgc/bounded/lipschitz_bound"] = metrics["pgc/L_hat_probe"] ** 2 * parts["displacement"]
        return out

    def _probe_gradient(self, pl_module: LightningModule) -> Tensor:
        """Gradient of the training loss on the fixed probe batch, leaving no trace (grads, buffers, RNG, logs)."""
        return _loss_gradient(pl_module, self._probe)

    # ----------------------------------------------------------------------------------------- the theory
    def _theory_metrics(
        self, trainer: Trainer, pl_module: LightningModule, strategy: Any, record: Any, info: Any
    ) -> dict[str, float]:
        """The theory's constants at version ``t`` from exact recomputation of every copy in every rank's cache.

        Mini-batches are deterministic (``PartitionStreams``), so rank 0 recomputes ``g_j^(v)`` for every copy of
        every rank at the snapshot of version ``v``, and ``grad F_j(beta_v)`` on the partition (or its fixed probe
        subset). Nothing of the run changes: parameters are swapped back, buffers restored, RNG forked, logs muted.
        """
        started = time.perf_counter()
        scheme = strategy.scheme
        n, t = scheme.n, info.version
        found = _partition_loader(trainer)
        if found is None:
            if not self._theory_warned:
                rank_zero_warn(
                    "PGCDiagnostics(theory_every_n_steps=...) needs PGCStrategy's partition sampler; "
                    "the theory measurements are skipped"
                )
                self._theory_warned = True
            return {}
        loader, sampler = found
        start = int(sampler.warmup_step())
        streams, batch_size = sampler.streams, sampler.batch_size

        # Versions of every copy in every rank's cache: what the admitted codes report (a rank that skipped steps has
        # fewer entries); for the other ranks the nominal pipeline (their cache had they computed every step).
        versions = {k: theory.nominal_cache_versions(scheme, k, t, start) for k in range(n)}
        exact = 1.0
        for k in record.admitted:
            ages = record.ages.get(k)
            reported = None
            # The header carries the first 16 ages, clamped at 15.
            if ages is not None and record.valid.get(k) == len(ages) and all(a < 15 for a in ages):
                reported = theory.versions_from_ages(scheme, k, t, ages, start)
            if reported is None:
                exact = 0.0  # keep the nominal pipeline for this rank
            else:
                versions[k] = reported
        used = [k for k in record.admitted if record.weights.get(k, 0.0) != 0.0]
        oldest = min((v for k in used for v in versions[k].values()), default=t)
        needed = sorted({v for vs in versions.values() for v in vs.values()} | {t, oldest})
        snapshots = dict(self._snapshots)
        if any(v not in snapshots for v in needed):
            return {"pgc/theory/missing_snapshot": 1.0}

        params = list(pl_module.parameters())  # the layout of _flat_params
        members = [self._probe_members(streams, j) for j in range(n)]
        minibatch: dict[tuple[int, int], Tensor] = {}
        full: dict[tuple[int, int], Tensor] = {}
        objective: dict[int, Tensor] = {}
        for v in needed:
            parts = sorted({j for vs in versions.values() for j, u in vs.items() if u == v})
            with _swapped_params(params, snapshots[v]):
                for j in parts:
                    minibatch[(j, v)] = _loss_gradient(pl_module, _collate(loader, streams.batch(j, v, batch_size)))
                for j in range(n):
                    full[(j, v)] = self._mean_gradient(pl_module, loader, members[j])
            objective[v] = torch.stack([full[(j, v)] for j in range(n)]).mean(dim=0)

        present = {k: tuple(vs) for k, vs in versions.items()}
        aggregate = info.aggregate.to(torch.float64).reshape(-1)
        W_used = theory.copy_weights(scheme, record.admitted, present)
        reconstructed = theory.weighted_copy_sum(W_used, versions, minibatch)
        W_ref = theory.reference_copy_weights(scheme, present)
        decomposition = theory.decompose_error(aggregate, W_ref, versions, minibatch, full, objective[t])
        squares = decomposition.squared_norms()
        grad_sq = float(objective[t].pow(2).sum())

        out: dict[str, float] = {
            "pgc/theory/total_sq": squares["total"],
            "pgc/theory/subset_sq": squares["subset"],
            "pgc/theory/sampling_sq": squares["sampling"],
            "pgc/theory/staleness_sq": squares["staleness"],
            "pgc/theory/decomp_residual": decomposition.residual,
            "pgc/theory/recon_residual": float(
                (reconstructed - aggregate).norm() / max(float(aggregate.norm()), 1e-300)
            ),
            "pgc/theory/grad_sq": grad_sq,
            "pgc/theory/oldest_age": float(t - oldest),
            "pgc/theory/gamma_hat": theory.gamma_hat(objective[t], objective[oldest]),
            "pgc/theory/gamma_avg": squares["staleness"] / max(grad_sq, 1e-300),
            "pgc/theory/exact": exact,
            "pgc/theory/partial_caches": float(sum(len(vs) < len(scheme.partitions(k)) for k, vs in versions.items())),
        }
        for name, value in decomposition.cross_terms().items():
            out["pgc/theory/cross_" + name.replace("*", "_")] = value
        if oldest != t:
            step = float((snapshots[t] - snapshots[oldest]).norm())
            out["pgc/theory/L_full"] = float((objective[t] - objective[oldest]).norm()) / max(step, 1e-300)
            out["pgc/theory/displacement_sq"] = step**2
        in_use = {k: versions[k] for k in used}
        xi = theory.xi_hat(in_use, minibatch, full, objective)
        out["pgc/theory/xi_hat"] = xi["xi"]
        out["pgc/theory/xi_within"] = xi["xi_within"]
        for name, value in theory.copy_statistics(W_ref, versions, minibatch, full, objective).items():
            out["pgc/theory/" + name] = value

        # The received-subset estimator against the all-rank average, over the straggler pattern (Lemma 3).
        codes = theory.codes_from_copies(scheme, versions, minibatch)
        g_bar = theory.weighted_copy_sum(W_ref, versions, minibatch)
        if self._patterns is None:
            patterns = theory.received_patterns(scheme, self.theory_max_patterns, seed=0)
            self._patterns = theory.pattern_rank_weights(scheme, patterns)
        uniform = theory.subset_moments(codes, g_bar, *self._patterns)
        out["pgc/theory/lemma3_mean_sq"] = uniform.mean_sq
        out["pgc/theory/lemma3_ref_sq"] = uniform.reference_sq
        out["pgc/theory/lemma3_gap_ratio"] = uniform.lemma3_gap / max(uniform.reference_sq, 1e-300)
        out["pgc/theory/subset_mse_uniform"] = uniform.mse
        out["pgc/theory/subset_bias_uniform"] = uniform.bias_sq
        out["pgc/theory/subset_var_uniform"] = uniform.variance
        runtime = strategy.runtime
        recent = [runtime.record(v) for v in range(max(t - self.theory_window + 1, 0), t + 1)]
        recent = [r for r in recent if r is not None]
        if recent:
            rank_weights = np.zeros((len(recent), n))
            for row, rec in enumerate(recent):
                for k, w in rec.weights.items():
                    rank_weights[row, k] = w
            empirical = theory.subset_moments(codes, g_bar, np.full(len(recent), 1.0 / len(recent)), rank_weights)
            out["pgc/theory/subset_mse_empirical"] = empirical.mse
            out["pgc/theory/subset_bias_empirical"] = empirical.bias_sq
            out["pgc/theory/subset_var_empirical"] = empirical.variance
            out["pgc/theory/empirical_patterns"] = float(len(recent))
        out["pgc/theory/cost_s"] = time.perf_counter() - started
        return out

    def _probe_members(self, streams: Any, j: int) -> np.ndarray:
        members = np.asarray(streams.partitions[j])
        cap = self.theory_probe_per_partition
        if cap is None or cap >= len(members):
            return members
        return np.sort(np.random.default_rng([int(streams.seed), 7919, j]).choice(members, size=cap, replace=False))

    def _mean_gradient(self, pl_module: LightningModule, loader: Any, members: np.ndarray) -> Tensor:
        """Gradient of the mean training loss over ``members`` (chunked; assumes training_step returns a mean)."""
        total: Optional[Tensor] = None
        size = len(members)
        for lo in range(0, size, self.theory_chunk):
            chunk = members[lo : lo + self.theory_chunk].tolist()
            g = _loss_gradient(pl_module, _collate(loader, chunk)) * (len(chunk) / size)
            total = g if total is None else total + g
        assert total is not None
        return total

    def _log_histogram(self, trainer: Trainer, record: Any, version: int, stats: list[dict[str, float]]) -> None:
        """W&B only: the age histogram and, for every rank (no cap), the per-rank table and lag histogram."""
        try:
            from lightning.pytorch.loggers import WandbLogger
        except ImportError:  # pragma: no cover
            return
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                import wandb

                ages = [a for r in record.admitted for a in record.ages.get(r, ())]
                row: dict[str, Any] = {"pgc/age_histogram": wandb.Histogram(ages), "trainer/global_step": version}
                if stats:
                    columns = ["rank", "admitted", "late", "skipped", "mean_lag_s"]
                    row["pgc/ranks"] = wandb.Table(
                        columns=columns, data=[[float(r[c]) for c in columns] for r in stats]
                    )
                    row["pgc/mean_lag_s_histogram"] = wandb.Histogram([float(r["mean_lag_s"]) for r in stats])
                logger.experiment.log(row)


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
        found = _partition_loader(trainer)
        if found is not None:
            loader = found[0]
        dataset = getattr(loader, "dataset", None)
        if dataset is None or not hasattr(dataset, "__len__"):
            raise ValueError("StalenessValve needs a map-style training dataset to draw its probe batch from")
        size = min(self.probe_size, len(dataset))
        indices = np.random.default_rng(self.probe_seed).permutation(len(dataset))[:size].tolist()
        self._probe = _collate(loader, indices)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._age == 0 or self._probe is None:
            return
        t, a, every = trainer.global_step, self._age, self.check_every_n_steps
        is_anchor = (t + a) % every == 0
        is_check = t % every == 0 and (t - a) in self._anchors
        if not (is_anchor or is_check):
            return
        params = _flat_params(pl_module)
        gradient = _loss_gradient(pl_module, self._probe)
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
            trainer.strategy.scheme.window = self.window = new_window
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
            _log_at(
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


# ================================================================================================== helpers
def _is_leader(strategy: Any) -> bool:
    """Whether this rank runs the leader (rank 0), where the per-version records are."""
    runtime = getattr(strategy, "runtime", None)
    return runtime is not None and runtime.is_leader


def _log_at(trainer: Trainer, metrics: dict[str, float], step: int) -> None:
    """Log ``metrics`` once, at ``step``, to every logger of the trainer (rank 0's loggers are the live ones)."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


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


def _flat_params(module: torch.nn.Module) -> Tensor:
    """Every parameter, frozen ones included, so the layout survives a finetuning callback's unfreezing."""
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in module.parameters()])


def _loss_gradient(pl_module: LightningModule, batch: Any) -> Tensor:
    """Flat float64 gradient of ``training_step(batch)``'s loss, leaving no trace (grads, buffers, RNG, logs)."""
    return _loss_and_gradient(pl_module, batch)[1]


def _loss_and_gradient(pl_module: LightningModule, batch: Any) -> tuple[float, Tensor]:
    """``training_step(batch)``'s loss and its flat float64 gradient over every parameter (zeros for frozen ones),
    leaving no trace (grads, buffers, metric states, RNG, logs)."""
    params = list(pl_module.parameters())
    trainable = [p for p in params if p.requires_grad]
    batch = apply_to_collection(batch, Tensor, lambda t: t.to(pl_module.device))
    with _untouched(pl_module), torch.enable_grad():
        output = pl_module.training_step(batch, 0)
        loss = output["loss"] if isinstance(output, Mapping) else output
        grads = dict(zip(map(id, trainable), torch.autograd.grad(loss, trainable, allow_unused=True)))
    flat = [(grads.get(id(p)) if grads.get(id(p)) is not None else torch.zeros_like(p)) for p in params]
    return float(loss.detach()), torch.cat([g.detach().reshape(-1).double().cpu() for g in flat])


def _probe_loss(pl_module: LightningModule, batch: Any) -> float:
    """``training_step(batch)``'s loss at the current parameters, without autograd, leaving no trace."""
    batch = apply_to_collection(batch, Tensor, lambda t: t.to(pl_module.device))
    with _untouched(pl_module), torch.no_grad():
        output = pl_module.training_step(batch, 0)
        loss = output["loss"] if isinstance(output, Mapping) else output
    return float(loss.detach())


@contextmanager
def _untouched(pl_module: LightningModule) -> Iterator[None]:
    """Run the user's training_step off the record: RNG forked, logs muted, collectives refused (under PGC), buffers
    and torchmetrics states restored afterwards (a probe call on rank 0 must not count in a metric or move
    BatchNorm statistics)."""
    buffers = [b.detach().clone() for b in pl_module.buffers()]
    metrics = _metric_states(pl_module)
    with torch.random.fork_rng(devices=[]), _muted(pl_module), _guarded(pl_module):
        try:
            yield
        finally:
            for b, saved in zip(pl_module.buffers(), buffers):
                b.data.copy_(saved)
            for metric, state in metrics:
                for name, value in state.items():
                    setattr(metric, name, value)


@contextmanager
def _guarded(pl_module: LightningModule) -> Iterator[None]:
    """Under PGC, refuse collectives in a probe call of training_step as in the real one (it runs on one rank)."""
    try:
        guard = getattr(pl_module.trainer.strategy, "collective_guard", None)
    except RuntimeError:  # not attached to a Trainer
        guard = None
    if guard is None:
        yield
    else:
        with guard(pl_module):
            yield


def _metric_states(module: torch.nn.Module) -> list[tuple[Any, dict[str, Any]]]:
    """A copy of every torchmetrics metric's state (its ``_defaults`` names and update bookkeeping)."""
    import copy

    saved = []
    for sub in module.modules():
        defaults = getattr(sub, "_defaults", None)
        if isinstance(defaults, dict) and hasattr(sub, "_update_count"):
            names = [*defaults, "_update_count", "_computed", "_forward_cache"]
            saved.append((sub, {n: copy.deepcopy(getattr(sub, n, None)) for n in names if hasattr(sub, n)}))
    return saved


@contextmanager
def _swapped_params(params: Sequence[torch.nn.Parameter], flat: Tensor) -> Iterator[None]:
    """Temporarily point every parameter's data at the values in ``flat`` (float64, from ``_flat_params``).

    The original tensors are put back untouched, so the run's parameters (and the optimizer's references to them)
    are bit-for-bit unchanged afterwards.
    """
    saved = [p.data for p in params]
    offset = 0
    try:
        for p in params:
            size = p.numel()
            p.data = flat[offset : offset + size].view_as(p).to(device=p.device, dtype=p.dtype).clone()
            offset += size
        yield
    finally:
        for p, data in zip(params, saved):
            p.data = data


def _partition_loader(trainer: Trainer) -> Optional[tuple[Any, Any]]:
    """``(DataLoader, PartitionBatchSampler)`` of the running fit, or ``None`` when the strategy is not PGC's."""
    from lightning_pgc.data import PartitionBatchSampler

    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    loaders = list(combined.flattened) if combined is not None else []
    if not loaders and trainer.train_dataloader is not None:
        loaders = [trainer.train_dataloader]
    for loader in loaders:
        sampler = getattr(loader, "batch_sampler", None)
        if isinstance(sampler, PartitionBatchSampler):
            return loader, sampler
    return None


def _collate(loader: Any, indices: Sequence[int]) -> Any:
    """The batch ``loader`` would yield for these dataset indices."""
    dataset = loader.dataset
    collate = getattr(loader, "collate_fn", None)
    if collate is None:
        from torch.utils.data import default_collate as collate
    return collate([dataset[int(i)] for i in indices])


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
