"""The pgc strategy on real processes: 4 CPU ranks over gloo, the digits CNN, Lightning's own launcher."""

from __future__ import annotations

import os

import statistics
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

import lightning_pgc  # noqa: F401
from lightning_pgc import PGCDiagnostics, PGCStrategy
from tests.jobs import run_job

N_SLOW = 6  # steps in the straggler comparison; the slow rank sleeps 1 s in each
#: the exact schemes' training-loss curve against dgd's: float rounding, and curve.csv's 6 significant digits
CURVE_RTOL, CURVE_ATOL = 2e-5, 1e-5


def _assert_identical_replicas(job):
    ranks = job["ranks"]
    assert len({r["checksum"] for r in ranks}) == 1, [r["checksum"][:12] for r in ranks]
    assert len({r["global_step"] for r in ranks}) == 1
    for r in ranks:
        assert r["pgc_threads_after_fit"] == [], r


def test_pgc_does_not_wait_for_a_slow_rank_while_ddp_and_dgd_do(tmp_path):
    slow = "slowranks(ranks=[3], seconds=1.0)"
    common = dict(devices=4, max_steps=N_SLOW, delay=slow, check_val_every_n_epoch=100)
    pgc = run_job(tmp_path, "pgc", strategy="pgc", **common)
    dgd = run_job(tmp_path, "dgd", strategy="dgd", **common)
    ddp = run_job(tmp_path, "ddp", strategy="ddp", **common)

    # The slow rank really slept on every step it computed, under every strategy.
    for job in (pgc, dgd, ddp):
        assert job["ranks"][3]["injected_sleep_s"] >= 1.0
    # ddp and dgd wait for it every step; pgc (s=1) does not wait for it at all.
    assert ddp["summary"]["fit_wall_s"] >= N_SLOW * 0.95
    assert dgd["summary"]["fit_wall_s"] >= N_SLOW * 0.95
    # (a ratio measured side by side, never an absolute time: the machine may be loaded)
    assert pgc["summary"]["fit_wall_s"] < 0.5 * min(ddp["summary"]["fit_wall_s"], dgd["summary"]["fit_wall_s"])
    # The slow rank caught up by applying published aggregates without computing (Invariant 3).
    assert pgc["ranks"][3]["skipped_steps"] >= 1
    assert all(r["skipped_steps"] == 0 for r in pgc["ranks"][:3])
    _assert_identical_replicas(pgc)
    _assert_identical_replicas(dgd)
    # The leader admitted the three fast ranks; its per-rank table names the straggler.
    admitted = [h["pgc/admitted/rank3"] for h in pgc["summary"]["diagnostics"][1:]]
    assert sum(admitted) == 0
    last = pgc["summary"]["diagnostics"][-1]
    assert last["pgc/rank3/admitted_rate"] == 0.0
    assert min(last[f"pgc/rank{k}/admitted_rate"] for k in range(3)) > 0.5


def test_exact_schemes_decode_the_full_gradient_on_real_ranks(tmp_path):
    """dgd, gc_fr and gc_cr all apply (1/n) sum_i g_i over the same partition mini-batches, so their loss curves
    agree, even when gradient coding ignores a slow rank and decodes from the other three."""
    common = dict(devices=4, max_steps=20, check_val_every_n_epoch=100)
    dgd = run_job(tmp_path, "dgd", strategy="dgd", **common)
    slow = "slowranks(ranks=[1], seconds=0.3)"
    gc_fr = run_job(tmp_path, "gc_fr", strategy="gc_fr", delay=slow, **common)
    gc_cr = run_job(tmp_path, "gc_cr", strategy="gc_cr", delay=slow, **common)  # float64 codes: still exact
    reference = [loss for _, _, loss in dgd["curve"]]
    for job in (gc_fr, gc_cr):
        losses = [loss for _, _, loss in job["curve"]]
        assert losses == pytest.approx(reference, rel=CURVE_RTOL, abs=CURVE_ATOL)  # curve.csv keeps 6 digits
        # the slow rank was really ignored, and the result is still exact
        admitted = [h["pgc/admitted/rank1"] for h in job["summary"]["diagnostics"][2:]]
        assert sum(admitted) < len(admitted)


@pytest.mark.parametrize(
    "strategy, kwargs, evals_per_step",
    [  # dgd, gc_fr and gc_cr run in the exactness test above
        ("pgc", {}, [2] + [1] * 29),  # full warm-up: both held partitions at the first step
        ("pgc_fr", {}, [2] + [1] * 29),
        ("ignore_stragglers", {}, [1] * 30),
        ("pgc_cr", {"coding": {"warmup": "gradual"}}, [1] * 30),
        ("pgc_cr", {"scheme": "pgc_cr_naive"}, [2] + [1] * 29),
    ],
)
def test_every_scheme_keeps_replicas_identical_and_lays_out_partitions(tmp_path, strategy, kwargs, evals_per_step):
    job = run_job(
        tmp_path,
        strategy,
        strategy=strategy,
        strategy_kwargs=kwargs,
        devices=4,
        max_steps=30,
        batch_size=8,
        delay="lognormal(median=0.005, sigma=1.0)",
        check_val_every_n_epoch=100,
    )
    _assert_identical_replicas(job)
    for r in job["ranks"]:
        assert r["global_step"] == 30
        assert r["batch_sizes"] == [8 * e for e in evals_per_step]
    losses = [loss for _, _, loss in job["curve"]]
    assert all(torch.isfinite(torch.tensor(losses)))


