"""scheme="auto" detects a slowness in a few versions and does not flap: its rule (pure) on synthetic per-rank time
sequences (:mod:`pgc_lab.auto_scenarios`), several seeds, numbers of ranks and slowdown factors, with the shipped
factor table. A switch is the first version that runs the new arm; a delay counts from the first slow (or first
healthy) version.
"""

from __future__ import annotations

import itertools
import random
from typing import Optional

import pytest
from pgc_lab.auto_scenarios import healthy, jittered, most_in_any, random_stalls, rare_stalls, simulate, slow_spell

from lightning_pgc.decisions.auto import AutoCandidate
from lightning_pgc.decisions.auto_detect import REACH, StallRate

DGD, IGN1 = AutoCandidate("dgd", 0), AutoCandidate("ignore", 1)
SEEDS = range(6)


# ------------------------------------------------------------------------------------------ slowdowns
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("factor", [2.0, 3.0, 5.0, 10.0])
def test_a_slow_spell_is_left_within_6_versions_of_its_onset_and_reentered_within_6_of_its_end(
    n: int, factor: float
) -> None:
    """With the shipped table at these n, a slow spell of 2x or more switches to ignore_stragglers s=1 and back, once
    each, within 6 versions; 3x or more within 2 (two versions of evidence, then the first one under the new arm)."""
    for seed in SEEDS:
        switches = simulate(n, slow_spell(n, factor, 30, 90, seed), 150, seed)
        assert [arm for _, arm in switches] == [IGN1, DGD], (seed, switches)
        (into, _), (back, _) = switches
        assert 30 + 2 <= into <= 30 + (6 if factor < 3 else 2), (seed, switches)
        assert 90 + 2 <= back <= 90 + 6, (seed, switches)


@pytest.mark.parametrize("factor", [3.0, 10.0])
@pytest.mark.parametrize("n", [4, 8])
def test_a_big_slowdown_is_left_within_2_versions_under_heavier_jitter(n: int, factor: float) -> None:
    for seed in SEEDS:
        switches = simulate(n, slow_spell(n, factor, 30, None, seed, sigma=0.1), 120, seed)
        assert len(switches) == 1 and switches[0][1] == IGN1 and switches[0][0] <= 30 + 2, (seed, switches)


@pytest.mark.parametrize("factor", [2.0, 10.0])
def test_at_16_ranks_a_slowdown_is_left_and_ignore_kept_where_the_table_says_it_costs_as_little_as_dgd(
    factor: float,
) -> None:
    """The shipped table's n = 16 entry puts ignore_stragglers s=1 at 1.02x dgd's versions: once left for a slow
    rank, dgd is never predicted 5 % cheaper again, so the rule stays (one switch, no flapping)."""
    for seed in SEEDS:
        switches = simulate(16, slow_spell(16, factor, 30, 90, seed), 200, seed)
        assert [arm for _, arm in switches] == [IGN1] and switches[0][0] <= 30 + 2, (seed, switches)


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("factor", [1.2, 1.4])
def test_a_slowdown_the_table_says_does_not_pay_never_switches(n: int, factor: float) -> None:
    """At n = 4 and 8 leaving a rank out costs 1.54x dgd's versions: a rank 1.4x slower is cheaper to wait for."""
    for seed in SEEDS:
        assert simulate(n, slow_spell(n, factor, 30, None, seed), 300, seed) == [], seed


# ------------------------------------------------------------------------------------------ healthy runs
@pytest.mark.parametrize("n", [2, 4, 8, 16])
@pytest.mark.parametrize("sigma", [0.05, 0.1])
def test_a_healthy_run_never_switches(n: int, sigma: float) -> None:
    for seed in SEEDS:
        assert simulate(n, healthy(n, sigma), 500, seed) == [], seed


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_every_jitter_pattern_of_10_percent_never_switches(n: int) -> None:
    """Every pattern of 0.9 / 1.0 / 1.1 s over n ranks, twice in a row each, cycled: never a switch."""
    patterns = [p for p in itertools.product([0.9, 1.0, 1.1], repeat=n) for _ in range(2)]
    assert simulate(n, lambda v, rng: list(patterns[v % len(patterns)]), 2 * len(patterns), 0) == []


