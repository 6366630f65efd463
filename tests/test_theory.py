"""What the convergence theory assumes, checked exactly: the review's objections on the real codes API, the
bounded-staleness mechanism checks on a quadratic, the exact error decomposition, the in-run machinery and the safety valve.

Pure math first (fast, exhaustive on small cases), then single-process Lightning checks of the callbacks, then ONE
real 4-process job (the in-run estimates are logged and consistent, replicas stay identical with the valve on).
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pgc.theory import quadratic as th
from lightning_pgc.callbacks import StalenessValve
from lightning_pgc.callbacks.probe import loss_gradient, swapped_params
from lightning_pgc.codes import SCHEMES, StaleCache, make_scheme

ROOT = Path(__file__).resolve().parents[1]


def _configs(max_n: int = 5):
    """Every valid (scheme, n, s) with n <= max_n."""
    for name in SCHEMES:
        for n in range(2, max_n + 1):
            for s in range(n):
                try:
                    yield make_scheme(name, n, s)
                except ValueError:
                    continue


def _decode_by_coordinator(scheme, order, codes):
    """What the coordinator does with arrival ``order``: decode the shortest prefix the scheme admits."""
    prefix = []
    for k in order:
        prefix.append(k)
        if scheme.admits(prefix):
            break
    return scheme.decode({k: codes[k] for k in prefix})


def _random_stale_copies(scheme, rng, d=3, t=10):
    """Every rank caches each held partition at a random version in [t-3, t]; random mini-batch / full gradients."""
    versions = {k: {j: int(t - rng.integers(0, 4)) for j in scheme.partitions(k)} for k in range(scheme.n)}
    keys = {(j, v) for vs in versions.values() for j, v in vs.items()} | {(j, t) for j in range(scheme.n)}
    minibatch = {key: torch.tensor(rng.normal(size=d)) for key in keys}
    full = {key: torch.tensor(rng.normal(size=d)) for key in keys}
    return versions, minibatch, full


# ============================================================================== review, Lemma 3: subset estimator
def test_lemma3_counterexample_of_the_review_on_pgc_cr_coefficients():
    scheme = make_scheme("pgc_cr", 3, 1)  # c = 2
    patterns = th.received_patterns(scheme)
    assert sorted(r for _, r in patterns) == [(0, 1), (0, 2), (1, 2)]  # every received set of n - s = 2 ranks
    probs, weights = th.pattern_rank_weights(scheme, patterns)
    assert np.allclose(weights[weights != 0], 1 / 4)  # mu / n = 1 / ((n - s) c)

    # The review's numbers: the three workers' coded gradients are (0, 1, 2) (i.e. partition gradients
    # (1/2, -1/2, 3/2), since f_k = g_k + g_(k+1)): E|g_hat|^2 = 7/24 > |g_bar|^2 = 1/4.
    g = {(0, 0): torch.tensor([0.5]), (1, 0): torch.tensor([-0.5]), (2, 0): torch.tensor([1.5])}
    versions = {k: {j: 0 for j in scheme.partitions(k)} for k in range(3)}
    codes = th.codes_from_copies(scheme, versions, g)
    assert codes.reshape(-1).tolist() == [0.0, 1.0, 2.0]
    g_bar = th.weighted_copy_sum(th.reference_copy_weights(scheme), versions, g)
    m = th.subset_moments(codes, g_bar, probs, weights)
    assert m.mean_sq == pytest.approx(7 / 24, abs=1e-15)
    assert m.reference_sq == pytest.approx(1 / 4, abs=1e-15)
    assert m.bias_sq == pytest.approx(0, abs=1e-15)  # unbiased over uniform received sets ...
    assert m.variance == pytest.approx(1 / 24, abs=1e-15)  # ... but with extra variance, which Lemma 3 drops
    assert m.lemma3_gap == pytest.approx(1 / 24, abs=1e-15)

    # Read literally (partition gradients 0, 1, 2): 25/24 vs 1, the same extra variance 1/24.
    g = {(j, 0): torch.tensor([float(j)]) for j in range(3)}
    codes = th.codes_from_copies(scheme, versions, g)
    g_bar = th.weighted_copy_sum(th.reference_copy_weights(scheme), versions, g)
    m = th.subset_moments(codes, g_bar, probs, weights)
    assert (m.mean_sq, m.reference_sq, m.variance) == pytest.approx((25 / 24, 1.0, 1 / 24), abs=1e-15)

    # Brute force over the three received sets with the real decoder.
    values = [float(scheme.decode({k: codes[k] for k in r})) for _, r in patterns]
    assert sorted(values) == pytest.approx([0.75, 1.0, 1.25])
    assert np.mean(np.square(values)) == pytest.approx(25 / 24)


@pytest.mark.parametrize("scheme", list(_configs(5)), ids=repr)
def test_subset_moments_equal_brute_force_over_every_arrival_order(scheme):
    """received_patterns + subset_moments == the coordinator's decode averaged over all n! arrival orders."""
    rng = np.random.default_rng(scheme.n * 10 + scheme.s)
    n = scheme.n
    versions, minibatch, _ = _random_stale_copies(scheme, rng)
    if not scheme.pipelined and scheme.name != "pgc_cr_naive":
        versions = {k: {j: 10 for j in scheme.partitions(k)} for k in range(n)}  # fresh schemes: one version
    codes = th.codes_from_copies(scheme, versions, minibatch)
    g_bar = th.weighted_copy_sum(th.reference_copy_weights(scheme), versions, minibatch)
    moments = th.subset_moments(codes, g_bar, *th.pattern_rank_weights(scheme, th.received_patterns(scheme)))
    outs = torch.stack([_decode_by_coordinator(scheme, order, codes) for order in itertools.permutations(range(n))])
    mean = outs.mean(dim=0)
    assert moments.mean_sq == pytest.approx(float(outs.pow(2).sum(dim=1).mean()), rel=1e-10, abs=1e-12)
    assert moments.mse == pytest.approx(float((outs - g_bar).pow(2).sum(dim=1).mean()), rel=1e-10, abs=1e-12)
    assert moments.bias_sq == pytest.approx(float((mean - g_bar).pow(2).sum()), rel=1e-9, abs=1e-12)
    assert moments.variance == pytest.approx(float((outs - mean).pow(2).sum(dim=1).mean()), rel=1e-9, abs=1e-12)
    if scheme.name in ("pgc_cr", "pgc_fr", "ignore", "dgd", "gc_fr", "gc_cr"):
        # The all-rank average is the estimator's mean under exchangeable arrivals, even with stale copies.
        assert moments.bias_sq == pytest.approx(0.0, abs=1e-12)
    if scheme.name in ("dgd", "gc_fr", "gc_cr"):  # exact schemes: no subset error at all
        assert moments.mse == pytest.approx(0.0, abs=1e-12)


