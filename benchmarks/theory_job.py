"""``lightning_pgc.job`` plus the theory callbacks: ``python benchmarks/theory_job.py SPEC.json``.

The spec is ``lightning_pgc.job``'s, with two extra keys:

- ``"diagnostics"``: keyword arguments of :class:`lightning_pgc.callbacks.PGCDiagnostics` (e.g.
  ``{"every_n_steps": 10, "theory_every_n_steps": 5}``); it replaces the one the strategy would attach;
- ``"valve"``: keyword arguments of :class:`lightning_pgc.callbacks.StalenessValve` (omit or ``null``: no valve).

Every rank additionally writes ``valve_rank{k}.json`` (the valve's checks, lr changes and final learning rates),
so a caller can check that all ranks took the same decisions. Lightning's launcher re-runs this script by path for
ranks 1..n-1, exactly as it re-runs ``python -m lightning_pgc.job``. :func:`run_theory_job` launches it from Python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parents[1]


def _install() -> list[Any]:
    """Wrap ``lightning_pgc.job.build_callbacks`` so the spec's ``diagnostics``/``valve`` callbacks are appended."""
    import lightning_pgc.job as job
    from lightning_pgc.callbacks import PGCDiagnostics, StalenessValve

    made: list[Any] = []
    original = job.build_callbacks

    def build_callbacks(spec: dict[str, Any], out: Path) -> list[Any]:
        callbacks = original(spec, out)  # job.run indexes [0] and [1]: append only
        # (If lightning_pgc.job learns these keys itself, use its callbacks instead of adding a second one.)
        if spec.get("diagnostics") is not None and not any(isinstance(cb, PGCDiagnostics) for cb in callbacks):
            callbacks.append(PGCDiagnostics(**spec["diagnostics"]))
        if spec.get("valve") is not None and not any(isinstance(cb, StalenessValve) for cb in callbacks):
            callbacks.append(StalenessValve(**spec["valve"]))
        made.extend(cb for cb in callbacks if isinstance(cb, StalenessValve))
        return callbacks

    job.build_callbacks = build_callbacks
    return made


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python benchmarks/theory_job.py SPEC.json")
    spec_path = Path(argv[0])
    spec = json.loads(spec_path.read_text())
    os.environ.setdefault("WANDB_MODE", "offline")
    made = _install()
    import lightning_pgc.job as job

    job.run(spec)
    if made:  # every rank: what its valve saw and did
        valve = made[0]
        out = Path(spec.get("out", job.DEFAULTS["out"]))
        record = {"rank": valve.rank, "scale": valve.scale, "events": valve.events, "checks": valve.history,
                  "final_lrs": valve.final_lrs}
        (out / f"valve_rank{valve.rank}.json").write_text(json.dumps(record))


def run_theory_job(out: Path, timeout: float = 600, **spec: Any) -> dict[str, Any]:
    """Run one job on real processes; return ranks' JSON, rank 0's summary, the curve and every rank's valve record."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = {"out": str(out), **spec}
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(spec_file)], cwd=out, env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"job in {out} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
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


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
