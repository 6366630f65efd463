"""Statistics of the tuning protocol: censored time to target, paired tests, Holm's correction (pure, numpy only).

A run that misses the target within the budget ``B`` is not dropped: its time is censored at ``B``. An arm is
summarised over its evaluation seeds by the *restricted mean* ``mean(min(T_i, B))`` (it counts every miss as ``B``,
a lower bound of what the miss cost) and the *median* (``None`` when half or more of the runs missed: then the median
is only known to exceed ``B``). Two arms are compared on the same seeds (the same delay realisations) by the ratio
of restricted means, with a seeded bootstrap interval over seeds, and by an exact paired sign-flip permutation test on
the per-seed log ratios. Claims of a winner in a cell are made only where Holm's step-down correction over all the
cell's comparisons keeps the test below ``alpha``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

__all__ = [
    "Comparison",
    "censor",
    "compare",
    "holm",
    "median_censored",
    "restricted_mean",
    "sign_flip_p",
    "tuning_score",
]


def censor(times: Sequence[Optional[float]], budget: float) -> np.ndarray:
    """Times to target with misses (``None``, or beyond the budget) set to ``budget``.

    Raises:
        ValueError: ``budget <= 0`` or a negative time.
    """
    if not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"budget must be a finite number > 0, got {budget!r}")
    out = []
    for t in times:
        if t is not None and t < 0:
            raise ValueError(f"times must be >= 0, got {t}")
        out.append(budget if t is None or not math.isfinite(t) or t > budget else float(t))
    return np.asarray(out, dtype=np.float64)


def restricted_mean(times: Sequence[Optional[float]], budget: float) -> float:
    """``mean(min(T_i, B))`` over the runs, misses counted as ``B``."""
    if not len(times):
        raise ValueError("restricted_mean of no runs")
    return float(censor(times, budget).mean())


def median_censored(times: Sequence[Optional[float]], budget: float) -> Optional[float]:
    """The median time with misses at ``B``; ``None`` when it is not below ``B`` (half or more missed)."""
    if not len(times):
        raise ValueError("median of no runs")
    med = float(np.median(censor(times, budget)))
    return med if med < budget else None


def tuning_score(times: Sequence[Optional[float]], budget: float) -> float:
    """Score of one setting over the tuning seeds (lower is better): its restricted mean time to target."""
    return restricted_mean(times, budget)


def sign_flip_p(diffs: Sequence[float]) -> float:
    """Two-sided p-value of the exact paired sign-flip permutation test that the ``diffs`` are centred at 0 (all
    ``2^m`` sign patterns; zeros count for both signs). 1.0 when every difference is 0.

    Raises:
        ValueError: more than 20 pairs (use fewer seeds or a sampled test) or none.
    """
    d = np.asarray(diffs, dtype=np.float64)
    if d.size == 0 or d.size > 20:
        raise ValueError(f"sign_flip_p needs 1 to 20 paired differences, got {d.size}")
    observed = abs(d.sum())
    if observed == 0:
        return 1.0
    flips = (np.arange(1 << d.size, dtype=np.uint32)[:, None] >> np.arange(d.size, dtype=np.uint32)) & 1
    sums = np.abs((1.0 - 2.0 * flips) @ d)  # one row per sign pattern (bit i set: difference i flipped)
    return float(np.mean(sums >= observed - 1e-12 * max(1.0, observed)))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (same order as given): control the family-wise error rate."""
    p = np.asarray(pvalues, dtype=np.float64)
    m = p.size
    order = np.argsort(p, kind="stable")
    adjusted = np.empty(m)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return adjusted.tolist()


@dataclass(frozen=True)
class Comparison:
    """``arm`` against ``baseline`` on the same seeds: ratio of restricted mean times (< 1: ``arm`` is faster), its
    bootstrap interval, and the sign-flip p-value of the per-seed log ratios."""

    ratio: float
    low: float
    high: float
    p: float
    seeds: int


def compare(
    arm: Sequence[Optional[float]],
    baseline: Sequence[Optional[float]],
    budget: float,
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> Comparison:
    """Paired comparison over seeds (``arm[i]`` and ``baseline[i]`` share delay seed ``i``).

    Raises:
        ValueError: different numbers of runs, or fewer than 2.
    """
    if len(arm) != len(baseline) or len(arm) < 2:
        raise ValueError(f"need two equally long lists of >= 2 paired runs, got {len(arm)} and {len(baseline)}")
    a, b = censor(arm, budget), censor(baseline, budget)
    ratio = float(a.mean() / b.mean())
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(resamples, len(a)))
    boot = a[idx].mean(axis=1) / b[idx].mean(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(boot, [tail, 1 - tail])
    p = sign_flip_p(np.log(a) - np.log(b))
    return Comparison(ratio, float(low), float(high), p, len(a))
