"""The grid's statistics against hand-computed examples and published t tables."""

from __future__ import annotations

import math

import pytest

from pgc_lab.experiments.stats import (
    equal_wall_time,
    paired_bootstrap_interval,
    paired_t_interval,
    t_cdf_two_sided,
    t_quantile,
    time_to_target,
    value_at_wall,
)

# Two-sided critical values of Student's t from printed tables (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2):
# (level, df) -> t
TABLE = {
    (0.95, 1): 12.706,
    (0.95, 2): 4.303,
    (0.95, 3): 3.182,
    (0.95, 4): 2.776,
    (0.95, 5): 2.571,
    (0.95, 9): 2.262,
    (0.95, 19): 2.093,
    (0.95, 29): 2.045,
    (0.90, 4): 2.132,
    (0.90, 9): 1.833,
    (0.99, 4): 4.604,
    (0.99, 9): 3.250,
}


@pytest.mark.parametrize("level,df", sorted(TABLE))
def test_t_quantiles_match_the_tables(level, df):
    assert t_quantile(level, df) == pytest.approx(TABLE[level, df], abs=6e-4)


def test_t_cdf_closed_forms():
    # df = 1 is the Cauchy distribution: P(|T| <= 1) = 2 atan(1) / pi = 1/2
    assert t_cdf_two_sided(1.0, 1) == pytest.approx(0.5)
    # df = 2: P(|T| <= t) = t / sqrt(2 + t^2); at t = sqrt(2): 1/sqrt(2)
    assert t_cdf_two_sided(math.sqrt(2), 2) == pytest.approx(1 / math.sqrt(2))
    # large df tends to the normal: P(|Z| <= 1.959964) = 0.95
    assert t_cdf_two_sided(1.959964, 2001) == pytest.approx(0.95, abs=2e-4)
    assert t_cdf_two_sided(0.0, 7) == 0.0 and t_cdf_two_sided(math.inf, 7) == 1.0
    with pytest.raises(ValueError, match="df"):
        t_cdf_two_sided(1.0, 0)
    with pytest.raises(ValueError, match="level"):
        t_quantile(1.0, 4)


def test_paired_t_interval_of_a_difference_by_hand():
    # 5 seeds: d = x - y = [-1, -0.5, -1, 0, -1.5]; mean -0.8; squared deviations 0.04 + 0.09 + 0.04 + 0.64 +
    # 0.49 = 1.30; variance 1.30 / 4 = 0.325; standard error sqrt(0.325 / 5) = 0.2549510; t(0.95, 4) = 2.7764451;
    # half width 0.7078566 -> [-1.5078566, -0.0921434]: x is smaller, the interval excludes 0.
    x = [10.0, 12.0, 9.0, 11.0, 13.0]
    y = [11.0, 12.5, 10.0, 11.0, 14.5]
    ci = paired_t_interval(x, y)
    assert ci.estimate == pytest.approx(-0.8)
    assert ci.low == pytest.approx(-1.5078566, abs=1e-6) and ci.high == pytest.approx(-0.0921434, abs=1e-6)
    assert ci.excludes_null and ci.seeds == 5 and not ci.ratio
    # unpaired, the seed-to-seed spread (9..14.5) would swamp the 0.8 difference: pairing is what shows it
    assert paired_t_interval(list(reversed(x)), y).low < 0 < paired_t_interval(list(reversed(x)), y).high


def test_paired_t_interval_of_a_ratio_by_hand():
    # ratios x/y = [2, 1/2, 1, 2, 1]; log ratios ln2 * [1, -1, 0, 1, 0]; mean ln2 / 5 = 0.1386294;
    # deviations ln2 * [0.8, -1.2, -0.2, 0.8, -0.2]; sum of squares ln2^2 * 2.8 = 1.3452689; variance 0.3363172;
    # standard error sqrt(0.3363172 / 5) = 0.2593520; half width 2.7764451 * 0.2593520 = 0.7200764;
    # interval exp(0.1386294 -/+ 0.7200764) = [0.5590888, 2.3601043]; estimate 2^(1/5) = 1.1486984.
    x = [2.0, 1.0, 3.0, 4.0, 5.0]
    y = [1.0, 2.0, 3.0, 2.0, 5.0]
    ci = paired_t_interval(x, y, ratio=True)
    assert ci.estimate == pytest.approx(2**0.2)
    assert ci.low == pytest.approx(0.5590888, rel=1e-6) and ci.high == pytest.approx(2.3601043, rel=1e-6)
    assert ci.ratio and not ci.excludes_null


def test_bootstrap_is_deterministic_and_narrower_than_t_at_five_seeds():
    x = [10.0, 12.0, 9.0, 11.0, 13.0]
    y = [11.0, 12.5, 10.0, 11.0, 14.5]
    a = paired_bootstrap_interval(x, y, seed=3)
    assert a == paired_bootstrap_interval(x, y, seed=3)
    assert a.estimate == pytest.approx(-0.8)
    # bootstrap means of 5 resampled differences lie within [min d, max d] = [-1.5, 0]
    assert -1.5 <= a.low < -0.8 < a.high <= 0.0
    t = paired_t_interval(x, y)
    assert t.high - t.low > a.high - a.low  # the t interval accounts for the few seeds (see the module doc)
    r = paired_bootstrap_interval([2.0, 4.0, 8.0], [1.0, 2.0, 4.0], ratio=True)  # every ratio is exactly 2
    assert r.low == pytest.approx(2.0) and r.high == pytest.approx(2.0)


def test_paired_inputs_are_checked():
    with pytest.raises(ValueError, match="one value per seed"):
        paired_t_interval([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="at least 2"):
        paired_t_interval([1.0], [1.0])
    with pytest.raises(ValueError, match="finite"):
        paired_t_interval([1.0, float("nan")], [1.0, 2.0])
    with pytest.raises(ValueError, match="positive"):
        paired_t_interval([1.0, 0.0], [1.0, 2.0], ratio=True)


def test_time_to_target_interpolates_between_evaluations():
    # validation loss 2.0 at 0 s, 1.0 at 10 s, 0.5 at 20 s: it reaches 0.8 at 10 + 10 * (1.0-0.8)/(1.0-0.5) = 14 s
    walls, losses = [0.0, 10.0, 20.0], [2.0, 1.0, 0.5]
    assert time_to_target(walls, losses, 0.8) == pytest.approx(14.0)
    assert time_to_target(walls, losses, 2.5) == 0.0  # already there at the first evaluation
    assert time_to_target(walls, losses, 0.4) is None  # never reached
    with pytest.raises(ValueError, match="length"):
        time_to_target(walls, losses[:2], 1.0)


def test_accuracy_at_equal_wall_time():
    # two runs end at 30 s and 24 s: both are compared at 24 s; run A's accuracy 0.5 at 20 s, 0.7 at 30 s -> 0.5 + 0.2 * 4/10 = 0.58
    assert equal_wall_time([30.0, 24.0]) == 24.0
    assert value_at_wall([0.0, 20.0, 30.0], [0.1, 0.5, 0.7], 24.0) == pytest.approx(0.58)
    assert value_at_wall([0.0, 20.0], [0.1, 0.5], 24.0) is None
    with pytest.raises(ValueError):
        equal_wall_time([])
