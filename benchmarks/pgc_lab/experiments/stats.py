"""Statistics of the benchmark grid: paired intervals over seeds, time to a target, values at equal wall time.

Pure Python (the bootstrap uses numpy's generator); no Lightning, no processes.

Why *paired*: for a given seed every scheme sees the same delays, initial weights and data split
(:func:`lightning_pgc.delays.delay_for`), so the per-seed difference between two schemes cancels most of the
seed-to-seed variation that an unpaired comparison of two means would count twice.

Which interval: :func:`paired_t_interval` (Student t on the per-seed differences, or on the log ratios for a
ratio such as "time to target relative to dgd") is the one the grid reports. With the 5-10 seeds a grid can
afford, the percentile bootstrap (:func:`paired_bootstrap_interval`) is too narrow: it resamples with the
``1/m`` variance and a normal-like spread, so at ``m = 5`` its nominal 95 % interval covers markedly less
(it ignores the t distribution's heavier tails, 2.78 vs 1.96 standard errors). The bootstrap is kept as the
alternative for many seeds and skewed differences (e.g. stalls that hit one seed), where the t interval's
normality assumption is the weaker one. Both need every seed of both schemes (a run that never reached a
target has no time: report how many reached it instead of dropping seeds silently).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from pgc_lab.experiments.curves import crossing, interpolate

__all__ = [
    "PairedInterval",
    "equal_wall_time",
    "paired_bootstrap_interval",
    "paired_t_interval",
    "seconds_per_step",
    "t_cdf_two_sided",
    "t_quantile",
    "time_to_target",
    "value_at_wall",
]


@dataclass(frozen=True)
class PairedInterval:
    """A paired comparison of a scheme (``x``) with a reference (``y``) over ``seeds`` seeds.

    ``estimate``, ``low``, ``high``: the mean difference ``x - y`` and its interval, or with ``ratio`` the
    geometric mean of ``x / y`` and its interval (1.0 means no difference; below 1, ``x`` is smaller).
    """

    estimate: float
    low: float
    high: float
    seeds: int
    level: float
    ratio: bool
    method: str

    @property
    def excludes_null(self) -> bool:
        """Whether the interval excludes "no difference" (0, or 1 for a ratio)."""
        null = 1.0 if self.ratio else 0.0
        return self.low > null or self.high < null

    def as_dict(self) -> dict[str, float | int | bool | str]:
        return {
            "estimate": self.estimate,
            "low": self.low,
            "high": self.high,
            "seeds": self.seeds,
            "level": self.level,
            "ratio": self.ratio,
            "method": self.method,
        }


def t_cdf_two_sided(t: float, df: int) -> float:
    """``P(|T| <= t)`` for Student's t with integer ``df`` degrees of freedom (exact finite series).

    With ``theta = atan(t / sqrt(df))``: for odd ``df``, ``(2/pi) (theta + sin(theta) sum_k a_k cos(theta)^(2k+1))``
    with ``a_0 = 1``, ``a_k = a_{k-1} 2k / (2k+1)`` for ``k < (df-1)/2``; for even ``df``,
    ``sin(theta) sum_k b_k cos(theta)^(2k)`` with ``b_0 = 1``, ``b_k = b_{k-1} (2k-1) / (2k)`` for ``k < df/2``
    (Abramowitz and Stegun 26.7.3-4).

    Raises:
        ValueError: ``df < 1``.
    """
    if isinstance(df, bool) or int(df) != df or df < 1:
        raise ValueError(f"df must be an integer >= 1, got {df!r}")
    df = int(df)
    t = abs(float(t))
    if math.isinf(t):
        return 1.0
    theta = math.atan(t / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2 == 1:
        total, term = 0.0, c
        for k in range((df - 1) // 2):
            if k > 0:
                term *= c * c * (2 * k) / (2 * k + 1)
            total += term
        return min(1.0, 2 / math.pi * (theta + s * total)) if df > 1 else 2 / math.pi * theta
    total, term = 0.0, 1.0
    for k in range(df // 2):
        if k > 0:
            term *= c * c * (2 * k - 1) / (2 * k)
        total += term
    return min(1.0, s * total)


def t_quantile(level: float, df: int) -> float:
    """The two-sided Student t critical value: ``q`` with ``P(|T| <= q) = level`` (e.g. 2.776 for 0.95, df 4).

    Raises:
        ValueError: ``level`` not in (0, 1) or ``df < 1``.
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    lo, hi = 0.0, 1.0
    while t_cdf_two_sided(hi, df) < level:
        hi *= 2.0
    for _ in range(200):  # bisection to float precision
        mid = (lo + hi) / 2
        if t_cdf_two_sided(mid, df) < level:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return (lo + hi) / 2