def test_loss_goes_down_and_validation_runs(tmp_path):
    # with BatchNorm: its running statistics (buffers) must stay identical on every rank too
    job = run_job(
        tmp_path,
        "train",
        strategy="pgc",
        devices=4,
        max_steps=150,
        batch_size=16,
        lr=0.05,
        batch_norm=True,
        delay="lognormal(median=0.002, sigma=0.5)",
        val_check_interval=None,
        check_val_every_n_epoch=2,
    )
    losses = [loss for _, _, loss in job["curve"]]
    first, last = statistics.mean(losses[:10]), statistics.mean(losses[-10:])
    assert first > 2.0  # ten balanced classes: ln(10) = 2.30 at initialization
    assert last < 0.5 * first
    metrics = job["summary"]["metrics"]
    assert metrics["val_acc"] > 0.8
    # The decoded loss is what the module logged as train_loss, identical on every rank.
    assert job["summary"]["diagnostics"][-1]["pgc/train_loss"] == pytest.approx(losses[-1], rel=1e-5)
    _assert_identical_replicas(job)


# ------------------------------------------------------------------------------------ configuration errors
def _trainer(strategy, devices=4):
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )


def test_registered_names():
    from lightning.pytorch.strategies import StrategyRegistry

    for name in ("pgc", "pgc_fr", "pgc_cr", "gc_fr", "gc_cr", "ignore_stragglers", "dgd"):
        assert StrategyRegistry[name]["strategy"] is PGCStrategy
    trainer = _trainer("pgc")
    assert isinstance(trainer.strategy, PGCStrategy)
    assert trainer.strategy.scheme_name == "pgc_cr" and trainer.strategy.stragglers == 1
    assert _trainer("ignore_stragglers").strategy.scheme_name == "ignore"
    import importlib

    importlib.reload(lightning_pgc)  # registering twice is harmless


def test_bad_configurations_fail_before_any_rank_starts():
    with pytest.raises(ValueError, match="divide"):
        _trainer(PGCStrategy(scheme="pgc_fr", stragglers=1), devices=3)
    with pytest.raises(ValueError, match="stragglers|s >= n|s=3"):
        _trainer(PGCStrategy(scheme="pgc_cr", stragglers=3), devices=3)
    with pytest.raises(ValueError, match="condition"):
        _trainer(PGCStrategy(scheme="gc_cr", stragglers=8), devices=64)
    with pytest.raises(ValueError, match="unknown scheme"):
        PGCStrategy(scheme="pgc_xx")
    with pytest.raises(ValueError, match=r"coding\.warmup must be one of 'full', 'gradual', got 'lazy'"):
        PGCStrategy(coding={"warmup": "lazy"})
    with pytest.raises(ValueError, match=r"liveness\.timeout must be positive seconds, got 0"):
        PGCStrategy(liveness={"timeout": 0})
    failover = {"failover": True}
    assert PGCStrategy(scheme="bounded", liveness=failover).liveness.failover is True  # (the table moves with it)
    with pytest.raises(ValueError, match="rank 0 is the launching process under start_method='popen'"):
        _trainer(PGCStrategy(liveness=failover), devices=2)  # popen (the default) outside a cluster launcher
    assert isinstance(_trainer(PGCStrategy(liveness=failover, start_method="fork"), devices=2).strategy, PGCStrategy)
    assert "LIGHTNING_PGC_RANK0_LAUNCHES" not in os.environ  # (a fork job after a popen one: rank 0 is a child)


def test_data_backend_is_checked_and_follows_the_device_by_default():
    """``data_backend``: NCCL on CUDA and gloo on CPU by default; gloo on CUDA on request (ranks sharing a GPU)."""
    from lightning_pgc.runtime.group import data_backend_for
    from lightning_pgc.runtime.plane import CollectiveRuntime
    from lightning_pgc.codes import make_scheme

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert data_backend_for(cuda) == "nccl" and data_backend_for(cpu) == "gloo"
    assert data_backend_for(cuda, "gloo") == "gloo" and data_backend_for(cpu, "gloo") == "gloo"
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        data_backend_for(cpu, "nccl")
    assert PGCStrategy(data_backend="gloo", process_group_backend="gloo").data_backend == "gloo"
    assert PGCStrategy().data_backend is None
    with pytest.raises(ValueError, match="data_backend must be one of nccl, gloo"):
        PGCStrategy(data_backend="mpi")
    with pytest.raises(TypeError, match="data_backend"):
        PGCStrategy(data_backend=1)
    with pytest.raises(ValueError, match="needs CUDA tensors"):  # at construction, before any thread or connection
        CollectiveRuntime(
            make_scheme("pgc_cr", 2, 1), None, 0, 2, 4, 3, 4, torch.float32, 0, 1.0, 4, data_backend="nccl"
        )


def test_unsupported_training_setups_are_refused():
    strategy = PGCStrategy()
    module = SimpleNamespace(automatic_optimization=True)
    ok = SimpleNamespace(lightning_module=module, accumulate_grad_batches=1, precision="32-true")
    strategy._check_supported(ok)
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        strategy._check_supported(SimpleNamespace(**{**vars(ok), "accumulate_grad_batches": 2}))
    with pytest.raises(ValueError, match="16-mixed"):
        strategy._check_supported(SimpleNamespace(**{**vars(ok), "precision": "16-mixed"}))
    manual = SimpleNamespace(**{**vars(ok), "lightning_module": SimpleNamespace(automatic_optimization=False)})
    with pytest.raises(ValueError, match="automatic optimization"):
        strategy._check_supported(manual)


def test_diagnostics_validates_its_arguments():
    with pytest.raises(ValueError):
        PGCDiagnostics(every_n_steps=0)
