"""State transfer at real size: a 25 M-parameter model (about 100 MB of weights, 200 MB with momentum) on 4 CPU
ranks through a fault, then every rank's replica, store payloads and memory written down.

``python -m tests.transfer_job SCENARIO OUT``, ``SCENARIO`` one of:

- ``stall``: rank 2's training thread sleeps past ``max_lag`` versions, then rejoins by state transfer;
- ``freeze_leader``: rank 0 (the leader) is frozen by SIGSTOP; rank 1 takes over; rank 0 rejoins when it resumes;
- ``donor_death``: as ``stall``, but the donor (the leader, rank 0) is killed in the middle of sending the state;
  rank 1 takes over and rank 2 asks again;
- ``resume``: a fit that saves a checkpoint, then a second Trainer that resumes from it.

The ranks are forked (Lightning's ``fork`` launcher), so the store every rank's control plane opens is wrapped here
in :class:`RecordingStore`, which notes the largest payload set or pushed and every key of a state transfer's
rendezvous.
Each rank that finishes writes ``OUT/rank{k}.json``: checksums of its parameters, buffers, optimizer and scheduler
state, the largest store payload, the transfers it took part in (with the growth of its resident memory during
each: the peak is reset before and read after, from ``/proc/self``) and the leader's per-rank counts.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torchmetrics
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import lightning_pgc
from lightning_pgc.callbacks.faults import Freeze, Stall
from lightning_pgc.runtime import plane as plane_module
from lightning_pgc.runtime import transfer as transfer_module
from lightning_pgc.runtime.transfer import ForwardingStore
from lightning_pgc.strategy import strategy as strategy_module

SCENARIOS = ("stall", "freeze_leader", "donor_death", "resume")
WIDTH = 4096  # 64 -> 4096 -> 4096 -> 2048 -> 10 with a BatchNorm: 25.4 M parameters
STEPS = 24
MAX_LAG = 3
STALL_S = 6.0  # past max_lag versions of the others, short of the fit's end
VAL_EVERY = 8
STATE_KEYS = "/state/"


class RecordingStore(ForwardingStore):
    """The control plane's store: notes the largest value set or pushed (``largest``), and every key of a state
    transfer's rendezvous set, read or waited for (``keys``). Clones share the notes."""

    def __init__(self, inner: dist.Store, notes: dict[str, Any]) -> None:
        super().__init__(inner)
        self.notes = notes

    def touched(self, key: str, value: Optional[bytes] = None) -> None:
        if value is not None and len(value) > self.notes["largest"][0]:
            self.notes["largest"] = (len(value), key)
        if STATE_KEYS in key:
            self.notes["keys"].add(key)

    def clone(self) -> "RecordingStore":
        return RecordingStore(self.inner.clone(), self.notes)


NOTES: dict[str, Any] = {"largest": (0, ""), "keys": set(), "transfers": []}
_open_store = strategy_module.open_store


def recording_store(timeout: timedelta) -> dist.Store:
    NOTES["store"] = RecordingStore(_open_store(timeout), NOTES)
    return NOTES["store"]


def _status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _measured(fn: Any, side: str) -> Any:
    """``fn`` with the growth of this process's resident memory during each call noted in ``NOTES``."""

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current size
        before, mapped = _status("VmRSS"), _status("RssFile") + _status("RssShmem")
        pool = self.aggregates
        pooled = pool.allocated
        start = time.monotonic()
        out = fn(self, *args, **kwargs)
        # Pages of the libraries' files the kernel dropped while this rank was frozen come back as it runs code
        # again: they count in VmHWM but are no copy of the state, so the growth of the file-backed part is taken
        # out (it only grows during the call: nothing is unmapped).
        reloaded = _status("RssFile") + _status("RssShmem") - mapped
        # Meanwhile the comm thread goes on with the members' all-reduces and keeps their aggregates for the
        # training thread: a buffer its pool adds then (at most ``max_lag`` in all) is no copy of the state either.
        pool_growth = (pool.allocated - pooled) * pool.numel * pool.dtype.itemsize
        NOTES["transfers"].append(
            {
                "side": side,
                "rss_growth": _status("VmHWM") - before - max(reloaded, 0) - pool_growth,
                "file_pages_reloaded": reloaded,
                "aggregate_buffers_added": pool.allocated - pooled,
                "seconds": time.monotonic() - start,
            }
        )
        return out

    return wrapped