# ------------------------------------------------------------------------------------------ rare stalls
@pytest.mark.parametrize("n", [2, 4, 8, 16])
@pytest.mark.parametrize("factor", [10.0, 30.0])
def test_rare_stalls_switch_at_most_once_per_50_versions(n: int, factor: float) -> None:
    """One rank stalls for one version every 30-50 versions: at most one switch in any 50 versions. At n = 4 and 8
    a 10x stall costs dgd less than leaving a rank out: no switch at all; where the rate makes ignore_stragglers
    the cheaper arm (n = 16, or 30x stalls) the rule switches once and stays."""
    for seed in SEEDS:
        switches = simulate(n, rare_stalls(n, factor, seed), 600, seed)
        assert most_in_any(switches, 50) <= 1 and len(switches) <= 1, (seed, switches)
        if factor == 10.0 and n in (4, 8):
            assert switches == [], (seed, switches)


def test_frequent_stalls_are_a_rate_that_switches_once_and_stays() -> None:
    """A 10x stall every 4 versions costs dgd 2.25x its healthy step per version on average: ignore_stragglers s=1
    is cheaper; the rule goes there once the rate is known and stays, whatever the versions between stalls say."""

    def times(v: int, rng: random.Random) -> list[float]:
        row = jittered(4, rng, 0.05)
        if v % 4 == 0:
            row[(v // 4) % 4] *= 10.0
        return row

    for seed in SEEDS:
        switches = simulate(4, times, 400, seed)
        assert [arm for _, arm in switches] == [IGN1], (seed, switches)


# ------------------------------------------------------------------------------------------ the stall judge
def test_a_stall_reported_late_with_skipped_versions_is_one_stall_not_a_slowness() -> None:
    """Under ignore_stragglers a stalled rank's code for version 10 arrives after versions 11-19 closed without it
    (it sends none for them): one stall at version 10, what it added to dgd's order statistic counted once."""
    stalls = StallRate(4, [3, 4], horizon=100)
    times: dict[int, list[Optional[float]]] = {v: [0.1, 0.1, 0.1, 0.1] for v in range(30)}
    for v in range(10, 20):
        times[v][3] = None
    for v in range(30):
        stalls.judge(times, v)
    assert stalls.count() == 0
    times[10][3] = 1.0  # the late code
    for v in range(10 - REACH, 10 + REACH + 1):
        stalls.judge(times, v)
    assert stalls.stalled == {10: [3]} and stalls.count() == 1
    assert stalls.per_version(4) == pytest.approx((1.0 - 0.1) / 100) and stalls.per_version(3) == 0.0
    stalls.forget_before(11)
    assert stalls.count() == 0


def test_a_slowness_of_more_than_reach_versions_is_a_level_not_a_stall() -> None:
    stalls = StallRate(4, [4], horizon=100)
    times: dict[int, list[Optional[float]]] = {
        v: [0.1, 0.1, 0.1, 1.0 if 10 <= v < 10 + REACH + 1 else 0.1] for v in range(30)
    }
    for v in range(30):
        stalls.judge(times, v)
    assert stalls.count() == 0


@pytest.mark.parametrize("n", [2, 4, 8, 16])
@pytest.mark.parametrize("factor", [10.0, 30.0])
def test_stalls_at_random_versions_switch_at_most_once_per_50_versions(n: int, factor: float) -> None:
    """Stalls at a rate of one per 40 versions, at independent random versions: two may come in consecutive
    versions, on other ranks or the same one. Still at most one switch in any 50 versions."""
    for seed in range(12):
        switches = simulate(n, random_stalls(n, factor, seed), 600, seed)
        assert most_in_any(switches, 50) <= 1, (seed, switches)


def test_two_stalls_of_other_ranks_in_consecutive_versions_are_no_onset() -> None:
    """Each is a version that alone says switch (capped at 60 % of the threshold), but they leave out other ranks:
    the second starts the evidence again. The same rank slow in two consecutive versions does switch."""
    other = [[0.1] * 4 for _ in range(40)]
    other[20][1] = other[21][2] = 1.0
    assert simulate(4, lambda v, rng: list(other[v]), 40, 0) == []
    same = [[0.1] * 4 for _ in range(40)]
    same[20][1] = same[21][1] = 1.0
    assert [v for v, _ in simulate(4, lambda v, rng: list(same[v]), 40, 0)][:1] == [22]
