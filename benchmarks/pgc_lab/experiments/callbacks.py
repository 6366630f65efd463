"""Measurement callbacks of the experiments harness: they work with any strategy (``ddp`` included) and any
classification recipe whose batches are ``(inputs, targets)``.

A job config lists them under ``trainer.callbacks`` (:func:`~pgc_lab.experiments.job_config` does it from a
spec); they can as well be added to any ``lightning-pgc fit`` command line by ``class_path``. Every file they write
is named in :data:`pgc_lab.experiments.results.FILES`.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch

from lightning_pgc.callbacks import PGCDiagnostics, StalenessValve
from pgc_lab.experiments.results import CURVE_HEADER, FILES, VAL_CURVE_HEADER, rank_file, valve_file
from lightning_pgc.strategy import PGCStrategy
from lightning_pgc.callbacks.stragglers import StragglerInjector

__all__ = [
    "JobRecorder",
    "LossRecorder",
    "ResourceMeter",
    "SimulatedCompute",
    "ValidationCurve",
    "WorkMeter",
    "parameter_checksum",
    "process_memory",
]


def parameter_checksum(module: torch.nn.Module) -> str:
    """SHA-256 of the state dict (parameters and buffers): equal only for bit-identical replicas."""
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _find(trainer: pl.Trainer, kind: type) -> Any:
    return next((cb for cb in trainer.callbacks if isinstance(cb, kind)), None)


class LossRecorder(pl.Callback):
    """Rank 0 writes ``curve.csv``: (wall seconds since the first step, step, training loss on the mean scale).

    Under :class:`~lightning_pgc.PGCStrategy` the step output is the decoded aggregate loss, the same on every
    rank. Under other strategies it is the rank's local loss; with ``sync`` it is averaged over the ranks (one
    extra all-reduce per step, which waits for every rank: use ``sync=False`` for timing runs).

    Args:
        out: the job folder.
        sync: average the loss over ranks under non-PGC strategies.
    """

    def __init__(self, out: str, sync: bool = True) -> None:
        self.out = Path(out)
        self.sync = sync
        self.rows: list[tuple[float, int, float]] = []
        self.t0: Optional[float] = None

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
        if trainer.is_global_zero and trainer.global_step % 10 == 0:
            (self.out / FILES["progress"]).write_text(str(trainer.global_step))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            with open(self.out / FILES["curve"], "w") as f:
                f.write(CURVE_HEADER + "\n")
                for t, step, loss in self.rows:
                    f.write(f"{t:.6f},{step},{loss:.6g}\n")


class SimulatedCompute(pl.Callback):
    """Sleeps ``seconds`` after every backward pass, i.e. per partition gradient evaluated.

    The digits CNN computes a mini-batch gradient in a few milliseconds, far less than the injected straggler
    delays, which would make a scheme's extra gradient evaluations (gradient coding's ``c`` per step) look free.
    This stands in for a heavier model on a dedicated device: every evaluation costs ``seconds`` of wall time on
    its rank, a step that evaluates ``c`` partitions costs ``c`` times that, and a step skipped while catching up
    costs nothing. A sleep takes no CPU, so it behaves the same on 2 cores as on 16.

    Args:
        seconds: sleep per backward pass (>= 0).

    Raises:
        ValueError: ``seconds < 0``.
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