def _kill_mid_transfer() -> None:
    """The donor (rank 0) dies after the header, the metadata and one chunk of the state."""
    send = transfer_module.Pair.send
    sent = [0]

    def dying(self: Any, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = send(self, tensor, *args, **kwargs)
        sent[0] += 1
        if self.index == 0 and sent[0] == 3 and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    transfer_module.Pair.send = dying  # type: ignore[method-assign]


class Net(pl.LightningModule):
    """An MLP of 25.4 M parameters with a BatchNorm (buffers), SGD with momentum and a step scheduler, and a metric
    whose state grows at every validation (every rank's predictions so far, gathered by each validation)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, WIDTH),
            torch.nn.BatchNorm1d(WIDTH),
            torch.nn.ReLU(),
            torch.nn.Linear(WIDTH, WIDTH),
            torch.nn.ReLU(),
            torch.nn.Linear(WIDTH, WIDTH // 2),
            torch.nn.ReLU(),
            torch.nn.Linear(WIDTH // 2, 10),
        )
        self.seen = torchmetrics.CatMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.seen.update(self.net(batch[0]).flatten())

    def on_validation_epoch_end(self) -> None:
        # every rank's predictions of every validation so far (never reset): a collective whose result grows
        self.log("val_seen", float(self.seen.compute().numel()))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(4096, 0), batch_size=16, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_data(256, 1), batch_size=64)


def _data(size: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 64, generator=g)
    return TensorDataset(x, (x[:, :10].argmax(1) + (x[:, 10] > 0).long()) % 10)


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class StateRecorder(Callback):
    """At the end of every fit, on every rank that finishes: what ``OUT/rank{k}.json`` holds."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        state = optimizer.state_dict()["state"]
        strategy = trainer.strategy
        store = NOTES.get("store")
        row = {
            "rank": trainer.global_rank,
            "step": trainer.global_step,
            "parameters": digest(list(pl_module.parameters())),
            "buffers": digest(list(pl_module.buffers())),
            "optimizer": digest([t for k in sorted(state) for t in state[k].values() if isinstance(t, torch.Tensor)]),
            "scheduler": json.dumps(trainer.lr_scheduler_configs[0].scheduler.state_dict(), sort_keys=True),
            "state_bytes": sum(p.numel() * p.element_size() for p in pl_module.parameters())
            + sum(t.numel() * t.element_size() for s in state.values() for t in s.values()),
            "largest_payload": list(NOTES["largest"]),
            "transfers": NOTES["transfers"],
            "keys_left": sorted(k for k in NOTES["keys"] if store is not None and store.check([k])),
            "rank_stats": getattr(strategy, "_rank_stats", None),
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(row))


def trainer(scenario: str, out: Path, max_steps: int, faults: list[Callback]) -> pl.Trainer:
    failover = scenario in ("freeze_leader", "donor_death")
    strategy = lightning_pgc.PGCStrategy(
        scheme="pgc_cr",
        stragglers=1,
        start_method="fork",
        liveness={
            "max_lag": MAX_LAG,
            "heartbeat_interval": 0.1,
            "heartbeat_misses": 20,
            "timeout": 3.0,
            "failover": failover,
        },
        diagnostics={"enabled": False},
    )
    return pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=max_steps,
        val_check_interval=VAL_EVERY,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=scenario == "resume",
        default_root_dir=str(out),
        callbacks=[
            StateRecorder(out),
            *faults,
            *([ModelCheckpoint(dirpath=str(out / "checkpoints"), save_last=True)] if scenario == "resume" else []),
        ],
    )


def main(scenario: str, out: Path) -> None:
    torch.set_num_threads(1)
    strategy_module.open_store = recording_store  # type: ignore[assignment]
    plane_module.CollectiveRuntime.rejoin = _measured(plane_module.CollectiveRuntime.rejoin, "recipient")  # type: ignore[method-assign]
    plane_module.CollectiveRuntime.send_state = _measured(plane_module.CollectiveRuntime.send_state, "donor")  # type: ignore[method-assign]
    if scenario == "donor_death":
        _kill_mid_transfer()
    pl.seed_everything(0, verbose=False)
    model = Net()
    if scenario == "resume":
        trainer(scenario, out, STEPS // 2, []).fit(model)
        trainer(scenario, out, STEPS, []).fit(model, ckpt_path=str(out / "checkpoints" / "last.ckpt"))
        return
    faults: list[Callback] = {
        "stall": [Stall(rank=2, step=4, seconds=STALL_S)],
        "donor_death": [Stall(rank=2, step=4, seconds=STALL_S)],
        "freeze_leader": [Freeze(rank=0, step=4, seconds=3.0)],
    }[scenario]
    trainer(scenario, out, STEPS, faults).fit(model)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
