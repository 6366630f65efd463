"""The map grid (benchmarks/grid.py): learning-rate rule, cell statistics, incomplete cells, rendering from the run
records (append-only, one file per round), and a 2-step smoke run of real jobs."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import grid_map  # noqa: E402

from pgc_lab.experiments import crossover as cx  # noqa: E402

T_975_DF2 = 4.302652729911275  # Student t, two-sided 95 %, 2 degrees of freedom (tables)


def test_choose_setting_lowest_mean_final_loss_ties_to_the_smaller_rate():
    assert cx.choose_setting({0.1: [0.5, 0.7], 0.05: [0.4, 0.9], 0.02: [0.8, 0.8]}, runs=2) == 0.1  # 0.6 < 0.65
    assert cx.choose_setting({0.1: [0.5], 0.05: [0.5]}, runs=1) == 0.05  # tie: the smaller rate
    assert cx.choose_setting({0.1: [0.1, float("nan")], 0.05: [0.9, 0.9]}, runs=2) == 0.05  # diverged seed: +inf
    assert cx.choose_setting({0.1: [None], 0.05: [2.0]}, runs=1) == 0.05  # a failed run is +inf
    assert cx.choose_setting({0.1: [0.1], 0.05: []}, runs=1) is None  # unfinished sweep: no rate yet
    assert cx.choose_setting({0.1: [math.inf], 0.05: [math.inf]}, runs=1) == 0.05
    # (rate, momentum) settings: ties go to the smaller rate, then the smaller momentum
    assert cx.choose_setting({(0.1, 0.9): [0.3], (0.5, 0.0): [0.2], (1.0, 0.0): [0.2]}, runs=1) == (0.5, 0.0)
    assert cx.choose_setting({(0.5, 0.9): [0.2], (0.5, 0.0): [0.2]}, runs=1) == (0.5, 0.0)


def test_sweep_settings_keep_the_effective_rate_across_momenta_and_old_names_stay_valid():
    settings = cx.sweep_settings([0.02, 0.05, 0.1], [0.9, 0.0, 0.5])
    assert settings == [
        (0.02, 0.9),
        (0.05, 0.9),
        (0.1, 0.9),
        (0.2, 0.0),
        (0.5, 0.0),
        (1.0, 0.0),
        (0.1, 0.5),
        (0.25, 0.5),
        (0.5, 0.5),
    ]  # lr / (1 - m) in {0.2, 0.5, 1.0} at every momentum
    with pytest.raises(ValueError, match="momentum must be in"):
        cx.sweep_settings([0.1], [1.0])
    cell, arm = cx.GridCell("exponential", "sleep"), cx.GridArm("pgc_cr", 2)
    # the recipe's momentum is not named: records made before momentum was swept keep their names and specs
    assert cx.Job("main", cell, arm, 0.05, 3).name == "main__exp-sleep__pgc_cr_c2__lr0.05__seed3"
    assert cx.Job("main", cell, arm, 0.5, 3, 0.0).name == "main__exp-sleep__pgc_cr_c2__lr0.5__m0__seed3"
    args = grid_map.parse_args(ARGV)
    assert "momentum" not in grid_map.job_spec(cx.Job("main", cell, arm, 0.05, 3), args, 10)["model"]
    assert grid_map.job_spec(cx.Job("main", cell, arm, 0.5, 3, 0.0), args, 10)["model"]["momentum"] == 0.0
    sweep = cx.plan_sweep([cell], [arm], [0.05, 0.1], [0], "lognormal + stalls", momenta=[0.9, 0.0])
    assert [j.setting for j in sweep] == [(0.05, 0.9), (0.1, 0.9), (0.5, 0.0), (1.0, 0.0)]


def test_a_new_round_reruns_every_arm_of_a_cell_and_round_one_keeps_its_names():
    """A round is a set of main runs made together: every arm of the cell gets a new name (and record) in round 2,
    also the arms whose setting did not change, while round 1's names are those of the records made before rounds
    existed. The sweep is not per round."""
    cell, arms = cx.GridCell("one slow rank", "sleep"), [cx.GridArm("dgd"), cx.GridArm("pgc_cr", 2)]
    setting_of = {("sleep", "dgd"): (0.1, 0.9), ("sleep", "pgc_cr_c2"): (0.5, 0.0)}
    first, _ = cx.plan_main([cell], arms, [0], setting_of, main_round=1)
    second, _ = cx.plan_main([cell], arms, [0], setting_of, main_round=2)
    assert [j.name for j in first] == [
        "main__slowrank-sleep__dgd__lr0.1__seed0",
        "main__slowrank-sleep__pgc_cr_c2__lr0.5__m0__seed0",
    ]
    assert [j.name for j in second] == [
        "main__slowrank-sleep__dgd__lr0.1__r2__seed0",
        "main__slowrank-sleep__pgc_cr_c2__lr0.5__m0__r2__seed0",
    ]
    assert [j.setting for j in first] == [j.setting for j in second]
    assert grid_map.parse_args([]).round == 2
    sweep = cx.plan_sweep([cell], arms, [0.1], [0], "lognormal + stalls")
    assert all(j.round == 1 and "__r" not in j.name for j in sweep)


def _record(time_to_target: float, final_acc: float = 0.9, reach: bool = True) -> dict:
    """Validation loss 1.0 at t=0 falling linearly to 0.0 (reach) or 0.6 at 2 * time_to_target: with target 0.5 the
    crossing is at ``time_to_target``; accuracy rises linearly from 0.1 to ``final_acc``."""
    end = 2 * time_to_target
    return {
        "ok": True,
        "error": "",
        "row": {
            "final_val_loss": 0.0 if reach else 0.6,
            "max_age": 1.0,
            "utilization_mean": 0.5,
            "grad_evals_to_target": 10.0,
            "error_decomposition": {"pgc/staleness_ratio": time_to_target},
        },
        "val": [[0.0, 0, 1.0, 0.1], [end, 10, 0.0 if reach else 0.6, final_acc]],
    }


def _cell(times: dict[str, list[float]], reach: dict[str, list[bool]] | None = None) -> dict:
    arms = [cx.GridArm("ddp"), cx.GridArm("dgd"), cx.GridArm("pgc_cr", 2)]
    records = {
        a.key: {
            seed: _record(t, reach=(reach or {}).get(a.key, [True] * 3)[i])
            for i, (seed, t) in enumerate(zip([0, 1, 2], times[a.key]))
        }
        for a in arms
    }
    return cx.summarize_cell(records, arms, [0, 1, 2], 0.5, {a.key: (0.05, 0.9) for a in arms})


def test_cell_winner_margin_and_paired_intervals_by_hand():
    cell = _cell({"ddp": [4.0, 6.0, 8.0], "dgd": [5.0, 5.0, 5.0], "pgc_cr_c2": [2.0, 3.0, 4.0]})
    assert cell["status"] == "complete" and cell["runs_finished"] == 9
    # geometric means: pgc (24)^(1/3) = 2.88 < dgd 5 < ddp (192)^(1/3) = 5.77
    assert (cell["winner"], cell["runner_up"]) == ("pgc_cr_c2", "dgd")
    d = [math.log(2 / 5), math.log(3 / 5), math.log(4 / 5)]
    half = T_975_DF2 * statistics.stdev(d) / math.sqrt(3)
    margin = cell["margin"]
    assert margin["estimate"] == pytest.approx(math.exp(statistics.fmean(d)))
    assert (margin["low"], margin["high"]) == (
        pytest.approx(math.exp(statistics.fmean(d) - half)),
        pytest.approx(math.exp(statistics.fmean(d) + half)),
    )
    pgc = next(a for a in cell["arms"] if a["arm"] == "pgc_cr_c2")
    assert pgc["time_to_target_s"] == pytest.approx(24 ** (1 / 3))
    assert pgc["means"]["error_decomposition"] == {"pgc/staleness_ratio": pytest.approx(3.0)}  # mean of 2, 3, 4
    # against ddp: per-seed ratios 1/2, 1/2, 1/2 -> exactly 0.5 with a zero-width interval
    assert pgc["vs_ddp"]["estimate"] == pytest.approx(0.5) and pgc["vs_ddp"]["low"] == pytest.approx(0.5)
    assert pgc["vs_dgd"]["estimate"] == pytest.approx(margin["estimate"])
    dgd = next(a for a in cell["arms"] if a["arm"] == "dgd")
    assert dgd["vs_dgd"] is None and dgd["vs_ddp"]["estimate"] == pytest.approx((5 / 4 * 5 / 6 * 5 / 8) ** (1 / 3))
    # equal wall per seed = the earliest end (pgc: 4, 6, 8 s); ddp ends at 8, 12, 16 s, so it is half way:
    # accuracy 0.1 + 0.8 / 2 = 0.5 on every seed
    ddp = next(a for a in cell["arms"] if a["arm"] == "ddp")
    assert ddp["acc_at_equal_wall"] == pytest.approx(0.5) and pgc["acc_at_equal_wall"] == pytest.approx(0.9)
    text = cx.map_cell_text(cell)
    assert text.startswith("**pgc_cr_c2** over dgd: 0.58x [") and text.endswith("(not separated)")  # [0.24, 1.37]
    steady = _cell({"ddp": [4.0, 6.0, 8.0], "dgd": [5.0, 5.0, 5.0], "pgc_cr_c2": [2.0, 2.1, 1.9]})
    assert steady["margin"]["high"] < 1 and not cx.map_cell_text(steady).endswith("(not separated)")


def test_the_ratio_against_dgd_splits_into_steps_and_seconds_per_step_by_hand():
    """An arm whose steps are cheaper but that needs more of them (what PGC does here): the two paired ratios
    are computed on the same seeds and multiply to the time ratio."""

    def rec(wall_end: float, steps_end: float) -> dict:  # loss 1 -> 0 linearly: target 0.5 is crossed half way
        return {"ok": True, "error": "", "row": {}, "val": [[0.0, 0, 1.0, 0.1], [wall_end, steps_end, 0.0, 0.9]]}

    arms = [cx.GridArm("ddp"), cx.GridArm("dgd"), cx.GridArm("pgc_cr", 2)]
    records = {
        "ddp": {s: rec(10.0, 100) for s in (0, 1, 2)},
        "dgd": {0: rec(10.0, 100), 1: rec(12.0, 100), 2: rec(8.0, 100)},  # 50 steps, 0.1 0.12 0.08 s each
        "pgc_cr_c2": {0: rec(12.0, 200), 1: rec(12.0, 160), 2: rec(12.0, 240)},
    }  # 100 80 120 steps, 6 s
    cell = cx.summarize_cell(records, arms, [0, 1, 2], 0.5, {})
    assert [a["momentum"] for a in cell["arms"]] == [None] * 3  # no setting given
    pgc = next(a for a in cell["arms"] if a["arm"] == "pgc_cr_c2")
    steps = [math.log(100 / 50), math.log(80 / 50), math.log(120 / 50)]
    per_step = [math.log(0.06 / 0.1), math.log(0.075 / 0.12), math.log(0.05 / 0.08)]
    times = [math.log(6 / 5), math.log(6 / 6), math.log(6 / 4)]
    for key, d in (("steps_vs_dgd", steps), ("step_time_vs_dgd", per_step), ("vs_dgd", times)):
        half = T_975_DF2 * statistics.stdev(d) / math.sqrt(3)
        iv = pgc[key]
        assert iv["estimate"] == pytest.approx(math.exp(statistics.fmean(d))), key
        assert (iv["low"], iv["high"]) == (
            pytest.approx(math.exp(statistics.fmean(d) - half)),
            pytest.approx(math.exp(statistics.fmean(d) + half)),
        ), key
    assert pgc["steps_vs_dgd"]["estimate"] * pgc["step_time_vs_dgd"]["estimate"] == pytest.approx(
        pgc["vs_dgd"]["estimate"]
    )
    assert pgc["steps_vs_dgd"]["low"] > 1 and pgc["step_time_vs_dgd"]["high"] < 1  # more, cheaper steps
    dgd = next(a for a in cell["arms"] if a["arm"] == "dgd")
    assert dgd["steps_vs_dgd"] is None and dgd["step_time_vs_dgd"] is None
    row = next(line for line in cx.cell_table(cell).splitlines() if line.startswith("| pgc_cr c=2 |"))
    assert f"| {cx._interval(pgc['steps_vs_dgd'])} | {cx._interval(pgc['step_time_vs_dgd'])} |" in row
    # an arm that missed the target on a seed gets no split either
    records["pgc_cr_c2"][1] = {**rec(12.0, 160), "val": [[0.0, 0, 1.0, 0.1], [12.0, 160, 0.6, 0.5]]}
    pgc = next(a for a in cx.summarize_cell(records, arms, [0, 1, 2], 0.5, {})["arms"] if a["arm"] == "pgc_cr_c2")
    assert pgc["steps_vs_dgd"] is None and pgc["step_time_vs_dgd"] is None


def test_an_arm_that_missed_the_target_on_a_seed_cannot_win():
    cell = _cell(
        {"ddp": [4.0, 6.0, 8.0], "dgd": [5.0, 5.0, 5.0], "pgc_cr_c2": [2.0, 3.0, 4.0]},
        reach={"pgc_cr_c2": [True, False, True]},
    )
    pgc = next(a for a in cell["arms"] if a["arm"] == "pgc_cr_c2")
    assert pgc["reached"] == 2 and pgc["vs_dgd"] is None and pgc["vs_ddp"] is None
    assert (cell["winner"], cell["runner_up"]) == ("dgd", "ddp")


def test_the_arms_table_marks_where_each_arm_is_separably_faster_or_slower_than_dgd():
    fast = _cell({"ddp": [4.0, 6.0, 8.0], "dgd": [5.0, 5.0, 5.0], "pgc_cr_c2": [2.0, 2.1, 1.9]})
    slow = _cell(
        {"ddp": [4.0, 6.0, 8.0], "dgd": [5.0, 5.0, 5.0], "pgc_cr_c2": [9.0, 10.0, 11.0]},
        reach={"ddp": [True, False, True]},
    )
    lines = cx.arms_table({"a-sleep": fast, "b-sleep": slow}, ["a-sleep", "b-sleep"]).splitlines()
    assert lines[0] == "| arm | `a-sleep` | `b-sleep` |" and len(lines) == 4  # header, separator, ddp, pgc: no dgd
    pgc = next(a for a in fast["arms"] if a["arm"] == "pgc_cr_c2")
    slower = next(a for a in slow["arms"] if a["arm"] == "pgc_cr_c2")
    ddp = next(a for a in fast["arms"] if a["arm"] == "ddp")
    assert pgc["vs_dgd"]["high"] < 1 and slower["vs_dgd"]["low"] > 1
    assert not cx.separated(ddp["vs_dgd"])  # 4/5, 6/5, 8/5: [0.53, 2.2]
    assert lines[2] == f"| ddp | {cx._interval(ddp['vs_dgd'])} | reached 2/3 |"
    assert lines[3] == (
        f"| pgc_cr c=2 | **{cx._interval(pgc['vs_dgd'])} faster** | {cx._interval(slower['vs_dgd'])} slower |"
    )


def test_a_cell_with_a_missing_run_is_incomplete_and_names_no_winner():
    arms = [cx.GridArm("ddp"), cx.GridArm("dgd")]
    records = {"ddp": {0: _record(4.0), 1: _record(4.0)}, "dgd": {0: _record(1.0)}}
    cell = cx.summarize_cell(records, arms, [0, 1], 0.5, {})
    assert cell["status"] == "incomplete" and cell["winner"] is None and cell["margin"] is None
    assert (cell["runs_finished"], cell["runs_expected"]) == (3, 4)
    assert cx.map_cell_text(cell) == "incomplete (3/4 runs)"
    records["dgd"][1] = {"ok": False, "error": "timeout", "row": {}, "val": []}  # finished, failed: cannot win
    cell = cx.summarize_cell(records, arms, [0, 1], 0.5, {})
    assert cell["status"] == "complete" and cell["winner"] == "ddp" and cell["runner_up"] is None
    assert cx.map_cell_text(cell) == "**ddp** (1 failed runs)"


def test_arms_follow_n():
    arms, skipped = cx.arms_for(4, [2, 4, 8])
    keys = [a.key for a in arms]
    assert keys[:2] == ["ddp", "dgd"] and "pgc_cr_c4_valve" in keys and "bounded_c4_valve" in keys
    assert "gc_fr_c2" in keys and not any(k.endswith("_c8") for k in keys)
    assert any("c=8" in reason for reason in skipped)
    assert cx.GridArm("bounded", 4, True).strategy(3) == (
        "bounded_staleness",
        {"seed": 3, "coordinator": {"replication": 2, "staleness": 4}},
        {**cx.VALVE, "action": "window"},
    )
    assert cx.GridArm("ignore", 2).strategy(0)[:2] == ("ignore_stragglers", {"seed": 0, "stragglers": 1})


ARGV = [
    "--devices",
    "2",
    "--c",
    "2",
    "--families",
    "ddp",
    "dgd",
    "pgc_cr",
    "--adaptive",
    "--delays",
    "exponential",
    "one slow rank",
    "--costs",
    "sleep",
    "--seeds",
    "0",
    "1",
    "2",
    "--lrs",
    "0.05",
    "0.1",
    "--sweep-seeds",
    "0",
    "--target",
    "0.5",
    "--no-wandb",
]


def test_report_renders_from_run_records_and_marks_incomplete_cells(tmp_path):
    """Fake sweep and main records in the store; the report chooses the rates, names the winner of the complete
    cell and marks the other one incomplete."""
    argv = ARGV + ["--runs", str(tmp_path / "runs"), "--docs", str(tmp_path / "docs"), "--out", str(tmp_path / "o")]
    args = grid_map.parse_args(argv)
    arms, _ = cx.arms_for(2, [2], ["ddp", "dgd", "pgc_cr"], [])
    store = cx.Store(tmp_path / "runs")
    cells = [cx.GridCell("exponential", "sleep"), cx.GridCell("one slow rank", "sleep")]
    sweep = cx.plan_sweep(cells, arms, [0.05, 0.1], [0], "lognormal + stalls", args.momenta)
    assert len(sweep) == 3 * 2 * 2  # one cost, three arms, two rates at two momenta, one seed
    for job in sweep:  # rate 0.1 at momentum 0.9 is best for pgc_cr only, momentum 0 for nobody
        best = job.setting == ((0.1, 0.9) if job.arm.family == "pgc_cr" else (0.05, 0.9))
        store.save(
            job,
            grid_map.job_spec(job, args, args.sweep_steps),
            {"ok": True, "error": "", "row": {"final_val_loss": 0.2 if best else 0.4}, "val": []},
        )
    setting_of = grid_map.chosen_settings(sweep, store, args)
    assert setting_of[("sleep", "pgc_cr_c2")] == (0.1, 0.9) and setting_of[("sleep", "ddp")] == (0.05, 0.9)
    main_jobs, waiting = cx.plan_main(cells, arms, [0, 1, 2], setting_of, args.round)
    assert not waiting and len(main_jobs) == 2 * 3 * 3
    # paired runs back to back: within a cell, every arm of seed 0, then of seed 1, ...
    assert [(j.seed, j.arm.key) for j in main_jobs[:4]] == [(0, "ddp"), (0, "dgd"), (0, "pgc_cr_c2"), (1, "ddp")]
    times = {"ddp": [4.0, 6.0, 8.0], "dgd": [5.0, 5.0, 5.0], "pgc_cr_c2": [2.0, 3.0, 4.0]}
    for job in main_jobs:
        if job.cell.key == "slowrank-sleep" and job.arm.key == "dgd" and job.seed == 2:
            continue  # not finished yet
        store.save(job, grid_map.job_spec(job, args, args.steps), _record(times[job.arm.key][job.seed]))
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["round2.jsonl.gz", "sweep.jsonl.gz"]
    # a record run with another spec (e.g. other steps) is not reused
    other = grid_map.parse_args(argv + ["--steps", "50"])
    assert store.load(main_jobs[0], grid_map.job_spec(main_jobs[0], other, other.steps)) is None

    result = grid_map.main(argv + ["--render-only"])
    cells_out = result["cells"]
    assert cells_out["exp-sleep"]["winner"] == "pgc_cr_c2"
    assert cells_out["slowrank-sleep"]["status"] == "incomplete"
    assert result["sweep_runs_finished"] == 12
    assert result["chosen_setting"]["sleep/pgc_cr_c2"] == {"lr": 0.1, "momentum": 0.9}
    text = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert text.count(cx.MARK_BEGIN) == 1 and "Complete cells: 1 of 2** (exp-sleep)" in text
    assert "| exponential | **pgc_cr_c2** over dgd: 0.58x [" in text
    assert "| one slow rank | incomplete (8/9 runs) |" in text
    assert "| pgc_cr c=2 | 0.1 | 0.9 | 3/3 | 2.88 |" in text
    assert (tmp_path / "docs" / "grid_map.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "docs" / "grid_map.json").read_text())["cells"] == json.loads(
        json.dumps(cells_out, default=float)
    )
    # rendering again replaces the block instead of adding another
    grid_map.main(argv + ["--render-only"])
    assert (tmp_path / "docs" / "benchmarks.md").read_text().count(cx.MARK_BEGIN) == 1


def test_smoke_grid_two_steps_per_cell_real_jobs(tmp_path):
    """Two real jobs (dgd and pgc_cr c=2 on 2 ranks, 2 steps, one seed, no sweep), then a rerun that reuses both."""
    argv = [
        "--devices",
        "2",
        "--c",
        "2",
        "--families",
        "dgd",
        "pgc_cr",
        "--adaptive",
        "--delays",
        "exponential",
        "--costs",
        "sleep",
        "--seeds",
        "0",
        "--steps",
        "2",
        "--val-every",
        "1",
        "--no-sweep",
        "--start-method",
        "fork",
        "--no-wandb",
        "--timeout",
        "120",
        "--runs",
        str(tmp_path / "runs"),
        "--docs",
        str(tmp_path / "docs"),
        "--out",
        str(tmp_path / "out"),
    ]
    result = grid_map.main(argv)
    store = cx.Store(tmp_path / "runs")
    records = store.records.records("round2")  # the default round
    assert list(records) == ["main__exp-sleep__dgd__lr0.05__r2__seed0", "main__exp-sleep__pgc_cr_c2__lr0.05__r2__seed0"]
    for record in records.values():
        assert record["ok"], record["error"]
        assert record["row"]["replicas_identical"] and record["row"]["steps"] == 2
        assert [p[1] for p in record["val"]] == [0, 1, 2]
        assert record["row"]["grad_evals_per_step"] > 0 and "error_decomposition" in record["row"]
    assert result["cells"]["exp-sleep"]["status"] != "incomplete"
    before = store.records.path("round2").read_bytes()
    grid_map.main(argv)  # everything reused: no job runs, nothing is appended
    assert store.records.path("round2").read_bytes() == before


def test_records_are_appended_and_the_newest_line_of_a_name_wins(tmp_path):
    """The store only appends: a rerun's record supersedes the earlier one, a fresh reader sees the same, and a
    last member cut short while it is being written is ignored."""
    from pgc_lab.experiments.results import RunRecords

    records = RunRecords(tmp_path)
    records.append("round1", [{"job": "a", "x": 1.0}, {"job": "b", "x": float("nan")}])
    first = records.path("round1").read_bytes()
    records.append("round1", [{"job": "a", "x": 2.0}])
    data = records.path("round1").read_bytes()
    assert data.startswith(first) and len(data) > len(first)
    fresh = RunRecords(tmp_path)
    assert fresh.books() == ["round1"] and list(fresh.records("round1")) == ["a", "b"]
    assert fresh.get("round1", "a") == {"job": "a", "x": 2.0} and math.isnan(fresh.get("round1", "b")["x"])
    assert fresh.get("round1", "c") is None and fresh.get("round2", "a") is None
    records.path("round1").write_bytes(data + data[len(first) :][:-5])  # a member still being written
    assert RunRecords(tmp_path).get("round1", "a") == {"job": "a", "x": 2.0}


@pytest.mark.parametrize("page", ["docs/results", "docs/results/first_pass"], ids=["map", "first_pass"])
def test_grid_map_json_is_what_the_shipped_records_render(page, tmp_path):
    """Re-rendering from the records in docs/results/grid_runs with the command grid_map.json names gives grid_map.json
    again (its render time and output folder aside)."""
    shipped = json.loads((ROOT / page / "grid_map.json").read_text())
    argv = shipped["command"].split("benchmarks/grid.py ", 1)[1].split()
    if "--docs" in argv:
        del argv[argv.index("--docs") : argv.index("--docs") + 2]
    grid_map.main(argv + ["--runs", str(ROOT / shipped["runs_folder"]), "--docs", str(tmp_path)])
    rendered = json.loads((tmp_path / "grid_map.json").read_text())
    for key in ("command", "rendered", "runs_folder"):
        rendered.pop(key), shipped.pop(key)
    assert rendered == shipped


@pytest.mark.parametrize("page", ["docs/results", "docs/results/first_pass"], ids=["map", "first_pass"])
def test_benchmarks_map_block_is_what_grid_renders_from_grid_map_json(page):
    """The map's block in docs/results/benchmarks.md, and the first pass's (momentum 0.9 only) in its own page, are exactly
    what benchmarks/grid.py renders from the grid_map.json beside them."""
    docs = ROOT / page
    result = json.loads((docs / "grid_map.json").read_text())
    text = (docs / "benchmarks.md").read_text()
    block = text[text.index(cx.MARK_BEGIN) : text.index(cx.MARK_END) + len(cx.MARK_END)]
    assert block == cx.render_markdown(result)


NUMBER_WORDS = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def test_the_summarys_count_of_separated_winners_is_the_maps():
    """docs/results/benchmarks.md says how many complete cells have a winner separated from its runner-up (the margin's
    interval excludes 1) and names each such cell's winner and runner-up with the margin; all of it is derived from
    docs/results/grid_map.json here, so a re-render that changes the count, a winner or a margin fails until the summary
    is updated."""
    cells = json.loads((ROOT / "docs" / "results" / "grid_map.json").read_text())["cells"]
    complete = {k: c for k, c in cells.items() if c["status"] == "complete"}
    separated = {k: c for k, c in complete.items() if c["margin"]["high"] < 1}
    text = " ".join((ROOT / "docs" / "results" / "benchmarks.md").read_text().replace("**", "").split()).lower()
    plural = "cell has" if len(separated) == 1 else "cells have"
    assert (
        f"{NUMBER_WORDS[len(separated)]} of the {len(complete)} {plural} a winner separated from its runner-up"
        in text.replace(f"of the {len(complete)} cells has", f"of the {len(complete)} cell has")
    )

    def named(arm: str) -> str:  # an arm key as the summary writes it: `gc_fr` c = 2
        family, _, c = arm.rpartition("_c")
        return f"`{family}` c = {c}" if family else f"`{arm}`"

    for key, cell in separated.items():
        sentence = f"{named(cell['winner'])} took {cx._interval(cell['margin'])} of {named(cell['runner_up'])}'s time"
        assert sentence.lower() in text, (key, sentence)


def test_the_runner_waits_while_the_pause_file_exists(tmp_path):
    """--pause-file: no job starts while the file exists; the runner goes on once it is removed."""
    import threading
    import time

    pause = tmp_path / "PAUSE"
    pause.touch()
    threading.Timer(0.5, pause.unlink).start()
    started = time.monotonic()
    grid_map.wait_while_paused(str(pause))
    assert not pause.exists() and time.monotonic() - started >= 0.5
    grid_map.wait_while_paused(str(pause))  # absent: returns at once
    grid_map.wait_while_paused(None)


def test_a_record_with_the_flat_strategy_keywords_of_older_runs_still_matches_its_job(tmp_path):
    """Records keep the strategy keywords they ran with: those made before the strategy grouped its options name
    them flat (``{"replication": 2, "staleness": 2}``). The store reads them in today's form, so such a record is
    reused for its job, and one of another window is not."""
    argv = ARGV + ["--runs", str(tmp_path / "runs"), "--docs", str(tmp_path / "docs"), "--out", str(tmp_path / "o")]
    args = grid_map.parse_args(argv)
    job = cx.Job("main", cx.GridCell("exponential", "sleep"), cx.GridArm("bounded", 2), 0.1, 0, 0.9, round=2)
    spec = grid_map.job_spec(job, args, args.steps)
    assert spec["strategy_kwargs"] == {"seed": 0, "coordinator": {"replication": 2, "staleness": 2}}
    store = cx.Store(tmp_path / "runs")
    for staleness, reused in ((2, True), (3, False)):  # the newest line of a name wins
        flat = {"seed": 0, "replication": 2, "staleness": staleness}
        old = json.loads(json.dumps({**cx.Store.comparable(spec), "strategy_kwargs": flat}))
        store.records.append(store.book(job), [{"job": job.name, "spec": old, "ok": True}])
        assert (store.load(job, spec) is not None) is reused