def test_naive_pgc_cr_is_biased_with_stale_copies():
    scheme = make_scheme("pgc_cr_naive", 4, 1)
    rng = np.random.default_rng(3)
    versions, minibatch, _ = _random_stale_copies(scheme, rng)
    codes = th.codes_from_copies(scheme, versions, minibatch)
    g_bar = th.weighted_copy_sum(th.reference_copy_weights(scheme), versions, minibatch)
    m = th.subset_moments(codes, g_bar, *th.pattern_rank_weights(scheme, th.received_patterns(scheme)))
    assert m.bias_sq > 1e-3 * m.reference_sq


def test_received_patterns_sample_when_there_are_too_many():
    scheme = make_scheme("pgc_cr", 12, 5)
    patterns = th.received_patterns(scheme, max_patterns=100, seed=1)
    assert len(patterns) == 100 and all(len(set(r)) == 7 for _, r in patterns)
    assert sum(p for p, _ in patterns) == pytest.approx(1.0)
    fr = make_scheme("pgc_fr", 6, 2)
    assert len(th.received_patterns(fr)) == 9  # 2 groups of c = 3 ranks: 3 x 3 first arrivals


# ======================================================================================= coefficients and caches
@pytest.mark.parametrize("scheme", list(_configs(6)), ids=repr)
def test_copy_weights_equal_the_schemes_copy_coefficients(scheme):
    for _, received in th.received_patterns(scheme):
        W = th.copy_weights(scheme, received)
        assert torch.allclose(W, scheme.copy_coefficients(list(received)), rtol=1e-6, atol=1e-12)
    ref = th.reference_copy_weights(scheme)
    assert torch.allclose(ref.sum(dim=0), torch.full((scheme.n,), 1 / scheme.n, dtype=torch.float64))
    if scheme.name == "pgc_cr":  # the all-rank average is the pgc_cr decode with every rank received
        assert torch.allclose(ref, scheme.copy_coefficients(list(range(scheme.n))), rtol=0, atol=1e-15)


