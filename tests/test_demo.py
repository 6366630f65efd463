"""The main job (`make demo`) on a short run, and its pure helpers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_pgc import demo
from lightning_pgc import demo_correction as dc
from lightning_pgc.experiments import JobResult

ROOT = Path(__file__).resolve().parents[1]


def test_outcome_reads_the_crossing_of_the_validation_loss():
    """The demo's time/steps to target: where the validation loss (not the decoded training loss, which mixes
    model versions under PGC) first reaches the target, linear between measurements."""
    curve = [(0.0, 1, 0.01), (1.0, 2, 0.01)]  # a training loss already below every target: not what is read
    val_curve = [
        (0.0, 0, 3.0, 0.1, 0.01),
        (1.0, 10, 2.0, 0.3, 0.01),
        (2.0, 20, 0.55, 0.8, 0.01),
        (3.0, 30, 0.1, 0.9, 0.01),
    ]
    result = JobResult(
        out=Path("."),
        ok=True,
        curve=curve,
        val_curve=val_curve,
        summary={"global_step": 30, "fit_wall_s": 3.5},
        ranks=[{"checksum": "a", "skipped_steps": 0}] * 2,
    )
    args = demo.parse_args(["--target-loss", "0.6"])
    o = demo.outcome("pgc", result, args)
    # 2.0 at wall 1 / step 10 and 0.55 at wall 2 / step 20: 0.6 is reached 1.4/1.45 of the way
    assert o.time_to_target == pytest.approx(1.0 + 1.4 / 1.45) and o.steps_to_target == pytest.approx(10 + 14 / 1.45)
    assert o.identical and o.final_loss == pytest.approx(0.1) and o.steps == 30 and o.val_acc == 0.9
    never = demo.outcome("pgc", result, demo.parse_args(["--target-loss", "0.01"]))
    assert never.time_to_target is None and never.steps_to_target is None


def test_unknown_setting_or_arm_is_refused():
    with pytest.raises(SystemExit, match="--only: unknown"):
        demo.selected(demo.parse_args(["--only", "pgc,nope"]))
    with pytest.raises(SystemExit, match="--settings: unknown"):
        demo.selected(demo.parse_args(["--settings", "wins,draws"]))
    with pytest.raises(SystemExit, match="at least one"):
        demo.selected(demo.parse_args(["--settings", ","]))
    pairs = demo.selected(demo.parse_args(["--settings", "loses", "--only", "pgc,dgd"]))
    assert [(s.key, a.key) for s, a in pairs] == [("loses", "dgd"), ("loses", "pgc")]


def test_every_demo_job_is_the_map_grids_job_for_its_cell_arm_and_seed():
    """The demo follows the map: each of its jobs has the spec benchmarks/grid_map.py gives the same cell, arm,
    setting and seed (delays, cost, steps, validation, rate, momentum), apart from where it writes and W&B."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import grid_map

    from lightning_pgc.experiments import crossover as cx

    grid_args = grid_map.parse_args(["--no-wandb"])
    args = demo.parse_args(["--seed", "3"])
    delays = {key: name for name, key in cx.DELAY_KEYS.items()}
    arms = {a.key: a for a in cx.arms_for(4, [2, 4])[0]}
    assert set(demo.SETTINGS) == {"wins", "loses"}
    for setting in demo.SETTINGS.values():
        delay, cost = setting.map_cell.split("-")
        cell = cx.Cell(delays[delay], cost)
        for arm in setting.arms:
            job = cx.Job("main", cell, arms[arm.map_arm], arm.lr, 3, arm.momentum, round=2)
            theirs = grid_map.job_spec(job, grid_args, grid_args.steps)
            mine = demo.job_spec(setting, arm, args, Path("x"))
            drop = ("out", "wandb")
            assert mine["wandb"] is None
            assert {k: v for k, v in mine.items() if k not in drop} == {
                k: v for k, v in theirs.items() if k not in drop
            }, (setting.key, arm.key)


def test_the_demos_settings_are_where_the_map_says_pgc_wins_and_loses():
    """Each demo setting is a complete cell of docs/grid_map.json, every arm at the rate and momentum the map's
    sweep chose, and the map's paired interval for its pgc arm lies below 1 against dgd and ddp where the demo says
    pgc wins, above 1 where it says pgc loses. If a new map changes this, the demo must change with it."""
    grid = json.loads(demo.MAP.read_text())
    assert (grid["settings"]["steps"], grid["settings"]["val_every"], grid["settings"]["target"]) == (
        demo.parse_args([]).steps,
        demo.parse_args([]).val_every,
        demo.parse_args([]).target_loss,
    )
    for setting in demo.SETTINGS.values():
        cell = grid["cells"][setting.map_cell]
        assert cell["status"] == "complete" and cell["runs_ok"] == cell["runs_expected"]
        cost = setting.map_cell.split("-")[1]
        for arm in setting.arms:
            chosen = grid["chosen_setting"][f"{cost}/{arm.map_arm}"]
            assert (chosen["lr"], chosen["momentum"]) == (arm.lr, arm.momentum), (setting.key, arm.key)
        (pgc,) = [a for a in cell["arms"] if a["arm"] == next(a.map_arm for a in setting.arms if a.key == "pgc")]
        for against in ("vs_dgd", "vs_ddp"):
            iv = pgc[against]
            assert iv["seeds"] >= 5
            assert (iv["high"] < 1) if setting.key == "wins" else (iv["low"] > 1), (setting.key, against, iv)


