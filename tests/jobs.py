"""Launch ``python -m lightning_pgc.job`` on real processes (gloo, CPU) and read what every rank wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_job(tmp_path: Path, name: str, timeout: float = 240, **spec: Any) -> dict[str, Any]:
    """Run one job; return {"ranks": [rank0.json, ...], "valves": [...], "summary": ..., "curve": [(wall, step, loss)]}."""
    out = tmp_path / name
    out.mkdir(parents=True, exist_ok=True)
    spec = {"out": str(out), **spec}
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_pgc.job", str(spec_file)],
        cwd=out, env=env, capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(f"job {name} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    devices = spec.get("devices", 4)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]
    valves = ([json.loads((out / f"valve_rank{r}.json").read_text()) for r in range(devices)]
              if spec.get("valve") is not None else [])
    summary = json.loads((out / "summary.json").read_text())
    curve = []
    for line in (out / "curve.csv").read_text().splitlines()[1:]:
        wall, step, loss = line.split(",")[:3]
        curve.append((float(wall), int(step), float(loss)))
    return {"ranks": ranks, "valves": valves, "summary": summary, "curve": curve, "out": out, "stderr": proc.stderr}
