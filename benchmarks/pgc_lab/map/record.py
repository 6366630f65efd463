"""A callback that records a real PGC run's schedule for the emulator: per version the leader's admitted set (in
arrival order), decoding weights and entry ages, plus the parameters at the start and the end of training.

Rank 0 (the leader, where the records are) writes ``schedule.json`` and ``params.pt`` into ``out`` when training
ends. :func:`load` reads them back as a list of :class:`~lightning_pgc.emulator.schedule.Version` and the two
flat parameter vectors. With ``trajectory=True`` it also writes ``trajectory.pt``: the parameters at the start of
every version and the aggregate applied at it (:func:`load_trajectory`), against which the emulator's aggregate of
each version can be checked at the run's own parameters (a replay from the initial parameters alone drifts from the
run wherever a float rounding moves an activation across a ReLU or max-pool kink: the gradient is not continuous
there).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_pgc.emulator.schedule import Version, from_json, from_records, to_json

__all__ = ["ScheduleRecorder", "load", "load_trajectory"]


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).cpu().clone() for p in module.parameters()])


class ScheduleRecorder(Callback):
    """Records the leader's per-version decisions and the start and end parameters (rank 0 writes them).

    Args:
        out: folder for ``schedule.json`` and ``params.pt``.
        trajectory: also record the parameters at the start of every version and the aggregate applied at it
            (``trajectory.pt``; two flat vectors per version, kept in host memory until the end).
    """

    def __init__(self, out: str, trajectory: bool = False) -> None:
        self.out = Path(out)
        self.trajectory = trajectory
        self.records: list[Any] = []
        self.initial: torch.Tensor | None = None
        self.params: list[torch.Tensor] = []
        self.aggregates: list[torch.Tensor] = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.records, self.params, self.aggregates = [], [], []
        self.initial = _flat(pl_module)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.trajectory and trainer.global_rank == 0:
            self.params.append(_flat(pl_module))

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
        if self.trajectory:
            loss = torch.tensor([info.loss], dtype=info.aggregate.dtype)
            self.aggregates.append(torch.cat([info.aggregate.detach().cpu(), loss]))  # (the buffer is reused)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        runtime = getattr(trainer.strategy, "runtime", None)
        if runtime is None or not runtime.is_leader:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        rows = to_json(from_records(self.records))
        (self.out / "schedule.json").write_text(json.dumps({"versions": rows}))
        torch.save({"initial": self.initial, "final": _flat(pl_module)}, self.out / "params.pt")
        if self.trajectory:
            if len(self.params) != len(self.aggregates):
                raise RuntimeError(
                    f"recorded {len(self.params)} versions' parameters but {len(self.aggregates)} aggregates: the leader "
                    "was not rank 0 for the whole fit"
                )
            torch.save(
                {"params": torch.stack(self.params), "aggregates": torch.stack(self.aggregates)},
                self.out / "trajectory.pt",
            )


def load(out: str | Path) -> tuple[list[Version], torch.Tensor, torch.Tensor]:
    """``(schedule, initial parameters, final parameters)`` written by :class:`ScheduleRecorder` into ``out``."""
    out = Path(out)
    rows = json.loads((out / "schedule.json").read_text())["versions"]
    params = torch.load(out / "params.pt", weights_only=True)
    return from_json(rows), params["initial"], params["final"]


def load_trajectory(out: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``(parameters, aggregates)`` written by ``ScheduleRecorder(trajectory=True)`` into ``out``: row ``i`` holds the
    flat parameters at the start of the ``i``-th recorded version and the aggregate applied at it (gradient, then the
    decoded loss)."""
    saved = torch.load(Path(out) / "trajectory.pt", weights_only=True)
    return saved["params"], saved["aggregates"]