@pytest.mark.parametrize("name", ["pgc_fr", "pgc_cr"])
def test_code_weights_of_partial_caches_carry_the_c_over_m_rescale(name):
    scheme = make_scheme(name, 6, 2)  # c = 3
    held = scheme.partitions(1)
    assert th.code_weights(scheme, 1, held[:1]) == pytest.approx({held[0]: 3.0})
    assert th.code_weights(scheme, 1, held[:2]) == pytest.approx({held[0]: 1.5, held[1]: 1.5})
    g = {j: torch.randn(5) for j in held[:2]}
    code = scheme.encode(1, g)
    w = th.code_weights(scheme, 1, held[:2])
    assert torch.allclose(code, sum(w[j] * g[j] for j in g), atol=1e-6)


@pytest.mark.parametrize(
    "name, n, s, warmup",
    [
        (name, n, s, warmup)
        for name, n, s in [
            ("pgc_fr", 4, 1),
            ("pgc_fr", 6, 2),
            ("pgc_cr", 4, 1),
            ("pgc_cr", 5, 3),
            ("pgc_cr_naive", 4, 1),
            ("gc_cr", 4, 1),
            ("dgd", 3, 0),
        ]
        for warmup in ("full", "gradual")
        if not (name == "pgc_cr_naive" and warmup == "gradual")  # refused by make_scheme (tested in test_codes)
    ],
)
def test_nominal_cache_versions_match_a_stale_cache_pipeline(name, n, s, warmup):
    scheme = make_scheme(name, n, s, warmup=warmup)
    for start in (0, 3):
        caches = [StaleCache(scheme.partitions(k), scheme.cache_max_age) for k in range(n)]
        for t in range(start, start + 3 * scheme.c + 2):
            for k in range(n):
                for j in scheme.evaluations(k, t, start=start):
                    caches[k].put(j, torch.zeros(1), t)
                expected = {j: v for j, v in caches[k].versions().items() if j in caches[k].valid(t)}
                assert th.nominal_cache_versions(scheme, k, t, start) == expected


@pytest.mark.parametrize("warmup", ["full", "gradual"])
@pytest.mark.parametrize("name, n, s", [("pgc_fr", 4, 1), ("pgc_fr", 6, 2), ("pgc_cr", 4, 1), ("pgc_cr", 5, 3)])
def test_versions_from_reported_ages_of_a_rank_that_skips_steps(name, n, s, warmup):
    """A rank that fell behind skips steps (Invariant 3); its code reports only ages: recover the partitions."""
    scheme = make_scheme(name, n, s, warmup=warmup)
    rng = np.random.default_rng(n + s)
    for k in range(n):
        cache = StaleCache(scheme.partitions(k), scheme.cache_max_age)
        for t in range(40):
            if t > 0 and rng.random() < 0.4:
                continue  # skipped: applied the published aggregate without computing
            for j in scheme.evaluations(k, t, start=0):
                cache.put(j, torch.zeros(1), t)
            valid = cache.valid(t)
            truth = {j: v for j, v in cache.versions().items() if j in valid}
            ages = tuple(t - v for v in truth.values())  # what the strategy puts in the header (held order)
            assert th.versions_from_ages(scheme, k, t, ages, 0) == truth
    assert th.versions_from_ages(scheme, 0, 10, (0, 0, 0, 0, 0), 0) is None  # inconsistent report


