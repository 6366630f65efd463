"""A callback that records a real PGC run's schedule for the emulator: per version the leader's admitted set (in
arrival order), decoding weights and entry ages, plus the parameters at the start and the end of training.

Rank 0 (the leader, where the records are) writes ``schedule.json`` and ``params.pt`` into ``out`` when training
ends. :func:`load` reads them back as a list of :class:`~lightning_pgc.emulator.schedule.Version` and the two
flat parameter vectors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_pgc.emulator.schedule import Version, from_json, from_records, to_json

__all__ = ["ScheduleRecorder", "load"]


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).cpu().clone() for p in module.parameters()])


class ScheduleRecorder(Callback):
    """Records the leader's per-version decisions and the start and end parameters (rank 0 writes them).

    Args:
        out: folder for ``schedule.json`` and ``params.pt``.
    """

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.records: list[Any] = []
        self.initial: torch.Tensor | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.records = []
        self.initial = _flat(pl_module)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
        runtime = getattr(strategy, "runtime", None)
        info = getattr(strategy, "last_step", None)
        if runtime is None or info is None or not runtime.is_leader:
            return
        record = runtime.record(info.version)
        if record is None:
            raise RuntimeError(f"the leader kept no record of version {info.version}")
        self.records.append(record)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        runtime = getattr(trainer.strategy, "runtime", None)
        if runtime is None or not runtime.is_leader:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        rows = to_json(from_records(self.records))
        (self.out / "schedule.json").write_text(json.dumps({"versions": rows}))
        torch.save({"initial": self.initial, "final": _flat(pl_module)}, self.out / "params.pt")


def load(out: str | Path) -> tuple[list[Version], torch.Tensor, torch.Tensor]:
    """``(schedule, initial parameters, final parameters)`` written by :class:`ScheduleRecorder` into ``out``."""
    out = Path(out)
    rows = json.loads((out / "schedule.json").read_text())["versions"]
    params = torch.load(out / "params.pt")
    return from_json(rows), params["initial"], params["final"]
