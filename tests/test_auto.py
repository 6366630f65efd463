"""scheme="auto": the switching rule, the window, the factor table and the leader, on small cases (pure)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import pytest

from lightning_pgc.codes import AutoScheme
from lightning_pgc.decisions.auto import (
    ARM_CODES,
    AutoCandidate,
    AutoRule,
    FactorTable,
    StepWindow,
    arm_from_code,
    candidates,
    order_statistic_mean,
)
from lightning_pgc.decisions.auto_detect import REACH
from lightning_pgc.decisions.auto_leader import AutoLeader
from lightning_pgc.decisions.header import Header

DGD, IGN1, IGN2 = AutoCandidate("dgd", 0), AutoCandidate("ignore", 1), AutoCandidate("ignore", 2)
TABLE = FactorTable(4, "test", {"ignore_stragglers c=2": 1.6, "ignore_stragglers c=3": 2.5})


def rule(n: int = 4, **kw) -> AutoRule:
    return AutoRule(n, candidates(min(2, n - 1)), TABLE, **kw)


def feed(r: AutoRule, times: Sequence[float], version: int) -> bool:
    for k, t in enumerate(times):
        r.add(k, version, t)
    return r.step(version).switched


def run(r: AutoRule, phases: Sequence[tuple[int, Sequence[float]]], start: int = 0) -> list[tuple[int, AutoCandidate]]:
    """Feed ``versions`` rows of ``times`` per phase; the switches as (first version under the new arm, new arm)."""
    out, v = [], start
    for versions, times in phases:
        for _ in range(versions):
            if feed(r, times, v):
                out.append((v + 1, r.arm))
            v += 1
    return out


# ------------------------------------------------------------------------------------------ arms and table
def test_arms_labels_codes_and_checks() -> None:
    assert DGD.label == "dgd" and DGD.table_key == "ddp"
    assert IGN1.label == "ignore_stragglers s=1" and IGN1.table_key == "ignore_stragglers c=2"
    assert AutoCandidate("pgc_cr", 2).table_key == "pgc_cr c=3"
    for name, code in ARM_CODES.items():
        s = 0 if name == "dgd" else 1
        assert arm_from_code(code, s) == AutoCandidate(name, s)
    with pytest.raises(ValueError, match="dgd has s = 0"):
        AutoCandidate("dgd", 1)
    with pytest.raises(ValueError, match="unknown arm"):
        AutoCandidate("bogus", 1)
    assert candidates(2) == [DGD, IGN1, IGN2]
    with pytest.raises(ValueError, match="max_stragglers"):
        candidates(0)


def test_the_shipped_table_says_where_it_came_from_and_picks_the_nearest_n() -> None:
    table = FactorTable.shipped(4)
    assert table.n == 4 and table.source.endswith(".jsonl")
    assert table.factor(DGD) == 1.0 and table.factor(IGN1) is not None and table.factor(IGN1) > 1.0
    assert FactorTable.shipped(5).n == 4 and FactorTable.shipped(1000).n == 16
    data = {"tables": [{"n": 4, "task": "a", "factors": {}}, {"n": 8, "task": "b", "factors": {}}]}
    assert FactorTable.from_dict(data, 6).n == 4  # tie: the smaller n
    two = {  # two tasks at one n: each arm's largest factor, whichever entry comes first
        "tables": [
            {"n": 4, "task": "mlp", "factors": {"x": {"factor": 1.3}, "y": {"factor": 2.0}}},
            {"n": 4, "task": "cnn", "factors": {"x": {"factor": 1.5}, "z": {"factor": 1.1}}},
        ]
    }
    merged = FactorTable.from_dict(two, 4)
    assert merged.task == "cnn+mlp" and merged.factors == {"x": 1.5, "y": 2.0, "z": 1.1}
    two["tables"].reverse()
    assert FactorTable.from_dict(two, 4) == merged
    with pytest.raises(ValueError, match="no tables"):
        FactorTable.from_dict({"tables": []}, 4)


def test_arms_without_a_factor_are_left_out() -> None:
    r = AutoRule(4, candidates(3), TABLE)
    assert r.arms == [DGD, IGN1, IGN2] and r.left_out == [AutoCandidate("ignore", 3)]
    with pytest.raises(ValueError, match="s < n"):
        AutoRule(2, candidates(2), TABLE)
    with pytest.raises(ValueError, match="margin"):
        AutoRule(4, candidates(1), TABLE, margin=1.0)


# ------------------------------------------------------------------------------------------ the window
def test_window_fills_missing_times_forward_and_keeps_the_last_versions() -> None:
    w = StepWindow(3, 3)
    w.add(0, 0, 1.0)
    w.add(1, 0, 2.0)
    w.add(2, 1, 3.0)
    assert w.known() and len(w) == 2 and w.newest() == 1
    # rank 2's first time stands for version 0; ranks 0, 1 carry their version-0 times forward
    assert w.rows() == [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]
    assert w.row(0) == [1.0, 2.0, 3.0] and w.row(1) == [1.0, 2.0, 3.0]
    w.add(0, 2, 5.0)
    w.add(0, 3, 6.0)  # version 0 leaves the window
    assert sorted(w.times) == [1, 2, 3]
    w.add(1, 0, 9.0)  # older than the window: ignored
    assert sorted(w.times) == [1, 2, 3]
    w.add(1, 1, math.nan)  # not a time: ignored
    assert w.times[1][1] is None
    assert w.known()  # rank 1's version-0 time stands for it (it left the window)
    assert w.rows() == [[1.0, 2.0, 3.0], [5.0, 2.0, 3.0], [6.0, 2.0, 3.0]]
    assert w.row(3) == [6.0, 2.0, 3.0]
    state = json.loads(json.dumps(w.state_dict()))  # what a checkpoint keeps survives JSON
    w2 = StepWindow(3, 3)
    w2.load_state_dict(state)
    assert w2.rows() == w.rows() and w2.known()
    w3 = StepWindow(4, 3)
    w3.load_state_dict(state)  # another n: nothing restored
    assert len(w3) == 0 and not w3.known()
    with pytest.raises(ValueError):
        w.add(3, 0, 1.0)


def test_order_statistics() -> None:
    rows = [[3.0, 1.0, 2.0], [1.0, 5.0, 1.0]]
    assert order_statistic_mean(rows, 3) == 4.0  # the slowest: (3 + 5) / 2
    assert order_statistic_mean(rows, 2) == 1.5
    assert order_statistic_mean(rows, 1) == 1.0
    assert order_statistic_mean([], 1) == 0.0


def test_costs_are_the_order_statistic_plus_the_all_reduce_times_the_factor() -> None:
    r = rule()
    feed(r, [1.0, 1.0, 1.0, 2.0], 0)
    r.window.add_allreduce(0.5)
    costs = r.costs()
    assert costs[DGD] == pytest.approx(2.5)
    assert costs[IGN1] == pytest.approx(1.5 * 1.6)
    assert costs[IGN2] == pytest.approx(1.5 * 2.5)


# ------------------------------------------------------------------------------------------ the rule
def test_the_evidence_adds_the_saving_beyond_the_margin_never_below_zero_and_at_most_part_of_the_threshold() -> None:
    """dgd at 2 s a version, ignore s=1 at 1.6 (1 s times its factor): each version adds 0.95 * 2 - 1.6 = 0.3 s, so
    the threshold of one version of ignore's step time (1 s) is reached at the fourth; a version where dgd is the
    cheaper takes its amount off, down to zero; a stall version adds at most 60 % of the threshold."""
    r = rule()
    slow = [1.0, 1.0, 1.0, 2.0]
    for v in range(3):
        assert not feed(r, slow, v)
        assert r.evidence.sums[IGN1] == pytest.approx(0.3 * (v + 1))
    assert r.evidence.since[IGN1] == 0
    assert not feed(r, [1.0] * 4, 3)  # 0.95 * 1 - 1.6 = -0.65 off the 0.9
    assert r.evidence.sums[IGN1] == pytest.approx(0.25) and r.evidence.since[IGN1] == 0
    assert not feed(r, [1.0] * 4, 4)  # down to zero, not below
    assert r.evidence.sums[IGN1] == 0.0 and IGN1 not in r.evidence.since
    assert not feed(r, [1.0, 1.0, 1.0, 50.0], 5)
    assert r.evidence.sums[IGN1] == pytest.approx(0.6)
    switches = run(r, [(2, slow)], start=6)
    assert switches == [(8, IGN1)] and r.evidence.sums == {}  # 0.6 + 0.3 + 0.3 >= 1: switched, the evidence restarts


def test_a_single_slow_version_is_no_onset() -> None:
    """However slow one version is, it alone never switches: not at once, and 10x stalls every 20 versions never (at
    that rate they cost dgd less than leaving a rank out costs). A 1000x stall is a rate worth a switch: it comes
    only once the stall is judged, ``REACH`` versions later, and three versions of evidence after that (with a
    stall in the horizon a version adds at most 40 % of the threshold)."""
    for n in (2, 4, 8):
        r = AutoRule(n, candidates(1), FactorTable.shipped(n))
        for v in range(200):
            times = [1.0] * n
            if v % 20 == 10:
                times[v % n] = 10.0
            assert not feed(r, times, v), (n, v)
        big = AutoRule(n, candidates(1), FactorTable.shipped(n))
        switches = run(big, [(10, [1.0] * n), (1, [1.0] * (n - 1) + [1000.0]), (20, [1.0] * n)])
        assert [v for v, _ in switches] == [10 + REACH + 3], n
        assert "1 stalls in the last 200 steps cost dgd" in big.explain(DGD, IGN1, 0.5, 10 + REACH)


def test_two_slow_ranks_go_to_the_arm_that_leaves_both_out() -> None:
    r = rule()
    switches = run(r, [(40, [1.0, 1.0, 4.0, 4.0])])
    assert switches and switches[-1][1] == IGN2


@pytest.mark.parametrize("wiggle", [0.0, 0.01, 0.03])
def test_no_flapping_at_the_margin(wiggle: float) -> None:
    """Costs that alternate around the margin: ignore at 0.95x dgd's cost +- wiggle each version. At most one switch,
    and never back: coming back needs dgd at 0.95x ignore's cost, far outside the band."""
    r = rule()
    at_margin = 1.6 / 0.95  # dgd's cost = the slow time, ignore's = 1.6 * 1.0
    switches = []
    for v in range(300):
        slow = at_margin * (1 + (wiggle if v % 2 else -wiggle))
        if feed(r, [1.0, 1.0, 1.0, slow], v):
            switches.append((v, r.arm))
    assert len(switches) <= 1


