"""``lightning-pgc advise`` on step traces whose answer is known, and the trace callback on a real (1-rank) run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lightning_pgc.emulator.advise import advise, load_trace, render
from lightning_pgc.step_trace import TRACE_FORMAT

N, STEPS = 4, 60
ARMS = ("gc_cr", "pgc_cr")  # two of the coded arms keep the test short


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def _base(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 0.1 + rng.lognormal(np.log(0.005), 0.3, size=(N, STEPS))  # 100 ms of work, a few ms of jitter


def _write(tmp_path, own: np.ndarray):
    path = tmp_path / "trace.json"
    path.write_text(
        json.dumps(
            {
                "format": TRACE_FORMAT,
                "version": 1,
                "n": N,
                "strategy": "DDPStrategy",
                "own_s": own.tolist(),
                "step_s": own.max(axis=0).tolist(),
            }
        )
    )
    return path


def test_a_persistent_slow_rank_is_worth_tolerating(tmp_path):
    own = _base()
    own[3] += 0.2  # rank 3 takes three times as long, every step
    advice = advise(load_trace(_write(tmp_path, own)), arms=ARMS)
    assert advice.strategy != "ddp" and advice.s == 1
    assert advice.high < 1.0 and advice.faster_on >= advice.seeds - 1
    assert "Recommendation: strategy=" in render(advice)


def test_no_stragglers_keep_ddp(tmp_path):
    advice = advise(load_trace(_write(tmp_path, _base())), arms=ARMS)
    assert advice.strategy == "ddp"
    assert "keep ddp" in render(advice)


def test_stalls_of_the_whole_cluster_keep_ddp(tmp_path):
    own = _base()
    hit = np.random.default_rng(1).random(STEPS) < 0.1
    own[:, hit] += 1.0  # every rank stalls at once: nothing to tolerate
    advice = advise(load_trace(_write(tmp_path, own)), arms=ARMS)
    assert advice.strategy == "ddp"


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


def test_step_trace_under_ddp_names_the_slow_rank(tmp_path):
    import os
    import statistics
    import subprocess
    import sys
    from pathlib import Path

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
    assert load_trace(path).shape == (2, 12)