def flops_per_sample(pl_module: pl.LightningModule, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Forward and forward+backward FLOPs of ``pl_module`` for the one sample ``(x, y)`` (convolutions and matmuls
    only, ``torch.utils.flop_counter``), with cross-entropy as the loss.

    Runs in eval mode (no BatchNorm statistics change) and takes gradients with ``torch.autograd.grad`` (nothing
    accumulates into ``.grad``), so training is untouched.
    """
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    was_training = pl_module.training
    pl_module.eval()
    params = [p for p in pl_module.parameters() if p.requires_grad]
    try:
        with torch.random.fork_rng(devices=[]):
            with FlopCounterMode(display=False) as forward:
                with torch.no_grad():
                    pl_module(x)
            with FlopCounterMode(display=False) as both:
                torch.autograd.grad(F.cross_entropy(pl_module(x), y), params, allow_unused=True)
    finally:
        pl_module.train(was_training)
    return {
        "flops_forward_per_sample": float(forward.get_total_flops()),
        "flops_fwd_bwd_per_sample": float(both.get_total_flops()),
    }


class WorkMeter(pl.Callback):
    """Per-rank work and time: compute, injected sleep, waiting, gradient evaluations per step.

    Forward time runs from the batch start (or the end of the previous backward, for strategies that evaluate
    several partitions per step) to ``on_before_backward``; backward time from there to ``on_after_backward``.
    Injected sleep (a :class:`~lightning_pgc.StragglerInjector`, a :class:`SimulatedCompute` among the trainer's
    callbacks) is subtracted from both wherever it happens and reported on its own. Under ``ddp`` the gradient
    all-reduce runs inside backward, so the end of the *local* backward is taken when DDP hands the gradient bucket
    to its communication hook (a timed copy of ``torch``'s default all-reduce hook); the rest of backward is waiting
    for the other ranks (with several buckets, the last one marks the end of the local backward). Under PGC the
    exchange happens after backward, so backward is compute only and the wait is
    ``strategy.last_step.worker_wait_s``. Whatever is neither busy nor this wait (Lightning's loop, the optimizer,
    data loading, and under ``ddp`` Lightning's per-step SIGTERM broadcast from rank 0) is ``wall - busy - wait``.
    The FLOPs of one sample are counted once, on the first batch (:func:`flops_per_sample`).
    """

    def __init__(self) -> None:
        self.injector: Optional[StragglerInjector] = None
        self.compute: Optional[SimulatedCompute] = None
        self.flops: dict[str, float] = {}
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
        return (self.injector.total_sleep_s if self.injector is not None else 0.0) + (
            self.compute.total_sleep_s if self.compute is not None else 0.0
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.injector = _find(trainer, StragglerInjector)
        self.compute = _find(trainer, SimulatedCompute)
        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel) and not self.ddp_hook:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            meter = self

            def timed_allreduce(state: Any, bucket: Any) -> Any:
                meter._bucket_ready = time.monotonic()  # the local backward has produced this bucket
                return allreduce_hook(state, bucket)

            # DDP checks the hook's annotations as objects (this module postpones them to strings)
            timed_allreduce.__annotations__ = {
                "state": object,
                "bucket": torch.distributed.GradBucket,
                "return": torch.futures.Future[torch.Tensor],
            }
            model.register_comm_hook(None, timed_allreduce)
            self.ddp_hook = True

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.flops and isinstance(batch, (list, tuple)) and len(batch) >= 2:
            self.flops = flops_per_sample(pl_module, batch[0][:1], batch[1][:1])
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

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        info = getattr(trainer.strategy, "last_step", None)
        if info is not None and isinstance(trainer.strategy, PGCStrategy):
            self._step_wait = float(info.worker_wait_s)
        self.evals[self._step] = self._count
        self.samples[self._step] = self._batch if self._count else 0
        self.waits[self._step] = self._step_wait
        self.wait_s += self._step_wait

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end = time.monotonic()

    def result(self) -> dict[str, Any]:
        """The ``measure`` entry of the rank file."""
        steps = range(min(self.evals, default=0), max(self.evals, default=-1) + 1)
        wall = (self.end or 0.0) - (self.first_batch or 0.0)
        injected = self.injector.total_sleep_s if self.injector is not None else 0.0
        simulated = self.compute.total_sleep_s if self.compute is not None else 0.0
        busy = self.forward_s + self.backward_s + injected + simulated
        return {
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "injected_sleep_s": injected,
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
            **self.flops,
        }


def process_memory() -> dict[str, int]:
    """This process's resident memory now and its high-water mark, in bytes (``VmRSS``, ``VmHWM`` of
    ``/proc/self/status``; Linux only, empty elsewhere)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return {
        key: int(fields[name].split()[0]) * 1024  # the kernel writes "<n> kB"
        for key, name in (("rss_bytes", "VmRSS"), ("peak_rss_bytes", "VmHWM"))
        if name in fields
    }


class ResourceMeter(pl.Callback):
    """Per-rank resident memory and thread count, sampled after the listed steps and when training ends: a soak
    run's evidence that nothing grows with the steps (no leaked buffers, no thread started per step or per fault).

    Each sample is ``{"step", "rss_bytes", "peak_rss_bytes", "threads"}`` (``threading.active_count()``); the list
    is the ``resources`` entry of the rank file. Sample first after warm-up (the first steps allocate the optimizer
    state, the caches and the allocator's pools), or growth from warm-up reads as a leak.

    Args:
        after_steps: sample when ``trainer.global_step`` reaches each of these (after that optimizer step).
    """

    def __init__(self, after_steps: list[int]) -> None:
        if any(not isinstance(k, int) or k < 1 for k in after_steps):
            raise ValueError(f"after_steps must be positive step counts, got {after_steps!r}")
        self.after_steps = sorted(set(after_steps))
        self.samples: list[dict[str, int]] = []

    def _sample(self, step: int) -> None:
        self.samples.append({"step": step, **process_memory(), "threads": threading.active_count()})

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step in self.after_steps and all(s["step"] != step for s in self.samples):
            self._sample(step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sample(trainer.global_step)


class ValidationCurve(pl.Callback):
    """Rank 0: validation loss and accuracy on the whole validation set every ``every`` steps, with wall time.

    Iterates the data module's ``val_dataloader()`` (batches ``(inputs, targets)``, cross-entropy loss, top-1
    accuracy). Runs outside Lightning's validation loop, so there is no collective and the other ranks never wait
    for it (except under ``ddp``, whose next all-reduce waits for rank 0). Replicas are identical under every
    strategy here, so rank 0's model is the model. The clock starts after the evaluation before the first step.
    Writes ``val_curve.csv`` and logs ``val/loss``, ``val/acc``, ``val/wall_s`` to every logger.

    Args:
        out: the job folder.
        every: steps between evaluations (>= 1); there is one before the first step and one after the last.

    Raises:
        ValueError: ``every < 1``.
    """

    def __init__(self, out: str, every: int) -> None:
        if every < 1:
            raise ValueError(f"val_every_n_steps must be >= 1, got {every}")
        self.out = Path(out)
        self.every = every
        self.rows: list[tuple[float, int, float, float, float]] = []
        self.t0: Optional[float] = None
        self._last_step = -1

    def _evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import torch.nn.functional as F

        started = time.monotonic()
        was_training = pl_module.training
        pl_module.eval()
        total_loss, correct, count = 0.0, 0, 0
        with torch.no_grad():
            for x, y in trainer.datamodule.val_dataloader():
                logits = pl_module(x.to(pl_module.device))
                y = y.to(logits.device)
                total_loss += float(F.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(dim=1) == y).sum())
                count += len(y)
        pl_module.train(was_training)
        loss, acc = total_loss / max(count, 1), correct / max(count, 1)
        now = time.monotonic()
        if self.t0 is None:
            self.t0 = now
        step = trainer.global_step
        self.rows.append((now - self.t0, step, loss, acc, now - started))
        self._last_step = step
        for logger in trainer.loggers:
            logger.log_metrics({"val/loss": loss, "val/acc": acc, "val/wall_s": now - self.t0}, step=step)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self._evaluate(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and step % self.every == 0 and step != self._last_step:
            self._evaluate(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        if trainer.global_step != self._last_step:
            self._evaluate(trainer, pl_module)
        with open(self.out / FILES["val_curve"], "w") as f:
            f.write(VAL_CURVE_HEADER + "\n")
            for wall, step, loss, acc, took in self.rows:
                f.write(f"{wall:.6f},{step},{loss:.6g},{acc:.6g},{took:.6f}\n")


class JobRecorder(pl.Callback):
    """Writes the per-rank and summary result files of a job when fit ends (see
    :mod:`pgc_lab.experiments.results`), and closes the W&B run with the job's totals.

    Reads, when present among the trainer's callbacks: :class:`LossRecorder` (clock of the training curve),
    :class:`WorkMeter` (``measure``), :class:`ResourceMeter` (``resources``), :class:`ValidationCurve`,
    :class:`~lightning_pgc.StragglerInjector`, :class:`~lightning_pgc.PGCDiagnostics`,
    :class:`~lightning_pgc.StalenessValve`; and from the strategy ``skipped_steps``, ``buffer_stats`` and
    ``rank_stats()`` when it has them.

    Args:
        out: the job folder (created if missing).
        save_checkpoint: if set, ``trainer.save_checkpoint`` to this path when training ends.
    """

    def __init__(self, out: str, save_checkpoint: Optional[str] = None) -> None:
        self.out = Path(out)
        self.save_checkpoint = save_checkpoint
        self.batch_sizes: list[int] = []
        self.fit_start: Optional[float] = None
        self.fit_end: Optional[float] = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.out.mkdir(parents=True, exist_ok=True)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.fit_start = time.monotonic()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.batch_sizes.append(len(batch[0]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.fit_end = time.monotonic()
        if self.save_checkpoint:
            trainer.save_checkpoint(self.save_checkpoint)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        injector = _find(trainer, StragglerInjector)
        rank = trainer.global_rank
        rank_stats = getattr(strategy, "rank_stats", None)
        result: dict[str, Any] = {
            "rank": rank,
            "global_step": trainer.global_step,
            "checksum": parameter_checksum(pl_module),
            "state_finite": all(
                bool(t.isfinite().all()) for t in pl_module.state_dict().values() if t.is_floating_point()
            ),
            "skipped_steps": getattr(strategy, "skipped_steps", 0),
            "injected_sleep_s": injector.total_sleep_s if injector is not None else 0.0,
            "fit_wall_s": (self.fit_end or 0.0) - (self.fit_start or 0.0),
            "batch_sizes": self.batch_sizes,
            "pgc_threads_after_fit": [t.name for t in threading.enumerate() if t.name.startswith("pgc-")],
            "buffers": getattr(strategy, "buffer_stats", {}),
            "rank_stats": rank_stats() if callable(rank_stats) else None,
        }
        if getattr(strategy, "scheme_name", None) == "auto":  # scheme="auto": the switches this rank applied
            result["auto_switches"] = [[v, old.label, new.label] for v, old, new in strategy.auto_switches]
            result["auto_arm"] = strategy.auto_arm.label
        meter = _find(trainer, WorkMeter)
        if meter is not None:
            result["measure"] = meter.result()
        resources = _find(trainer, ResourceMeter)
        if resources is not None:
            result["resources"] = resources.samples
        (self.out / rank_file(rank)).write_text(json.dumps(result, default=float))
        valve = _find(trainer, StalenessValve)
        if valve is not None:  # every rank: what its valve saw and did (all ranks must have decided alike)
            record = {
                "rank": rank,
                "scale": valve.scale,
                "window": valve.window,
                "events": valve.events,
                "checks": valve.history,
                "final_lrs": valve.final_lrs,
            }
            (self.out / valve_file(rank)).write_text(json.dumps(record))
        if not trainer.is_global_zero:  # rank 0, or the rank that took over when it died
            return
        diagnostics = _find(trainer, PGCDiagnostics)
        summary: dict[str, Any] = {
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1},
            "fit_wall_s": result["fit_wall_s"],
            "global_step": trainer.global_step,
            "diagnostics": list(diagnostics.history) if diagnostics is not None else [],
        }
        curve = _find(trainer, ValidationCurve)
        recorder = _find(trainer, LossRecorder)
        if curve is not None and curve.t0 is not None and recorder is not None and recorder.t0 is not None:
            summary["curve_offset_s"] = recorder.t0 - curve.t0  # curve.csv's wall_s + this = val_curve.csv's clock
            summary["val_curve"] = curve.rows
        (self.out / FILES["summary"]).write_text(json.dumps(summary))
        self._finish_wandb(trainer, summary, result)

    def _finish_wandb(self, trainer: pl.Trainer, summary: dict[str, Any], result: dict[str, Any]) -> None:
        """Rank 0: put the run's totals into the W&B summary, name the run folder, close the run."""
        from lightning.pytorch.loggers import WandbLogger

        logger = next((lg for lg in trainer.loggers if isinstance(lg, WandbLogger)), None)
        if logger is None:
            return
        import wandb

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
        (self.out / FILES["wandb"]).write_text(
            json.dumps(
                {
                    "dir": str(Path(run.dir).parent),
                    "id": run.id,
                    "name": run.name,
                    "group": run.group,
                    "project": run.project,
                    "config": dict(run.config),
                },
                default=str,
            )
        )
        wandb.finish()
