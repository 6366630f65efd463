"""The staleness corrections: their tensor math, the optimizer rule, the option checks, and real 4-rank runs."""

from __future__ import annotations

import statistics

import pytest
import torch

import lightning_pgc  # noqa: F401
from lightning_pgc import CodingOptions, PGCStrategy
from lightning_pgc.codes import BoundedScheme, make_scheme
from pgc_lab.experiments import read_result
from lightning_pgc.staleness import (
    StalenessCorrection,
    accounted_momentum,
    default_lookahead,
    delay_compensate,
    nominal_mean_age,
    set_momentum,
)
from tests.jobs import run_job


# ============================================================================================ delay compensation
def test_delay_compensation_is_g_plus_lambda_g_squared_times_the_displacement():
    g = torch.tensor([1.0, -2.0, 0.5])
    d = torch.tensor([0.1, 0.2, -0.4])
    assert torch.allclose(delay_compensate(g, d, 0.04), g + 0.04 * g * g * d)
    assert torch.equal(g, torch.tensor([1.0, -2.0, 0.5]))  # not in place


def test_with_lambda_h_over_g_squared_compensation_recovers_the_fresh_gradient_of_a_quadratic():
    h, x_v, x_t = 3.0, torch.tensor([2.0]), torch.tensor([1.5])
    g_v = h * x_v
    lam = float(h / g_v**2)
    assert torch.allclose(delay_compensate(g_v, x_t - x_v, lam), h * x_t)


def _params(values):
    return [torch.nn.Parameter(torch.tensor(v, dtype=torch.float32)) for v in values]


def test_compensate_corrects_stale_entries_only_keeps_the_tail_and_leaves_the_cache_alone():
    corr = StalenessCorrection("delay_compensation", 0.5, dc_lambda=0.5, window=3)
    params = _params([[0.0, 0.0]])
    corr.begin_step(4, params)
    with torch.no_grad():
        params[0].add_(torch.tensor([1.0, -1.0]))
    corr.begin_step(5, params)
    stale = torch.tensor([2.0, 3.0, 7.0])  # two gradient values, then the loss slot
    fresh = torch.tensor([1.0, 1.0, 9.0])
    out = corr.compensate({0: stale, 1: fresh}, {0: 4, 1: 5}, 5, numel=2)
    assert out[1] is fresh
    assert torch.allclose(out[0], torch.tensor([2.0 + 0.5 * 4 * 1, 3.0 + 0.5 * 9 * -1, 7.0]))
    assert torch.equal(stale, torch.tensor([2.0, 3.0, 7.0]))
    # a version whose parameters were not kept (before a rejoin): sent as it is
    assert corr.compensate({0: stale}, {0: 1}, 5, numel=2)[0] is stale


def test_snapshots_kept_per_correction():
    params = _params([[1.0]])
    for kind, most in (("none", 0), ("momentum", 0), ("lookahead", 2), ("delay_compensation", 4)):
        corr = StalenessCorrection(kind, 1.5, window=4)
        for t in range(10):
            corr.begin_step(t, params)
            assert corr.snapshots <= most
        assert corr.snapshots == most
    corr = StalenessCorrection("delay_compensation", 1.5, window=4)
    for t in (0, 1, 2):
        corr.begin_step(t, params)
    corr.begin_step(1, params)  # back to an earlier version (a resume): newer snapshots are dropped
    assert corr.displacement(1, 0) is not None and corr.displacement(2, 1) is None


# ===================================================================================================== look-ahead
def test_lookahead_shifts_inside_the_block_and_restores_the_parameters_bit_for_bit():
    params = _params([[1.0, 2.0], [3.0]])
    corr = StalenessCorrection("lookahead", 0.5, lookahead=1.5)
    corr.begin_step(0, params)
    with corr.shifted(0, params):  # no previous version: no shift
        assert params[0].tolist() == [1.0, 2.0]
    with torch.no_grad():
        params[0].add_(torch.tensor([0.1, -0.3]))
        params[1].add_(torch.tensor([0.7]))
    before = [p.detach().clone() for p in params]
    corr.begin_step(1, params)
    with corr.shifted(1, params):
        assert torch.allclose(params[0], before[0] + 1.5 * torch.tensor([0.1, -0.3]))
        assert torch.allclose(params[1], before[1] + 1.5 * torch.tensor([0.7]))
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    with pytest.raises(RuntimeError):
        with corr.shifted(1, params):
            raise RuntimeError("a failing training step")
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # restored on errors too


def test_other_corrections_do_not_shift():
    params = _params([[1.0]])
    for kind in ("none", "momentum", "delay_compensation"):
        corr = StalenessCorrection(kind, 0.5)
        corr.begin_step(0, params)
        with torch.no_grad():
            params[0].add_(1.0)
        corr.begin_step(1, params)
        value = params[0].item()
        with corr.shifted(1, params):
            assert params[0].item() == value


# ============================================================================================ momentum accounting
def test_lookahead_extrapolates_by_the_windows_oldest_age_by_default_and_bounded_by_its_mean_age():
    for c in (2, 3, 4):
        scheme = make_scheme("pgc_fr", 12, c - 1)
        assert default_lookahead(scheme) == c - 1
        assert StalenessCorrection.for_fit("lookahead", scheme, []).lookahead == c - 1
        assert StalenessCorrection.for_fit("lookahead", scheme, [], lookahead=0.5).lookahead == 0.5  # given: kept
    assert default_lookahead(make_scheme("pgc_cr", 4, 1)) == 1.0
    assert default_lookahead(BoundedScheme(4, 2, 2)) == nominal_mean_age(BoundedScheme(4, 2, 2)) == 0.25
    assert StalenessCorrection.for_fit("lookahead", BoundedScheme(4, 2, 2), []).lookahead == 0.25
    with pytest.raises(ValueError, match="fresh gradients only"):
        default_lookahead(make_scheme("gc_fr", 4, 1))


