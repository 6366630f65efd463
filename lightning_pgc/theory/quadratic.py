"""The theory lab: exact simulations on a quadratic that test what the convergence proofs assume (research code).

Pure math (numpy / torch, float64), no Lightning and no ``torch.distributed``; not imported by ``import
lightning_pgc``. The quantities measured on one aggregate (coefficients, the error decomposition, the constants),
which :class:`~lightning_pgc.callbacks.PGCDiagnostics` also evaluates during a real run, live in
:mod:`lightning_pgc.codes.measures` and are re-exported here, so the lab and its users read both from one place.
``docs/results/theory.md`` explains every quantity; ``tests/test_theory.py`` checks them exhaustively on small cases.

Notation (as in ``docs/math.md``): ``n`` ranks and partitions, ``c = s + 1`` copies, model version ``t``.
``g_j^(v)`` is the mini-batch gradient of partition ``j`` at version ``v``; ``grad F_j(beta_v)`` the gradient of
partition ``j``'s whole loss; the objective the schemes optimise is ``F = (1/n) sum_j F_j``. Rank ``k``'s cache holds
partition ``j`` at version ``v_kj``; ``W[k, j]`` is the weight of that copy in the aggregate.

Main entry points:

- coefficients: :func:`code_weights`, :func:`copy_weights`, :func:`reference_copy_weights`,
  :func:`received_patterns`, :func:`pattern_rank_weights`, :func:`nominal_cache_versions`;
- the received-subset estimator versus the all-rank average: :func:`subset_moments` (review, Lemma 3);
- the exact error decomposition of one aggregate: :func:`decompose_error`;
- the constants of the theorems: :func:`gamma_hat`, :func:`xi_hat`, :func:`copy_statistics` (Lemma 4's cross terms);
- an exact stochastic simulator of a scheme on a quadratic (:func:`simulate_pgc_quadratic`, affine in the noise, so
  expectations and covariances are exact), used for Lemma 1 and Lemma 4;
- delayed-gradient stability on a quadratic: :func:`pure_delay_threshold`, :func:`stability_threshold`,
  :func:`simulated_threshold`, :func:`staleness_error_curve`, :func:`loglog_slope`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from lightning_pgc.codes import StaleCache
from lightning_pgc.codes.measures import (
    ErrorDecomposition,
    SubsetMoments,
    code_weights,
    codes_from_copies,
    copy_statistics,
    copy_weights,
    decompose_error,
    gamma_hat,
    nominal_cache_versions,
    pattern_rank_weights,
    received_patterns,
    reference_copy_weights,
    subset_moments,
    versions_from_ages,
    weighted_copy_sum,
    xi_hat,
)

__all__ = [
    "code_weights",
    "copy_weights",
    "reference_copy_weights",
    "received_patterns",
    "pattern_rank_weights",
    "nominal_cache_versions",
    "versions_from_ages",
    "codes_from_copies",
    "weighted_copy_sum",
    "SubsetMoments",
    "subset_moments",
    "ErrorDecomposition",
    "decompose_error",
    "gamma_hat",
    "xi_hat",
    "copy_statistics",
    "QuadraticRun",
    "simulate_pgc_quadratic",
    "pure_delay_threshold",
    "delay_spectral_radius",
    "stability_threshold",
    "simulate_delayed",
    "simulated_threshold",
    "staleness_error_curve",
    "loglog_slope",
]


# ============================================================================ exact stochastic quadratic simulator
@dataclass
class QuadraticRun:
    """A scheme run on ``F_j(beta) = 1/2 (beta - b_j)^T H (beta - b_j)`` with Gaussian gradient noise, kept exact.

    Every vector is stored *affinely* in the noise: a ``[d, 1 + N]`` matrix whose column 0 is the mean and whose
    other columns are the coefficients of ``N`` independent standard-normal scalars (times ``sigma``). Encode,
    decode and the update are linear, so means, second moments and covariances below are exact, not sampled.
    """

    scheme: Any
    H: Tensor
    b: Tensor  # [n, d] partition optima
    eta: float
    sigma: float
    noise: str
    betas: list[Tensor]  # beta_t, t = 0..steps
    aggregates: list[Tensor]  # g_hat_t, t = 0..steps-1
    received: list[tuple[int, ...]]  # decoded received set (arrival order) per step
    versions: list[dict[int, dict[int, int]]]  # per step: rank -> {partition: version} of the codes' entries
    copies: list[dict[int, dict[int, Tensor]]]  # per step: rank -> {partition: cached gradient (affine)}

    @property
    def b_mean(self) -> Tensor:
        return self.b.mean(dim=0)

    def grad_F(self, t: int) -> Tensor:
        """``grad F(beta_t) = H (beta_t - mean_j b_j)`` (affine)."""
        out = self.H @ self.betas[t]
        out[:, 0] -= self.H @ self.b_mean
        return out

    def grad_Fj(self, j: int, t: int) -> Tensor:
        out = self.H @ self.betas[t]
        out[:, 0] -= self.H @ self.b[j]
        return out

    def mean(self, x: Tensor) -> Tensor:
        return x[:, 0].clone()

    def inner(self, x: Tensor, y: Tensor) -> float:
        """``E <x, y>``."""
        return float((x[:, 0] * y[:, 0]).sum() + self.sigma**2 * (x[:, 1:] * y[:, 1:]).sum())

    def sq(self, x: Tensor) -> float:
        """``E |x|^2``."""
        return self.inner(x, x)

    def cov(self, x: Tensor, y: Tensor) -> float:
        """``E <x - E x, y - E y>`` (the trace of the cross-covariance)."""
        return float(self.sigma**2 * (x[:, 1:] * y[:, 1:]).sum())


def simulate_pgc_quadratic(
    scheme: Any,
    H: Any,
    b: Any,
    eta: float,
    steps: int,
    sigma: float = 0.0,
    noise: str = "fresh",
    beta0: Any = None,
    arrival: Optional[Callable[[int], Sequence[int]]] = None,
) -> QuadraticRun:
    """Run ``scheme`` (from ``make_scheme``) for ``steps`` versions on the quadratic, through the real codes API.

    Every rank keeps a :class:`~lightning_pgc.codes.StaleCache`, evaluates ``scheme.evaluations(k, t)``, encodes its
    valid entries with the scheme's code weights (:func:`code_weights`, applied in float64), and the coordinator
    decodes with ``scheme.decode`` the shortest prefix of the arrival order ``arrival(t)`` (default ``0..n-1``)
    that ``scheme.admits``, as the runtime does. Gradient noise: ``g_j^(v) = H (beta_v - b_j) + sigma * z`` with
    ``z`` standard normal, fresh per evaluation ``(j, v)`` (``noise="fresh"``: a new mini-batch each time) or fixed
    per partition (``noise="shared"``: every evaluation of partition ``j`` sees the same data), or none
    (``sigma = 0``).
    """
    if noise not in ("fresh", "shared"):
        raise ValueError(f"noise must be 'fresh' or 'shared', got {noise!r}")
    n = scheme.n
    H = torch.as_tensor(H, dtype=torch.float64)
    if H.dim() == 0:
        H = H.reshape(1, 1)
    d = H.shape[0]
    b = torch.as_tensor(b, dtype=torch.float64).reshape(n, d)
    N = d * n * (steps + 1) if noise == "fresh" else d * n
    width = 1 + N
    beta = torch.zeros(d, width, dtype=torch.float64)
    if beta0 is not None:
        beta[:, 0] = torch.as_tensor(beta0, dtype=torch.float64).reshape(d)
    arrival = arrival or (lambda t: range(n))
    caches = [StaleCache(scheme.partitions(k), scheme.cache_max_age) for k in range(n)]
    run = QuadraticRun(scheme, H, b, float(eta), float(sigma), noise, [beta.clone()], [], [], [], [])

    def gradient(j: int, v: int) -> Tensor:
        g = H @ run.betas[v]
        g[:, 0] -= H @ b[j]
        col = 1 + ((v * n + j) * d if noise == "fresh" else j * d)
        g[:, col : col + d] += torch.eye(d, dtype=torch.float64)
        return g

    for t in range(steps):
        codes: dict[int, Tensor] = {}
        step_versions: dict[int, dict[int, int]] = {}
        step_copies: dict[int, dict[int, Tensor]] = {}
        for k in range(n):
            for j in scheme.evaluations(k, t, start=0):
                caches[k].put(j, gradient(j, t).reshape(-1), t, copy=False)
            valid = caches[k].valid(t)
            versions = caches[k].versions()
            step_versions[k] = {j: versions[j] for j in valid}
            step_copies[k] = {j: g.reshape(d, width) for j, g in valid.items()}
            weights = code_weights(scheme, k, tuple(valid))
            codes[k] = torch.stack([weights[j] * g for j, g in valid.items()]).sum(0)
        order = list(arrival(t))
        prefix: list[int] = []
        for k in order:
            prefix.append(k)
            if scheme.admits(prefix):
                break
        g_hat = scheme.decode({k: codes[k] for k in prefix}).reshape(d, width)
        run.aggregates.append(g_hat)
        run.received.append(tuple(prefix))
        run.versions.append(step_versions)
        run.copies.append(step_copies)
        run.betas.append(run.betas[-1] - run.eta * g_hat)
    return run


# ==================================================================================== delayed-gradient stability
def pure_delay_threshold(tau: int) -> float:
    """Largest stable ``a = eta * h`` of ``x_{t+1} = x_t - a x_{t-tau}`` (gradient delayed by ``tau`` steps).

    ``2 sin(pi / (2 (2 tau + 1)))``: 2 without delay, 1 for one step, about ``pi / (2 tau)`` for large delays.
    """
    if tau < 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    return 2.0 * math.sin(math.pi / (2.0 * (2 * tau + 1)))


def _delay_weights(weights: Any) -> np.ndarray:
    w = np.atleast_1d(np.asarray(weights, dtype=np.float64))
    if w.ndim != 1 or len(w) == 0 or abs(w.sum() - 1.0) > 1e-12:
        raise ValueError(f"delay weights must be a non-empty 1-D vector summing to 1, got {weights!r}")
    return w


def delay_spectral_radius(a: float, weights: Any) -> float:
    """Spectral radius of ``x_{t+1} = x_t - a sum_d w_d x_{t-d}`` (``w_d``: weight of the gradient ``d`` steps old).

    Pure delay ``tau``: ``w = e_tau``; the PGC pipeline on identical partitions: ``w = (1/c, ..., 1/c)`` (one copy of
    each age ``0..c-1``). The characteristic polynomial is ``z^(D+1) - z^D + a sum_d w_d z^(D-d)``.
    """
    w = _delay_weights(weights)
    D = len(w) - 1
    poly = np.zeros(D + 2)
    poly[0] = 1.0
    poly[1] = -1.0
    poly[1:] += a * w
    return float(np.abs(np.roots(poly)).max())


def stability_threshold(weights: Any, hi: float = 4.0, tol: float = 1e-12) -> float:
    """The largest ``a = eta h`` with spectral radius below 1 (bisection on :func:`delay_spectral_radius`)."""
    w = _delay_weights(weights)
    lo = 0.0
    while delay_spectral_radius(hi, w) < 1.0:
        hi *= 2.0
    while hi - lo > tol * max(hi, 1.0):
        mid = 0.5 * (lo + hi)
        if delay_spectral_radius(mid, w) < 1.0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def simulate_delayed(a: float, weights: Any, steps: int, x0: float = 1.0) -> np.ndarray:
    """Trajectory of ``x_{t+1} = x_t - a sum_d w_d x_{max(t-d, 0)}`` from ``x_0 = x0`` (history clamped at 0)."""
    w = _delay_weights(weights)
    x = np.empty(steps + 1, dtype=np.float64)
    x[0] = x0
    with np.errstate(over="ignore", invalid="ignore"):  # unstable runs overflow to inf/nan, which is the answer
        for t in range(steps):
            delayed = sum(w[d] * x[max(t - d, 0)] for d in range(len(w)))
            x[t + 1] = x[t] - a * delayed
    return x


def simulated_threshold(weights: Any, steps: int = 4000, tol: float = 1e-4, hi: float = 4.0) -> float:
    """The stability boundary found by *running* the recursion: the largest ``a`` whose trajectory does not grow.

    A run counts as stable when the largest ``|x|`` over its last quarter is below ``|x_0|``; bisection on ``a``.
    Independent of the closed form and of the spectral radius (a check of both).
    """
    w = _delay_weights(weights)

    def stable(a: float) -> bool:
        x = simulate_delayed(a, w, steps)
        tail = np.abs(x[3 * steps // 4 :])
        return bool(np.all(np.isfinite(tail)) and tail.max() < 1.0)

    lo = 0.0
    while stable(hi):
        hi *= 2.0
    while hi - lo > tol * hi:
        mid = 0.5 * (lo + hi)
        if stable(mid):
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def staleness_error_curve(
    H: Any, eta: float, delays: Sequence[int], t: int, beta0: Any, b: Any = None
) -> tuple[np.ndarray, np.ndarray]:
    """Staleness error ``|grad F(beta_t) - grad F(beta_{t-tau})|^2`` and ``L^2 |beta_t - beta_{t-tau}|^2`` per delay.

    Along the gradient-descent trajectory of ``F(beta) = 1/2 (beta - b)^T H (beta - b)`` with step ``eta``; ``L`` is
    the largest eigenvalue of ``H`` (the Lipschitz constant of ``grad F``). For small ``eta`` the iterate moves
    about ``eta |grad F|`` per step, so the error grows as ``tau^2`` (log-log slope 2) and the Lipschitz bound is
    tight when the trajectory follows the top eigenvector.
    """
    H = np.atleast_2d(np.asarray(H, dtype=np.float64))
    d = H.shape[0]
    b = np.zeros(d) if b is None else np.asarray(b, dtype=np.float64).reshape(d)
    beta = np.asarray(beta0, dtype=np.float64).reshape(d).copy()
    history = [beta.copy()]
    for _ in range(t):
        beta = beta - eta * H @ (beta - b)
        history.append(beta.copy())
    L = float(np.linalg.eigvalsh((H + H.T) / 2).max())
    err, bound = [], []
    for tau in delays:
        if tau > t:
            raise ValueError(f"delay {tau} exceeds t={t}")
        diff = history[t] - history[t - tau]
        err.append(float(np.sum((H @ diff) ** 2)))
        bound.append(L**2 * float(np.sum(diff**2)))
    return np.array(err), np.array(bound)


def loglog_slope(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of ``log y`` against ``log x``."""
    lx, ly = np.log(np.asarray(x, dtype=np.float64)), np.log(np.asarray(y, dtype=np.float64))
    return float(np.polyfit(lx, ly, 1)[0])
