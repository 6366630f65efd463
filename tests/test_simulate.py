"""The simulated clock against schedules computed by hand, and its invariants on random cases."""

from __future__ import annotations

import itertools

import pytest

from lightning_pgc.codes import BoundedScheme, make_scheme
from lightning_pgc.emulator.clock import Costs, simulate
from lightning_pgc.delays import delay_for, parse_delay

SLOW2 = "slowranks(ranks=[2], seconds=2.4)"  # rank 2 takes 2.4 s more on every step it computes
UNIT = Costs(compute_s=1.0)  # one partition gradient = 1 s, free messages and steps


def close(xs, ys):
    return len(xs) == len(ys) and all(abs(x - y) < 1e-9 for x, y in zip(xs, ys))


def test_dgd_waits_for_every_rank():
    # n=3, compute 1 s, rank 2 slow by 2.4 s; ranks 1 and 2 reach the leader 0.1 s after computing (rank 0 is the
    # leader: its code is local), the aggregate is usable 0.2 s after the close, every step costs 0.05 s more.
    # Step 0: rank 2 ends compute at 3.4, code at 3.5 -> close 3.5; aggregate 3.7; step ends 3.75 on every rank.
    # Each step then repeats the 3.75 s cycle: closes at 3.5, 7.25, 11.0.
    res = simulate(
        make_scheme("dgd", 3, 0), 3, SLOW2, Costs(compute_s=1.0, overhead_s=0.05, code_s=0.1, aggregate_s=0.2)
    )
    assert close(res.close_times, [3.5, 7.25, 11.0])
    assert res.admitted == [[0, 1, 2]] * 3
    for k in range(3):
        assert close(res.applied[k], [3.75, 7.5, 11.25])
    assert res.skipped == [0, 0, 0] and res.late == [0, 0, 0]
    # utilisation: ranks 0 and 1 busy 1 s of every 3.75 s, rank 2 3.4 s
    assert close(res.utilization, [3 / 11.25, 3 / 11.25, 10.2 / 11.25])


def test_ignore_takes_the_fastest_and_the_straggler_catches_up():
    # ignore, n=3, s=1: ranks 0 and 1 close every version alone at 1, 2, 3, ... Rank 2 ends step 0 at 3.4
    # (v0's code late); v1 (closed 2) and v2 (closed 3) are published: skipped; v3 is open (closes at 4):
    # computed 3.4 -> 6.8 (late); v4, v5 (closed 5, 6) skipped.
    res = simulate(make_scheme("ignore", 3, 1), 6, SLOW2, UNIT)
    assert close(res.close_times, [1, 2, 3, 4, 5, 6])
    assert res.admitted == [[0, 1]] * 6
    assert close(res.applied[2], [3.4, 3.4, 3.4, 6.8, 6.8, 6.8])
    assert res.skipped == [0, 0, 4] and res.late == [0, 0, 2] and res.computed == [6, 6, 2]
    assert res.max_ages() == [0] * 6


def test_gc_cr_costs_c_evaluations_per_step():
    # gc_cr, n=3, s=1 (c=2): every computed step evaluates 2 partitions (2 s); ranks 0, 1 close at 2, 4, 6.
    # Rank 2: v0 0 -> 4.4; v1 (closed 4) skipped; v2 open (closes 6): 4.4 -> 8.8; v3 (closed 8) skipped.
    res = simulate(make_scheme("gc_cr", 3, 1), 4, SLOW2, UNIT)
    assert close(res.close_times, [2, 4, 6, 8])
    assert res.admitted == [[0, 1]] * 4
    assert close(res.applied[2], [4.4, 4.4, 8.8, 8.8])
    assert res.evaluations == [8, 8, 4]


def test_pgc_cr_pipelines_one_evaluation_per_step_after_a_full_warmup():
    # pgc_cr, n=3, s=1 (c=2), warmup "full": step 0 evaluates both held partitions (2 s), later steps one (1 s).
    # Closes: 2, 3, 4, 5, 6, 7 with ranks 0, 1. Rank 2: v0 0 -> 4.4; v1, v2 skipped (closed 3, 4); v3 open
    # (closes 5): 4.4 -> 7.8; v4, v5 skipped. From step 1 on every admitted code carries one entry of age 1
    # (the partition evaluated the step before) and one fresh: max age c-1 = 1.
    res = simulate(make_scheme("pgc_cr", 3, 1), 6, SLOW2, UNIT)
    assert close(res.close_times, [2, 3, 4, 5, 6, 7])
    assert res.admitted == [[0, 1]] * 6
    assert close(res.applied[2], [4.4, 4.4, 4.4, 7.8, 7.8, 7.8])
    assert res.max_ages() == [0, 1, 1, 1, 1, 1]
    assert res.records[1].ages[0] == (1, 0)  # rank 0 holds (0, 1); at step 1 it evaluates partition 1
    assert res.evaluations == [7, 7, 3]