def test_state_round_trip_continues_the_same_decision() -> None:
    r = rule()
    run(r, [(30, [1.0, 1.0, 1.0, 2.0]), (1, [1.0] * 4)])
    assert r.arm == IGN1 and r.evidence.sums[DGD] > 0
    state = json.loads(json.dumps(r.state_dict()))
    r2 = rule()
    r2.load_state_dict(state)
    assert r2.arm == IGN1 and r2.window.rows() == r.window.rows()
    assert (r2.evidence.sums, r2.evidence.since, r2.evidence.who) == (r.evidence.sums, r.evidence.since, r.evidence.who)
    assert r2.stalls.state_dict() == r.stalls.state_dict()
    assert run(r2, [(1, [1.0] * 4)], start=31) == run(r, [(1, [1.0] * 4)], start=31) == [(32, DGD)]
    r3 = AutoRule(4, candidates(1), FactorTable(4, "t", {}))  # the saved arm is no candidate here: dgd
    r3.load_state_dict(state)
    assert r3.arm == DGD and r3.evidence.sums == {}
    r4 = rule()
    r4.load_state_dict({"arm": ["ignore", 1], "window": None, "pending": None, "count": 3})  # an older rule's state
    assert r4.arm == IGN1 and r4.evidence.sums == {}


# ------------------------------------------------------------------------------------------ the leader
def leader(n: int = 4, max_s: int = 1, **kw) -> AutoLeader:
    r = AutoRule(n, candidates(max_s), TABLE)
    return AutoLeader(AutoScheme(n, max_s), n, 0, timeout=1.0, max_lag=100, now=0.0, rule=r, **kw)


