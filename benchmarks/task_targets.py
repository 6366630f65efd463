"""Fix the harder proxy tasks' horizon, targets and map grid by the stated rule, from ddp's runs on the tuning seeds
only (``TARGET_RULE`` in lightning_pgc/emulator/tasks.py), before any arm runs on them.

    OMP_NUM_THREADS=1 python benchmarks/task_targets.py    # writes docs/results/task_targets.json

The constants of ``TASKS`` in lightning_pgc/emulator/tasks.py (``horizon``, ``targets``, ``val_every``,
``map_lrs``, ``map_momenta``) are copied from that file, and a test holds them to it. Each task's CPU seconds
are in the file (about a minute each, one thread).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from lightning_pgc.codes import make_scheme
from lightning_pgc.emulator.clock import simulate
from lightning_pgc.emulator.cluster import costs_for
from lightning_pgc.emulator.data import DataCondition, partition_streams
from lightning_pgc.emulator.schedule import from_records
from lightning_pgc.emulator.tasks import TARGET_RULE, make_task, spec, targets_from_curve
from lightning_pgc.emulator.train import emulate_grid

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "task_targets.json"
COMMAND = "OMP_NUM_THREADS=1 python benchmarks/task_targets.py"


def floor_loss(steps: list[int], loss: list[float], last: int, window: int) -> float:
    """The mean validation loss over the last ``window`` versions of a run that applied ``last`` versions."""
    values = [v for s, v in zip(steps, loss) if s > last - window]
    return float(np.mean(values)) if values else float("nan")


def fix_task(task: str, rule: dict[str, Any]) -> dict[str, Any]:
    """The rule's runs of ``task`` and the constants they fix."""
    started = time.process_time()
    n, horizon = rule["n"], rule["horizon"]
    lrs = list(spec(task).lrs)
    scheme = make_scheme("dgd", n, 0)
    res = simulate(scheme, horizon, "none", costs_for(4.0))
    versions = from_records(res.records, res.applied[0])
    curves: dict[float, list[list[float]]] = {lr: [] for lr in lrs}
    steps: list[int] = []
    for seed in rule["tuning_seeds"]:
        built = make_task(task, seed)
        streams = partition_streams(built.y_train.numpy(), n, seed, DataCondition())
        runs = emulate_grid(
            scheme, versions, built, streams, [(lr, rule["momentum"]) for lr in lrs], val_every=rule["val_every"]
        )
        for lr, run in zip(lrs, runs):
            curves[lr].append([float(v) for v in run.val_loss] if not run.diverged else [])
            steps = list(run.val_steps) if not run.diverged else steps
    finals = {}
    for lr, per_seed in curves.items():
        ok = [c for c in per_seed if len(c) == len(steps)]
        finals[lr] = (
            float(np.mean([floor_loss(steps, c, horizon, rule["floor_window"]) for c in ok]))
            if len(ok) == len(per_seed)
            else float("inf")  # a seed diverged at this lr
        )
    chosen = min(lrs, key=lambda lr: (finals[lr], -lr))
    mean_curve = np.mean(np.asarray(curves[chosen]), axis=0).tolist()
    early, late = targets_from_curve(steps, mean_curve, rule["early_at"], rule["late_at"])
    return {
        "lrs": lrs,
        "final_loss": {f"{lr:g}": finals[lr] for lr in lrs},
        "chosen_lr": chosen,
        "steps": steps,
        "mean_curve": mean_curve,
        "constants": {
            "horizon": horizon,
            "targets": [early, late],
            "val_every": rule["val_every"],
            "map_lrs": [round(chosen * f, 10) for f in rule["lr_factors"]],
            "map_momenta": list(rule["map_momenta"]),
        },
        "cpu_s": time.process_time() - started,
    }


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out: dict[str, Any] = {"rule": TARGET_RULE, "command": COMMAND, "tasks": {}}
    for task in TARGET_RULE["tasks"]:
        out["tasks"][task] = fix_task(task, TARGET_RULE)
        print(task, json.dumps(out["tasks"][task]["constants"]), f"{out['tasks'][task]['cpu_s']:.0f} CPU s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
