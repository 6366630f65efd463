import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_pgc.delays import (
    Constant,
    DelayModel,
    Exponential,
    LogNormal,
    NoDelay,
    SlowRanks,
    Spikes,
    SumDelay,
    delay_for,
    parse_delay,
)
from lightning_pgc.callbacks import StragglerInjector

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def sleeps(monkeypatch):
    """Record time.sleep calls instead of sleeping."""
    calls = []
    monkeypatch.setattr(time, "sleep", lambda s: calls.append(s))
    return calls


def _empirical_mean(model, rank=0, draws=40_000):
    rng = np.random.default_rng(123)
    return float(np.mean([model.sample(rank, 0, rng) for _ in range(draws)]))


MODELS = [
    NoDelay(),
    Constant(0.5),
    Constant(0.25, ranks=[1]),
    Exponential(0.1, ranks=[0, 2]),
    LogNormal(0.02, 0.5),
    Spikes(0.01, 10, 30),
    SlowRanks([3], 1.0),
    LogNormal(0.02, 0.5) + SlowRanks([3], 1.0) + Spikes(0.05, 1, 2, ranks=[0]),
]


@pytest.mark.parametrize("model", MODELS, ids=repr)
def test_determinism_per_seed_rank_step(model):
    for seed, rank, step in [(0, 0, 0), (1, 3, 7), (5, 2, 1000)]:
        a = delay_for(model, seed, rank, step)
        assert a == delay_for(model, seed, rank, step)
        assert a >= 0


def test_delays_vary_with_seed_rank_step():
    model = LogNormal(1.0, 0.5)
    values = {delay_for(model, s, r, t) for s in range(3) for r in range(3) for t in range(3)}
    assert len(values) == 27


def test_ranks_filter():
    model = Exponential(0.1, ranks=[0, 2])
    for step in range(20):
        assert delay_for(model, 0, 1, step) == 0.0
        assert delay_for(model, 0, 3, step) == 0.0
    assert all(delay_for(model, 0, 0, t) > 0 for t in range(20))
    assert model.mean_seconds(0) == 0.1 and model.mean_seconds(1) == 0.0
    assert Constant(0.5, ranks=[2]).mean_seconds(2) == 0.5
    assert Constant(0.5, ranks=[2]).mean_seconds(0) == 0.0
    assert Constant(0.5).mean_seconds(17) == 0.5
    slow = SlowRanks([1, 3], 2.0)
    assert [delay_for(slow, 0, r, 4) for r in range(4)] == [0.0, 2.0, 0.0, 2.0]


def test_filter_does_not_change_other_parts_realisation():
    # Every part consumes the rng the same way on every rank, so filtering one part never shifts another.
    tail = LogNormal(1.0, 0.3)
    a = Exponential(0.1, ranks=[0]) + tail
    b = Exponential(0.1) + tail
    for step in range(10):
        assert delay_for(a, 0, 1, step) == pytest.approx(delay_for(b, 0, 1, step) - _first_part(b, 0, 1, step))


def _first_part(model, seed, rank, step):
    rng = np.random.default_rng([seed, rank, step])
    return model.parts[0].sample(rank, step, rng)


@pytest.mark.parametrize(
    "model,rel",
    [
        (LogNormal(0.02, 0.5), 0.02),
        (Exponential(0.1), 0.03),
        (Spikes(0.05, 10, 30), 0.05),
    ],
    ids=repr,
)
def test_empirical_means_match_analytic(model, rel):
    assert _empirical_mean(model) == pytest.approx(model.mean_seconds(0), rel=rel)


def test_spikes_values():
    model = Spikes(0.2, 10, 30)
    rng = np.random.default_rng(0)
    draws = np.array([model.sample(0, 0, rng) for _ in range(5000)])
    nonzero = draws[draws > 0]
    assert np.all((nonzero >= 10) & (nonzero <= 30))
    assert abs(len(nonzero) / len(draws) - 0.2) < 0.02


def test_composition():
    a, b, c = LogNormal(0.02, 0.5), SlowRanks([3], 1.0), Constant(0.1)
    total = a + b + c
    assert isinstance(total, SumDelay) and total.parts == [a, b, c]
    assert total.mean_seconds(3) == pytest.approx(a.mean_seconds(3) + 1.0 + 0.1)
    assert total.mean_seconds(0) == pytest.approx(a.mean_seconds(0) + 0.1)
    for step in range(5):
        rng = np.random.default_rng([0, 3, step])
        expected = a.sample(3, step, rng) + b.sample(3, step, rng) + c.sample(3, step, rng)
        assert delay_for(total, 0, 3, step) == pytest.approx(expected)
    assert _empirical_mean(LogNormal(0.02, 0.5) + Exponential(0.1), draws=40_000) == pytest.approx(
        LogNormal(0.02, 0.5).mean_seconds(0) + 0.1, rel=0.03
    )


