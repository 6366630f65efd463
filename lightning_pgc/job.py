"""One training job from a JSON spec, on real processes: what the demo, the benchmarks and the tests launch.

``python -m lightning_pgc.job spec.json`` trains the digits CNN with the spec's strategy (any Lightning
strategy name, ``ddp`` included) and straggler model, and writes into ``spec["out"]``:

- ``rank{k}.json`` from every rank: final step, a checksum of the parameters, steps skipped while catching up,
  injected sleep;
- ``curve.csv`` from rank 0: wall-clock seconds since the first step, step, training loss on the mean scale
  of all ranks (the decoded aggregate under PGC, the all-rank mean under other strategies);
- ``valve_rank{k}.json`` from every rank when the spec has a ``valve``: its checks, lr changes, final lrs;
- ``summary.json`` from rank 0: the spec, final validation metrics, fit wall time and the diagnostics history.

Optional spec keys (all off by default), used by ``benchmarks/grid.py``:

- ``measure: true``: every ``rank{k}.json`` gets a ``"measure"`` entry: forward and backward compute seconds
  (sleeps excluded), injected sleep, simulated compute, busy seconds (= forward + backward + injected sleep +
  simulated compute), the rank's wall seconds from its first training batch to the end of fit, how many
  partition mini-batch gradients it evaluated at each step (0 for a step skipped while catching up), the
  samples it evaluated at each step, its waiting time for the aggregate (PGC: from sending its code to holding
  the aggregate; ``ddp``: from the end of its local backward to the end of the gradient all-reduce, measured
  with a DDP communication hook; Lightning's per-step SIGTERM broadcast under ``ddp`` is a second wait it does
  not see), and the forward+backward FLOPs of one sample (``torch.utils.flop_counter``: convolutions and
  matmuls only);
- ``compute_s_per_eval: x``: every partition gradient evaluation (every backward pass) sleeps ``x`` more seconds
  on its rank, a stand-in for a model heavier than the digits CNN (see :class:`SimulatedCompute`);
- ``val_every_n_steps: k``: rank 0 evaluates the model on the whole validation set before the first step, every
  ``k`` steps and after the last step, outside Lightning's validation loop (no collective, so no rank waits for
  it except under ``ddp``, where the next all-reduce waits for rank 0), and writes ``val_curve.csv``: seconds
  since the start of training (the same clock as ``summary.json``'s ``curve_offset_s``), step, validation loss,
  validation accuracy, seconds the evaluation took;
- ``wandb: {project, group, name, offline: true, config: {...}, tags: [...]}``: a ``WandbLogger`` next to the CSV
  logger (save_dir = ``out``), one W&B run per job with the scheme, n, s, c, delay model, seeds, learning rate,
  batch size and steps as config; ``wandb_run.json`` (rank 0) names the run directory.

Lightning's launcher re-runs this same command for ranks 1..n-1, as it does for any ``ddp`` script.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch

import lightning_pgc  # noqa: F401  (registers the strategy names)
from lightning_pgc.callbacks import PGCDiagnostics, StalenessValve
from lightning_pgc.digits import DigitsCNN, DigitsDataModule
from lightning_pgc.strategy import PGCStrategy
from lightning_pgc.stragglers import StragglerInjector

DEFAULTS: dict[str, Any] = {
    "strategy": "pgc",
    "strategy_kwargs": {},
    "devices": 4,
    "delay": "none",
    "delay_seed": 0,
    "max_steps": 100,
    "max_epochs": -1,
    "batch_size": 16,
    "lr": 0.05,
    "seed": 0,
    "threads": 1,
    "val_check_interval": None,
    "check_val_every_n_epoch": 1,
    "limit_val_batches": 1.0,
    "ckpt_path": None,
    "save_checkpoint": None,
    "checkpoint_every_n_steps": None,
    "final_validation": False,
    "sync_loss": True,  # ddp & co: average the logged loss over ranks (one all-reduce per step); False for timing
    "compute_s_per_eval": 0.0,  # simulated extra compute (sleep) per partition gradient, see SimulatedCompute
    "measure": False,  # per-rank compute/busy/wait time, gradient evaluations and FLOPs (rank{k}.json "measure")
    "val_every_n_steps": None,  # rank 0 evaluates the validation set every k steps -> val_curve.csv
    "wandb": None,  # {"project", "group", "name", "offline": True, "config": {}, "tags": []} -> one W&B run
    "diagnostics": None,  # PGCDiagnostics kwargs, e.g. {"theory_every_n_steps": 50} (else the strategy's default)
    "valve": None,  # StalenessValve kwargs: lower the lr when the staleness term dominates (off by default)
    "out": "outputs/job",
}


def parameter_checksum(module: torch.nn.Module) -> str:
    """SHA-256 of the state dict (parameters and buffers): equal only for bit-identical replicas."""
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def build_callbacks(spec: dict[str, Any], out: Path) -> list[Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    injector = StragglerInjector(spec["delay"], seed=spec["delay_seed"])
    callbacks: list[Any] = [LossRecorder(out, sync=spec["sync_loss"]), injector]
    compute = SimulatedCompute(float(spec["compute_s_per_eval"])) if spec["compute_s_per_eval"] else None
    if compute is not None:
        callbacks.append(compute)
    if spec["measure"]:
        callbacks.append(WorkMeter(injector, compute))
    if spec["val_every_n_steps"]:
        callbacks.append(ValidationCurve(out, int(spec["val_every_n_steps"])))
    if spec["diagnostics"] is not None:
        callbacks.append(PGCDiagnostics(**spec["diagnostics"]))
    if spec["valve"] is not None:
        callbacks.append(StalenessValve(**spec["valve"]))
    if spec["checkpoint_every_n_steps"]:
        callbacks.append(
            ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=spec["checkpoint_every_n_steps"],
                            save_top_k=-1, save_last=True)
        )
    return callbacks


class LossRecorder(pl.Callback):
    """Records (wall time, step, mean-scale training loss) and the fit's wall time."""

    def __init__(self, out: Path, sync: bool = True) -> None:
        self.out = out
        self.sync = sync
        self.rows: list[tuple[float, int, float]] = []
        self.batch_sizes: list[int] = []
        self.t0: float | None = None
        self.fit_start: float | None = None
        self.fit_end: float | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.fit_start = time.monotonic()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.batch_sizes.append(len(batch[0]))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is None:
            return
        loss = loss.detach().float()
        if self.sync and not isinstance(trainer.strategy, PGCStrategy) and trainer.world_size > 1:
            loss = trainer.strategy.reduce(loss, reduce_op="mean")  # DDP's mean of the local losses
        now = time.monotonic()
        if self.t0 is None:
            self.t0 = now
        self.rows.append((now - self.t0, trainer.global_step, float(loss)))
        if trainer.global_rank == 0 and trainer.global_step % 10 == 0:
            (self.out / "progress.txt").write_text(str(trainer.global_step))  # read by the demo's progress bars

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.fit_end = time.monotonic()
        if trainer.global_rank == 0:
            with open(self.out / "curve.csv", "w") as f:
                f.write("wall_s,step,train_loss\n")
                for t, step, loss in self.rows:
                    f.write(f"{t:.6f},{step},{loss:.6g}\n")