def code(lead: AutoLeader, rank: int, version: int, busy: float, now: float) -> None:
    lead.on_code(Header(version, rank, 1, (0,), busy_s=busy), now)


def test_leader_under_dgd_waits_for_every_live_rank_and_averages_all() -> None:
    lead = leader()
    for k in range(3):
        code(lead, k, 0, 0.1, 0.1)
        assert lead.try_close(0.1) is None
    code(lead, 3, 0, 0.1, 0.2)
    rec = lead.try_close(0.2)
    assert rec is not None and rec.admitted == [0, 1, 2, 3]
    assert all(w == 0.25 for w in rec.weights.values()) and lead.arm_of(0) == DGD


def test_leader_under_dgd_closes_without_a_dead_rejected_or_silent_rank() -> None:
    for fault in ("dead", "rejected", "silent"):
        lead = leader()
        now = 0.1
        if fault == "dead":
            lead.on_dead(3)
        elif fault == "rejected":
            lead.on_reject(3, 0, now)
        else:
            now = 10.0  # rank 3's last heartbeat is older than the window; the others beat
        for k in range(3):
            code(lead, k, 0, 0.1, now)
        rec = lead.try_close(now)
        assert rec is not None and rec.admitted == [0, 1, 2], fault
        assert all(w == pytest.approx(1 / 3) for w in rec.weights.values())


