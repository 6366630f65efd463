"""The emulated map's protocol: a tiny round end to end (resumable, summarised, turned into the guide's rows), the
tuning grid's edge rule, the miss rule and its bound labels, the statistics (the permutation test of the ratio, its
power on synthetic data with a known 10 % effect, the winner against its runner-up at equal s), and the audit."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from benchmarks import which_strategy
from pgc_lab.map.audit import audit
from lightning_pgc.emulator.cells import (
    CORRECTIONS,
    LR_REACH,
    MOMENTUM_STEPS,
    MapArm,
    MapCell,
    Protocol,
    arms_for,
    cs_for,
    on_edge,
    run_arm,
)
from lightning_pgc.emulator.cluster import NODE_PATTERNS, SlowSpells, node_size
from lightning_pgc.emulator.machine import environment
from pgc_lab.map.confirm import CONFIRM_FIRST, CONFIRM_SEEDS, confirm_plan, confirm_summary
from pgc_lab.map.crossmap import item_key, plan_items, read_records, run_round
from pgc_lab.map.rounds import HARD_TASKS, protocol_for, rounds, tiny_protocol
from lightning_pgc.emulator.scoring import (
    detectable_effect,
    holm,
    ratio_permutation_p,
    required_seeds,
    sign_flip_p,
)
from lightning_pgc.emulator.summary import summarize, summarize_cell

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def test_tiny_map_round_resumes_and_yields_guide_rows(tmp_path):
    cells = [MapCell(4, "slow node", "compute", cs=(2,))]
    protocol = tiny_protocol()
    path = tmp_path / "round.jsonl"
    items, _ = plan_items(cells, protocol)
    families = {(a.strategy, a.correction) for _, a in items}
    assert {("pgc_fr", c) for c in CORRECTIONS} | {("pgc_cr", c) for c in CORRECTIONS} <= families
    assert {("bounded_staleness", "none"), ("bounded_staleness", "lookahead"), ("ddp", "none")} <= families
    assert run_round(path, cells, protocol, progress=False, limit=2) == 2
    with open(path, "a") as f:
        f.write('{"torn')  # a run killed mid-write
    assert run_round(path, cells, protocol, progress=False) == len(items) - 2  # only what is missing
    assert run_round(path, cells, protocol, progress=False) == 0
    records = read_records(path)
    assert len(records) == len(items) == len(path.read_text().splitlines()) - 1  # all but the torn line
    for r in records:
        assert set(r["protocol"]["tuning_seeds"]).isdisjoint(r["protocol"]["eval_seeds"])
        assert len(r["tuning"]["scores"]) == len(protocol.lrs) * len(protocol.momenta)
        assert len(r["eval"]["time_late"]) == len(protocol.eval_seeds)
        times = [t for t in r["eval"]["time_late"] if t is not None]
        assert all(0 < t <= r["budget_s"] for t in times)

    summary = summarize(records, source="round.jsonl")
    assert summary["environments"] == [{**environment(), "records": len(records)}]  # the machine each record ran on
    (cell,) = summary["cells"]
    compared = [a for a in cell["arms"] if a["strategy"] != "ddp"]
    assert compared and all("vs_ddp_late" in a and "vs_ddp_early" in a for a in compared)
    ranked = [a for a in compared if a["bound"] is None]
    assert cell["family"] == len(ranked)
    assert all(a["vs_ddp_late"]["p_holm"] >= a["vs_ddp_late"]["p"] for a in ranked)
    assert cell["power"]["family"] == len(ranked) and cell["power"]["seeds"] == len(protocol.eval_seeds)

    table = which_strategy.build(summary | {"round": "tiny"}, "round.jsonl")
    (row,) = table["rows"]
    assert tuple(row) == which_strategy.FIELDS and (row["task"], row["n"]) == ("mlp", 4)
    json.dumps(table)


def test_a_node_level_cell_runs_s_at_and_above_the_node_size_and_intermediate_c_everywhere():
    for n in (4, 16, 64, 256):
        assert any(2 < c < n // 2 or n == 4 and c == 3 for c in cs_for(n)), n
        for pattern in NODE_PATTERNS:
            node = node_size(n)
            cs = cs_for(n, pattern)
            assert {node + 1, 2 * node} <= set(cs) | {2}, (n, cs)
            arms, _ = arms_for(n, pattern=pattern)
            assert any(a.s >= node for a in arms if a.strategy != "ddp"), n
    assert 9 in cs_for(64, "slow node")


def test_slow_spells_last_many_steps_and_do_not_depend_on_the_order_they_are_read():
    model = SlowSpells(normal_steps=30, slow_steps=10, seconds=0.3, seed=4)
    first = np.array([[model.slow(r, t) for t in range(3000)] for r in range(6)])
    again = SlowSpells(30, 10, 0.3, seed=4)
    assert all(again.slow(r, t) == first[r, t] for r in reversed(range(6)) for t in reversed(range(0, 3000, 7)))
    assert 0.15 < first.mean() < 0.35  # about 10 / (30 + 10)
    changes = np.abs(np.diff(first.astype(int), axis=1)).sum()
    assert first.sum() / max(changes, 1) * 2 > 5  # slow spells span many steps, not single ones


def test_the_edge_rule_names_edges_and_extends_the_grid_until_the_choice_is_inside():
    assert on_edge((0.8, 0.5), [0.2, 0.4, 0.8], [0.0, 0.5, 0.9]) == ["lr_high"]
    assert on_edge((0.2, 0.9), [0.2, 0.4, 0.8], [0.0, 0.5, 0.9]) == ["lr_low", "momentum_high"]
    assert on_edge((0.4, 0.0), [0.2, 0.4, 0.8], [0.0, 0.5, 0.9]) == []  # momentum 0: the domain's boundary
    assert LR_REACH >= 1 and list(MOMENTUM_STEPS) == sorted(MOMENTUM_STEPS)
    # a one-setting grid far below the optimum: the rule widens it until the choice is not on an edge
    protocol = Protocol(
        budget_steps=60,
        max_versions=80,
        tuning_seeds=(1000,),
        eval_seeds=(0, 1),
        lrs=(0.1,),
        momenta=(0.0,),
        targets=(0.9, 0.6),
    )
    record = run_arm(MapCell(4, "none", "compute"), MapArm("ddp"), protocol)
    tuning = record["tuning"]
    assert len(tuning["lrs"]) > 2 and min(tuning["lrs"]) < 0.1 < max(tuning["lrs"])
    assert max(tuning["lrs"]) <= 0.1 * 2**LR_REACH  # the reach is counted from the starting grid
    chosen = (tuning["chosen"]["lr"], tuning["chosen"]["momentum"])
    assert tuning["edge"] == on_edge(chosen, tuning["lrs"], tuning["momenta"]) == []
    assert len(tuning["scores"]) == len(tuning["lrs"]) * len(tuning["momenta"])


def test_an_arm_that_misses_everywhere_is_labelled_a_bound_and_never_ranked():
    protocol = Protocol(
        budget_steps=20,
        max_versions=30,
        tuning_seeds=(1000,),
        eval_seeds=(0, 1, 2),
        lrs=(0.2,),
        momenta=(0.0,),
        targets=(0.9, 0.01),  # the late target is out of reach in 20 steps
        extend=False,
    )
    cell = MapCell(4, "none", "compute")
    records = [run_arm(cell, arm, protocol) for arm in (MapArm("ddp"), MapArm("ignore_stragglers", 2))]
    for r in records:
        assert r["tuning"]["missed_everywhere"]
    summary = summarize_cell(records)
    assert summary["ddp_missed"] and summary["family"] == 0 and summary["winner"] is None
    assert set(summary["bounds"]) == {"ddp", "ignore_stragglers c=2"}
    assert audit(records)["missed_everywhere"] == sorted(
        f"{r['arm']['label']} | n=4 | none | compute | iid | mlp" for r in records
    )


def test_the_permutation_test_of_the_ratio_is_exact_and_matches_the_sign_flip_test_on_one_pair():
    a, b = [2.0, 3.0, 4.0], [2.0, 3.0, 4.0]
    assert ratio_permutation_p(a, b) == 1.0
    # every pattern by brute force
    x, y = np.array([1.0, 2.0, 5.0, 3.0]), np.array([2.0, 2.5, 6.0, 3.5])
    observed = abs(math.log(x.sum() / y.sum()))
    hits = 0
    for mask in range(16):
        swap = np.array([(mask >> i) & 1 for i in range(4)], dtype=bool)
        xa, ya = np.where(swap, y, x), np.where(swap, x, y)
        hits += abs(math.log(xa.sum() / ya.sum())) >= observed * (1 - 1e-12)
    assert ratio_permutation_p(x, y) == hits / 16
    assert ratio_permutation_p([1.0], [2.0]) == sign_flip_p([math.log(0.5)]) == 1.0
    with pytest.raises(ValueError):
        ratio_permutation_p([1.0, 0.0], [1.0, 1.0])


def test_twenty_seeds_detect_a_real_ten_percent_effect_after_holm_over_the_cells_family():
    """Synthetic cells: ddp's per-seed times log-normal, one arm truly 10 % faster per seed with log-normal noise of
    sd 0.1, the rest of a family of 30 comparisons null. The power computation says 20 seeds detect 10 % there;
    the simulated power of the Holm-corrected permutation test agrees, and a null arm is rarely flagged."""
    seeds, family, sd, trials = 20, 30, 0.1, 60
    assert detectable_effect(sd, seeds, family) <= 0.1
    assert required_seeds(sd, 0.1, family) <= seeds < required_seeds(2 * sd, 0.1, family)
    rng = np.random.default_rng(7)
    detected = false_alarms = 0
    for trial in range(trials):
        base = rng.lognormal(2.0, 0.3, seeds)
        arms = [0.9 * base * rng.lognormal(0, sd, seeds)]
        arms += [base * rng.lognormal(0, sd, seeds) for _ in range(family - 1)]
        p = holm([ratio_permutation_p(a, base, resamples=4000, seed=trial) for a in arms])
        detected += p[0] < 0.05
        false_alarms += sum(q < 0.05 for q in p[1:])
    assert detected / trials >= 0.8
    assert false_alarms / (trials * (family - 1)) <= 0.01


CELL = {"n": 4, "pattern": "rank stalls", "bound": "compute", "data": "iid", "alpha": 0.1, "task": "mlp"}


def _record(label: str, strategy: str, s: int, times: list[float], missed: bool = False, cell: dict = CELL) -> dict:
    return {
        "cell": cell,
        "arm": {"strategy": strategy, "c": s + 1, "s": s, "label": label},
        "protocol": {"lrs": [0.1, 0.2], "momenta": [0.0, 0.5]},
        "budget_s": 100.0,
        "tuning": {"chosen": {"lr": 0.1, "momentum": 0.0}, "edge": [], "missed_everywhere": missed},
        "eval": {"time_early": times, "time_late": times, "diverged": [False] * len(times)},
    }


def test_the_winner_is_compared_with_its_runner_up_at_equal_s_and_bounds_are_never_ranked():
    base = np.repeat(np.linspace(20, 40, 10), 2)  # seeds in pairs of equal ddp times
    swing = np.tile([1.3, 0.7], 10)  # pgc_fr alternates around 0.7 of ddp: always faster, not steadily vs 0.72
    records = [
        _record("ddp", "ddp", 0, list(base)),
        _record("pgc_fr c=2", "pgc_fr", 1, list(0.70 * base * swing)),
        _record("ignore_stragglers c=2", "ignore_stragglers", 1, list(0.72 * base)),
        _record("gc_fr c=3", "gc_fr", 2, list(0.85 * base)),
        _record("pgc_cr c=2 lookahead", "pgc_cr", 1, list(0.5 * base), missed=True),  # a bound: fast, not ranked
    ]
    cell = summarize_cell(records)
    assert cell["bounds"] == ["pgc_cr c=2 lookahead"] and cell["family"] == 3
    win = cell["winner"]
    assert win["arm"] == "pgc_fr c=2" and win["runner_up"] == "ignore_stragglers c=2"
    assert win["vs_runner_up"]["ratio"] == pytest.approx(0.70 / 0.72)
    assert win["sure"] == "not separated from the runner-up" and win["vs_runner_up"]["p"] > 0.05
    assert {row["s"]: row["best"] for row in cell["by_s"]} == {1: "pgc_fr c=2", 2: "gc_fr c=3"}
    records[2] = _record("ignore_stragglers c=2", "ignore_stragglers", 1, list(0.95 * base))
    cell = summarize_cell(records)
    win = cell["winner"]
    assert win["arm"] == "pgc_fr c=2" and win["sure"] == "separated" and win["vs_runner_up"]["p"] < 0.05
    row = which_strategy._row(cell)
    assert (row["arm"], row["runner_up"], row["sure"]) == ("pgc_fr c=2", "ignore_stragglers c=2", "separated")


def test_the_audit_command_prints_one_json_object_about_the_shipped_round():
    """``python benchmarks/map_audit.py`` on the shipped round: one JSON object with the documented fields,
    equal to the audit of the round's records, and the protocol's promises hold there: every arm family of the map
    in it, at least 20 evaluation seeds per arm, every node-level cell with s at or above the node size, and every
    arm that missed everywhere listed by the summary as a bound."""
    import subprocess
    import sys
    from pathlib import Path

    from pgc_lab.map.audit import shipped_records, shipped_summaries

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "benchmarks/map_audit.py"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = done.stdout.splitlines()
    out = json.loads(line)
    fields = {"tasks", "arms", "n", "min_seeds_per_arm", "edge_choices", "missed_everywhere", "node_cells_covered"}
    assert fields <= set(out)
    paths, records = shipped_records()
    assert {k: out[k] for k in fields} == {k: audit(records)[k] for k in fields}
    assert out["records"] == [p.relative_to(root).as_posix() for p in paths]
    families = {"ddp", "ignore_stragglers", "gc_fr", "gc_cr", "pgc_fr", "pgc_cr", "bounded_staleness"}
    families |= {f"pgc_{p} {c}" for p in ("fr", "cr") for c in CORRECTIONS} | {"bounded_staleness lookahead"}
    assert families <= set(out["arms"])
    assert out["min_seeds_per_arm"] >= 20 and out["node_cells_covered"] and out["node_cells"] > 0
    cells = [c for summary in shipped_summaries() for c in summary["cells"]]
    bounds = {f"{a} | {c['label']}" for c in cells for a in c["bounds"]}
    assert set(out["missed_everywhere"]) <= bounds
    edges = sum(bool(a["edge"]) for c in cells if c["cell"].get("fixed") is None for a in c["arms"])
    assert out["edge_choices"] == edges


def test_the_confirmation_reruns_the_candidate_its_runner_up_and_ddp_on_fresh_seeds_and_decides_there():
    base = np.repeat(np.linspace(20, 40, 10), 2)
    screen = [
        _record("ddp", "ddp", 0, list(base)),
        _record("pgc_fr c=2", "pgc_fr", 1, list(0.80 * base * np.tile([1.3, 0.7], 10))),
        _record("ignore_stragglers c=2", "ignore_stragglers", 1, list(0.85 * base)),
        _record("gc_fr c=3", "gc_fr", 2, list(0.90 * base)),
    ]
    summary = summarize(screen, source="screen")
    protocol = Protocol()
    ((cell, arms, confirm_protocol),) = confirm_plan(summary, screen, protocol)
    assert [a.label for a in arms] == ["ddp", "pgc_fr c=2", "ignore_stragglers c=2"]
    assert cell.fixed == (("ddp", 0.1, 0.0), ("pgc_fr c=2", 0.1, 0.0), ("ignore_stragglers c=2", 0.1, 0.0))
    seeds = confirm_protocol.eval_seeds
    assert CONFIRM_SEEDS[0] <= len(seeds) <= CONFIRM_SEEDS[1] and min(seeds) == CONFIRM_FIRST
    assert set(seeds).isdisjoint(protocol.eval_seeds) and set(seeds).isdisjoint(protocol.tuning_seeds)
    fixed = dict(CELL, fixed=[list(f) for f in cell.fixed])
    fresh = np.random.default_rng(1).uniform(20, 40, len(seeds))

    def confirm(candidate: float, runner: float) -> dict:
        records = [
            _record("ddp", "ddp", 0, list(fresh), cell=fixed),
            _record("pgc_fr c=2", "pgc_fr", 1, list(candidate * fresh), cell=fixed),
            _record("ignore_stragglers c=2", "ignore_stragglers", 1, list(runner * fresh), cell=fixed),
        ]
        (out,) = confirm_summary(records).values()
        return out

    out = confirm(0.8, 0.9)
    assert out["wins"] and out["sure"] == "confirmed; separated from the runner-up" and out["seeds"] == len(seeds)
    assert out["vs_ddp"]["ratio"] == pytest.approx(0.8) and out["vs_runner_up"]["ratio"] == pytest.approx(0.8 / 0.9)
    out = confirm(0.8, 0.8)
    assert out["wins"] and out["sure"] == "confirmed; not separated from the runner-up"
    out = confirm(1.0, 1.1)
    assert not out["wins"] and out["sure"].startswith("not confirmed")
    out = confirm(1.3, 1.4)  # every other arm slower: the row says ddp is faster, not "not confirmed"
    assert not out["wins"] and out["sure"].startswith("ddp is faster") and out["vs_ddp"]["p_holm"] < 0.05


def test_a_cell_confirmed_again_is_decided_on_its_newest_plan_only():
    """An arm added to the map can change a cell's candidate or runner-up: the cell is confirmed again on a new plan
    (its own seeds), and the records of the old plan, left in the same file, do not enter the decision."""
    rng = np.random.default_rng(2)
    old_times, new_times = rng.uniform(20, 40, 12), rng.uniform(20, 40, 8)
    old = dict(CELL, fixed=[["ddp", 0.1, 0.0], ["ignore_stragglers c=2", 0.1, 0.0]])
    new = dict(CELL, fixed=[["ddp", 0.1, 0.0], ["pgc_auto c=2", 0.1, 0.0], ["ignore_stragglers c=2", 0.1, 0.0]])
    records = [
        _record("ddp", "ddp", 0, list(old_times), cell=old),
        _record("ignore_stragglers c=2", "ignore_stragglers", 1, list(1.3 * old_times), cell=old),
        _record("ddp", "ddp", 0, list(new_times), cell=new),
        _record("pgc_auto c=2", "pgc_auto", 1, list(new_times), cell=new),
        _record("ignore_stragglers c=2", "ignore_stragglers", 1, list(1.3 * new_times), cell=new),
    ]
    (out,) = confirm_summary(records).values()
    assert out["candidate"] == "pgc_auto c=2" and out["seeds"] == len(new_times)
    assert out["vs_ddp"]["ratio"] == pytest.approx(1.0) and not out["wins"]


def test_the_guide_rows_state_task_n_pattern_arm_ratio_and_how_sure_and_say_so_where_pgc_wins_nowhere():
    base = np.repeat(np.linspace(20, 40, 10), 2)
    records = [
        _record("ddp", "ddp", 0, list(base)),
        _record("pgc_fr c=2", "pgc_fr", 1, list(0.70 * base * np.tile([1.3, 0.7], 10))),
        _record("ignore_stragglers c=2", "ignore_stragglers", 1, list(0.95 * base)),
    ]
    summary = summarize(records, source="docs/results/x.json") | {"round": "reduced"}
    table = which_strategy.build(summary, "docs/results/x.json")
    which_strategy.check(table, {"pgc_fr", "ignore_stragglers"})
    (row,) = table["rows"]
    assert (row["task"], row["n"], row["pattern"], row["arm"], row["seeds"]) == (
        "mlp",
        4,
        "rank stalls",
        "pgc_fr c=2",
        20,
    )
    assert table["pipelined_wins"] == 1
    readme, guide = which_strategy.render(table), which_strategy.render_guide(table)
    for block in (readme, guide):
        assert which_strategy.NO_PGC.split("**")[1] not in block
        line = next(x for x in block.splitlines() if x.startswith("| mlp | 4 |"))
        assert "`pgc_fr c=2`" in line and f"{row['ratio']:.2f} [{row['low']:.2f}, {row['high']:.2f}]" in line
        assert "separated" in line and "20 seeds" in line
    records[1] = _record("pgc_fr c=2", "pgc_fr", 1, list(1.2 * base))  # now slower: ignore_stragglers or ddp remain
    table = which_strategy.build(summarize(records, source="x") | {"round": "reduced"}, "x")
    assert table["pipelined_wins"] == 0
    assert which_strategy.NO_PGC in which_strategy.render(table)
    assert which_strategy.NO_PGC.replace("(docs/", "(") in which_strategy.render_guide(table)


def test_the_hard_round_runs_every_arm_on_the_harder_tasks_under_their_own_protocol():
    cells = rounds()["hard"]
    assert [c.task for c in cells[:2]] == list(HARD_TASKS) and {c.task for c in cells} == set(HARD_TASKS)
    assert all(c.n == 4 and c.cs == (2,) for c in cells) and cells[0].pattern == "rank stalls"
    assert {c.pattern for c in cells} == {"rank stalls", "slow node", "none"}
    items, skipped = plan_items(cells, protocol_for("hard"))
    labels = {a.label for c, a in items if c == cells[0]}
    assert {"ddp", "ignore_stragglers c=2", "gc_fr c=2", "gc_cr c=2", "pgc_auto c=2"} <= labels
    for strategy in ("pgc_fr", "pgc_cr"):
        assert {f"{strategy} c=2"} | {f"{strategy} c=2 {k}" for k in CORRECTIONS} <= labels
    assert {"bounded r=2 c=2", "bounded r=2 c=2 lookahead"} <= labels and not skipped
    assert len(items) == len(cells) * len(labels)


def test_a_validation_interval_enters_an_items_key_only_when_it_is_not_every_version():
    cell, arm = MapCell(4, "none", "compute"), MapArm("ddp")
    assert "val_every" not in item_key(cell, arm, Protocol())  # the shipped records keep their keys
    assert '"val_every": 5' in item_key(cell, arm, Protocol(val_every=5))


def test_a_round_stopped_part_way_confirms_its_complete_cells_only(tmp_path):
    from benchmarks import emulated_map

    cells = rounds()["tiny"]
    first = len(plan_items(cells[:1], tiny_protocol())[0])
    out = tmp_path / "tiny.jsonl"
    # the first cell whole, the second with ddp and one arm
    emulated_map.main(["--round", "tiny", "--out", str(out), "--limit", str(first + 2)])
    confirm = out.with_name("tiny_confirm.jsonl")
    assert len(read_records(out)) == first + 2 and not confirm.exists()  # a partial screen confirms nothing itself
    emulated_map.main(["--round", "tiny", "--out", str(out), "--confirm-complete-cells"])
    assert len(read_records(out)) == first + 2  # no screen item ran
    labels = {json.dumps([r["cell"]["pattern"], r["cell"]["data"]]) for r in read_records(confirm)}
    assert labels == {json.dumps([cells[0].pattern, cells[0].data])}
    summary = json.loads(out.with_suffix(".json").read_text())
    assert [(c["screened"], c.get("confirm") is not None) for c in summary["cells"]] == [(True, True), (False, False)]
    assert summary["confirm_planned"] == summary["confirm_done"] == 1 and summary["items_planned"] > first


def test_the_reduced_rounds_timing_tells_a_regenerated_arm_or_verdict_apart_from_the_shipped_one():
    import copy

    from benchmarks import reduced_timing

    shipped = json.loads(reduced_timing.SHIPPED.read_text())
    rows = reduced_timing.compare(shipped, shipped)
    assert all(r["present"] and not r["arms_differing"] and r["same_winner"] and r["same_confirmation"] for r in rows)
    changed = copy.deepcopy(shipped)
    cell = next(c for c in changed["cells"] if c.get("winner"))
    cell["arms"][1]["rmean_late_s"] *= 1.01  # one arm's time to the late target moved
    cell["winner"]["arm"] = "ddp"
    confirmed = next(c for c in changed["cells"] if c.get("confirm"))
    confirmed["confirm"]["wins"] = not confirmed["confirm"]["wins"]
    del changed["cells"][-1]
    rows = {r["cell"]: r for r in reduced_timing.compare(shipped, changed)}
    assert rows[cell["label"]]["arms_differing"] == [cell["arms"][1]["arm"]]
    assert not rows[cell["label"]]["same_winner"]
    assert not rows[confirmed["label"]]["same_confirmation"]
    assert not rows[shipped["cells"][-1]["label"]]["present"]


def test_a_changed_winner_is_within_the_stated_uncertainty_only_where_neither_summary_separated_it():
    from benchmarks.reduced_timing import within_stated_uncertainty

    def claim(winner, sure="not separated from the runner-up"):
        return {"winner": winner, "sure": sure, "runner_up": None, "vs_runner_up": None}

    assert within_stated_uncertainty(claim("a", "separated"), claim("a", "separated"))
    assert within_stated_uncertainty(claim("a"), claim("b"))
    assert not within_stated_uncertainty(claim("a", "separated"), claim("b"))
    assert not within_stated_uncertainty(claim("a"), claim("b", "separated"))
    assert not within_stated_uncertainty(claim("a"), claim(None, None))  # a winner against "no arm beats ddp"
    assert not within_stated_uncertainty(claim(None, None), claim("b"))


def test_every_record_names_the_machine_and_software_it_ran_on_and_the_summary_counts_them():
    from lightning_pgc.emulator.machine import NOT_RECORDED, environments

    here = environment()
    assert here["torch"] == torch.__version__ and here["cores"] == os.cpu_count()
    assert here["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and here["cpu"]
    other = {**here, "cpu_capability": "DEFAULT"}
    counted = environments([{"environment": here}, {"environment": other}, {"environment": here}, {}])
    assert counted == [
        {**here, "records": 2},
        {**other, "records": 1},
        {"environment": NOT_RECORDED, "records": 1},
    ]