def test_scaled():
    model = LogNormal(0.02, 0.5) + Spikes(0.01, 10, 30) + SlowRanks([3], 1.0) + Exponential(0.1) + Constant(0.5)
    half = model.scaled(0.5)
    for rank in range(4):
        assert half.mean_seconds(rank) == pytest.approx(0.5 * model.mean_seconds(rank))
        for step in range(10):
            assert delay_for(half, 7, rank, step) == pytest.approx(0.5 * delay_for(model, 7, rank, step))
    assert NoDelay().scaled(3.0) == NoDelay()
    with pytest.raises(ValueError):
        model.scaled(-1)


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("none", NoDelay()),
        ("None", NoDelay()),
        ("constant(0.5)", Constant(0.5)),
        ("CONSTANT(seconds=0.5, ranks=[1])", Constant(0.5, [1])),
        ("exponential(mean=0.1, ranks=[0,2])", Exponential(0.1, [0, 2])),
        ("spikes(prob=0.01, low=10, high=30)", Spikes(0.01, 10, 30)),
        ("LogNormal(0.02, 0.5)", LogNormal(0.02, 0.5)),
        ("slow_ranks([3], 1)", SlowRanks([3], 1.0)),
        (
            "lognormal(median=0.02, sigma=0.5) + slowranks(ranks=[3], seconds=1.0)",
            LogNormal(0.02, 0.5) + SlowRanks([3], 1.0),
        ),
    ],
)
def test_parse_delay(spec, expected):
    assert parse_delay(spec) == expected


@pytest.mark.parametrize("model", MODELS + [Exponential(0.1 + 0.2), Spikes(1 / 3, 0.1, 0.7, ranks=[5])], ids=repr)
def test_str_round_trip(model):
    assert parse_delay(str(model)) == model
    assert str(parse_delay(str(model))) == str(model)


@pytest.mark.parametrize(
    "spec,match",
    [
        ("gaussian(1)", "valid names: .*constant.*lognormal"),
        ("constant()", "Bad arguments for 'constant'"),
        ("constant(1, 2, 3)", "Bad arguments"),
        ("constant(secs=1)", "Bad arguments"),
        ("constant(-1)", "seconds must be"),
        ("lognormal(0.1, sigma=-1)", "sigma"),
        ("spikes(prob=1.5, low=1, high=2)", "prob"),
        ("spikes(prob=0.5, low=2, high=1)", "high must be >= low"),
        ("slowranks(ranks=None, seconds=1)", "ranks"),
        ("exponential(0.1, ranks=[-1])", "ranks"),
        ("constant('a')", "seconds must be a number"),
        ("constant(x)", "not a literal"),
        ("__import__('os').system('true')", "Cannot parse|Unknown"),
        ("constant(1) * 2", "Cannot parse"),
        ("constant(1) +", "Cannot parse"),
        ("", "Empty"),
    ],
)
def test_parse_delay_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_delay(spec)


def test_delay_for_validates():
    with pytest.raises(ValueError):
        delay_for(NoDelay(), -1, 0, 0)
    with pytest.raises(ValueError):
        delay_for(NoDelay(), 0, 0, 1.5)


def _drive(injector, steps, backwards_per_step, rank=0):
    trainer = SimpleNamespace(global_step=0, global_rank=rank)
    for step in range(steps):
        trainer.global_step = step
        for _ in range(backwards_per_step):
            injector.on_after_backward(trainer, None)


def test_injector_sleeps_once_per_step(sleeps):
    model = LogNormal(0.02, 0.5) + SlowRanks([1], 0.3)
    injector = StragglerInjector(model, seed=4, scale=0.5)
    _drive(injector, steps=6, backwards_per_step=3, rank=1)
    expected = [0.5 * delay_for(model, 4, 1, t) for t in range(6)]
    assert sleeps == pytest.approx(expected)
    assert injector.steps_delayed == 6
    assert injector.total_sleep_s == pytest.approx(sum(expected))
    assert injector.last_delay_s == pytest.approx(expected[-1])


def test_injector_skipped_steps_and_ranks(sleeps):
    injector = StragglerInjector("slowranks(ranks=[2], seconds=1.0)")
    assert isinstance(injector.delay, SlowRanks)
    _drive(injector, steps=4, backwards_per_step=2, rank=0)
    assert sleeps == [] and injector.steps_delayed == 0 and injector.total_sleep_s == 0.0
    # a rank that skips steps 1 and 2 (never calls backward) is delayed only for the steps it computes
    other = StragglerInjector("constant(0.25)")
    trainer = SimpleNamespace(global_step=0, global_rank=2)
    for step in (0, 3, 4):
        trainer.global_step = step
        other.on_after_backward(trainer, None)
    assert sleeps == [0.25] * 3 and other.steps_delayed == 3


