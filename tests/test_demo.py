"""The main job (`make demo`) on a short run, and its pure helpers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pgc_lab import demo
from pgc_lab.experiments import JobResult

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
        demo.selected(demo.parse_args(["--settings", "slow,draws"]))
    with pytest.raises(SystemExit, match="at least one"):
        demo.selected(demo.parse_args(["--settings", ","]))
    with pytest.raises(SystemExit):
        demo.parse_args(["--arms", "some"])
    pairs = demo.selected(demo.parse_args(["--settings", "rare", "--only", "pgc,ddp"]))
    assert [(s.key, a.key) for s, a in pairs] == [("rare", "ddp"), ("rare", "pgc")]
    # --only names any arm of the full race, not only the default race's
    pairs = demo.selected(demo.parse_args(["--settings", "slow", "--only", "pgc_fr_lookahead,gc"]))
    assert [a.key for _, a in pairs] == ["gc", "pgc_fr_lookahead"]


def test_the_default_race_has_the_arms_a_user_weighs_and_the_full_race_every_arm():
    """``make demo``: ddp, ignore_stragglers, the registered pgc (PGC-CR with look-ahead), bounded_staleness and
    pgc_auto, in a cell with one slow rank and in one where stragglers are rare; ``--arms all`` adds the map's best
    GC and PGC-FR without and with look-ahead."""
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_pgc  # noqa: F401  (registers the names)

    default = [a for _, a in demo.selected(demo.parse_args(["--settings", "slow"]))]
    assert [a.strategy for a in default] == ["ddp", "ignore_stragglers", "pgc", "bounded_staleness", "pgc_auto"]
    assert [a.key for a in default] == list(demo.DEFAULT_ARMS)
    assert len(demo.selected(demo.parse_args([]))) == len(demo.DEFAULT_ARMS) * len(demo.SETTINGS) == 10
    # the pgc arm is the registered name, PGC-CR (s=1) with look-ahead, with no correction keyword of its own
    (pgc,) = [a for a in default if a.key == "pgc"]
    assert not pgc.correction and set(pgc.strategy_kwargs(0)) <= {"seed", "stragglers"}
    registered = StrategyRegistry["pgc"]["init_params"]
    assert registered == {**StrategyRegistry["pgc_cr"]["init_params"], "coding": {"staleness_correction": "lookahead"}}
    everything = [a for _, a in demo.selected(demo.parse_args(["--arms", "all", "--settings", "slow"]))]
    assert everything == list(demo.ARMS)
    strategies = [(a.strategy, a.correction.get("coding", {}).get("staleness_correction")) for a in everything]
    assert strategies[0] == ("ddp", None)
    assert {s for s, _ in strategies} >= {"ddp", "ignore_stragglers", "gc_fr", "pgc_fr", "pgc", "bounded_staleness"}
    assert ("pgc_fr", None) in strategies and ("pgc_fr", "lookahead") in strategies
    assert ("pgc_auto", None) in strategies
    assert {s.map_cell for s in demo.SETTINGS.values()} == {"slowrank-sleep", "stalls-sleep"}
    assert len(demo.selected(demo.parse_args(["--arms", "all"]))) == len(demo.ARMS) * len(demo.SETTINGS)


def test_every_demo_job_is_the_map_grids_job_for_its_cell_arm_and_seed():
    """The demo follows the map: each job of an arm the map grid has is the spec benchmarks/grid_map.py gives the
    same cell, arm, setting and seed (delays, cost, steps, validation, rate, momentum), apart from where it writes
    and W&B; a corrected arm's job is its uncorrected arm's plus the correction (``pgc``: pgc_cr's under the
    registered name), at its own tuned setting."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import grid_map

    from pgc_lab.experiments import crossover as cx

    grid_args = grid_map.parse_args(["--no-wandb"])
    args = demo.parse_args(["--seed", "3"])
    delays = {key: name for name, key in cx.DELAY_KEYS.items()}
    arms = {a.key: a for a in cx.arms_for(4, [2, 4])[0]}
    drop = ("out", "wandb")
    for setting in demo.SETTINGS.values():
        delay, cost = setting.map_cell.split("-")
        cell = cx.GridCell(delays[delay], cost)
        for arm in demo.ARMS:
            job = cx.Job("main", cell, arms[arm.map_arm], arm.lr, 3, arm.momentum, round=2)
            theirs = grid_map.job_spec(job, grid_args, grid_args.steps)
            mine = demo.job_spec(setting, arm, args, Path("x"))
            assert mine["wandb"] is None
            theirs["strategy_kwargs"] = {**theirs["strategy_kwargs"], **arm.correction}
            if arm.strategy == "pgc_auto":  # dgd's job under the strategy that starts as dgd
                theirs["strategy"], theirs["strategy_kwargs"] = "pgc_auto", {"seed": 3, "auto": {"max_stragglers": 1}}
            if arm.strategy == "pgc":  # pgc_cr's job under the registered name that adds look-ahead to it
                assert theirs["strategy"] == "pgc_cr"
                theirs["strategy"] = "pgc"
            assert {k: v for k, v in mine.items() if k not in drop} == {
                k: v for k, v in theirs.items() if k not in drop
            }, (setting.key, arm.key)