def test_leader_never_closes_with_fewer_than_max_stragglers_allow() -> None:
    lead = leader()
    lead.on_dead(2)
    lead.on_dead(3)
    for k in range(2):
        code(lead, k, 0, 0.1, 0.1)
    assert lead.try_close(0.1) is None


def test_leader_switches_once_and_the_next_version_closes_without_the_slow_rank() -> None:
    seen = []
    lead = leader(on_switch=seen.append)
    t = 0.0
    version = 0
    while not lead.switches and version < 50:
        for k in range(4):
            code(lead, k, version, 0.2 if k == 3 else 0.1, t)
        assert lead.try_close(t) is not None
        version += 1
        t += 0.2
    assert len(seen) == 1 and seen[0].new == IGN1 and seen[0].version == version
    assert "rank 3 has been 2.0x slower" in seen[0].reason
    assert "switching to ignore_stragglers s=1" in seen[0].reason
    for k in range(3):
        code(lead, k, version, 0.1, t)
    rec = lead.try_close(t)
    assert rec is not None and rec.admitted == [0, 1, 2] and lead.arm_of(version) == IGN1
    assert lead.arm_of(version - 1) == DGD
    assert lead.state_dict()["arm"] == ["ignore", 1]


def test_a_successor_leader_keeps_the_arm_in_effect() -> None:
    lead = leader(state={"arm": ["ignore", 1]})
    assert lead.arm == IGN1 and len(lead.rule.window) == 0 and lead.rule.evidence.sums == {}
    with pytest.raises(TypeError, match="AutoScheme"):
        from lightning_pgc.codes import make_scheme

        AutoLeader(make_scheme("ignore", 4, 1), 4, 0, 1.0, 10)


# ------------------------------------------------------------------------------------------ the emulator
def test_the_emulator_runs_the_strategys_leader_and_rule() -> None:
    """pgc_auto on the simulated clock: the same AutoLeader class and AutoRule (not a copy); a healthy cluster never
    switches, a persistently 2x slow rank switches once, a rank slow for a while then normal switches in and out,
    each within 6 versions."""
    from lightning_pgc.emulator.auto import auto_leader, switches
    from lightning_pgc.emulator.cells import STRATEGIES, MapArm
    from lightning_pgc.emulator.clock import Costs, simulate

    assert STRATEGIES["pgc_auto"] == "auto"
    scheme = MapArm("pgc_auto", 2).scheme(4)
    assert isinstance(scheme, AutoScheme) and scheme.s == 1
    costs = Costs(compute_s=0.01, overhead_s=0.002, code_s=0.001, aggregate_s=0.002)
    out = {}
    for name, delay in [
        ("healthy", "lognormal(median=0.002, sigma=0.5)"),
        ("slow", "slowranks(ranks=[3], seconds=0.01)"),
        ("while", "slowranks(ranks=[3], seconds=0.01, steps=[50, 150])"),
    ]:
        lead = auto_leader(scheme, 300, costs.aggregate_s)
        assert type(lead) is AutoLeader and type(lead.rule) is AutoRule
        res = simulate(scheme, 300, delay, costs, leader=lead)
        out[name] = [(s.version, s.new) for s in switches(lead)]
        for rec in res.records:  # dgd's versions admit every rank, the others leave rank 3 out
            assert len(rec.admitted) == (4 if lead.arm_of(rec.version) == DGD else 3)
    assert out["healthy"] == []
    assert [a for _, a in out["slow"]] == [IGN1]
    assert [a for _, a in out["while"]] == [IGN1, DGD]
    # within 6 versions of the onset (rank 3 is slow from version 0, or from 50) and of the end (150)
    assert out["slow"][0][0] <= 6 and 50 < out["while"][0][0] <= 56 and 150 < out["while"][1][0] <= 156
    # simulate() builds the same leader itself for an AutoScheme
    assert simulate(scheme, 60, "slowranks(ranks=[3], seconds=0.01)", costs).records[-1].admitted == [0, 1, 2]