def test_pgc_fr_gradual_warmup_and_group_rule():
    # pgc_fr, n=4, s=1 (c=2): groups {0,1} and {2,3}; warmup "gradual": one partition per step from step 0.
    # Rank 3 slow by 2.4: group 1 is covered by rank 2, so closes need one rank per group: 1, 2, 3, ...
    # Admitted in arrival order: ranks 0, 1, 2 arrive at the same time (0 first, then 1: order of the events,
    # the leader closes as soon as 2 arrives since both groups are then present) -> [0, 1, 2].
    res = simulate(make_scheme("pgc_fr", 4, 1, warmup="gradual"), 4, "slowranks(ranks=[3], seconds=2.4)", UNIT)
    assert close(res.close_times, [1, 2, 3, 4])
    assert res.admitted == [[0, 1, 2]] * 4
    # gradual warm-up: step 0's codes carry one entry (age 0), later ones two (ages 1 and 0)
    assert res.records[0].ages[0] == (0,) and sorted(res.records[1].ages[0]) == [0, 1]


def test_bounded_closes_on_coverage_with_the_window():
    # bounded, n=4, r=2 (rank k holds k, k+1), c=2, fresh = n-r+1 = 3; rank 3 slow by 2.4. Evaluations: held
    # position t % 2, i.e. partition k at even t, k+1 at odd t.
    # v0: ranks 0,1,2 report partitions 0,1,2 at 1; partition 3 only from rank 3 (3.4) -> close 3.4, all four.
    # v1 (3.4 -> 4.4): partitions 1,2,3 at v1 from ranks 0,1,2; partition 0 has (rank 0, v0), age 1 < 2 ->
    # close 4.4 with ranks [0, 1, 2]. From then on ranks 0,1,2 alternate and cover every partition within the
    # window: closes every second, 5.4, 6.4, ...; rank 3's codes arrive after newer entries (never used again).
    res = simulate(BoundedScheme(4, replication=2, staleness=2), 6, "slowranks(ranks=[3], seconds=2.4)", UNIT)
    assert close(res.close_times, [3.4, 4.4, 5.4, 6.4, 7.4, 8.4])
    assert res.admitted == [[0, 1, 2, 3]] + [[0, 1, 2]] * 5
    assert [(e.rank, e.version) for e in res.records[1].entries] == [(0, 0), (0, 1), (1, 1), (2, 1)]
    assert res.max_ages() == [0, 1, 1, 1, 1, 1]


def test_busy_time_is_the_delay_realisation_of_a_real_run():
    # the simulated ranks sleep what StragglerInjector would: delay_for(model, seed, rank, step) * scale
    model = parse_delay("lognormal(median=0.5, sigma=0.5)")
    res = simulate(make_scheme("dgd", 4, 0), 5, model, Costs(compute_s=0.1), delay_seed=7, scale=2.0)
    for k in range(4):
        expected = sum(0.1 + 2.0 * delay_for(model, 7, k, t) for t in range(5))
        assert res.busy_s[k] == pytest.approx(expected)
    # dgd: each close is the slowest rank's compute end, one step after the previous close
    t = 0.0
    for v, rec in enumerate(res.records):
        t += max(0.1 + 2.0 * delay_for(model, 7, k, v) for k in range(4))
        assert rec.closed_at == pytest.approx(t)


CASES = [
    ("dgd", 0),
    ("ignore", 1),
    ("gc_fr", 1),
    ("gc_cr", 2),
    ("pgc_fr", 1),
    ("pgc_cr", 2),
    ("pgc_cr_naive", 1),
    ("bounded", 2),
    ("bounded", 4),
]


