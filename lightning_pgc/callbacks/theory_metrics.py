"""TheoryMeter: the convergence theory's constants measured during a run (``PGCDiagnostics(theory_every_n_steps)``).

At a measured version ``t`` the leader's rank recomputes every copy in every rank's cache at the model version it
was computed at, and the whole-partition gradients, then evaluates :mod:`lightning_pgc.codes.measures` on them:
the error decomposition of the aggregate, ``gamma_hat``, ``xi_hat``, the copy statistics and the received-subset
estimator's moments (``docs/results/theory.md``). Rank 0 only; nothing of the run changes.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Hashable, Mapping, Optional

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_pgc.callbacks.probe import collate, loss_gradient, partition_loader, swapped_params
from lightning_pgc.codes import measures

__all__ = ["TheoryMeter"]


class TheoryMeter:
    """The measurements behind ``pgc/theory/...``, for :class:`~lightning_pgc.callbacks.PGCDiagnostics`.

    Args:
        probe_per_partition: samples of each partition used for ``grad F_j`` (a fixed, seeded subset, the same at
            every measurement); ``None`` uses the whole partition.
        window: how many recent leader records form the empirical straggler pattern.
        max_patterns: received sets enumerated exactly up to this many, sampled beyond.
        chunk: samples per forward pass when computing ``grad F_j``.
    """

    def __init__(self, probe_per_partition: Optional[int], window: int, max_patterns: int, chunk: int) -> None:
        self.probe_per_partition = probe_per_partition
        self.window = window
        self.max_patterns = max_patterns
        self.chunk = chunk
        self._patterns: Optional[tuple[np.ndarray, np.ndarray]] = None  # the scheme's received sets, computed once
        self._warned = False

    def reset(self) -> None:
        """Forget the received sets (a new fit may run another scheme)."""
        self._patterns = None

    def measure(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        scheme: Any,
        record: Any,
        info: Any,
        snapshots: Mapping[int, Tensor],
        record_of: Callable[[int], Any],
    ) -> dict[str, float]:
        """The theory's constants at version ``t = info.version`` from exact recomputation of every copy in every
        rank's cache.

        ``record`` is the leader's record of ``t``, ``info`` the step's (``version``, ``aggregate``), ``snapshots``
        the flat parameters (:func:`~lightning_pgc.callbacks.probe.flat_params`) of the versions kept, and
        ``record_of(v)`` the leader's record of version ``v`` (``None`` if gone): the recent ones form the empirical
        straggler pattern.

        Mini-batches are deterministic (``PartitionStreams``), so rank 0 recomputes ``g_j^(v)`` for every copy of
        every rank at the snapshot of version ``v``, and ``grad F_j(beta_v)`` on the partition (or its fixed probe
        subset). Nothing of the run changes: parameters are swapped back, buffers restored, RNG forked, logs muted.
        """
        started = time.perf_counter()
        n, t = scheme.n, info.version
        found = partition_loader(trainer)
        if found is None:
            if not self._warned:
                rank_zero_warn(
                    "PGCDiagnostics(theory_every_n_steps=...) needs PGCStrategy's partition sampler; "
                    "the theory measurements are skipped"
                )
                self._warned = True
            return {}
        loader, sampler = found
        start = int(sampler.warmup_step())
        streams, batch_size = sampler.streams, sampler.batch_size

        # Versions of every copy in every rank's cache: what the admitted codes report (a rank that skipped steps has
        # fewer entries); for the other ranks the nominal pipeline (their cache had they computed every step).
        versions = {k: measures.nominal_cache_versions(scheme, k, t, start) for k in range(n)}
        exact = 1.0
        for k in record.admitted:
            ages = record.ages.get(k)
            reported = None
            # The header carries the first 16 ages, clamped at 15.
            if ages is not None and record.valid.get(k) == len(ages) and all(a < 15 for a in ages):
                reported = measures.versions_from_ages(scheme, k, t, ages, start)
            if reported is None:
                exact = 0.0  # keep the nominal pipeline for this rank
            else:
                versions[k] = reported
        used = [k for k in record.admitted if record.weights.get(k, 0.0) != 0.0]
        oldest = min((v for k in used for v in versions[k].values()), default=t)
        needed = sorted({v for vs in versions.values() for v in vs.values()} | {t, oldest})
        if any(v not in snapshots for v in needed):
            return {"pgc/theory/missing_snapshot": 1.0}

        params = list(pl_module.parameters())  # the layout of flat_params
        members = [self._probe_members(streams, j) for j in range(n)]
        minibatch: dict[Hashable, Tensor] = {}  # (partition, version)
        full: dict[Hashable, Tensor] = {}
        objective: dict[int, Tensor] = {}
        for v in needed:
            parts = sorted({j for vs in versions.values() for j, u in vs.items() if u == v})
            with swapped_params(params, snapshots[v]):
                for j in parts:
                    minibatch[(j, v)] = loss_gradient(pl_module, collate(loader, streams.batch(j, v, batch_size)))
                for j in range(n):
                    full[(j, v)] = self._mean_gradient(pl_module, loader, members[j])
            objective[v] = torch.stack([full[(j, v)] for j in range(n)]).mean(dim=0)

        present = {k: tuple(vs) for k, vs in versions.items()}
        aggregate = info.aggregate.to(torch.float64).reshape(-1)
        W_used = measures.copy_weights(scheme, record.admitted, present)
        reconstructed = measures.weighted_copy_sum(W_used, versions, minibatch)
        W_ref = measures.reference_copy_weights(scheme, present)
        decomposition = measures.decompose_error(aggregate, W_ref, versions, minibatch, full, objective[t])
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
            "pgc/theory/gamma_hat": measures.gamma_hat(objective[t], objective[oldest]),
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
        xi = measures.xi_hat(in_use, minibatch, full, objective)
        out["pgc/theory/xi_hat"] = xi["xi"]
        out["pgc/theory/xi_within"] = xi["xi_within"]
        for name, value in measures.copy_statistics(W_ref, versions, minibatch, full, objective).items():
            out["pgc/theory/" + name] = value

        # The received-subset estimator against the all-rank average, over the straggler pattern (Lemma 3).
        codes = measures.codes_from_copies(scheme, versions, minibatch)
        g_bar = measures.weighted_copy_sum(W_ref, versions, minibatch)
        if self._patterns is None:
            patterns = measures.received_patterns(scheme, self.max_patterns, seed=0)
            self._patterns = measures.pattern_rank_weights(scheme, patterns)
        uniform = measures.subset_moments(codes, g_bar, *self._patterns)
        out["pgc/theory/lemma3_mean_sq"] = uniform.mean_sq
        out["pgc/theory/lemma3_ref_sq"] = uniform.reference_sq
        out["pgc/theory/lemma3_gap_ratio"] = uniform.lemma3_gap / max(uniform.reference_sq, 1e-300)
        out["pgc/theory/subset_mse_uniform"] = uniform.mse
        out["pgc/theory/subset_bias_uniform"] = uniform.bias_sq
        out["pgc/theory/subset_var_uniform"] = uniform.variance
        recent = [record_of(v) for v in range(max(t - self.window + 1, 0), t + 1)]
        recent = [r for r in recent if r is not None]
        if recent:
            rank_weights = np.zeros((len(recent), n))
            for row, rec in enumerate(recent):
                for k, w in rec.weights.items():
                    rank_weights[row, k] = w
            empirical = measures.subset_moments(codes, g_bar, np.full(len(recent), 1.0 / len(recent)), rank_weights)
            out["pgc/theory/subset_mse_empirical"] = empirical.mse
            out["pgc/theory/subset_bias_empirical"] = empirical.bias_sq
            out["pgc/theory/subset_var_empirical"] = empirical.variance
            out["pgc/theory/empirical_patterns"] = float(len(recent))
        out["pgc/theory/cost_s"] = time.perf_counter() - started
        return out

    def _probe_members(self, streams: Any, j: int) -> np.ndarray:
        members = np.asarray(streams.partitions[j])
        cap = self.probe_per_partition
        if cap is None or cap >= len(members):
            return members
        return np.sort(np.random.default_rng([int(streams.seed), 7919, j]).choice(members, size=cap, replace=False))

    def _mean_gradient(self, pl_module: LightningModule, loader: Any, members: np.ndarray) -> Tensor:
        """Gradient of the mean training loss over ``members`` (chunked; assumes training_step returns a mean)."""
        total: Optional[Tensor] = None
        size = len(members)
        for lo in range(0, size, self.chunk):
            chunk = members[lo : lo + self.chunk].tolist()
            g = loss_gradient(pl_module, collate(loader, chunk)) * (len(chunk) / size)
            total = g if total is None else total + g
        assert total is not None
        return total
