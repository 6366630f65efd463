"""The main job (`make demo`) on a short run, and its pure helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_pgc import demo
from lightning_pgc.experiments import JobResult


def test_outcome_reads_the_crossing_of_the_validation_loss():
    """The demo's time/steps to target: where the validation loss (not the decoded training loss, which mixes
    model versions under PGC) first reaches the target, linear between measurements."""
    curve = [(0.0, 1, 0.01), (1.0, 2, 0.01)]  # a training loss already below every target: not what is read
    val_curve = [(0.0, 0, 3.0, 0.1, 0.01), (1.0, 10, 2.0, 0.3, 0.01), (2.0, 20, 0.55, 0.8, 0.01),
                 (3.0, 30, 0.1, 0.9, 0.01)]
    result = JobResult(out=Path("."), ok=True, curve=curve, val_curve=val_curve,
                       summary={"global_step": 30, "fit_wall_s": 3.5}, ranks=[{"checksum": "a", "skipped_steps": 0}] * 2)
    args = demo.parse_args(["--target-loss", "0.6"])
    o = demo.outcome("pgc", result, args)
    # 2.0 at wall 1 / step 10 and 0.55 at wall 2 / step 20: 0.6 is reached 1.4/1.45 of the way
    assert o.time_to_target == pytest.approx(1.0 + 1.4 / 1.45) and o.steps_to_target == pytest.approx(10 + 14 / 1.45)
    assert o.identical and o.final_loss == pytest.approx(0.1) and o.steps == 30 and o.val_acc == 0.9
    never = demo.outcome("pgc", result, demo.parse_args(["--target-loss", "0.01"]))
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
