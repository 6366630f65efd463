"""The staleness corrections on the quadratic model, exactly: closed-form boundaries, the companion-matrix spectra,
and the real schemes run through the real correction code reproducing the recursions the theory analyses."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_pgc.theory import quadratic as th
from pgc_lab import corrections as tc
from lightning_pgc.codes import StaleCache, make_scheme
from lightning_pgc.staleness import StalenessCorrection, accounted_momentum, implicit_momentum


MOMENTA = [0.0, 0.3, 0.6, 0.9]  #: the momenta the closed forms are checked at (docs/results/theory.md cites them)


# ================================================================================================ closed forms
@pytest.mark.parametrize("m", MOMENTA)
def test_fresh_heavy_ball_boundary_is_two_times_one_plus_m(m):
    assert tc.boundary(m, tc.window_filter(1)) == pytest.approx(2.0 * (1.0 + m), rel=1e-8)


@pytest.mark.parametrize("m", MOMENTA)
def test_the_c2_window_with_momentum_is_stable_exactly_below_two_times_one_minus_m(m):
    """Jury's test on z^2 - (1 + m - a/2) z + (m + a/2): a < 2 (1 - m); in effective-rate units a / (1 - m) < 2
    for every m, where fresh gradients allow 2 (1 + m) / (1 - m)."""
    a = tc.window_boundary_c2(m)
    assert tc.boundary(m, tc.window_filter(2)) == pytest.approx(a, rel=1e-8)
    assert (
        tc.spectral_radius(0.99 * a, m, tc.window_filter(2))
        < 1.0
        < tc.spectral_radius(1.01 * a, m, tc.window_filter(2))
    )
    assert a / (1.0 - m) == pytest.approx(2.0)
    # with compensation lam: z^2 - (1 + m - (1 + lam) a / 2) z + m + (1 - lam) a / 2, so a < 2 (1 - m) / (1 - lam)
    for lam in (0.25, 0.5):
        assert tc.boundary(m, tc.corrected_filter("delay_compensation", 2, lam=lam)) == pytest.approx(
            2.0 * (1.0 - m) / (1.0 - lam), rel=1e-8
        )


@pytest.mark.parametrize("c", range(2, 9))
def test_without_momentum_the_window_boundary_is_the_pipeline_boundary_of_the_delay_theory(c):
    assert tc.boundary(0.0, tc.window_filter(c)) == pytest.approx(th.stability_threshold(np.full(c, 1.0 / c)), rel=1e-7)


@pytest.mark.parametrize("c", range(2, 9))
def test_mean_ages_of_the_corrected_filters(c):
    assert tc.filter_mean_age(tc.window_filter(c)) == pytest.approx((c - 1) / 2)
    assert tc.filter_mean_age(tc.corrected_filter("lookahead", c)) == pytest.approx(0.0, abs=1e-12)
    for lam in (0.0, 0.5, 1.0):
        f = tc.corrected_filter("delay_compensation", c, lam=lam)
        assert f.sum() == pytest.approx(1.0)
        assert tc.filter_mean_age(f) == pytest.approx((1 - lam) * (c - 1) / 2)
    # exact compensation (the Hessian itself) makes every gradient fresh: dgd's boundary 2 (1 + m)
    assert np.allclose(tc.corrected_filter("delay_compensation", c, lam=1.0), np.eye(c)[0])


@pytest.mark.parametrize("c", range(2, 9))
def test_momentum_accounting_is_the_window_s_implicit_momentum_subtracted(c):
    mu = implicit_momentum((c - 1) / 2)
    assert mu == pytest.approx((c - 1) / (c + 1))
    assert mu / (1 - mu) == pytest.approx((c - 1) / 2)  # the geometric weights' mean age is the window's
    assert accounted_momentum(0.9, (c - 1) / 2) == pytest.approx(max(0.0, 0.9 - (c - 1) / (c + 1)))
    assert accounted_momentum(0.0, (c - 1) / 2) == 0.0
    with pytest.raises(ValueError):
        accounted_momentum(1.0, 0.5)


# ============================================================================ boundaries and rates, c = 2..8
@pytest.mark.parametrize("c", range(2, 9))
def test_at_momentum_09_every_correction_raises_the_stability_boundary(c):
    none = tc.boundary(0.9, tc.window_filter(c))
    assert none < 0.21  # 0.2 at c = 2, 0.032 at c = 8; dgd: 3.8
    look = tc.boundary(0.9, tc.corrected_filter("lookahead", c))
    dc = tc.boundary(0.9, tc.corrected_filter("delay_compensation", c, lam=0.5))
    mom = tc.boundary(tc.momentum_accounting(0.9, c), tc.window_filter(c))
    assert look > 2.3 * none and dc > 1.99 * none and mom > 4.0 * none
    assert max(look, dc, mom) < 3.8 / 4  # none comes within 4x of fresh gradients' boundary


def test_c2_rates_at_momentum_09_lookahead_nearly_restores_momentum_and_accounting_does_not():
    """kappa = 100, best lr at the user's momentum 0.9: e-fold steps fresh 19.0, window 62.0, look-ahead 22.5
    (1.18x fresh), delay compensation (lam = 0.5) 39.8, momentum accounting 56.1."""

    def steps(f, m):
        r, _, _ = tc.best_rate(f, 100.0, momenta=[m])
        return -1.0 / math.log(r)

    fresh = steps(tc.window_filter(1), 0.9)
    none = steps(tc.window_filter(2), 0.9)
    look = steps(tc.corrected_filter("lookahead", 2), 0.9)
    dc = steps(tc.corrected_filter("delay_compensation", 2, lam=0.5), 0.9)
    mom = steps(tc.window_filter(2), tc.momentum_accounting(0.9, 2))
    assert fresh == pytest.approx(19.0, rel=0.02)
    assert none > 3.0 * fresh
    assert look < 1.25 * fresh
    assert look < dc < mom < none


def test_at_c2_momentum_buys_no_rate_the_best_is_gradient_descent_s():
    """Over every (lr, m) of the grid the c = 2 window's best rate is no better than plain gradient descent's
    optimum (kappa - 1) / (kappa + 1), while fresh gradients reach heavy ball's
    (sqrt(kappa) - 1) / (sqrt(kappa) + 1)."""
    kappa = 100.0
    r_window, _, _ = tc.best_rate(tc.window_filter(2), kappa)
    r_fresh, _, _ = tc.best_rate(tc.window_filter(1), kappa)
    assert r_window >= (kappa - 1) / (kappa + 1) - 1e-4
    heavy_ball = (math.sqrt(kappa) - 1) / (math.sqrt(kappa) + 1)
    assert heavy_ball <= r_fresh < heavy_ball + 0.01


# ============================================================ the real scheme + correction code = the recursion
def _run_real(scheme_name, c, a, m, correction, steps=60, lam=None):
    """pgc on identical partitions F_j = x^2 / 2 (h = 1) through StaleCache, encode, decode (float32 payloads, hence
    the 1e-5 tolerances: the filters differ by far more), torch SGD and the
    strategy's StalenessCorrection; returns x_t."""
    n = 4
    scheme = make_scheme(scheme_name, n, c - 1)
    x = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    applied = m
    if correction == "momentum":
        applied = tc.momentum_accounting(m, c)
    opt = torch.optim.SGD([x], lr=a, momentum=applied)
    caches = [StaleCache(scheme.partitions(k), scheme.cache_max_age) for k in range(n)]
    corrections = [StalenessCorrection(correction, (c - 1) / 2, window=c) for _ in range(n)]
    xs = [1.0]
    for t in range(steps):
        codes = {}
        for k in range(n):
            corrections[k].begin_step(t, [x])
            for j in scheme.evaluations(k, t):
                with corrections[k].shifted(t, [x]):
                    g = x.detach().clone()  # grad of x^2 / 2 at the (shifted) parameters
                caches[k].put(j, g, t)
            valid = caches[k].valid(t)
            if lam is not None:  # exact-Hessian compensation: g_v + lam * h * (x_t - x_v)
                valid = {j: gj + lam * (x.detach() - xs[caches[k].versions()[j]]) for j, gj in valid.items()}
            codes[k] = scheme.encode(k, valid)
        received = list(range(n))
        prefix = []
        for k in received:
            prefix.append(k)
            if scheme.admits(prefix):
                break
        x.grad = scheme.decode({k: codes[k] for k in prefix}).to(torch.float64)
        opt.step()
        xs.append(float(x.detach()))
    return np.array(xs)