def test_every_arm_is_at_its_own_tuning_and_the_gc_is_the_maps_best():
    """Each arm runs at the rate and momentum its tuning chose: the map grid's sweep, or, for the look-ahead arms
    (not in the map grid), the staleness benchmark's look-ahead arm, whose cell and scheme (pgc_fr) the pgc_fr arm's
    must be, and which ``pgc`` (pgc_cr, which the staleness benchmark did not sweep) borrows and says so. The GC is
    the one the map finds fastest in both cells. If new results change this, the demo must change with them."""
    grid = json.loads(demo.MAP.read_text())
    assert (grid["settings"]["steps"], grid["settings"]["val_every"], grid["settings"]["target"]) == (
        demo.parse_args([]).steps,
        demo.parse_args([]).val_every,
        demo.parse_args([]).target_loss,
    )
    staleness = json.loads(demo.STALENESS.read_text())
    tuned = {a["label"]: a["chosen"] for a in staleness["arms"]}
    for setting in demo.SETTINGS.values():
        cell = grid["cells"][setting.map_cell]
        assert cell["status"] == "complete" and cell["runs_ok"] == cell["runs_expected"]
        cost = setting.map_cell.split("-")[1]
        for arm in demo.ARMS:
            assert arm.in_map == (arm.staleness_arm is None and arm.strategy != "pgc_auto")
            if arm.correction or arm.strategy == "pgc":
                assert arm.staleness_arm is not None and "staleness.json" in arm.tuned_by
                assert staleness["settings"]["c"] == 2 and staleness["settings"]["scheme"] == "pgc_fr"
                if arm.strategy == "pgc_fr":
                    assert arm.staleness_arm == arm.label.replace(" + ", " ")
                else:
                    assert arm.staleness_arm in arm.tuned_by and "did not sweep" in arm.tuned_by
                chosen = tuned[arm.staleness_arm]
                assert "lookahead" in arm.staleness_arm
            else:
                chosen = grid["chosen_setting"][f"{cost}/{arm.map_arm}"]
            assert (chosen["lr"], chosen["momentum"]) == (arm.lr, arm.momentum), (setting.key, arm.key)
        gcs = [a for a in cell["arms"] if a["arm"].startswith("gc_") and a.get("vs_ddp")]
        (gc,) = [a for a in demo.ARMS if a.key == "gc"]
        assert min(gcs, key=lambda a: a["vs_ddp"]["estimate"])["arm"] == gc.map_arm


def test_every_settings_guide_row_is_a_row_of_the_guides_map_table():
    guide = (ROOT / "docs" / "guide.md").read_text()
    block = guide[guide.index("<!-- which-guide:begin") : guide.index("<!-- which-guide:end")]
    patterns = {line.split("|")[3].strip() for line in block.splitlines() if line.startswith("| ")}
    for setting in demo.SETTINGS.values():
        assert setting.guide_row in patterns, (setting.key, sorted(patterns))