def test_the_emulator_under_rare_stalls_switches_at_most_once_per_50_versions() -> None:
    """Every rank stalls for a version with probability 0.006 per step (about one stall per 40 versions on 4 ranks)
    under the emulator's pgc_auto: 10x stalls never switch (waiting for them costs dgd less than leaving a rank out),
    30x ones at most once in any 50 versions."""
    from pgc_lab.auto_scenarios import most_in_any

    from lightning_pgc.emulator.auto import auto_leader, switches
    from lightning_pgc.emulator.cells import MapArm
    from lightning_pgc.emulator.clock import Costs, simulate

    scheme = MapArm("pgc_auto", 2).scheme(4)
    costs = Costs(compute_s=0.01, overhead_s=0.002, code_s=0.001, aggregate_s=0.002)
    for seed in range(6):
        for stall, most in (("0.1", 0), ("0.3", 1)):
            lead = auto_leader(scheme, 400, costs.aggregate_s)
            simulate(scheme, 400, f"spikes(prob=0.006, low={stall}, high={stall})", costs, leader=lead, delay_seed=seed)
            found = [(s.version, s.new) for s in switches(lead)]
            assert most_in_any(found, 50) <= most, (seed, stall, found)


# ------------------------------------------------------------------------------------------ the strategy's options
def test_pgc_auto_is_registered_and_its_options_are_checked() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_pgc import AutoOptions, PGCStrategy

    entry = StrategyRegistry["pgc_auto"]
    assert entry["strategy"] is PGCStrategy and entry["init_params"] == {"scheme": "auto"}
    st = PGCStrategy(scheme="auto", auto={"max_stragglers": 2, "margin": 0.2, "threshold": 2.0, "horizon": 50})
    assert st.auto == AutoOptions(max_stragglers=2, margin=0.2, threshold=2.0, horizon=50)
    assert isinstance(st._make_scheme(4), AutoScheme) and st._make_scheme(4).s == 2
    with pytest.raises(ValueError, match="s must be < n"):
        st._make_scheme(2)
    with pytest.raises(ValueError, match="auto options apply to scheme='auto' only"):
        PGCStrategy(scheme="pgc_cr", auto={"max_stragglers": 2})
    with pytest.raises(ValueError, match=r"auto\.margin must be in \[0, 1\)"):
        PGCStrategy(scheme="auto", auto={"margin": 1.5})
    with pytest.raises(ValueError, match=r"auto\.max_stragglers must be an int >= 1"):
        AutoOptions(max_stragglers=0)
    with pytest.raises(TypeError, match=r"auto\.horizon must be int"):
        PGCStrategy(scheme="auto", auto={"horizon": 2.5})
    with pytest.raises(ValueError, match=r"pass auto=\{'max_stragglers': 2\}, not stragglers"):
        PGCStrategy(scheme="auto", stragglers=2)
    with pytest.raises(ValueError, match="no staleness to correct"):
        PGCStrategy(scheme="auto", coding={"staleness_correction": "momentum"})


def test_the_shipped_table_is_rederived_from_the_shipped_map_records() -> None:
    """``lightning_pgc/auto_factors.json`` is what ``python benchmarks/auto_table.py`` derives from the records it
    names: a checkout can regenerate the table its ``pgc_auto`` reads."""
    from benchmarks import auto_table

    root = Path(__file__).resolve().parents[1]
    shipped = json.loads((root / "lightning_pgc" / "auto_factors.json").read_text())
    summary = json.loads((root / shipped["summary"]).read_text())
    summary["_path"] = shipped["summary"]
    assert (root / summary["source"]).exists() and shipped["source"] == summary["source"]
    assert auto_table.derive(summary, auto_table._records(root / summary["source"])) == shipped