@pytest.mark.parametrize("name,s", CASES)
def test_invariants_on_random_delays(name, s):
    n = 6
    delay = "exponential(mean=0.3) + spikes(prob=0.1, low=1.0, high=3.0)"
    for seed in range(3):
        if name == "bounded":
            scheme = BoundedScheme(n, replication=2, staleness=s)
        else:
            scheme = make_scheme(name, n, s)
        res = simulate(scheme, 30, delay, Costs(0.05, 0.01, 0.02, 0.03), delay_seed=seed)
        times = res.close_times
        assert all(a < b for a, b in zip(times, times[1:]))  # one version after the other
        for rec in res.records:
            if name == "bounded":
                assert len(rec.entries) == n and rec.fresh >= scheme.wait_for  # every partition covered
                assert all(a < s for a in rec.delays())  # ages < c
            else:
                assert scheme.admits(rec.admitted)
                assert not scheme.admits(rec.admitted[:-1])  # closed as soon as admissible, never waiting more
        if scheme.cache_max_age is not None:  # pgc_cr_naive's cache never expires: a rank that skipped sends older
            assert max(res.max_ages()) <= (s - 1 if name == "bounded" else scheme.max_staleness)
        for k in range(n):  # every rank applied every version, in order, after its close
            assert len(res.applied[k]) == 30
            assert all(res.applied[k][v] >= times[v] for v in range(30))
            assert all(a <= b for a, b in zip(res.applied[k], res.applied[k][1:]))
        assert all(0 < u <= 1 for u in res.utilization)


def test_more_tolerance_is_never_slower_under_the_same_delays():
    # with identical delays and free messages, waiting for n-s codes closes no later than waiting for all
    delay = "lognormal(median=0.2, sigma=1.0)"
    for seed in range(3):
        dgd = simulate(make_scheme("dgd", 5, 0), 20, delay, UNIT, delay_seed=seed)
        ign = simulate(make_scheme("ignore", 5, 2), 20, delay, UNIT, delay_seed=seed)
        assert all(b <= a + 1e-12 for a, b in zip(dgd.close_times, ign.close_times))


def test_bad_arguments():
    with pytest.raises(ValueError, match="steps"):
        simulate(make_scheme("dgd", 2, 0), 0)
    with pytest.raises(ValueError, match="compute_s"):
        Costs(compute_s=-1.0)
    with pytest.raises(ValueError, match="delay"):
        simulate(make_scheme("dgd", 2, 0), 2, "nonsense(1)")
    assert Costs.message_s(1e6, 0.001, 1e9) == pytest.approx(0.002)


def test_all_schemes_run_for_every_small_configuration():
    for n, s in itertools.product((2, 3, 4), (0, 1)):
        for name in ("ignore", "gc_cr", "pgc_cr"):
            if s < n:
                res = simulate(make_scheme(name, n, s), 5, "exponential(mean=0.1)", UNIT)
                assert len(res.records) == 5


def test_simulated_grid_smoke(tmp_path):
    # benchmarks/grid.py --simulate: every scheme n allows, paired ratios to dgd, labelled simulated, in the doc block
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import grid

    (tmp_path / "costs.json").write_text(
        json.dumps({"costs": {"compute_s": 0.05, "overhead_s": 0.01, "code_s": 0.001, "aggregate_s": 0.002}})
    )
    (tmp_path / "simulation.md").write_text("# page\n\nprose kept\n")
    result = grid.main(
        [
            "--simulate",
            "--n",
            "4",
            "--c",
            "2",
            "--seeds",
            "0",
            "1",
            "--steps",
            "4",
            "--costs",
            str(tmp_path / "costs.json"),
            "--docs",
            str(tmp_path),
        ]
    )
    assert result["simulated"] is True
    labels = {r["scheme"] for r in result["rows"] if r["delay"] == "exponential"}
    assert labels == {"dgd", "ignore c=2", "gc_fr c=2", "gc_cr c=2", "pgc_fr c=2", "pgc_cr c=2", "bounded r=2 c=2"}
    for r in result["rows"]:
        assert (r["scheme"] == "dgd") == ("speedup_vs_dgd" not in r)
        assert r["seeds"] == 2 and r["steps_per_s"] > 0
    page = (tmp_path / "simulation.md").read_text()
    assert "prose kept" in page and "**Simulated**" in page
    assert json.loads((tmp_path / "sim_grid.json").read_text())["rows"] == result["rows"]
