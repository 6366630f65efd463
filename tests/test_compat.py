"""The compatibility table of ``docs/guide.md``: every "works" row on real ranks (two batched 2-rank jobs of
``tests/compat_job.py``), every "refused" row in the launching process, before any rank starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

import lightning_pgc  # noqa: F401
from lightning_pgc import PGCStrategy
from lightning_pgc.strategy.preflight import CollectiveGuard, PGCUnsupportedError, SingleUseClosure, check_train_loader
from tests import compat_job

ROOT = Path(__file__).resolve().parents[1]


# ================================================================================== works: real ranks
def _run(case: str, out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.compat_job", case, str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((out / f"rank{k}.json").read_text()) for k in range(2)]
    assert len({r["checksum"] for r in ranks}) == 1, "replicas differ"  # parameters and buffers, bit for bit
    assert len({r["global_step"] for r in ranks}) == 1
    return ranks, json.loads((out / "logged.json").read_text())


def _assert_logged_once_at_the_step_measured(logged: list[dict[str, Any]], steps: int) -> None:
    """Each diagnostic is logged exactly once per measurement, at the step it was measured, whatever Lightning's
    ``log_every_n_steps``."""

    def steps_of(key: str) -> list[int]:
        return [call["step"] for call in logged if key in call["keys"]]

    every, loss_every = compat_job.DIAGNOSTICS["every_n_steps"], compat_job.DIAGNOSTICS["loss_every_n_steps"]
    assert steps_of("pgc/train_loss") == list(range(steps))
    for k in range(2):  # every rank, the straggler included
        for key in (f"pgc/admitted/rank{k}", f"pgc/rank{k}/late", f"pgc/rank{k}/skipped", f"pgc/rank{k}/mean_lag_s"):
            assert steps_of(key) == list(range(steps)), key
    assert steps_of("pgc/probe_loss") == list(range(0, steps, loss_every))
    assert steps_of("pgc/probe_grad_sqnorm") == list(range(0, steps, every))
    assert steps_of("pgc/L_hat_probe") == list(range(every, steps, every))  # needs two probe measurements


def test_features_work_with_identical_replicas(tmp_path):
    """Finetuning unfreeze, BatchNorm, clipping, step/epoch/plateau schedulers, torchmetrics, sync_dist in
    validation, ModelCheckpoint, EarlyStopping, val_check_interval, nested dict / list[str] / ragged batches."""
    ranks, logged = _run("features", tmp_path / "features")
    r0 = ranks[0]
    # EarlyStopping (patience 3, no improvement by 10 ever): the 4th validation, at step 12 (val every 3 steps)
    assert r0["global_step"] == 12 and r0["should_stop"]
    # BackboneFinetuning: frozen through epoch 0, trained after unfreezing at epoch 1, on every rank alike
    backbone = r0["backbone"]
    assert backbone["epoch0_end"] == backbone["start"] != backbone["end"]
    assert all(r["param_groups"] == 2 and r["lrs"] == r0["lrs"] for r in ranks)
    # the schedulers moved the lr (step x epoch x plateau), identically on every rank
    assert r0["lrs"][0] < 0.2 * 0.95**5
    # clipping acted on the decoded gradient the optimizer applied
    seen = r0["seen"]
    assert max(seen["pre_clip_norms"]) > 2 * compat_job.CLIP
    assert max(seen["applied_norms"]) <= compat_job.CLIP * (1 + 1e-5)
    assert seen["chunks_checked"] > 0  # training_step checked each chunk's names and ragged tensors
    best = Path(r0["best_model_path"])
    # ModelCheckpoint(save_top_k=1) removed the older checkpoints, each with its folder of per-rank stale caches
    assert sorted(p.name for p in best.parent.iterdir()) == [best.name, best.name + ".pgc"]
    assert sorted(p.name for p in (best.parent / (best.name + ".pgc")).iterdir()) == ["rank0.pt", "rank1.pt"]
    _assert_logged_once_at_the_step_measured(logged, r0["global_step"])


def test_bf16_and_max_time_work_and_diagnostics_ignore_log_every_n_steps(tmp_path):
    ranks, logged = _run("timed", tmp_path / "timed")
    steps = ranks[0]["global_step"]
    assert 4 < steps < 100_000 and ranks[0]["should_stop"]  # stopped by max_time, at the same step on both ranks
    _assert_logged_once_at_the_step_measured(logged, steps)  # log_every_n_steps=50 here, 1 in the job above


# ============================================================================ refused: before launch
class Plain(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, sync_dist=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)  # fine: every rank

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SyncDistInTrainingStep(Plain):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("synced", loss, sync_dist=True)
        return loss


class AllGatherInAHelper(Plain):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.shared(batch)

    def shared(self, batch: Any) -> torch.Tensor:
        x, y = batch
        gathered = self.all_gather(x)
        return nn.functional.cross_entropy(self.net(gathered.reshape(-1, 4)), y.repeat(2))


class WithSyncBatchNorm(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.SyncBatchNorm(4)


class StepSyncedMetric(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.acc = torchmetrics.Accuracy("multiclass", num_classes=2, dist_sync_on_step=True)


class Manual(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self) -> Any:  # two optimizers need manual optimization in Lightning 2
        return torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.Adam(self.parameters())


class Stream(IterableDataset):
    def __iter__(self):
        yield from ((torch.zeros(4), 0) for _ in range(8))


def _data() -> TensorDataset:
    return TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))


def _fit_refused(module: pl.LightningModule, loader: Any = None, match: str = "", **trainer_kwargs: Any) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=PGCStrategy(),
        logger=False,
        max_steps=2,
        enable_progress_bar=False,
        enable_checkpointing=False,
        **trainer_kwargs,
    )
    with pytest.raises(PGCUnsupportedError, match=match):
        trainer.fit(module, loader if loader is not None else DataLoader(_data(), batch_size=4))
    assert trainer.strategy.launcher.procs == []  # refused before Lightning started rank 1


@pytest.mark.parametrize(
    "module, loader, match, trainer_kwargs",
    [
        (Plain, None, "precision='16-true'.*bf16-mixed", {"precision": "16-true"}),
        (Plain, None, "accumulate_grad_batches.*batch_size", {"accumulate_grad_batches": 2}),
        (Plain, None, "GradientAccumulationScheduler", {"callbacks": [GradientAccumulationScheduler({0: 1, 1: 2})]}),
        (Plain, None, "sync_batchnorm=True.*plain BatchNorm", {"sync_batchnorm": True}),
        (WithSyncBatchNorm, None, "SyncBatchNorm \\(norm\\)", {}),
        (StepSyncedMetric, None, "dist_sync_on_step=True", {}),
        (Manual, None, "automatic optimization.*multiple optimizers", {}),
        (SyncDistInTrainingStep, None, "sync_dist=.*line .* of training_step.*sync_dist=False", {}),
        (AllGatherInAHelper, None, "`all_gather` \\(line .* of shared\\)", {}),
        (Plain, DataLoader(Stream(), batch_size=4), "map-style", {}),
        (
            Plain,
            DataLoader(_data(), batch_size=4, sampler=WeightedRandomSampler([1.0] * 32, 32)),
            "WeightedRandomSampler.*weight the loss",
            {},
        ),
        (Plain, DataLoader(_data(), batch_sampler=[[0, 1], [2, 3]]), "batch_sampler", {}),
    ],
    ids=[
        "fp16",
        "accumulate",
        "accumulation-scheduler",
        "sync_batchnorm",
        "SyncBatchNorm",
        "metric-sync-on-step",
        "manual-and-multiple-optimizers",
        "sync_dist",
        "all_gather-in-helper",
        "IterableDataset",
        "custom-sampler",
        "custom-batch_sampler",
    ],
)
def test_unsupported_setups_are_refused_before_any_rank_starts(module, loader, match, trainer_kwargs):
    _fit_refused(module(), loader, match, **trainer_kwargs)


def test_loaders_built_in_the_ranks_are_checked_alike():
    """A train_dataloader() hook runs in the ranks: the same check, on every rank, before the first step."""
    with pytest.raises(PGCUnsupportedError, match="map-style"):
        check_train_loader(DataLoader(Stream(), batch_size=4))
    check_train_loader(DataLoader(_data(), batch_size=4, shuffle=True))  # the ordinary loader passes


def test_collectives_only_visible_at_run_time_are_refused_at_the_first_call():
    guard = CollectiveGuard()
    module = Plain()
    with guard(module):
        with pytest.raises(PGCUnsupportedError, match="sync_dist=True.*on_train_batch_end"):
            module.log("x", 1.0, sync_dist=True)
        synced = torchmetrics.Accuracy("multiclass", num_classes=2)
        with pytest.raises(PGCUnsupportedError, match="sync_on_compute=False"):
            module.log("acc", synced)
        with pytest.raises(PGCUnsupportedError, match="`all_gather`"):
            guard.refuse("`all_gather`")
    guard.refuse("`all_gather`")  # outside training_step (callbacks, validation): allowed
    assert "log" not in vars(module)  # the module's own log is back


def test_an_optimizer_that_calls_the_closure_twice_is_refused():
    """LBFGS evaluates the closure several times per step; PGC exchanges one gradient per step."""
    param = nn.Parameter(torch.zeros(2))
    exchanges = []

    def exchange() -> torch.Tensor:
        exchanges.append(1)
        param.grad = None
        loss = (param - 1).pow(2).sum()
        loss.backward()
        return loss

    closure = SingleUseClosure(exchange)
    with pytest.raises(PGCUnsupportedError, match="closure a second time.*SGD, Adam"):
        torch.optim.LBFGS([param], max_iter=5).step(closure)
    assert exchanges == [1]


def test_ordinary_modules_pass_the_checks():
    """No false refusal: sync_dist=False in training_step, sync_dist=True in validation, a plain loader."""
    from lightning_pgc.strategy.preflight import check_module, scan_training_step

    found = scan_training_step(Plain)
    assert found.certain == [] and found.possible == []
    check_module(Plain())


class ConditionalSync(Plain):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.hparams.get("sync_train_metrics", False):
            self.log("train_loss", loss, sync_dist=True)
        self.log("computed", loss, sync_dist=self.trainer.world_size > 8)
        return self.helper(loss) if batch_idx else loss

    def helper(self, loss: torch.Tensor) -> torch.Tensor:
        return self.all_gather(loss).mean()


class EarlyReturn(Plain):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        with torch.no_grad():
            self.log("first", loss, sync_dist=True)
        if batch_idx > 3:
            return loss
        self.log("after", loss, sync_dist=True)
        return loss


def test_the_source_scan_refuses_only_collectives_that_run_at_every_call():
    """A literal ``sync_dist=True`` or a collective at the top level of training_step (or of a helper it always
    calls) is certain to run: refused before launch. One under a condition, with a computed ``sync_dist``, after
    a branch that may return, or in a helper called conditionally, may never run: a warning, and the run-time
    guard refuses it at its first actual call."""
    from lightning_pgc.strategy.preflight import check_module, scan_training_step

    found = scan_training_step(ConditionalSync)
    assert found.certain == []
    assert [p.split(" (")[0] for p in found.possible] == [
        "`sync_dist=True`",
        "`sync_dist=self.trainer.world_size > 8`",
        "the collective `all_gather`",
    ]
    with pytest.warns(UserWarning, match="may call a collective.*refused at that moment"):
        check_module(ConditionalSync())

    found = scan_training_step(EarlyReturn)
    assert [p.split(" (")[0] for p in found.certain] == ["`sync_dist=True`"]  # inside `with`: always runs
    assert "line 7 of training_step" in found.possible[0]  # after the branch that may return
    with pytest.raises(PGCUnsupportedError, match="sync_dist=True.*line 4 of training_step"):
        check_module(EarlyReturn())


def _tunable() -> pl.LightningModule:
    module = Plain()
    module.lr, module.batch_size = 0.1, 4
    module.train_dataloader = lambda: DataLoader(_data(), batch_size=module.batch_size)  # type: ignore[method-assign]
    return module


def test_the_tuner_is_refused_before_any_rank_starts_naming_the_alternative():
    """``Tuner.lr_find`` under PGC: refused in the launching process, naming what to do instead.
    ``Tuner.scale_batch_size``: Lightning's own refusal, the same as under ``ddp``."""
    from lightning.pytorch.tuner import Tuner

    def trainer(strategy: Any) -> pl.Trainer:
        return pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            logger=False,
            max_steps=2,
            enable_progress_bar=False,
            enable_checkpointing=False,
        )

    pgc = trainer(PGCStrategy())
    with pytest.raises(PGCUnsupportedError, match="Tuner.lr_find.*strategy='ddp'.*one device.*new PGC `Trainer`"):
        Tuner(pgc).lr_find(_tunable())
    assert pgc.strategy.launcher.procs == []
    errors = []
    for strategy in ("ddp", PGCStrategy()):
        with pytest.raises(ValueError) as error:
            Tuner(trainer(strategy)).scale_batch_size(_tunable())
        errors.append(str(error.value))
    assert errors[0] == errors[1] and "not supported with distributed strategies" in errors[0]