def test_with_wandb_every_demo_job_is_an_offline_run_grouped_by_setting():
    args = demo.parse_args(["--wandb"])
    setting = demo.SETTINGS["loses"]
    spec = demo.job_spec(setting, setting.arms[-1], args, Path("x"))
    assert spec["wandb"]["offline"] and spec["wandb"]["group"] == "demo-loses"
    assert spec["wandb"]["name"] == "loses__pgc" and "stalls-sleep" in spec["wandb"]["tags"]


def _outcome(setting: str, key: str, time: float, steps: float, ref: dict | None = None) -> demo.Outcome:
    return demo.Outcome(
        label=key,
        wall_s=1.0,
        steps=200,
        time_to_target=time,
        steps_to_target=steps,
        val_acc=0.9,
        final_loss=0.1,
        curve=[],
        skipped=[0] * 4,
        identical=True,
        setting=setting,
        key=key,
        lr=0.1,
        momentum=0.9,
        map_vs_dgd=ref,
    )


def test_the_verdict_says_what_this_run_shows_the_split_and_why_and_flags_disagreement_with_the_map():
    ref = {"estimate": 0.56, "low": 0.46, "high": 0.68, "seeds": 5}
    runs = [_outcome("wins", "ddp", 10.0, 80), _outcome("wins", "dgd", 9.0, 80), _outcome("wins", "pgc", 4.5, 100, ref)]
    text = demo.verdict(demo.SETTINGS["wins"], runs)
    # 4.5 / 9 = 0.5x the time; 100 / 80 = 1.25x the steps; (4.5 / 100) / (9 / 80) = 0.40x the seconds per step
    assert "This run: pgc wins (0.50x dgd's time to the target: 1.25x its steps at 0.40x its seconds per step)" in text
    assert "the map over 5 seeds: 0.56x [0.46, 0.68]" in text and "disagrees" not in text
    slower = [_outcome("wins", "ddp", 10.0, 80), _outcome("wins", "dgd", 9.0, 80), _outcome("wins", "pgc", 9.5, 90)]
    assert "pgc ties" in demo.verdict(demo.SETTINGS["wins"], slower)  # slower than dgd, faster than ddp
    lost = [_outcome("loses", "dgd", 5.0, 70), _outcome("loses", "pgc", 8.0, 170)]
    assert "pgc loses (1.60x" in demo.verdict(demo.SETTINGS["loses"], lost)
    flipped = demo.verdict(
        demo.SETTINGS["wins"], lost[:1] + [_outcome("wins", "pgc", 8.0, 170)] + [_outcome("wins", "dgd", 5.0, 70)]
    )
    assert "pgc loses" in flipped and "disagrees with the map" in flipped
    table = demo.markdown_table(runs, demo.parse_args([]))
    assert (
        "| pgc wins: one slow rank | pgc | 0.1, 0.9 | 4.5 | 100 | 0.045 | 0.50x | 1.25x, 0.40x | "
        "0.56x [0.46, 0.68] (5) | 0.900 | yes | " + demo.SETTINGS["wins"].short_why + " |" in table
    )
    assert demo.verdict(demo.SETTINGS["wins"], runs[2:]) == ""  # no reference run: nothing to compare


def test_demo_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    demo.main(
        ["--steps", "25", "--settings", "wins", "--only", "pgc", "--out", str(out), "--target-loss", "5.0"]
        + ["--correction", "off"]
    )
    printed = capsys.readouterr().out
    assert "pgc" in printed and "wrote" in printed and "Why:" in printed
    # captured output is not a terminal: nothing is cut to 80 columns
    assert "…" not in printed
    header = next(line for line in printed.splitlines() if "strategy" in line)
    assert all(col in header for col in ("lr, mom.", "to target (s)", "vs dgd, map", "identical"))
    results = json.loads((out / "results.json").read_text())
    assert [(r["setting"], r["key"]) for r in results] == [("wins", "pgc")]
    (pgc,) = results
    assert pgc["steps"] == 25 and pgc["identical"] and (pgc["lr"], pgc["momentum"]) == (0.5, 0.0)
    assert pgc["time_to_target"] is not None  # a loss of 5 is reached at once
    assert sum(pgc["skipped"]) > 0  # the slow rank caught up by skipping (it is 0.1 s slower per step)
    assert (out / "loss_vs_wall_clock.png").stat().st_size > 10_000
    assert "| pgc wins: one slow rank | pgc c=2 |" in (out / "results.md").read_text()


