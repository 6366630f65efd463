"""The main job (`make demo`) on a short run, and its pure helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_pgc import demo
from lightning_pgc.experiments import JobResult


def test_outcome_reads_the_crossing_of_the_smoothed_loss():
    """The demo's time/steps to target: where the trailing mean (window 2) first reaches the target, linear
    between steps (the harness's one first_crossing)."""
    curve = [(0.0, 1, 3.0), (1.0, 2, 1.0), (2.0, 3, 0.1), (3.0, 4, 0.1)]  # smoothed: 3.0, 2.0, 0.55, 0.1
    result = JobResult(out=Path("."), ok=True, curve=curve, summary={"global_step": 4, "fit_wall_s": 3.5},
                       ranks=[{"checksum": "a", "skipped_steps": 0}] * 2)
    args = demo.parse_args(["--target-loss", "0.6", "--window", "2"])
    o = demo.outcome("pgc", result, args)
    # 2.0 at wall 1 / step 2 and 0.55 at wall 2 / step 3: 0.6 is reached 1.4/1.45 of the way
    assert o.time_to_target == pytest.approx(1.0 + 1.4 / 1.45) and o.steps_to_target == pytest.approx(2 + 1.4 / 1.45)
    assert o.identical and o.final_loss == pytest.approx(0.1) and o.steps == 4
    never = demo.outcome("pgc", result, demo.parse_args(["--target-loss", "0.01", "--window", "2"]))
    assert never.time_to_target is None and never.steps_to_target is None


def test_unknown_run_is_refused():
    with pytest.raises(SystemExit, match="unknown"):
        demo.selected_runs(demo.parse_args(["--only", "pgc,nope"]))


def test_demo_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    demo.main(["--steps", "25", "--only", "pgc", "--out", str(out), "--target-loss", "5.0"])
    printed = capsys.readouterr().out
    assert "pgc" in printed and "wrote" in printed
    results = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in results] == ["pgc"]
    (pgc,) = results
    assert pgc["steps"] == 25 and pgc["identical"]
    assert pgc["time_to_target"] is not None  # a loss of 5 is reached at once
    assert sum(pgc["skipped"]) > 0  # the slow rank caught up by skipping (it is 0.1 s slower per step)
    assert (out / "loss_vs_wall_clock.png").stat().st_size > 10_000
    assert "| pgc |" in (out / "results.md").read_text()
