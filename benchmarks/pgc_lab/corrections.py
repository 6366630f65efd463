"""Staleness corrections on the quadratic model: stability boundaries and convergence rates, exactly.

Research code (numpy, float64; not imported by ``import lightning_pgc``). ``docs/results/theory.md`` (section 7) states the
results and ``tests/test_theory_corrections.py`` checks them against closed forms and against the real schemes.

The model (``docs/results/theory.md``, section 4): one eigen-direction of a quadratic, curvature ``h``, ``a = lr * h``.
On identical partitions every ``pgc_cr``/``pgc_fr`` aggregate holds one gradient of each age ``0..c-1``, so with
heavy-ball momentum ``m`` (torch's SGD: ``x_(t+1) = x_t - lr g_t + m (x_t - x_(t-1))``) the iterate follows

    x_(t+1) = (1 + m) x_t - m x_(t-1) - a sum_j f_j x_(t-j)

where ``f`` (the *gradient filter*) says how much of ``x_(t-j)`` the aggregate at step ``t`` holds:

- no correction: ``f = (1/c, ..., 1/c)`` (ages ``0..c-1``), :func:`window_filter`;
- look-ahead by ``k`` steps: each gradient is computed at ``x_u + k (x_u - x_(u-1))``, :func:`lookahead_filter`;
- delay compensation with an effective Hessian fraction ``lam``: an entry of age ``d`` is
  ``h x_(t-d) + lam h (x_t - x_(t-d))``, :func:`compensated_filter` (``lam = 1``: the exact correction on a quadratic,
  every gradient fresh again; the ``g * g`` stand-in gives ``lam = lambda E[g^2] / h``, see ``docs/results/theory.md``);
- momentum accounting: the same window with ``m`` replaced by ``max(0, m - D / (1 + D))``
  (:func:`lightning_pgc.staleness.accounted_momentum`).

:func:`spectral_radius` is the largest root modulus of the characteristic polynomial (the companion matrix's
spectral radius); :func:`boundary` the largest stable ``a``; :func:`rate` the worst spectral radius over a spectrum
``h in [L / kappa, L]``; :func:`best_rate` the best of it over ``(lr, m)``.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from lightning_pgc.staleness import accounted_momentum

__all__ = [
    "window_filter",
    "lookahead_filter",
    "compensated_filter",
    "filter_mean_age",
    "characteristic",
    "spectral_radius",
    "boundary",
    "window_boundary_c2",
    "rate",
    "best_rate",
    "simulate",
    "corrected_filter",
]


# =============================================================================================== gradient filters
def window_filter(c: int) -> NDArray[np.float64]:
    """``f_j = 1/c`` for ``j = 0..c-1``: the pipeline's aggregate on identical partitions (ages ``0..c-1``)."""
    if c < 1:
        raise ValueError(f"c must be >= 1, got {c}")
    return np.full(c, 1.0 / c)


def lookahead_filter(weights: ArrayLike, k: float) -> NDArray[np.float64]:
    """Each gradient computed at ``x_u + k (x_u - x_(u-1))``: ``f_j = (1 + k) w_j - k w_(j-1)``."""
    w = np.asarray(weights, dtype=np.float64)
    f = np.zeros(len(w) + 1)
    f[:-1] += (1.0 + k) * w
    f[1:] -= k * w
    return f


def compensated_filter(weights: ArrayLike, lam: float) -> NDArray[np.float64]:
    """An entry of age ``d`` corrected by ``lam h (x_t - x_(t-d))``: ``f_0 += lam (1 - w_0)``, ``f_d *= 1 - lam``."""
    w = np.asarray(weights, dtype=np.float64)
    f = (1.0 - lam) * w
    f[0] = w[0] + lam * (1.0 - w[0])
    return f


def filter_mean_age(f: ArrayLike) -> float:
    """``sum_j j f_j / sum_j f_j``: the mean age of use (``(c - 1) / 2`` for the window, ``0`` after look-ahead by
    the mean age, ``(1 - lam) (c - 1) / 2`` after compensation)."""
    arr = np.asarray(f, dtype=np.float64)
    return float(np.arange(len(arr)) @ arr / arr.sum())


def corrected_filter(correction: str, c: int, *, k: Optional[float] = None, lam: float = 1.0) -> NDArray[np.float64]:
    """The filter of ``correction`` (``none``, ``momentum``, ``lookahead``, ``delay_compensation``) at window ``c``.

    ``momentum`` changes the momentum, not the filter: its filter is the window's.
    """
    w = window_filter(c)
    if correction in ("none", "momentum"):
        return w
    if correction == "lookahead":
        return lookahead_filter(w, (c - 1) / 2.0 if k is None else k)
    if correction == "delay_compensation":
        return compensated_filter(w, lam)
    raise ValueError(f"unknown correction {correction!r}")


# ============================================================================================ spectra, boundaries
def characteristic(a: float, m: float, f: ArrayLike) -> NDArray[np.float64]:
    """Coefficients (highest power first) of ``z^(D+1) - (1 + m) z^D + m z^(D-1) + a sum_j f_j z^(D-j)``."""
    arr = np.asarray(f, dtype=np.float64)
    D = max(len(arr), 2)
    coef = np.zeros(D)  # coefficient of x_(t-j) in x_(t+1)
    coef[0] += 1.0 + m
    coef[1] -= m
    coef[: len(arr)] -= a * arr
    return np.concatenate([[1.0], -coef])