# ================================================================================ the exact error decomposition
@pytest.mark.parametrize("scheme", list(_configs(5)), ids=repr)
def test_error_decomposition_sums_to_the_total_for_every_received_set(scheme):
    rng = np.random.default_rng(7 + scheme.n)
    n, t = scheme.n, 10
    versions, minibatch, full = _random_stale_copies(scheme, rng)
    grad_now = torch.stack([full[(j, t)] for j in range(n)]).mean(dim=0)
    ref = th.reference_copy_weights(scheme)
    for _, received in th.received_patterns(scheme):
        W = th.copy_weights(scheme, received)
        g_hat = th.weighted_copy_sum(W, versions, minibatch)
        codes = th.codes_from_copies(scheme, versions, minibatch)
        assert torch.allclose(g_hat, scheme.decode({k: codes[k] for k in received}), atol=1e-12)
        dec = th.decompose_error(g_hat, ref, versions, minibatch, full, grad_now)
        assert torch.allclose(dec.subset + dec.sampling + dec.staleness, dec.total, atol=1e-13, rtol=0)
        assert dec.residual < 1e-13
        sq, cross = dec.squared_norms(), dec.cross_terms()
        assert sq["total"] == pytest.approx(
            sq["subset"] + sq["sampling"] + sq["staleness"] + sum(cross.values()), rel=1e-12, abs=1e-12
        )


def test_error_decomposition_terms_vanish_when_their_cause_does():
    scheme = make_scheme("pgc_cr", 5, 2)
    rng = np.random.default_rng(0)
    n, t = 5, 10
    versions, minibatch, full = _random_stale_copies(scheme, rng)
    ref = th.reference_copy_weights(scheme)
    grad_now = torch.stack([full[(j, t)] for j in range(n)]).mean(dim=0)
    everyone = th.weighted_copy_sum(th.copy_weights(scheme, list(range(n))), versions, minibatch)
    assert th.decompose_error(everyone, ref, versions, minibatch, full, grad_now).subset.abs().max() < 1e-15
    exact = th.decompose_error(everyone, ref, versions, full, full, grad_now)  # mini-batch == full gradient
    assert exact.sampling.abs().max() == 0
    fresh = {k: {j: t for j in vs} for k, vs in versions.items()}
    dec = th.decompose_error(everyone, ref, fresh, minibatch, full, grad_now)
    assert dec.staleness.abs().max() < 1e-15


# ===================================================================== review, Lemma 1 (staleness differs by partition)
def test_lemma1_identity_fails_when_staleness_differs_between_partitions():
    """pgc_fr, n = c = 2, identical partitions and exact gradients (every assumption of the paper holds)."""
    scheme = make_scheme("pgc_fr", 2, 1)
    H = torch.tensor([[1.0, 0.3], [0.3, 0.5]], dtype=torch.float64)
    b = torch.tensor([[1.0, -1.0], [1.0, -1.0]], dtype=torch.float64)
    run = th.simulate_pgc_quadratic(scheme, H, b, eta=0.3, steps=6, beta0=[3.0, 2.0])
    t = 5
    (k,) = run.received[t]
    stale = run.versions[t][k]
    assert sorted(stale.values()) == [t - 1, t]  # one fresh and one stale partition in the code
    g_hat, grad_t = run.aggregates[t], run.grad_F(t)
    lhs = run.sq(grad_t - g_hat)
    rhs_by_age = {}
    for i, v in stale.items():  # the lemma's right-hand side for either choice of the index i
        rhs = run.sq(grad_t - run.grad_F(v)) - run.sq(run.grad_F(v)) + run.sq(g_hat)
        assert abs(lhs - rhs) > 0.1 * lhs, (i, lhs, rhs)
        rhs_by_age[t - v] = rhs
    # the values docs/results/theory.md quotes: LHS 0.00858, RHS -0.0398 (i = stale) and 0.0570 (i = fresh)
    assert float(lhs) == pytest.approx(0.00858, abs=5e-6)
    assert float(rhs_by_age[1]) == pytest.approx(-0.0398, abs=5e-5)
    assert float(rhs_by_age[0]) == pytest.approx(0.0570, abs=5e-5)
    # What does hold (sigma = 0): g_hat is the mean of the partitions' gradients at their own versions.
    m = sum(run.grad_F(v) for v in stale.values()) / 2
    assert torch.allclose(run.mean(g_hat), run.mean(m), atol=1e-12)
    assert lhs == pytest.approx(run.sq(grad_t - m), rel=1e-12)