def test_with_wandb_every_demo_job_is_an_offline_run_grouped_by_setting():
    args = demo.parse_args(["--wandb"])
    setting = demo.SETTINGS["rare"]
    spec = demo.job_spec(setting, demo.ARMS[-1], args, Path("x"))
    assert spec["wandb"]["offline"] and spec["wandb"]["group"] == "demo-rare"
    assert spec["wandb"]["name"] == "rare__auto" and "stalls-sleep" in spec["wandb"]["tags"]


def _outcome(setting: str, key: str, time: float | None, steps: float | None) -> demo.Outcome:
    return demo.Outcome(
        label=next(a.label for a in demo.ARMS if a.key == key),
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
    )


def _map(tmp_path: Path, cells: dict[str, dict[str, tuple[float, float, float]]]) -> Path:
    path = tmp_path / "grid_map.json"
    rows = {
        cell: {
            "arms": [{"arm": a, "vs_ddp": dict(zip(("estimate", "low", "high"), r), seeds=5)} for a, r in arms.items()]
        }
        for cell, arms in cells.items()
    }
    path.write_text(json.dumps({"cells": rows}))
    return path


def test_the_verdict_names_the_winner_the_maps_verdict_and_the_guides_row(tmp_path):
    slow = demo.SETTINGS["slow"]
    path = _map(tmp_path, {slow.map_cell: {"pgc_fr_c2": (0.56, 0.48, 0.66), "gc_fr_c2": (0.61, 0.51, 0.72)}})
    runs = [_outcome("slow", "ddp", 10.0, 80), _outcome("slow", "pgc_fr", 5.0, 100), _outcome("slow", "gc", 6.0, 70)]
    text = demo.verdict(slow, runs, path)
    # 5 / 10 = 0.5x the time; 100 / 80 = 1.25x the steps; (5 / 100) / (10 / 80) = 0.40x the seconds per step
    assert text.startswith("This run: pgc_fr c=2 reached the target first, in 5.0 s (0.50x ddp's time: 1.25x its")
    assert (
        "The map over 5 seeds, of the arms raced here: pgc_fr c=2 is fastest at 0.56x ddp's time [0.48, 0.66]." in text
    )
    assert f'The guide\'s row: "{slow.guide_row}"' in text and "disagrees" not in text
    runs[2].time_to_target = 4.0
    assert "disagrees with the map" in demo.verdict(slow, runs, path)
    # the map's verdict is on the arms this run raced: without pgc_fr, gc_fr is the map's fastest, and it won
    text = demo.verdict(slow, [runs[0], runs[2]], path)
    assert "of the arms raced here: gc_fr c=2 is fastest at 0.61x" in text and "disagrees" not in text
    runs.append(_outcome("slow", "pgc", 3.0, 60))  # not an arm of the map grid: no verdict on it
    text = demo.verdict(slow, runs, path)
    assert "did not run pgc (pgc_cr c=2 + lookahead k=1)" in text and "disagrees" not in text
    rare = demo.SETTINGS["rare"]
    path = _map(tmp_path, {rare.map_cell: {"pgc_fr_c2": (1.08, 0.71, 1.65), "ignore_c2": (1.25, 0.8, 1.9)}})
    runs = [_outcome("rare", "ddp", 5.0, 70), _outcome("rare", "ignore", 4.0, 90)]
    text = demo.verdict(rare, runs, path)
    assert "no arm is separably faster than ddp" in text and "disagrees" not in text
    nobody = demo.verdict(rare, [_outcome("rare", "ddp", None, None)], tmp_path / "absent.json")
    assert nobody.startswith("This run: no arm reached the target. The guide")  # no map: no map verdict


