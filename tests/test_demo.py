"""The main job (`make demo`) on a short run, and its pure helpers."""

from __future__ import annotations

import json

import pytest

from lightning_pgc import demo


def test_smoothed_and_first_crossing():
    assert demo.smoothed([4.0, 2.0, 0.0, 0.0], window=2) == [4.0, 3.0, 1.0, 0.0]
    curve = [(0.0, 1, 3.0), (1.0, 2, 1.0), (2.0, 3, 0.1), (3.0, 4, 0.1)]
    assert demo.first_crossing(curve, target=0.6, window=2) == (2.0, 3)  # mean(1.0, 0.1) = 0.55
    assert demo.first_crossing(curve, target=0.01, window=2) == (None, None)


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
