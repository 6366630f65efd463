"""The benchmark grid's pure parts (crossings, interpolation, run rows, table, CSV, the report block) and one tiny real
job logged to W&B offline."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import grid  # noqa: E402

from pgc_lab.experiments import at_index, cumulative_at, first_crossing, interpolate, launch, smoothed  # noqa: E402
from pgc_lab.experiments import runs as grid_runs  # noqa: E402


def test_interpolation_and_crossing():
    assert interpolate([0.0, 1.0, 3.0], [10.0, 20.0, 0.0], 2.0) == pytest.approx(10.0)
    assert interpolate([0.0, 1.0], [1.0, 2.0], 1.5) is None
    assert interpolate([0.0, 1.0], [1.0, 2.0], -0.1) is None
    # the loss crosses 1.0 a quarter of the way from index 1 (2.0) to index 2 (-2.0)
    assert first_crossing([3.0, 2.0, -2.0, 0.5], 1.0) == pytest.approx(1.25)
    assert first_crossing([0.5, 3.0], 1.0) == 0.0
    assert first_crossing([3.0, 2.0], 1.0) is None
    assert at_index([0.0, 10.0, 30.0], 1.25) == pytest.approx(15.0)
    assert at_index([0.0, 10.0, 30.0], 2.0) == 30.0
    # work that produced version 2.5: steps 0 and 1 whole, half of step 2
    assert cumulative_at([4, 4, 8, 8], 2.5) == pytest.approx(12.0)
    assert cumulative_at([4, 4], 2.0) == 8.0
    assert smoothed([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]


def test_grid_configs_respect_n():
    configs, skipped = grid.grid_configs(4, [2, 4, 8])
    keys = {(c.scheme, c.s) for c in configs}
    assert ("ddp", 0) in keys and ("dgd", 0) in keys
    assert {("pgc_fr", 1), ("pgc_fr", 3), ("pgc_cr", 3), ("gc_cr", 3), ("ignore_stragglers", 3)} <= keys
    assert not any(c.s == 7 for c in configs)
    assert any("c=8" in reason and "n >= 8" in reason for reason in skipped)
    assert next(c for c in configs if c.scheme == "pgc_cr" and c.s == 1).c == 2
    baseline = grid.baseline_configs(configs, ["ddp", "pgc_cr"])
    assert [(c.scheme, c.s, c.condition) for c in baseline] == [("ddp", 0, "no delay"), ("pgc_cr", 1, "no delay")]
    assert baseline[1].key == "pgc_cr_s1_nodelay"
    configs6, skipped6 = grid.grid_configs(6, [4])
    assert ("pgc_fr", 3) not in {(c.scheme, c.s) for c in configs6}  # FR needs c | n
    assert any("c | n" in reason for reason in skipped6)
    assert ("pgc_cr", 3) in {(c.scheme, c.s) for c in configs6}


def _synthetic_run(cfg: grid_runs.Config, seed: int, slowdown: float, evals: int, ages: int) -> grid_runs.Run:
    """Validation every 10 steps, loss 2.0 -> 0.2 over 40 steps; wall time = slowdown * step / 10."""
    val = [(slowdown * s / 10, s, 2.0 - 0.045 * s, 0.2 + 0.02 * s) for s in range(0, 41, 10)]
    train = [(slowdown * s / 10, s, 2.0 - 0.045 * s) for s in range(40)]
    measure = {
        "evals_per_step": [evals] * 40,
        "samples_per_step": [16 * evals] * 40,
        "flops_fwd_bwd_per_sample": 1e6,
        "utilization": 0.5,
        "busy_s": 1.0,
        "wall_s": 2.0,
        "forward_s": 0.2,
        "backward_s": 0.3,
        "injected_sleep_s": 0.5,
        "wait_s": 0.4,
    }
    ranks = [{"measure": measure, "checksum": "x", "skipped_steps": 0} for _ in range(2)]
    diagnostics = (
        [
            {
                "step": float(t),
                "pgc/max_age": float(ages),
                "pgc/mean_age": ages / 2,
                "pgc/coordinator_wait_s": 0.05,
                "pgc/arrival_s/rank0": 0.01,
                "pgc/arrival_s/rank1": 0.04,
            }
            for t in range(40)
        ]
        if cfg.scheme != "ddp"
        else []
    )
    return grid_runs.Run(
        cfg,
        seed,
        Path("/nowhere"),
        ok=True,
        job_wall_s=10.0,
        val=val,
        train=train,
        ranks=ranks,
        diagnostics=diagnostics,
    )


def test_rows_table_and_csv(tmp_path):
    ddp, pgc = grid_runs.Config("ddp", 0, 1), grid_runs.Config("pgc_cr", 1, 2)
    runs = [
        _synthetic_run(ddp, 0, 2.0, 1, 0),
        _synthetic_run(pgc, 0, 1.0, 1, 1),
        _synthetic_run(ddp, 1, 2.2, 1, 0),
        _synthetic_run(pgc, 1, 1.2, 1, 1),
        grid_runs.Run(pgc, 2, Path("/nowhere"), ok=False, error="boom"),
    ]
    equal = grid_runs.equal_wall_times(runs)
    assert equal == {("stragglers", 0): pytest.approx(4.0), ("stragglers", 1): pytest.approx(4.8)}  # pgc is first
    rows = [grid_runs.run_row(r, 1.0, equal.get(("stragglers", r.seed))) for r in runs]
    row = rows[0]  # ddp seed 0: loss 2 - 0.045 s <= 1.0 from step 22.2; wall = 0.2 * step
    assert row["reached"] and row["steps_to_target"] == pytest.approx(1.0 / 0.045, rel=1e-6)
    assert row["time_to_target_s"] == pytest.approx(0.2 / 0.045, rel=1e-6)
    assert row["grad_evals_to_target"] == pytest.approx(2 * 1.0 / 0.045, rel=1e-6)  # 2 ranks, 1 eval each
    assert row["gflop_to_target"] == pytest.approx(2 * 16 * 1e6 * (1.0 / 0.045) / 1e9, rel=1e-6)
    assert row["val_acc_at_equal_wall"] == pytest.approx(0.2 + 0.02 * 20)  # ddp at 4 s is at step 20
    assert row["max_age"] == 0.0 and math.isnan(row["coord_wait_ms_per_step"])
    assert row["idle_ms_per_step"] == pytest.approx(1000 * (2.0 - 1.0) / 40)
    assert row["worker_wait_ms_per_step"] == pytest.approx(1000 * 0.4 / 40)
    assert rows[1]["val_acc_at_equal_wall"] == pytest.approx(0.2 + 0.02 * 40)
    assert rows[1]["coord_wait_ms_per_step"] == pytest.approx(50.0)
    assert rows[1]["coord_wait_after_first_code_ms"] == pytest.approx(40.0)
    assert rows[1]["max_age"] == 1.0 and rows[1]["mean_age"] == 0.5
    assert rows[-1]["status"] == "failed"

    table = grid.aggregate(rows, [ddp, pgc])
    t_ddp, t_pgc = table
    assert (t_ddp["runs"], t_ddp["ok"], t_ddp["reached"]) == (2, 2, 2)
    assert (t_pgc["runs"], t_pgc["ok"], t_pgc["reached"]) == (3, 2, 2)
    assert t_ddp["time_to_target_s"] == pytest.approx(2.1 / 10 / 0.045, rel=1e-6)
    assert t_ddp["time_to_target_s_spread"] == pytest.approx(0.1 / 10 / 0.045, rel=1e-6)
    md = grid.markdown_table(table, 2)
    assert md.count("\n") == 3 and "| pgc_cr | 1 | 2 | 2/3 |" in md and "±" in md

    path = tmp_path / "runs.csv"
    grid.write_csv(rows, path)
    read = list(csv.DictReader(path.open()))
    assert len(read) == 5 and read[0]["scheme"] == "ddp" and read[-1]["status"] == "failed"
    assert float(read[1]["time_to_target_s"]) == pytest.approx(rows[1]["time_to_target_s"], rel=1e-5)

    doc = tmp_path / "bench.md"
    doc.write_text(
        "# mine\n\nhand-written intro\n\n" + grid.MARK_BEGIN + "\nold\n" + grid.MARK_END + "\n\nmy discussion\n"
    )
    grid.update_markdown(doc, grid.MARK_BEGIN + "\nnew table\n" + grid.MARK_END)
    text = doc.read_text()
    assert "hand-written intro" in text and "my discussion" in text and "new table" in text and "old" not in text


def test_tiny_job_logs_one_offline_wandb_run(tmp_path):
    """One real job (2 ranks, 6 steps) with W&B offline: a run directory with the grid's config keys."""
    spec = dict(
        strategy="pgc_cr",
        strategy_kwargs={"stragglers": 1},
        devices=2,
        max_steps=6,
        batch_size=8,
        delay="lognormal(median=0.001, sigma=0.5)",
        check_val_every_n_epoch=100_000,
        val_every_n_steps=3,
        measure=True,
        sync_loss=False,
        model={"sync_train_loss": False},
        wandb={"project": "test", "group": "test-group", "name": "tiny", "offline": True},
    )
    job = launch({**spec, "out": str(tmp_path / "tiny")}, timeout=180)
    out = job.out
    info = job.wandb
    run_dir = Path(info["dir"])
    assert run_dir.is_dir() and run_dir.parent == out / "wandb" and run_dir.name.startswith("offline-run-")
    assert info["group"] == "test-group" and info["name"] == "tiny"
    config = info["config"]
    assert {"scheme", "n", "s", "c", "delay", "seed", "delay_seed", "lr", "batch_size", "steps"} <= set(config)
    assert (config["scheme"], config["n"], config["s"], config["c"]) == ("pgc_cr", 2, 1, 2)
    records = b"".join(p.read_bytes() for p in run_dir.glob("*.wandb"))
    assert b"pgc_cr" in records and b"lognormal(median=0.001" in records and b"test-group" in records
    # the measurements the grid's table needs (read_result checks the header of val_curve.csv)
    assert [step for _, step, *_ in job.val_curve] == [0, 3, 6]
    for rank in job.ranks:
        m = rank["measure"]
        # full warm-up: both held partitions at step 0, unless the rank skipped it (the other closed it alone)
        assert len(m["evals_per_step"]) == 6 and m["evals_per_step"][0] in (0, 2)
        assert set(m["evals_per_step"][1:]) <= {0, 1}
        assert m["flops_fwd_bwd_per_sample"] > m["flops_forward_per_sample"] > 0
        # a rank that evaluated nothing (with n=2, s=1 the other rank can close every version alone, e.g. while
        # W&B starts up on rank 0) was never busy; one that evaluated was busy for part of its wall time
        assert (m["busy_s"] > 0) == (sum(m["evals_per_step"]) > 0)
        assert 0 <= m["busy_s"] <= m["wall_s"] * 1.05 and m["busy_s"] >= m["injected_sleep_s"]
    assert sum(r["measure"]["busy_s"] for r in job.ranks) > 0
    per_step = [sum(col) for col in zip(*(r["measure"]["evals_per_step"] for r in job.ranks))]
    assert all(e >= 1 for e in per_step)  # some rank computed every version
    assert "curve_offset_s" in job.summary and len(job.summary["val_curve"]) == 3