def test_lemma1_identity_holds_when_every_partition_has_the_same_staleness():
    """Sanity check of the test above: with fresh gradients (gc_fr) the identity holds, noise included (exact)."""
    scheme = make_scheme("gc_fr", 2, 1)
    run = th.simulate_pgc_quadratic(scheme, [[1.0]], [[0.5], [0.5]], eta=0.3, steps=5, sigma=0.7, beta0=[2.0])
    t = 4
    g_hat, grad_t = run.aggregates[t], run.grad_F(t)
    lhs = run.sq(grad_t - g_hat)
    rhs = run.sq(grad_t - run.grad_F(t)) - run.sq(run.grad_F(t)) + run.sq(g_hat)
    assert lhs == pytest.approx(rhs, rel=1e-12)


# ======================================================================= review, Lemma 4 (same-partition copies)
def _copy_pair(run, t, j):
    (va, ga), (vb, gb) = [(run.versions[t][k][j], run.copies[t][k][j]) for k in (0, 1)]
    return va, ga, vb, gb


def test_lemma4_same_partition_copies_on_a_quadratic_with_n_equal_c_equal_2():
    scheme = make_scheme("pgc_cr", 2, 1)
    t, eta, sigma = 39, 0.5, 1.0
    # Fresh independent mini-batches, identical partitions: the paper's best case.
    run = th.simulate_pgc_quadratic(scheme, 1.0, [[0.0], [0.0]], eta, t + 1, sigma=sigma, beta0=[1.0])
    covs = []
    parts = []
    for j in range(2):
        va, ga, vb, gb = _copy_pair(run, t, j)
        assert {va, vb} == {t, t - 1}  # the two copies: one fresh, one a step old
        fresh, stale = (ga, gb) if va == t else (gb, ga)
        # covariance of the two copies = the shared trajectory's + the fresh iterate's with the stale copy's noise
        trajectory = run.cov(run.betas[t], run.betas[t - 1])
        moved = run.cov(run.betas[t], stale - run.betas[t - 1])
        assert run.cov(fresh, stale) == pytest.approx(trajectory + moved, abs=1e-12)
        parts.append((round(float(trajectory), 12), round(float(moved), 12)))
        # The raw copies can be correlated through the shared trajectory (beta_t and beta_(t-1) carry the same
        # earlier noise; for one partition beta_t also moved against the stale copy's noise, which cancels it) ...
        corr = run.cov(ga, gb) / math.sqrt(run.cov(ga, ga) * run.cov(gb, gb))
        covs.append(corr)
        # ... but their noise about grad F(beta_v) is uncorrelated: Lemma 4's cross terms do vanish here.
        assert run.inner(ga - run.grad_F(va), gb - run.grad_F(vb)) == pytest.approx(0.0, abs=1e-15)
    assert max(abs(c) for c in covs) > 0.15  # exact: 0.1875 for one partition with eta = 0.5
    # docs/results/theory.md: the 0.1875 is all trajectory (0.25, the stale noise 0); for the other partition beta_t moved
    # against the stale copy's noise (-0.25), which cancels the trajectory term
    assert sorted(parts) == [(0.25, -0.25), (0.25, 0.0)]
    assert sorted(round(float(c), 12) for c in covs) == [0.0, 0.1875]
    # Heterogeneous partitions (non-iid data): both copies err by the same H (b_bar - b_j): cross terms do not vanish.
    run = th.simulate_pgc_quadratic(scheme, 1.0, [[1.0], [-1.0]], eta, t + 1, sigma=sigma, beta0=[1.0])
    va, ga, vb, gb = _copy_pair(run, t, 0)
    assert run.inner(ga - run.grad_F(va), gb - run.grad_F(vb)) == pytest.approx(1.0, rel=1e-12)
    # Copies computed on the same data (a fixed partition sample): their noise is the same draw.
    run = th.simulate_pgc_quadratic(scheme, 1.0, [[0.0], [0.0]], eta, t + 1, sigma=sigma, beta0=[1.0], noise="shared")
    va, ga, vb, gb = _copy_pair(run, t, 0)
    assert run.inner(ga - run.grad_F(va), gb - run.grad_F(vb)) == pytest.approx(sigma**2, rel=1e-12)