def spectral_radius(a: float, m: float, f: ArrayLike) -> float:
    """Largest modulus of the roots (the companion matrix's spectral radius): below 1 iff the recursion is stable."""
    return float(np.abs(np.roots(characteristic(a, m, f))).max())


def boundary(m: float, f: ArrayLike, hi: float = 16.0, tol: float = 1e-10) -> float:
    """The largest ``a`` such that every ``a' in (0, a)`` is stable: a fine scan for the first unstable ``a``, then
    bisection (``inf`` if none up to ``hi``)."""
    grid = np.linspace(hi / 20000, hi, 20000)
    first = next((x for x in grid if spectral_radius(x, m, f) >= 1.0), None)
    if first is None:
        return math.inf
    lo, up = first - hi / 20000, first
    while up - lo > tol:
        mid = 0.5 * (lo + up)
        if spectral_radius(mid, m, f) < 1.0:
            lo = mid
        else:
            up = mid
    return 0.5 * (lo + up)


def window_boundary_c2(m: float) -> float:
    """Closed form for ``c = 2`` without correction: ``a < 2 (1 - m)`` (Jury: ``z^2 - (1 + m - a/2) z + m + a/2``).

    In effective-rate units ``a / (1 - m)`` the boundary is 2 for every ``m``, the plain gradient-descent boundary:
    momentum buys no larger effective step, where fresh gradients allow ``2 (1 + m) / (1 - m)`` (38 at ``m = 0.9``).
    """
    if not 0.0 <= m < 1.0:
        raise ValueError(f"m must be in [0, 1), got {m}")
    return 2.0 * (1.0 - m)


def rate(aL: float, m: float, f: ArrayLike, kappa: float, points: int = 40) -> float:
    """Worst spectral radius over the spectrum ``a in [aL / kappa, aL]`` (log grid, ends included): the per-step
    contraction of the slowest direction; steps to shrink the error ``e``-fold: ``-1 / log(rate)``."""
    return max(spectral_radius(aL * h, m, f) for h in np.geomspace(1.0 / kappa, 1.0, points))


def best_rate(
    f: ArrayLike, kappa: float, momenta: Optional[Sequence[float]] = None, rates: Optional[Sequence[float]] = None
) -> tuple[float, float, float]:
    """``(rate, aL, m)``: the best :func:`rate` over a grid of momenta (default ``0, 0.02, ..., 0.98``) and of
    ``aL = lr L`` (default 60 values from 1e-2 to 8, log-spaced)."""
    momentum_grid: Iterable[float] = np.linspace(0.0, 0.98, 50) if momenta is None else momenta
    rate_grid: Iterable[float] = np.geomspace(1e-2, 8.0, 60) if rates is None else rates
    best = (math.inf, math.nan, math.nan)
    for m in momentum_grid:
        for aL in rate_grid:
            r = rate(aL, float(m), f, kappa, points=25)
            if r < best[0]:
                best = (r, float(aL), float(m))
    return best


def simulate(a: float, m: float, f: ArrayLike, steps: int, x0: float = 1.0) -> NDArray[np.float64]:
    """``x_(t+1) = (1 + m) x_t - m x_(t-1) - a sum_j f_j x_(t-j)`` from ``x_0 = x0`` (history before 0 clamped)."""
    arr = np.asarray(f, dtype=np.float64)
    x = np.empty(steps + 1)
    x[0] = x0
    with np.errstate(over="ignore", invalid="ignore"):
        for t in range(steps):
            g = sum(arr[j] * x[max(t - j, 0)] for j in range(len(arr)))
            x[t + 1] = x[t] + m * (x[t] - x[max(t - 1, 0)]) - a * g
    return x


def momentum_accounting(m: float, c: int) -> float:
    """The momentum the ``"momentum"`` correction applies for window ``c`` (mean age ``(c - 1) / 2``)."""
    return accounted_momentum(m, (c - 1) / 2.0)


# ================================================================================================ the summary table
def correction_table(
    cs: Sequence[int] = range(2, 9), momenta: Sequence[float] = (0.0, 0.9), kappa: float = 100.0, dc_lambda: float = 0.5
) -> list[dict[str, Any]]:
    """Per ``c``, momentum ``m`` (the one the user sets) and correction: the stability boundary in ``a = lr h``, the
    boundary in effective-rate units ``a / (1 - m_applied)``, the best rate over ``aL`` (the grid of
    :func:`best_rate`) on a spectrum of condition number ``kappa`` and its steps per ``e``-fold error reduction.
    Fresh gradients (``dgd``) are the row ``c = 1``."""
    rows: list[dict[str, Any]] = []
    for c in [1, *cs]:
        for m in momenta:
            for correction in ("none",) if c == 1 else ("none", "momentum", "lookahead", "delay_compensation"):
                f = corrected_filter(correction, c, lam=dc_lambda)
                applied = momentum_accounting(m, c) if correction == "momentum" else m
                a_max = boundary(applied, f)
                r, aL, _ = best_rate(f, kappa, momenta=[applied])
                rows.append(
                    {
                        "c": c,
                        "momentum": m,
                        "correction": correction,
                        "momentum_applied": applied,
                        "mean_age": filter_mean_age(f),
                        "boundary": a_max,
                        "effective_boundary": a_max / (1.0 - applied),
                        "best_rate": r,
                        "best_aL": aL,
                        "steps_per_efold": -1.0 / math.log(r),
                    }
                )
    return rows
