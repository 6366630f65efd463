"""Statistics of the tuning protocol: censored time to target, paired tests, Holm's correction (pure, numpy only).

A run that misses the target within the budget ``B`` is not dropped: its time is censored at ``B``. An arm is
summarised over its evaluation seeds by the *restricted mean* ``mean(min(T_i, B))`` (it counts every miss as ``B``,
a lower bound of what the miss cost) and the *median* (``None`` when half or more of the runs missed: then the median
is only known to exceed ``B``).

The estimand of a comparison is the **ratio of restricted mean times** of two arms run on the same seeds (the same
delay realisations, splits and initial weights). Its interval is a seeded paired bootstrap over seeds, and its test
is the matching paired permutation test (:func:`ratio_permutation_p`): under the null hypothesis the two runs of a
seed are exchangeable, and the statistic is ``|log|`` of the ratio of the two sums itself. Claims of a winner in a
cell are made only where Holm's step-down correction over the cell's family keeps the test below ``alpha``.
:func:`detectable_effect` and :func:`required_seeds` are the power computation: the smallest effect the test
detects with the given seeds after that correction, from the spread of the per-seed log ratios.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Optional, Sequence

import numpy as np

__all__ = [
    "Comparison",
    "censor",
    "compare",
    "detectable_effect",
    "holm",
    "median_censored",
    "ratio_permutation_p",
    "required_seeds",
    "restricted_mean",
    "sign_flip_p",
    "tuning_score",
]

#: pairs up to which :func:`ratio_permutation_p` enumerates every swap pattern (above: random swaps)
EXACT_PAIRS = 16


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


def ratio_permutation_p(
    a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, resamples: int = 20000, seed: int = 0
) -> float:
    """Two-sided p-value of the paired permutation test of ``sum(a) / sum(b) = 1`` (``a[i]``, ``b[i]``: the two arms'
    censored times on seed ``i``): every pattern of swaps within pairs for up to :data:`EXACT_PAIRS` pairs, else
    ``resamples`` random patterns (with the ``+1`` correction, so a p-value is never 0). 1.0 when every pair is
    equal.

    Raises:
        ValueError: no pairs, different lengths, or a time that is not > 0.
    """
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.size == 0 or x.shape != y.shape:
        raise ValueError(f"need two equally long lists of >= 1 paired times, got {x.size} and {y.size}")
    if (x <= 0).any() or (y <= 0).any():
        raise ValueError("times must be > 0")
    total = x.sum() + y.sum()
    observed = abs(math.log(x.sum() / y.sum()))
    if observed == 0:
        return 1.0
    m = x.size
    d = y - x  # what swapping pair i adds to sum(a)
    if m <= EXACT_PAIRS:
        flips = ((np.arange(1 << m, dtype=np.uint32)[:, None] >> np.arange(m, dtype=np.uint32)) & 1).astype(float)
        sums_a = x.sum() + flips @ d
        stats = np.abs(np.log(sums_a / (total - sums_a)))
        return float(np.mean(stats >= observed * (1 - 1e-12)))
    rng = np.random.default_rng(seed)
    flips = rng.integers(0, 2, size=(resamples, m)).astype(float)
    sums_a = x.sum() + flips @ d
    stats = np.abs(np.log(sums_a / (total - sums_a)))
    return float((1 + np.sum(stats >= observed * (1 - 1e-12))) / (1 + resamples))


def _z(q: float) -> float:
    """The standard normal quantile of ``q`` (``statistics.NormalDist``)."""
    return NormalDist().inv_cdf(q)


def detectable_effect(sd_log: float, seeds: int, family: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest relative effect ``1 - ratio`` that a paired test on ``seeds`` pairs detects with probability
    ``power`` after Holm's correction over ``family`` comparisons, where ``sd_log`` is the standard deviation of the
    per-seed log ratios: ``|log ratio| = (z(1 - alpha / (2 family)) + z(power)) sd_log / sqrt(seeds)`` (normal
    approximation; Holm's first step, the strictest, is Bonferroni's ``alpha / family``).

    Raises:
        ValueError: ``seeds < 2``, ``family < 1``, a negative ``sd_log`` or ``alpha``/``power`` outside (0, 1).
    """
    if seeds < 2 or family < 1 or sd_log < 0 or not (0 < alpha < 1 and 0 < power < 1):
        raise ValueError(f"bad power inputs: sd_log={sd_log}, seeds={seeds}, family={family}, alpha={alpha}")
    shift = (_z(1 - alpha / (2 * family)) + _z(power)) * sd_log / math.sqrt(seeds)
    return 1 - math.exp(-shift)


def required_seeds(sd_log: float, effect: float, family: int, alpha: float = 0.05, power: float = 0.8) -> int:
    """The evaluation seeds a paired test needs to detect a relative ``effect`` (0.1: a ratio of 0.9) with
    probability ``power`` after Holm's correction over ``family`` comparisons (:func:`detectable_effect` solved for
    the seeds; at least 2)."""
    if not 0 < effect < 1:
        raise ValueError(f"effect must be in (0, 1), got {effect}")
    shift = -math.log(1 - effect)
    if family < 1 or sd_log < 0 or not (0 < alpha < 1 and 0 < power < 1):
        raise ValueError(f"bad power inputs: sd_log={sd_log}, family={family}, alpha={alpha}, power={power}")
    need = ((_z(1 - alpha / (2 * family)) + _z(power)) * sd_log / shift) ** 2
    return max(2, math.ceil(need))


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
    bootstrap interval, the paired permutation test of the ratio (:func:`ratio_permutation_p`), and the standard
    deviation of the per-seed log ratios (the power computation's input)."""

    ratio: float
    low: float
    high: float
    p: float
    seeds: int
    sd_log: float = 0.0


def compare(
    arm: Sequence[Optional[float]],
    baseline: Sequence[Optional[float]],
    budget: float,
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> Comparison:
    """Paired comparison over seeds (``arm[i]`` and ``baseline[i]`` share seed ``i``).

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
    p = ratio_permutation_p(a, b, seed=seed)
    sd = float(np.std(np.log(a) - np.log(b), ddof=1))
    return Comparison(ratio, float(low), float(high), p, len(a), sd)