def test_lemma4_covariance_agrees_with_monte_carlo():
    """The affine-exact covariance of the simulator against an independent sampled simulation of the same system."""
    scheme = make_scheme("pgc_cr", 2, 1)
    eta, T, runs = 0.5, 12, 40000
    run = th.simulate_pgc_quadratic(scheme, 1.0, [[0.0], [0.0]], eta, T, sigma=1.0, beta0=[1.0])
    exact = {j: run.cov(run.copies[T - 1][0][j], run.copies[T - 1][1][j]) for j in range(2)}
    rng = np.random.default_rng(0)
    beta = [np.ones(runs)]
    cache = {k: {} for k in range(2)}  # rank -> partition -> gradient samples
    for t in range(T):
        for k in range(2):
            parts = (0, 1) if t == 0 else ((k + t) % 2,)  # full warm-up, then the CR rotation
            for j in parts:
                cache[k][j] = beta[t] + rng.standard_normal(runs)  # h = 1, b_j = 0
        if t == T - 1:
            break
        g_hat = (cache[0][0] + cache[0][1]) / 2  # rank 0 arrives first; w = mu / n = 1 / ((n - s) c)
        beta.append(beta[t] - eta * g_hat)
    for j in range(2):
        mc = float(np.cov(cache[0][j], cache[1][j])[0, 1])
        assert mc == pytest.approx(exact[j], abs=0.02)


def test_copy_statistics_on_a_hand_made_case():
    # One partition with two copies at versions 4 and 5 (and one more partition with a single copy).
    W = torch.tensor([[0.25, 0.0], [0.25, 0.5]], dtype=torch.float64)
    versions = {0: {0: 4}, 1: {0: 5, 1: 5}}
    e = torch.tensor([1.0, 0.0], dtype=torch.float64)
    objective = {4: torch.zeros(2, dtype=torch.float64), 5: torch.zeros(2, dtype=torch.float64)}
    minibatch = {(0, 4): e, (0, 5): e.clone(), (1, 5): torch.tensor([0.0, 1.0], dtype=torch.float64)}
    full = {key: torch.zeros(2, dtype=torch.float64) for key in minibatch}
    stats = th.copy_statistics(W, versions, minibatch, full, objective)
    assert stats["copy_cos"] == pytest.approx(1.0)
    assert stats["copy_noise_corr"] == pytest.approx(1.0)
    # cross 2 * 1/4 * 1/4 * 1 against the diagonal 1/16 + 1/16 + 1/4
    assert stats["lemma4_cross_ratio"] == pytest.approx((2 / 16) / (1 / 16 + 1 / 16 + 1 / 4))
    xi = th.xi_hat({1: versions[1]}, minibatch, full, {5: torch.tensor([1.0, 1.0], dtype=torch.float64)})
    assert xi["xi"] == pytest.approx((1 + 1) / (2 + 2))
    assert xi["xi_within"] == pytest.approx((1 + 1) / (2 + 2))
    assert th.gamma_hat(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0])) == pytest.approx(1.0)


# ==================================================== bounded staleness: delayed-gradient stability and delay^2
@pytest.mark.parametrize("tau", range(9))
def test_delayed_gradient_stability_boundary_matches_theory(tau):
    theory_a = th.pure_delay_threshold(tau)
    weights = np.eye(tau + 1)[tau]
    assert th.stability_threshold(weights) == pytest.approx(theory_a, rel=1e-9)
    assert th.simulated_threshold(weights, steps=3000) == pytest.approx(theory_a, rel=1e-3)  # the method states 0.08 %
    # Just below the boundary a run decays; just above it grows.
    assert abs(th.simulate_delayed(0.97 * theory_a, weights, 3000)[-200:]).max() < 1.0
    assert abs(th.simulate_delayed(1.03 * theory_a, weights, 3000)[-200:]).max() > 1.0