def _staleness_benchmark():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import staleness

    saved = json.loads(dc.STALENESS.read_text())
    args = staleness.parse_args(["--lookahead-steps", *map(str, saved["settings"]["lookahead_steps"])])
    return staleness, args, saved


def test_every_correction_job_is_the_staleness_benchmarks_job_for_its_arm_and_seed():
    """The comparison follows the benchmark: each job has the spec benchmarks/staleness.py gives the same arm, chosen
    setting and seed (delays, model, steps, validation), apart from where it writes and W&B."""
    staleness, args, _ = _staleness_benchmark()
    kwargs = {label: kw for label, _, kw in staleness.arms(args)}
    for arm in dc.ARMS:
        theirs = staleness.spec_of(args, "pgc_fr", kwargs[arm.label], arm.lr, arm.momentum, 3, args.steps, "x")
        mine = dc.job_spec(arm, 3, Path("x"))
        assert mine["wandb"] is None
        drop = ("out", "wandb")
        assert {k: v for k, v in mine.items() if k not in drop} == {k: v for k, v in theirs.items() if k not in drop}


def test_the_correction_comparison_is_where_the_shipped_measurements_differ_most():
    """Both arms are at the setting the benchmark's tuning chose, in the benchmark's cell, and the corrected arm is
    the correction whose steps to target moved furthest from the uncorrected arm's, separated from 1. If new
    measurements change this, the demo must change with them."""
    _, args, saved = _staleness_benchmark()
    assert (saved["settings"]["steps"], saved["settings"]["val_every"], saved["settings"]["target"]) == (
        dc.STEPS,
        dc.VAL_EVERY,
        dc.TARGET,
    )
    assert saved["delay_model"] == dc.DELAY and saved["settings"]["scheme"] == "pgc_fr" and saved["settings"]["c"] == 2
    arms = {a["label"]: a for a in saved["arms"]}
    for arm in dc.ARMS:
        assert (arms[arm.label]["chosen"]["lr"], arms[arm.label]["chosen"]["momentum"]) == (arm.lr, arm.momentum)
    corrected = [a for a in saved["arms"] if a.get("steps_vs_none")]
    largest = min(corrected, key=lambda a: a["steps_vs_none"]["mean"])
    assert largest["label"] == dc.ARMS[1].label and largest["steps_vs_none"]["high"] < 1
    assert dc.ARMS[0].label == "pgc_fr c=2 none" and dc.ARMS[0].strategy_kwargs["staleness_correction"] == "none"


def test_the_correction_verdict_gives_this_runs_ratios_next_to_the_measured_ones():
    ref = {
        "pgc_fr c=2 lookahead k=1": {
            "steps_vs_none": {"mean": 0.59, "low": 0.39, "high": 0.88, "seeds": 5},
            "time_vs_none": {"mean": 0.68, "low": 0.55, "high": 0.84, "seeds": 5},
            "steps_ratio": {"mean": 1.28, "low": 0.99, "high": 1.65, "seeds": 5},
            "time_ratio": None,
        }
    }
    runs = [_outcome("correction", "uncorrected", 20.0, 80), _outcome("correction", "lookahead", 15.0, 50)]
    runs[1].label = "pgc_fr c=2 lookahead k=1"
    text = dc.verdict(runs, ref)
    assert "look-ahead needed 0.62x the uncorrected arm's steps and 0.75x its time" in text
    assert "over 5 seeds (docs/staleness.json): 0.59x [0.39, 0.88] the steps, 0.68x [0.55, 0.84] the time" in text
    assert "outside" not in text
    runs[1].steps_to_target = 90
    assert "outside that interval" in dc.verdict(runs, ref)
    runs[1].time_to_target = runs[1].steps_to_target = None
    assert dc.verdict(runs, ref).startswith("This run: only uncorrected reached the target.")
    table = dc.markdown(runs[:1], ref)
    assert "| uncorrected | 0.1, 0.9 | 20.0 | 80 | 0.250 | - | - | - | - | yes |" in table


def test_the_correction_comparison_runs_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(dc, "STEPS", 6)
    monkeypatch.setattr(dc, "TARGET", 5.0)  # reached at once
    out = tmp_path / "demo"
    demo.main(["--correction", "only", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "Staleness correction." in printed and "Why:" in printed and "wrote" in printed
    assert "…" not in printed and "pgc_fr c=2 lookahead k=1" in printed
    page = (out / "correction.md").read_text()
    assert "This run: " in page and "Measured over 5 seeds" in page
    assert "| pgc_fr c=2 none | 0.1, 0.9 |" in page and "| pgc_fr c=2 lookahead k=1 | 0.1, 0.9 |" in page
    assert page.count("| yes |") == 2  # identical replicas under both