@pytest.mark.parametrize("scheme_name", ["pgc_cr", "pgc_fr"])
@pytest.mark.parametrize("c", [2, 4])
@pytest.mark.parametrize("m", [0.0, 0.9])
def test_real_scheme_with_lookahead_runs_the_lookahead_recursion(scheme_name, c, m):
    a = 0.05
    xs = _run_real(scheme_name, c, a, m, "lookahead")
    assert np.allclose(xs, tc.simulate(a, m, tc.corrected_filter("lookahead", c), len(xs) - 1), rtol=1e-5, atol=1e-7)
    assert not np.allclose(xs, tc.simulate(a, m, tc.window_filter(c), len(xs) - 1), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("c", [2, 4])
def test_real_scheme_without_correction_and_with_momentum_accounting_run_the_window_recursion(c):
    a = 0.05
    for correction, m in (("none", 0.9), ("momentum", 0.9)):
        xs = _run_real("pgc_cr", c, a, m, correction)
        applied = tc.momentum_accounting(m, c) if correction == "momentum" else m
        assert np.allclose(xs, tc.simulate(a, applied, tc.window_filter(c), len(xs) - 1), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("lam", [0.5, 1.0])
def test_exact_hessian_compensation_runs_the_compensated_recursion(lam):
    a, m, c = 0.05, 0.9, 2
    xs = _run_real("pgc_cr", c, a, m, "none", lam=lam)
    assert np.allclose(
        xs, tc.simulate(a, m, tc.corrected_filter("delay_compensation", c, lam=lam), len(xs) - 1), rtol=1e-5, atol=1e-7
    )


@pytest.mark.parametrize("c", [2, 3])
def test_lookahead_recursion_grows_above_and_decays_below_its_boundary(c):
    f = tc.corrected_filter("lookahead", c)
    a_max = tc.boundary(0.9, f)
    assert abs(tc.simulate(0.95 * a_max, 0.9, f, 3000)[-200:]).max() < 1.0
    assert abs(tc.simulate(1.05 * a_max, 0.9, f, 3000)[-200:]).max() > 1.0


def test_correction_table_rows():
    rows = tc.correction_table(cs=[2], momenta=[0.9], kappa=100.0)
    by = {(r["c"], r["correction"]): r for r in rows}
    assert by[(1, "none")]["boundary"] == pytest.approx(3.8, rel=1e-8)
    assert by[(2, "none")]["boundary"] == pytest.approx(0.2, rel=1e-8)
    assert by[(2, "momentum")]["momentum_applied"] == pytest.approx(0.9 - 1 / 3)
    assert by[(2, "lookahead")]["mean_age"] == pytest.approx(0.0, abs=1e-12)