@pytest.mark.parametrize("stem", ["demo", "demo_full"])
def test_the_shipped_race_ran_every_arm_in_both_cells_and_its_verdicts_agree_with_the_map_and_name_the_guides_row(
    stem,
):
    """docs/results/demo.json, what `make demo` last printed, and demo_full.json, the full race (``--arms all``):
    every arm of its race in both cells, at the demo's settings, identical replicas, and a verdict that does not
    disagree with the map and quotes the guide's row for its cell."""
    saved = json.loads((ROOT / "docs" / "results" / f"{stem}.json").read_text())
    race = {"demo": demo.DEFAULT_ARMS, "demo_full": tuple(a.key for a in demo.ARMS)}[stem]
    assert saved["settings"]["arms"] == {"demo": "default", "demo_full": "all"}[stem] and not saved["settings"]["only"]
    defaults = vars(demo.parse_args([]))
    assert {k: saved["settings"][k] for k in ("steps", "target_loss", "val_every", "seed")} == {
        k: defaults[k] for k in ("steps", "target_loss", "val_every", "seed")
    }
    outcomes = demo.read_outcomes(saved["results"])
    for setting in demo.SETTINGS.values():
        runs = [o for o in outcomes if o.setting == setting.key]
        assert sorted(o.key for o in runs) == sorted(race), setting.key
        assert all(o.identical for o in runs)
        assert next(o for o in runs if o.key == "ddp").time_to_target is not None  # the target is reached
        text = demo.verdict(setting, runs)
        assert "disagrees" not in text and f'The guide\'s row: "{setting.guide_row}"' in text, text


def test_the_table_gives_every_arm_its_ratio_to_ddp():
    runs = [_outcome("slow", "ddp", 10.0, 80), _outcome("slow", "pgc_fr", 5.0, 100), _outcome("slow", "gc", None, None)]
    runs[1].map_vs_ddp = {"estimate": 0.56, "low": 0.48, "high": 0.66, "seeds": 5}
    table = demo.markdown_table(runs, demo.parse_args([]))
    assert (
        "| one slow rank | pgc_fr c=2 | 0.1, 0.9 | 5.0 | 100 | 0.050 | 0.50x | 1.25x, 0.40x | 0.56x [0.48, 0.66] (5) |"
        in table
    )
    assert "| one slow rank | gc_fr c=2 | 0.1, 0.9 | not reached | not reached | - | - | - | - |" in table


def test_demo_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    demo.main(["--steps", "25", "--settings", "slow", "--only", "ddp,pgc", "--out", str(out), "--target-loss", "5.0"])
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert "pgc (pgc_cr c=2 + lookahead k=1)" in printed and "wrote" in printed and "What the cell shows:" in printed
    # captured output is not a terminal: the job count and estimate first, then a plain line as each job starts and
    # ends, and nothing cut to 80 columns
    assert lines[0].startswith("lightning_pgc demo: 2 jobs (2 arms x 1 cell) x 25 steps") and " min on 2 " in lines[0]
    assert demo.FULL_RACE in lines[0] and "demo_full.md" in lines[0]
    progress = [line for line in lines if line.startswith("[")]
    assert progress[0] == "[1/2] one slow rank: ddp ... starting"
    assert progress[1].startswith("[1/2] one slow rank: ddp ... done: target in ") and "about " in progress[1]
    assert progress[2] == "[2/2] one slow rank: pgc (pgc_cr c=2 + lookahead k=1) ... starting"
    assert " s per step, job " in progress[3] and "elapsed " in progress[3] and "left" not in progress[3]
    assert len(progress) == 4
    assert "…" not in printed
    header = next(line for line in lines if "strategy" in line)
    assert all(col in header for col in ("lr, mom.", "to target (s)", "vs ddp, map", "identical"))
    results = json.loads((out / "results.json").read_text())
    assert [(r["setting"], r["key"]) for r in results] == [("slow", "ddp"), ("slow", "pgc")]
    pgc = results[1]
    assert pgc["steps"] == 25 and pgc["identical"] and (pgc["lr"], pgc["momentum"]) == (0.1, 0.9)
    assert pgc["time_to_target"] is not None  # a loss of 5 is reached at once
    assert sum(pgc["skipped"]) > 0  # the slow rank caught up by skipping (it is 0.1 s slower per step)
    assert pgc["job_wall_s"] > pgc["wall_s"] > 0
    assert (out / "loss_vs_wall_clock.png").stat().st_size > 10_000
    assert "| one slow rank | pgc (pgc_cr c=2 + lookahead k=1) |" in (out / "results.md").read_text()