@pytest.mark.parametrize("c", [2, 3, 4])
def test_the_pgc_pipeline_is_the_averaged_delay_recursion_and_has_its_boundary(c):
    """On identical partitions every pgc_cr code holds one gradient of each age 0..c-1, so the real scheme runs
    x_{t+1} = x_t - (a/c) sum_{d<c} x_{t-d}: stable up to stability_threshold(1/c, ..., 1/c), well above the
    pure delay c-1 boundary."""
    scheme = make_scheme("pgc_cr", 4, c - 1)
    weights = np.full(c, 1.0 / c)
    boundary = th.stability_threshold(weights)
    assert boundary > 1.5 * th.pure_delay_threshold(c - 1)
    for a, grows in ((0.95 * boundary, False), (1.05 * boundary, True)):
        run = th.simulate_pgc_quadratic(scheme, 1.0, np.zeros((4, 1)), eta=a, steps=300, beta0=[1.0])
        xs = np.array([float(beta[0, 0]) for beta in run.betas])
        assert np.allclose(xs, th.simulate_delayed(a, weights, 300), rtol=1e-9, atol=1e-12)
        assert (abs(xs[-50:]).max() > 1.0) == grows


def test_staleness_error_grows_as_delay_squared_and_the_lipschitz_bound_is_tight():
    H = np.diag([1.0, 0.05])
    delays = np.arange(1, 9)
    err, bound = th.staleness_error_curve(H, eta=0.002, delays=delays, t=400, beta0=[1.0, 1.0])
    assert th.loglog_slope(delays, err) == pytest.approx(2.0, abs=0.02)
    assert err[-1] / err[0] == pytest.approx(64, rel=0.03)
    assert np.all(err <= bound * (1 + 1e-12))
    err1, bound1 = th.staleness_error_curve(H, eta=0.002, delays=delays, t=400, beta0=[1.0, 0.0])  # top eigenvector
    assert np.allclose(err1, bound1, rtol=1e-12)


