"""``lightning-pgc advise`` on step traces whose answer is known, its JSON, and the trace callback on real runs.

The advice runs here on a smaller protocol than the map's (a 2 x 3 corner of its grid that holds ddp's and the
dropping arm's optimum on these traces, one tuning seed, a shorter budget, three arms) to keep the tests short; the
command runs the map's protocol.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from lightning_pgc.emulator import advise as advise_module
from lightning_pgc.emulator.advise import (
    advise,
    candidate_arms,
    load_trace,
    p_floor,
    proxy_task,
    render,
    s_values,
)
from lightning_pgc.emulator.cells import MapArm, Protocol
from lightning_pgc.step_trace import TRACE_FORMAT

N, STEPS = 4, 120
SEEDS = 8  # over 4 comparisons the smallest attainable Holm p is 4 * 2 / 2^8 = 0.03
PROTOCOL = Protocol(budget_steps=150, max_versions=200, tuning_seeds=(1000,), lrs=(0.4, 0.8), momenta=(0.0, 0.5, 0.8))
#: ddp, a dropping arm, bounded staleness (a replica covers the slow rank's partition, one step stale)
ARMS = [MapArm("ddp"), MapArm("ignore_stragglers", 2), MapArm("bounded_staleness", 2)]
FIELDS = ("strategy", "s", "ratio", "low", "high", "p_holm", "seeds", "task", "rows")


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def _base(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 0.1 * rng.lognormal(0.0, 0.05, size=(N, STEPS))  # 100 ms of work, a few ms of jitter


def _write(tmp_path, own: np.ndarray, allreduce_s=0.005):
    path = tmp_path / "trace.json"
    path.write_text(
        json.dumps(
            {
                "format": TRACE_FORMAT,
                "version": 2,
                "n": N,
                "strategy": "DDPStrategy",
                "own_s": own.tolist(),
                "step_s": own.max(axis=0).tolist(),
                "allreduce_s": allreduce_s,
                "grad_numel": 4810,
            }
        )
    )
    return path


def _advise(path, **kwargs):
    return advise(load_trace(path), seeds=SEEDS, protocol=PROTOCOL, arms=ARMS, **kwargs)


def test_a_persistently_slow_replica_is_dropped(tmp_path):
    """One replica of four twice as slow at every step. Dropping it removes its cost per version (the clock: about
    0.5x ddp's time per version); the dropped quarter of the gradients costs versions on the proxy task (digits MLP,
    8 samples per partition: noise-dominated, about 1.25x ddp's versions), so the time to target is about 0.65x. The
    ratio is measured (every seed reached the target), its interval excludes 1, and Holm's test separates it."""
    own = _base()
    own[3] *= 2.0
    advice = _advise(_write(tmp_path, own))
    assert advice.surely_faster and advice.strategy == "ignore_stragglers" and advice.s == 1
    row = next(r for r in advice.rows if r["arm"] == advice.arm)
    assert row["per_version_vs_ddp"] == pytest.approx(0.5, abs=0.06)
    assert not row["ratio_is_bound"]
    assert 0.5 <= advice.ratio <= 0.8 and advice.ratio == pytest.approx(
        row["versions_vs_ddp"] * row["per_version_vs_ddp"], rel=0.15
    )
    assert advice.high < 0.9 and advice.p_holm is not None and advice.p_holm < advice.alpha
    assert "Recommendation: strategy=" in render(advice)


def test_a_healthy_trace_says_nothing_is_surely_faster(tmp_path):
    advice = _advise(_write(tmp_path, _base()))
    assert advice.strategy == "ddp" and advice.s is None and not advice.surely_faster
    assert advice.p_floor < advice.alpha  # the seeds could have shown a difference
    text = render(advice)
    assert "Nothing is surely faster than ddp" in text and "Recommendation" not in text


def test_json_has_the_fields_and_the_command_prints_one_object(tmp_path, capsys, monkeypatch):
    own = _base()
    own[3] *= 2.0
    path = _write(tmp_path, own)
    real = advise_module.advise

    def small(trace, **kwargs):  # the command's own advise, on the tests' protocol
        kwargs.update(protocol=PROTOCOL, arms=ARMS[:2])
        return real(trace, **kwargs)

    monkeypatch.setattr(advise_module, "advise", small)
    assert advise_module.main([str(path), "--json", "--quiet", "--seeds", "6", "--workers", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in FIELDS:
        assert key in data
    assert data["seeds"] == 6 and data["task"] == "mlp" and data["label"] == "emulated"
    assert data["ratio_source"] == "measured" and data["comm_ratio"] == pytest.approx(0.1 * 1.0 / 0.005, rel=0.1)
    assert [r["arm"] for r in data["rows"]] == ["ddp", "ignore_stragglers c=2"]
    assert {"ratio", "low", "high", "p_holm", "ratio_is_bound"} <= set(data["rows"][1])


def test_too_few_seeds_are_reported_as_unable_to_decide():
    """6 seeds over 8 comparisons: the exact sign-flip test's smallest p, 2/64, times 8 is 0.25."""
    assert p_floor(6, 8) == pytest.approx(0.25)
    assert p_floor(16, 76) < 0.05
    assert advise_module.seeds_needed(8) == 9  # 8 * 2/2^9 = 0.03


def test_arms_and_s_follow_the_map_and_the_trace():
    labels = [a.label for a in candidate_arms(4)]
    assert labels[0] == "ddp"
    for label in ("ignore_stragglers c=4", "gc_fr c=2", "gc_cr c=3", "pgc_fr c=2 lookahead", "pgc_cr c=3 momentum"):
        assert label in labels
    assert "pgc_fr c=2 delay_compensation" in labels and "bounded r=4 c=2 lookahead" in labels
    assert len(labels) == len(set(labels))
    assert s_values(4) == [1, 2, 3] and s_values(64) == [1, 2, 4, 8, 16, 32]
    assert proxy_task(4.0, known=lambda t: t in ("bncnn", "lm", "mlp")) == "mlp"  # (the timed default)
    assert proxy_task(0.5, known=lambda t: t in ("bncnn", "lm", "mlp")) == "mlp"
    assert proxy_task(4.0, known=lambda t: t == "mlp") == "mlp"
    with pytest.raises(ValueError, match="proxy tasks"):
        proxy_task(0.5, known=lambda t: False)


def test_a_trace_without_an_allreduce_time_needs_a_ratio(tmp_path):
    path = _write(tmp_path, _base(), allreduce_s=None)
    with pytest.raises(ValueError, match="no all-reduce time"):
        advise(load_trace(path), protocol=PROTOCOL, arms=ARMS[:2])
    assert advise_module.main([str(path), "--quiet"]) == 2


def test_bad_traces_are_refused(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a step trace"):
        load_trace(path)
    with pytest.raises(ValueError, match="2 or more ranks"):
        load_trace(_write(tmp_path, _base()[:1]))


def test_cli_advise_prints_a_recommendation(tmp_path, capsys):
    from lightning_pgc.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["advise", str(tmp_path / "missing.json")])
    assert exit_info.value.code == 2
    assert "lightning-pgc advise:" in capsys.readouterr().out


def test_step_trace_callback_records_own_times(tmp_path):
    import lightning.pytorch as pl

    from lightning_pgc.examples.digits import DigitsCNN, DigitsDataModule
    from lightning_pgc.step_trace import StepTimeTrace
    from lightning_pgc.callbacks import StragglerInjector

    path = tmp_path / "trace.json"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=12,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        callbacks=[StepTimeTrace(str(path), skip=2), StragglerInjector("constant(seconds=0.05)")],
    )
    trainer.fit(DigitsCNN(), DigitsDataModule(batch_size=16))
    data = json.loads(path.read_text())
    assert data["format"] == TRACE_FORMAT and data["n"] == 1
    own = data["own_s"][0]
    assert len(own) == 10
    assert min(own) >= 0.05  # the injected delay after backward counts as the rank's own time
    assert data["allreduce_s"] is None  # one rank: no all-reduce to time
    with pytest.raises(ValueError, match="allreduce_repeats"):
        StepTimeTrace(str(path), allreduce_repeats=0)


def test_step_trace_under_ddp_names_the_slow_rank(tmp_path):
    import os
    import statistics
    import subprocess
    import sys
    from pathlib import Path

    from lightning_pgc.examples.digits import DigitsCNN

    root = Path(__file__).resolve().parents[1]
    path = tmp_path / "trace.json"
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, str(root / "tests" / "step_trace_job.py"), str(path)],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=240,
        capture_output=True,
    )
    data = json.loads(path.read_text())
    assert data["n"] == 2 and data["strategy"] == "DDPStrategy"
    fast, slow = (statistics.median(r) for r in data["own_s"])
    assert slow - fast >= 0.08  # rank 1's own 0.1 s per step, not the wait it causes rank 0
    assert data["grad_numel"] == sum(p.numel() for p in DigitsCNN().parameters())
    assert data["grad_dtype"] == "torch.float32"
    assert 0 < data["allreduce_s"] < 1.0  # one all-reduce of 11k floats between two local processes
    trace = load_trace(path)
    assert trace.own.shape == (2, 12) and trace.ratio == pytest.approx(trace.compute_s / data["allreduce_s"])