def _paired(x: Sequence[float], y: Sequence[float], ratio: bool) -> list[float]:
    """Per-seed differences ``x_i - y_i`` (``log(x_i / y_i)`` with ``ratio``), validated."""
    if len(x) != len(y):
        raise ValueError(f"paired samples need one value per seed on both sides, got {len(x)} and {len(y)}")
    if len(x) < 2:
        raise ValueError(f"an interval needs at least 2 seeds, got {len(x)}")
    values = [float(v) for v in (*x, *y)]
    if not all(math.isfinite(v) for v in values):
        raise ValueError(
            "paired samples must be finite (a run that never reached the target has no time: "
            "compare reach counts, or use a value every run has)"
        )
    if ratio:
        if min(values) <= 0:
            raise ValueError("a ratio interval needs positive values on both sides")
        return [math.log(a) - math.log(b) for a, b in zip(x, y)]
    return [float(a) - float(b) for a, b in zip(x, y)]


def paired_t_interval(
    x: Sequence[float], y: Sequence[float], level: float = 0.95, ratio: bool = False
) -> PairedInterval:
    """Student t interval of the mean per-seed difference ``x_i - y_i`` (``ratio``: of the mean log ratio,
    reported as a geometric-mean ratio), seeds in the same order on both sides.

    Raises:
        ValueError: fewer than 2 seeds, unequal lengths, non-finite values, or non-positive values with ``ratio``.
    """
    d = _paired(x, y, ratio)
    m = len(d)
    mean = statistics.fmean(d)
    half = t_quantile(level, m - 1) * statistics.stdev(d) / math.sqrt(m)
    lo, hi = mean - half, mean + half
    if ratio:
        mean, lo, hi = math.exp(mean), math.exp(lo), math.exp(hi)
    return PairedInterval(mean, lo, hi, m, level, ratio, "paired t")


def paired_bootstrap_interval(
    x: Sequence[float],
    y: Sequence[float],
    level: float = 0.95,
    ratio: bool = False,
    resamples: int = 10_000,
    seed: int = 0,
) -> PairedInterval:
    """Percentile bootstrap interval of the mean per-seed difference (``ratio``: geometric-mean ratio): seeds are
    resampled with replacement, pairs kept together. Deterministic for a given ``seed``.

    Raises:
        ValueError: as :func:`paired_t_interval`, or ``resamples < 100``.
    """
    if resamples < 100:
        raise ValueError(f"resamples must be >= 100, got {resamples}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    d = np.asarray(_paired(x, y, ratio), dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)
    tail = (1.0 - level) / 2
    mean, lo, hi = float(d.mean()), float(np.quantile(means, tail)), float(np.quantile(means, 1.0 - tail))
    if ratio:
        mean, lo, hi = math.exp(mean), math.exp(lo), math.exp(hi)
    return PairedInterval(mean, lo, hi, len(d), level, ratio, "percentile bootstrap")


def time_to_target(walls: Sequence[float], losses: Sequence[float], target: float) -> Optional[float]:
    """Wall time at which the validation curve ``(walls, losses)`` first reaches ``<= target``, linear between
    two evaluations (not rounded up to the next one); ``None`` if it never does."""
    if len(walls) != len(losses):
        raise ValueError(f"walls and losses differ in length ({len(walls)} vs {len(losses)})")
    return crossing(walls, losses, target) if walls else None


def equal_wall_time(ends: Sequence[float]) -> float:
    """The wall time every compared run reached: the earliest end among them (compare values there)."""
    if not ends:
        raise ValueError("equal_wall_time needs at least one run")
    return min(float(e) for e in ends)


def value_at_wall(walls: Sequence[float], values: Sequence[float], wall: float) -> Optional[float]:
    """A curve's value (e.g. validation accuracy) at wall time ``wall``, linear between evaluations; ``None``
    outside the curve."""
    if len(walls) != len(values):
        raise ValueError(f"walls and values differ in length ({len(walls)} vs {len(values)})")
    return interpolate(walls, values, wall)


def seconds_per_step(times: Sequence[Sequence[float]], skip: int) -> float:
    """Throughput of a run on several ranks, as seconds per step: the wall time from the moment every rank finished
    step ``skip`` to the moment every rank finished its last step, divided by the steps in between (``times[r][i]``:
    when rank ``r`` finished step ``i + 1``). A rank that lags and catches up in bursts cannot make it look fast."""
    last = len(times[0])
    if not 0 < skip < last:
        raise ValueError(f"skip must be in [1, {last - 1}] for {last} steps, got {skip}")
    start = max(t[skip - 1] for t in times)
    end = max(t[-1] for t in times)
    return (end - start) / (last - skip)
