"""A script that calls the Trainer several times, as ordinary Lightning scripts do, on 2 CPU ranks.

``python -m tests.trainer_calls_job STRATEGY START_METHOD OUT [short]`` (``STRATEGY``: ``ddp`` or a registered PGC
name):

1. ``validate`` before ``fit``;
2. ``fit`` for 6 steps with ``ModelCheckpoint(save_last=True)`` and a per-step ``OneCycleLR``;
3. ``validate``, ``test`` and ``predict`` on the same Trainer;
4. a second ``Trainer`` that fits on to step 12 from ``ckpt_path="last"``, then ``test``;
5. ``destroy_process_group`` before it exits, on every rank.

Every rank appends ``OUT/rank{k}.jsonl`` at the end of each Trainer call (the call, its parameter checksum, the
step, the live ``pgc-*`` threads). Each process that runs the script (every rank under ``popen``, the launching
process under ``fork``/``spawn``) writes ``OUT/script{k}.json``: what each call returned (how many results) and
what is left when the script ends (threads, process groups), and the sockets it opened during the script that
are still open once its process group is destroyed. The training step logs with ``sync_dist=True`` only under a
condition that is false, which must not refuse the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_pgc
from lightning_pgc.strategy import REGISTERED

STEPS, RESUMED_STEPS = 6, 12


class Calls(BoringModel):
    """Lightning's BoringModel with a per-step OneCycleLR and a conditional ``sync_dist`` in training_step."""

    def __init__(self, sync_train_metrics: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        if self.hparams.sync_train_metrics:
            self.log("train_loss", out["loss"], sync_dist=True)
        return out

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=RESUMED_STEPS)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def checksum(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in [*module.parameters(), *module.buffers()]:
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def pgc_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("pgc"))


def open_sockets() -> set[str]:
    """The sockets this process holds, by inode (a process group that was not destroyed keeps its connections)."""
    links = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return {link for link in links if link.startswith("socket:")}


def sockets_left(before: set[str], deadline_s: float = 20.0) -> list[str]:
    """The sockets opened since ``before`` that are still open, polled until none is or ``deadline_s`` passes: a
    peer's close reaches this process's side of a connection a moment later, and the OS may still be closing it."""
    deadline = time.monotonic() + deadline_s
    while (left := open_sockets() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    return sorted(left)


class CallRecorder(Callback):
    """At the end of every Trainer call, on every rank: the call, the checksum, the step and the pgc threads."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        row = {"call": stage, "checksum": checksum(pl_module), "step": trainer.global_step, "threads": pgc_threads()}
        with open(self.out / f"rank{trainer.global_rank}.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")


def trainer(strategy_name: str, start_method: str, out: Path, max_steps: int) -> pl.Trainer:
    if strategy_name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        strategy: Any = DDPStrategy(start_method=start_method)
    else:
        strategy = lightning_pgc.PGCStrategy(**REGISTERED[strategy_name].kwargs, start_method=start_method)
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=max_steps,
        limit_val_batches=2,
        limit_test_batches=2,
        limit_predict_batches=2,
        val_check_interval=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
        callbacks=[
            CallRecorder(out),
            ModelCheckpoint(dirpath=str(out / "checkpoints"), save_last=True, every_n_train_steps=3, save_top_k=-1),
        ],
    )


def count(results: Any) -> Any:
    return None if results is None else len(results)


def main(strategy_name: str, start_method: str, out: Path, short: bool = False) -> None:
    """``short``: only ``fit``, ``validate`` and the second Trainer's ``fit`` (for launchers that start fresh
    ranks, importing Lightning, at every call)."""
    sockets_before = open_sockets()
    pl.seed_everything(0, verbose=False)
    model = Calls()
    first = trainer(strategy_name, start_method, out, STEPS)
    returned = {} if short else {"validate_before_fit": count(first.validate(model))}
    first.fit(model)
    returned["validate"] = count(first.validate(model))
    if not short:
        returned["test"] = count(first.test(model))
        returned["predict"] = count(first.predict(model))
    second = trainer(strategy_name, start_method, out, RESUMED_STEPS)
    second.fit(model, ckpt_path="last")
    if not short:
        returned["test_after_resume"] = count(second.test(model))
    groups = len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0
    script = {
        "returned": returned,
        "step": second.global_step,
        "checksum": checksum(model),
        "threads": pgc_threads(),
        "process_groups": groups,
    }
    if dist.is_initialized():  # as torch asks of every script: a gloo group alive at interpreter exit can abort it
        dist.destroy_process_group()
    script["sockets_left"] = sockets_left(sockets_before)
    (out / f"script{second.global_rank}.json").write_text(json.dumps(script))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), short=sys.argv[4:] == ["short"])