def test_injector_validates():
    with pytest.raises(ValueError):
        StragglerInjector("nope(1)")
    with pytest.raises(ValueError):
        StragglerInjector(seed=-1)
    with pytest.raises(ValueError):
        StragglerInjector(scale=-0.5)
    with pytest.raises(ValueError):
        StragglerInjector(delay=3.0)  # type: ignore[arg-type]


def _trainer(injector, **kwargs):
    return Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[injector],
        **kwargs,
    )


def test_injector_in_real_trainer(sleeps):
    model = LogNormal(0.01, 0.5)
    injector = StragglerInjector("lognormal(median=0.01, sigma=0.5)", seed=2, scale=2.0)
    _trainer(injector).fit(BoringModel())
    expected = [2.0 * delay_for(model, 2, 0, t) for t in range(5)]
    assert sleeps == pytest.approx(expected)
    assert injector.steps_delayed == 5
    assert injector.total_sleep_s == pytest.approx(sum(expected))


class _ThreeBackwards(BoringModel):
    """Manual optimization with three backward passes per step, like gradient coding with c = 3."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        for chunk in torch.chunk(batch, 3):
            self.manual_backward(self.step(chunk) / 3)
        opt.step()


def test_injector_once_per_step_with_several_backwards(sleeps):
    injector = StragglerInjector(Constant(0.125), seed=0)
    _trainer(injector).fit(_ThreeBackwards())
    assert sleeps == [0.125] * 5
    assert injector.steps_delayed == 5


def test_injector_from_jsonargparse_config():
    from jsonargparse import ArgumentParser

    def instantiate(parser, cfg):
        return getattr(parser, "instantiate", parser.instantiate_classes)(cfg)

    parser = ArgumentParser()
    parser.add_class_arguments(StragglerInjector, "injector")
    cfg = parser.parse_object({"injector": {"delay": "lognormal(median=0.02, sigma=0.5)", "seed": 3}})
    injector = instantiate(parser, cfg).injector
    assert isinstance(injector, StragglerInjector)
    assert injector.delay == LogNormal(0.02, 0.5) and injector.seed == 3 and injector.scale == 1.0

    cfg = parser.parse_object(
        {
            "injector": {
                "delay": {
                    "class_path": "lightning_pgc.delays.SlowRanks",
                    "init_args": {"ranks": [1], "seconds": 0.5},
                }
            }
        }
    )
    assert instantiate(parser, cfg).injector.delay == SlowRanks([1], 0.5)

    callbacks = ArgumentParser()
    callbacks.add_argument("--callbacks", type=list[Callback])
    yaml = """
callbacks:
  - class_path: lightning_pgc.callbacks.stragglers.StragglerInjector
    init_args:
      delay: "lognormal(median=0.02, sigma=0.5) + slowranks(ranks=[3], seconds=1.0)"
      seed: 0
      scale: 0.1
"""
    (injector,) = instantiate(callbacks, callbacks.parse_string(yaml)).callbacks
    assert injector.delay == LogNormal(0.02, 0.5) + SlowRanks([3], 1.0)
    assert injector.scale == 0.1


def test_injector_from_lightning_cli(monkeypatch):
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr("sys.argv", ["cli"])
    cli = LightningCLI(
        BoringModel,
        run=False,
        args={
            "trainer": {
                "accelerator": "cpu",
                "logger": False,
                "callbacks": [
                    {
                        "class_path": "lightning_pgc.callbacks.stragglers.StragglerInjector",
                        "init_args": {"delay": "spikes(prob=0.01, low=10, high=30)", "seed": 1, "scale": 0.01},
                    }
                ],
            }
        },
    )
    (injector,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, StragglerInjector)]
    assert injector.delay == Spikes(0.01, 10, 30) and injector.seed == 1 and injector.scale == 0.01
    assert isinstance(injector.delay, DelayModel)


_DDP_SCRIPT = """
import sys
from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_pgc.callbacks.stragglers import StragglerInjector


class RecordingInjector(StragglerInjector):
    def on_train_end(self, trainer, pl_module):
        out = Path(sys.argv[1]) / f"rank{trainer.global_rank}.txt"
        out.write_text(f"{self.steps_delayed} {self.total_sleep_s!r}")


if __name__ == "__main__":
    injector = RecordingInjector(delay=sys.argv[2], seed=0)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[injector],
    )
    trainer.fit(BoringModel())
"""


def test_injector_with_two_process_ddp(tmp_path):
    """Unchanged under strategy="ddp" with 2 real processes (run in a fresh interpreter: real, tiny sleeps)."""
    model = SlowRanks([1], 0.02) + Constant(0.01)
    script = tmp_path / "ddp_run.py"
    script.write_text(_DDP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(model)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        steps, total = (tmp_path / f"rank{rank}.txt").read_text().split()
        assert int(steps) == 5
        assert float(total) == pytest.approx(5 * model.mean_seconds(rank))