def test_nominal_mean_ages():
    assert nominal_mean_age(make_scheme("pgc_cr", 4, 1)) == 0.5
    assert nominal_mean_age(make_scheme("pgc_fr", 4, 3)) == 1.5
    assert nominal_mean_age(make_scheme("pgc_cr_naive", 4, 1)) == 0.5
    assert nominal_mean_age(BoundedScheme(4, 2, 2)) == 0.25  # 3 fresh codes close a version, 1 partition is 1 old
    assert nominal_mean_age(BoundedScheme(4, 2, 3, fresh=1)) == 0.75
    for name, s in (("dgd", 0), ("gc_cr", 1), ("ignore", 1)):
        with pytest.raises(ValueError, match="fresh gradients only"):
            nominal_mean_age(make_scheme(name, 4, s))


def test_set_momentum_on_sgd_and_adam_and_again_after_a_resume():
    w = torch.nn.Parameter(torch.zeros(2))
    sgd = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    assert set_momentum(sgd, 0.5) == [(0.9, pytest.approx(0.9 - 1 / 3))]
    assert sgd.param_groups[0]["momentum"] == pytest.approx(0.9 - 1 / 3)
    # applied again (a resumed fit: the group carries the chosen value in its state dict): not reduced twice
    state = sgd.state_dict()
    again = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    again.load_state_dict(state)
    set_momentum(again, 0.5)
    assert again.param_groups[0]["momentum"] == pytest.approx(0.9 - 1 / 3)
    adam = torch.optim.Adam([w], lr=1e-3, betas=(0.9, 0.999))
    set_momentum(adam, 1.5)  # c = 4: mu = 0.6
    assert adam.param_groups[0]["betas"] == (pytest.approx(0.3), 0.999)
    assert accounted_momentum(0.5, 3.5) == 0.0  # clipped: torch refuses negative momentum


def test_set_momentum_refuses_an_optimizer_without_momentum():
    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="neither 'momentum' nor 'betas'"):
        set_momentum(torch.optim.Adagrad([w], lr=0.1), 0.5)


# =================================================================================================== the option
def test_option_checks():
    for scheme in ("pgc_cr", "pgc_fr", "pgc_cr_naive", "bounded"):
        PGCStrategy(scheme, coding={"staleness_correction": "lookahead", "lookahead_steps": 1.0})
        PGCStrategy(scheme, coding={"staleness_correction": "momentum"})
    PGCStrategy("pgc_fr", coding={"staleness_correction": "delay_compensation", "dc_lambda": 0.1})
    for scheme in ("dgd", "ignore", "gc_fr", "gc_cr"):
        with pytest.raises(ValueError, match="fresh gradients only"):
            PGCStrategy(scheme, stragglers=0 if scheme == "dgd" else 1, coding={"staleness_correction": "lookahead"})
    with pytest.raises(ValueError, match="aggregator reuses"):
        PGCStrategy("bounded", coding={"staleness_correction": "delay_compensation"})
    with pytest.raises(ValueError, match=r"coding\.staleness_correction must be one of"):
        CodingOptions(staleness_correction="dc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"coding\.dc_lambda must be None, or >= 0 with .*'delay_compensation'"):
        PGCStrategy("pgc_cr", coding={"staleness_correction": "lookahead", "dc_lambda": 0.1})
    with pytest.raises(ValueError, match=r"coding\.lookahead_steps"):
        PGCStrategy("pgc_cr", coding={"staleness_correction": "lookahead", "lookahead_steps": -1.0})
    with pytest.raises(TypeError, match=r"coding\.dc_lambda must be float or None"):
        PGCStrategy("pgc_cr", coding={"staleness_correction": "delay_compensation", "dc_lambda": "big"})
    assert PGCStrategy().coding.staleness_correction == "none"


# ============================================================================================== real 4-rank runs
@pytest.mark.parametrize(
    "strategy,kind,slow",
    [
        ("pgc_fr", "momentum", False),
        ("pgc_cr", "lookahead", True),
        ("pgc_fr", "delay_compensation", True),
        ("bounded_staleness", "lookahead", False),
    ],
)
def test_each_correction_on_4_real_ranks_keeps_replicas_identical_and_trains(tmp_path, strategy, kind, slow):
    """With ``slow``, rank 3 sleeps in every step, so it skips versions (applies published aggregates without
    computing) and its look-ahead / compensation works from the parameters it recorded at those versions."""
    job = run_job(
        tmp_path,
        kind,
        strategy=strategy,
        strategy_kwargs={"coding": {"staleness_correction": kind}},
        devices=4,
        max_steps=30,
        lr=0.2 if kind == "momentum" else 0.1,
        check_val_every_n_epoch=100,
        sync_loss=False,
        delay="slowranks(ranks=[3], seconds=0.2)" if slow else "none",
    )
    ranks = job["ranks"]
    assert len({r["checksum"] for r in ranks}) == 1, [r["checksum"][:12] for r in ranks]
    assert all(r["global_step"] == 30 for r in ranks)
    if slow:
        assert ranks[3]["skipped_steps"] >= 1
    losses = [row[2] for row in read_result(job["out"]).curve]
    assert statistics.fmean(losses[-5:]) < statistics.fmean(losses[:5]) - 0.1, losses