class WorkMeter(pl.Callback):
    """Per-rank work and time: compute, injected sleep, waiting, gradient evaluations per step (``measure: true``).

    Forward time runs from the batch start (or the end of the previous backward, for strategies that evaluate
    several partitions per step) to ``on_before_backward``; backward time from there to ``on_after_backward``.
    Injected sleep is subtracted from both wherever it happens and reported on its own. Under ``ddp`` the
    gradient all-reduce runs inside backward, so the end of the *local* backward is taken when DDP hands the
    gradient bucket to its communication hook (a timed copy of ``torch``'s default all-reduce hook); the rest of
    backward is waiting for the other ranks (with several buckets, the last one marks the end of the local
    backward). Under PGC the exchange happens after backward, so backward is compute only and the wait is
    ``strategy.last_step.worker_wait_s``. Whatever is neither busy nor this wait (Lightning's loop, the optimizer,
    data loading, and under ``ddp`` Lightning's per-step SIGTERM broadcast from rank 0) is ``wall - busy - wait``.
    """

    def __init__(self, injector: StragglerInjector, compute: Optional["SimulatedCompute"] = None) -> None:
        self.injector = injector
        self.compute = compute
        self.forward_s = 0.0
        self.backward_s = 0.0
        self.wait_s = 0.0
        self.evals: dict[int, int] = {}
        self.samples: dict[int, int] = {}
        self.waits: dict[int, float] = {}
        self.first_batch: Optional[float] = None
        self.end: Optional[float] = None
        self.ddp_hook = False
        self._mark = 0.0
        self._sleep_mark = 0.0
        self._before = 0.0
        self._sleep_before = 0.0
        self._bucket_ready: Optional[float] = None
        self._step = 0
        self._count = 0
        self._batch = 0
        self._step_wait = 0.0

    def _slept(self) -> float:
        """Seconds this rank has slept so far (injected delays and simulated compute)."""
        return self.injector.total_sleep_s + (self.compute.total_sleep_s if self.compute is not None else 0.0)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.nn.parallel import DistributedDataParallel

        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel) and not self.ddp_hook:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            meter = self

            def timed_allreduce(state: Any, bucket: Any) -> Any:
                meter._bucket_ready = time.monotonic()  # the local backward has produced this bucket
                return allreduce_hook(state, bucket)

            # DDP checks the hook's annotations as objects (this module postpones them to strings)
            timed_allreduce.__annotations__ = {"state": object, "bucket": torch.distributed.GradBucket,
                                               "return": torch.futures.Future[torch.Tensor]}
            model.register_comm_hook(None, timed_allreduce)
            self.ddp_hook = True

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        now = time.monotonic()
        if self.first_batch is None:
            self.first_batch = now
        self._mark, self._sleep_mark = now, self._slept()
        self._step, self._count, self._step_wait = trainer.global_step, 0, 0.0
        self._batch = len(batch[0]) if isinstance(batch, (list, tuple)) else 0

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        now = time.monotonic()
        sleep = self._slept()
        self.forward_s += max(0.0, now - self._mark - (sleep - self._sleep_mark))
        self._before, self._sleep_before = now, sleep
        self._bucket_ready = None

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        now = time.monotonic()
        sleep = self._slept()
        end = now
        if self.ddp_hook and self._bucket_ready is not None:
            end = self._bucket_ready
            self._step_wait += max(0.0, now - end - (sleep - self._sleep_before))
        self.backward_s += max(0.0, end - self._before - (sleep - self._sleep_before if end == now else 0.0))
        self._mark, self._sleep_mark = now, sleep
        self._count += 1

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        info = getattr(trainer.strategy, "last_step", None)
        if info is not None and isinstance(trainer.strategy, PGCStrategy):
            self._step_wait = float(info.worker_wait_s)
        self.evals[self._step] = self._count
        self.samples[self._step] = self._batch if self._count else 0
        self.waits[self._step] = self._step_wait
        self.wait_s += self._step_wait

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end = time.monotonic()

    def result(self, flops: dict[str, float]) -> dict[str, Any]:
        steps = range(min(self.evals, default=0), max(self.evals, default=-1) + 1)
        wall = (self.end or 0.0) - (self.first_batch or 0.0)
        simulated = self.compute.total_sleep_s if self.compute is not None else 0.0
        busy = self.forward_s + self.backward_s + self.injector.total_sleep_s + simulated
        return {
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "injected_sleep_s": self.injector.total_sleep_s,
            "simulated_compute_s": simulated,
            "busy_s": busy,
            "wall_s": wall,
            "utilization": busy / wall if wall > 0 else float("nan"),
            "wait_s": self.wait_s,
            "ddp_comm_hook": self.ddp_hook,
            "first_step": steps.start,
            "evals_per_step": [self.evals.get(t, 0) for t in steps],
            "samples_per_step": [self.samples.get(t, 0) for t in steps],
            "wait_per_step_s": [round(self.waits.get(t, 0.0), 6) for t in steps],
            **flops,
        }