# ===================================================================== the callbacks in one process (no collectives)
class _Tiny(pl.LightningModule):
    """BatchNorm (buffers) and dropout (RNG): whatever a measurement could disturb."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def _tiny_data(n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def _fit(callbacks, steps: int = 24, lr: float = 0.5):
    pl.seed_everything(0, verbose=False)
    model = _Tiny(lr)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, DataLoader(_tiny_data(), batch_size=16, shuffle=True))
    return model, trainer


def test_measurements_leave_no_trace_on_params_buffers_grads_and_rng():
    pl.seed_everything(1, verbose=False)
    model = _Tiny()
    model.train()
    x, y = _tiny_data(32).tensors
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    params = [p.detach().clone() for p in model.parameters()]
    buffers = [b.detach().clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    other = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()]) * 0.5
    with swapped_params(list(model.parameters()), other):
        g_other = loss_gradient(model, (x, y))
    g = loss_gradient(model, (x, y))
    assert not torch.equal(g, g_other)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert all(torch.equal(b, q) for b, q in zip(model.buffers(), buffers))
    assert all(torch.equal(p.grad, torch.full_like(p, 0.25)) for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(loss_gradient(model, (x, y)), g)  # deterministic (dropout under a forked RNG)


def test_valve_lowers_the_lr_and_otherwise_leaves_training_unchanged():
    plain, _ = _fit([])
    watched, _ = _fit([StalenessValve(threshold=0.0, action="warn", staleness=2, check_every_n_steps=5)])
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), watched.parameters()))  # warn: no effect

    valve = StalenessValve(threshold=0.0, factor=0.5, staleness=2, check_every_n_steps=5, min_scale=0.25)
    with pytest.warns(UserWarning, match="staleness valve"):
        _, trainer = _fit([valve])
    assert [e["step"] for e in valve.events] == [5.0, 10.0]  # checks at 5, 10, 15, 20; floor 0.25 after two
    assert len(valve.history) == 4 and all(h["ratio"] > 0 and math.isfinite(h["ratio"]) for h in valve.history)
    assert valve.scale == 0.25 and valve.final_lrs == [0.5 * 0.25]
    restored = StalenessValve()
    restored.load_state_dict(valve.state_dict())
    assert restored.scale == 0.25 and restored.events == valve.events

    recovering = StalenessValve(threshold=1e9, recover_below=1e8, staleness=2, check_every_n_steps=5)
    recovering.scale = 0.5  # e.g. restored from a checkpoint
    _fit([recovering])
    assert recovering.scale == 1.0

    inert = StalenessValve(threshold=0.0)  # max_staleness = 0 outside PGC: nothing to measure
    _fit([inert], steps=8)
    assert inert.history == [] and inert.scale == 1.0


def test_valve_arguments_are_checked():
    for kwargs in (
        {"factor": 1.0},
        {"threshold": -1},
        {"check_every_n_steps": 0},
        {"min_scale": 0},
        {"action": "stop"},
        {"recover_below": 2.0, "threshold": 1.0},
        {"staleness": -1},
    ):
        with pytest.raises(ValueError):
            StalenessValve(**kwargs)


def test_theory_measurement_refuses_a_staleness_correction_it_does_not_model():
    """The theory's decomposition is the uncorrected schemes': under a correction (the registered ``pgc`` runs
    look-ahead) the callback refuses to start instead of logging a reconstruction that cannot match."""
    from types import SimpleNamespace

    from lightning_pgc import CodingOptions, PGCDiagnostics

    module = torch.nn.Linear(2, 1)
    for correction in ("lookahead", "momentum"):
        coding = CodingOptions(staleness_correction=correction)
        trainer = SimpleNamespace(strategy=SimpleNamespace(scheme=None, coding=coding))
        with pytest.raises(ValueError, match="strategy='pgc_cr'"):
            PGCDiagnostics(theory_every_n_steps=5).on_train_start(trainer, module)
    coding = CodingOptions(staleness_correction="lookahead")
    trainer = SimpleNamespace(strategy=SimpleNamespace(scheme=None, coding=coding))
    PGCDiagnostics().on_train_start(trainer, module)  # the diagnostics without the theory still run


# ============================================================================== one real 4-process job (< 60 s)
def test_in_run_theory_estimates_and_valve_on_a_real_4_process_job(tmp_path):
    sys.path.insert(0, str(ROOT))
    from tests.jobs import run_job

    job = run_job(
        tmp_path,
        "theory",
        timeout=240,
        strategy="pgc_cr",
        devices=4,
        max_steps=20,
        batch_size=16,
        lr=0.05,
        delay="lognormal(median=0.003, sigma=1.0)",
        check_val_every_n_epoch=100,
        diagnostics={"every_n_steps": 5, "theory_every_n_steps": 5},
        valve={"threshold": 0.0, "factor": 0.5, "check_every_n_steps": 5, "min_scale": 0.25},
    )
    # Replicas bit-identical with the valve acting, and every rank took the same decisions at the same steps.
    assert len({r["checksum"] for r in job["ranks"]}) == 1
    assert all(r["global_step"] == 20 for r in job["ranks"])
    valves = job["valves"]
    assert [e["step"] for e in valves[0]["events"]] == [5.0, 10.0]
    for v in valves[1:]:
        assert v["events"] == valves[0]["events"] and v["checks"] == valves[0]["checks"]  # bit-equal floats
        assert v["final_lrs"] == valves[0]["final_lrs"] == [0.05 * 0.25]

    rows = [h for h in job["summary"]["diagnostics"] if "pgc/theory/total_sq" in h]
    assert [int(h["step"]) for h in rows] == [0, 5, 10, 15]
    for h in rows:
        theory = {k: v for k, v in h.items() if k.startswith("pgc/theory/")}
        assert all(math.isfinite(v) for v in theory.values()), theory
        assert theory["pgc/theory/decomp_residual"] < 1e-9
        assert theory["pgc/theory/recon_residual"] < 1e-5  # rank 0 recomputed the aggregate from the copies
        parts = sum(theory[f"pgc/theory/{k}_sq"] for k in ("subset", "sampling", "staleness"))
        cross = sum(v for k, v in theory.items() if k.startswith("pgc/theory/cross_"))
        assert theory["pgc/theory/total_sq"] == pytest.approx(parts + cross, rel=1e-9)
        assert theory["pgc/theory/xi_hat"] > 0 and theory["pgc/theory/gamma_hat"] >= 0
        assert theory["pgc/theory/lemma3_mean_sq"] >= theory["pgc/theory/lemma3_ref_sq"] - 1e-12
        if theory["pgc/theory/partial_caches"] == 0:  # (a rank that skipped steps sends a rescaled partial code)
            assert theory["pgc/theory/subset_bias_uniform"] == pytest.approx(0.0, abs=1e-12)
    later = rows[1:]
    assert all(h["pgc/theory/oldest_age"] == 1.0 and h["pgc/theory/gamma_hat"] > 0 for h in later)
    assert all("pgc/theory/copy_noise_corr" in h for h in later)