class SimulatedCompute(pl.Callback):
    """Sleeps ``seconds`` after every backward pass, i.e. per partition gradient evaluated (``compute_s_per_eval``).

    The digits CNN computes a mini-batch gradient in a few milliseconds, far less than the injected straggler
    delays, which would make a scheme's extra gradient evaluations (gradient coding's ``c`` per step) look free.
    This stands in for a heavier model on a dedicated device: every evaluation costs ``seconds`` of wall time on
    its rank, a step that evaluates ``c`` partitions costs ``c`` times that, and a step skipped while catching up
    costs nothing. A sleep takes no CPU, so it behaves the same on 2 cores as on 16.
    """

    def __init__(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"compute_s_per_eval must be >= 0, got {seconds}")
        self.seconds = seconds
        self.total_sleep_s = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.total_sleep_s = 0.0

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        started = time.monotonic()
        time.sleep(self.seconds)
        self.total_sleep_s += time.monotonic() - started


class ValidationCurve(pl.Callback):
    """Rank 0: validation loss and accuracy on the whole validation set every ``every`` steps, with wall time.

    Runs outside Lightning's validation loop, so there is no collective and the other ranks never wait for it
    (except under ``ddp``, whose next all-reduce waits for rank 0). Replicas are identical under every strategy
    here, so rank 0's model is the model. The clock starts after the evaluation before the first step.
    """

    def __init__(self, out: Path, every: int) -> None:
        if every < 1:
            raise ValueError(f"val_every_n_steps must be >= 1, got {every}")
        self.out = out
        self.every = every
        self.rows: list[tuple[float, int, float, float, float]] = []
        self.t0: Optional[float] = None
        self._last_step = -1

    def _evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import torch.nn.functional as F

        started = time.monotonic()
        x, y = trainer.datamodule.val_set.tensors
        was_training = pl_module.training
        pl_module.eval()
        with torch.no_grad():
            logits = pl_module(x.to(pl_module.device))
            loss = float(F.cross_entropy(logits, y.to(logits.device)))
            acc = float((logits.argmax(dim=1).cpu() == y).float().mean())
        pl_module.train(was_training)
        now = time.monotonic()
        if self.t0 is None:
            self.t0 = now
        step = trainer.global_step
        self.rows.append((now - self.t0, step, loss, acc, now - started))
        self._last_step = step
        for logger in trainer.loggers:
            logger.log_metrics({"val/loss": loss, "val/acc": acc, "val/wall_s": now - self.t0}, step=step)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            self._evaluate(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if trainer.global_rank == 0 and step % self.every == 0 and step != self._last_step:
            self._evaluate(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        if trainer.global_step != self._last_step:
            self._evaluate(trainer, pl_module)
        with open(self.out / "val_curve.csv", "w") as f:
            f.write("wall_s,step,val_loss,val_acc,eval_s\n")
            for wall, step, loss, acc, took in self.rows:
                f.write(f"{wall:.6f},{step},{loss:.6g},{acc:.6g},{took:.6f}\n")


def flops_per_sample(lr: float) -> dict[str, float]:
    """Forward and forward+backward FLOPs of the digits CNN for one sample (convolutions and matmuls only)."""
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    with torch.random.fork_rng(devices=[]):  # leaves the job's seeded random stream untouched
        model = DigitsCNN(lr=lr)
    x, y = torch.zeros(1, 1, 8, 8), torch.zeros(1, dtype=torch.long)
    with FlopCounterMode(display=False) as forward:
        with torch.no_grad():
            model(x)
    with FlopCounterMode(display=False) as both:
        F.cross_entropy(model(x), y).backward()
    return {"flops_forward_per_sample": float(forward.get_total_flops()),
            "flops_fwd_bwd_per_sample": float(both.get_total_flops())}


def scheme_config(spec: dict[str, Any]) -> dict[str, Any]:
    """scheme, n, s and c of a job's strategy (``ddp``: s = 0, c = 1), for W&B configs and reports."""
    from lightning.pytorch.strategies import StrategyRegistry

    n = int(spec["devices"])
    name = spec["strategy"]
    if name in StrategyRegistry and StrategyRegistry[name]["strategy"] is PGCStrategy:
        kwargs = {**StrategyRegistry[name]["init_params"], **spec["strategy_kwargs"]}
        scheme, s = kwargs.get("scheme", "pgc_cr"), int(kwargs.get("stragglers", 1))
        from lightning_pgc.codes import make_scheme

        c = int(make_scheme(scheme, n, s).c)
        return {"strategy": name, "scheme": scheme, "n": n, "s": s, "c": c}
    return {"strategy": name, "scheme": name, "n": n, "s": 0, "c": 1}


def make_wandb_logger(spec: dict[str, Any], out: Path) -> Any:
    """A ``WandbLogger`` (offline unless ``offline: false``) whose config lines runs up in the W&B UI."""
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    options = dict(spec["wandb"])
    config = {
        **scheme_config(spec),
        "delay": spec["delay"],
        "delay_seed": spec["delay_seed"],
        "seed": spec["seed"],
        "lr": spec["lr"],
        "batch_size": spec["batch_size"],
        "steps": spec["max_steps"],
        "compute_s_per_eval": spec["compute_s_per_eval"],
        "val_every_n_steps": spec["val_every_n_steps"],
        "strategy_kwargs": spec["strategy_kwargs"],
        **options.get("config", {}),
    }
    return WandbLogger(
        project=options.get("project", "lightning_pgc"),
        group=options.get("group"),
        name=options.get("name"),
        tags=options.get("tags"),
        save_dir=str(out),
        offline=bool(options.get("offline", True)),
        config=config,
        # no system-metrics sampler or console capture: they would compete with the ranks for the CPU
        settings=wandb.Settings(x_disable_stats=True, console="off"),
    )


def run(spec: dict[str, Any]) -> None:
    spec = {**DEFAULTS, **spec}
    torch.set_num_threads(int(spec["threads"]))
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(spec["seed"], workers=True, verbose=False)

    strategy: Any = spec["strategy"]
    if spec["strategy_kwargs"]:
        from lightning.pytorch.strategies import StrategyRegistry

        kwargs = dict(spec["strategy_kwargs"])
        if strategy in StrategyRegistry and StrategyRegistry[strategy]["strategy"] is PGCStrategy:
            kwargs = {**StrategyRegistry[strategy]["init_params"], **kwargs}
        strategy = PGCStrategy(**kwargs)

    callbacks = build_callbacks(spec, out)
    loggers: list[Any] = [pl.loggers.CSVLogger(out, name="logs")]
    is_launcher = all(int(os.environ.get(k, "0")) == 0 for k in ("RANK", "LOCAL_RANK", "NODE_RANK"))  # global rank 0
    if spec["wandb"] and is_launcher:  # rank 0 logs (as WandbLogger would); the other ranks skip importing wandb
        loggers.append(make_wandb_logger(spec, out))
        loggers[-1].experiment  # start the W&B run now, before the ranks launch and the clocks start
    flops = flops_per_sample(spec["lr"]) if spec["measure"] else {}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=spec["devices"],
        strategy=strategy,
        max_steps=spec["max_steps"],
        max_epochs=spec["max_epochs"],
        val_check_interval=spec["val_check_interval"],
        check_val_every_n_epoch=spec["check_val_every_n_epoch"],
        limit_val_batches=spec["limit_val_batches"],
        callbacks=callbacks,
        logger=loggers,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(spec["checkpoint_every_n_steps"]),
        num_sanity_val_steps=0,
        deterministic=False,
    )
    model = DigitsCNN(lr=spec["lr"], sync_train_loss=spec["sync_loss"], batch_norm=spec.get("batch_norm", False))
    data = DigitsDataModule(batch_size=spec["batch_size"], seed=spec["seed"])
    trainer.fit(model, datamodule=data, ckpt_path=spec["ckpt_path"])
    if spec["save_checkpoint"]:
        trainer.save_checkpoint(spec["save_checkpoint"])
    if spec["final_validation"]:
        trainer.validate(model, datamodule=data, verbose=False)

    recorder = callbacks[0]
    injector = callbacks[1]
    rank = trainer.global_rank
    result = {
        "rank": rank,
        "global_step": trainer.global_step,
        "checksum": parameter_checksum(model),
        "skipped_steps": getattr(trainer.strategy, "skipped_steps", 0),
        "injected_sleep_s": injector.total_sleep_s,
        "fit_wall_s": (recorder.fit_end or 0.0) - (recorder.fit_start or 0.0),
        "batch_sizes": recorder.batch_sizes,
        "pgc_threads_after_fit": [t.name for t in threading.enumerate() if t.name.startswith("pgc-")],
        "buffers": getattr(trainer.strategy, "buffer_stats", {}),
    }
    meter = next((cb for cb in callbacks if isinstance(cb, WorkMeter)), None)
    if meter is not None:
        result["measure"] = meter.result(flops)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    valve = next((cb for cb in trainer.callbacks if isinstance(cb, StalenessValve)), None)
    if valve is not None:  # every rank: what its valve saw and did (all ranks must have decided alike)
        record = {"rank": rank, "scale": valve.scale, "events": valve.events, "checks": valve.history,
                  "final_lrs": valve.final_lrs}
        (out / f"valve_rank{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        diagnostics = next((cb for cb in trainer.callbacks if isinstance(cb, PGCDiagnostics)), None)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        summary = {
            "spec": spec,
            "metrics": metrics,
            "fit_wall_s": result["fit_wall_s"],
            "global_step": trainer.global_step,
            "diagnostics": diagnostics.history if diagnostics is not None else [],
        }
        curve = next((cb for cb in callbacks if isinstance(cb, ValidationCurve)), None)
        if curve is not None and curve.t0 is not None and recorder.t0 is not None:
            summary["curve_offset_s"] = recorder.t0 - curve.t0  # curve.csv's wall_s + this = val_curve.csv's clock
            summary["val_curve"] = curve.rows
        (out / "summary.json").write_text(json.dumps(summary))
        if spec["wandb"]:
            finish_wandb(trainer, summary, result, out)


def finish_wandb(trainer: pl.Trainer, summary: dict[str, Any], result: dict[str, Any], out: Path) -> None:
    """Rank 0: put the run's totals into the W&B summary, name the run directory, close the run."""
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    logger = next((lg for lg in trainer.loggers if isinstance(lg, WandbLogger)), None)
    if logger is None:
        return
    run = logger.experiment
    totals: dict[str, Any] = {"fit_wall_s": summary["fit_wall_s"], "global_step": summary["global_step"]}
    if summary.get("val_curve"):
        totals["final_val_loss"], totals["final_val_acc"] = summary["val_curve"][-1][2:4]
    history = summary["diagnostics"]
    for key in ("pgc/max_age", "pgc/mean_age", "pgc/coordinator_wait_s"):
        values = [h[key] for h in history if key in h]
        if values:
            totals[f"{key}_max"], totals[f"{key}_mean"] = max(values), sum(values) / len(values)
    if "measure" in result:
        m = result["measure"]
        totals["rank0/utilization"] = m["utilization"]
        totals["rank0/grad_evals"] = sum(m["evals_per_step"])
    run.summary.update(totals)
    (out / "wandb_run.json").write_text(json.dumps(
        {"dir": str(Path(run.dir).parent), "id": run.id, "name": run.name, "group": run.group,
         "project": run.project, "config": dict(run.config)}, default=str))
    wandb.finish()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m lightning_pgc.job SPEC.json")
    spec = json.loads(Path(argv[0]).read_text())
    os.environ.setdefault("WANDB_MODE", "offline")
    run(spec)


if __name__ == "__main__":
    main()
