"""A run of the benchmark grids: one job's result read back (:class:`Run`) and every column measured on it.

:func:`read_run` reads a finished job (:class:`~pgc_lab.experiments.results.JobResult`) as a :class:`Run` of
one :class:`Config` (a scheme with its ``s`` and ``c``); :func:`run_row` measures it: time and steps to the target
validation loss, gradient evaluations and FLOPs, utilization, ages, coordinator waits. The one-table grid, the map
grid, the bounded-staleness and staleness benchmarks and the seed experiment all read their jobs this way.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from pgc_lab.experiments.curves import at_index, cumulative_at, first_crossing, interpolate
from pgc_lab.experiments.results import JobResult, read_result
from pgc_lab.experiments.spec import current_spec, resolve_spec

__all__ = ["Config", "Run", "equal_wall_times", "isnan", "read_run", "reusable", "run_row", "seed_mean"]


@dataclass(frozen=True)
class Config:
    """One row of the table: a scheme with its s and c (c = copies of each partition, 1 for ddp/dgd/ignore)."""

    scheme: str
    s: int
    c: int
    condition: str = "stragglers"  # or "no delay": the same job without injected delays

    @property
    def label(self) -> str:
        return self.scheme if self.s == 0 else f"{self.scheme} s={self.s}"

    @property
    def key(self) -> str:
        return f"{self.scheme}_s{self.s}" + ("" if self.condition == "stragglers" else "_nodelay")


@dataclass
class Run:
    """What one job wrote, read back."""

    config: Config
    seed: int
    out: Path
    ok: bool
    job_wall_s: float = float("nan")  # the whole job, launch to exit
    val: list[tuple[float, int, float, float]] = field(default_factory=list)  # (wall, step, loss, acc)
    train: list[tuple[float, int, float]] = field(default_factory=list)  # (wall on the val clock, step, loss)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    diagnostics: list[dict[str, float]] = field(default_factory=list)
    error: str = ""


def read_run(cfg: Config, seed: int, result: JobResult) -> Run:
    """A grid run from a job's result (``ok=False`` with the reason when something is missing)."""
    if not result.ok or not result.val_curve:
        return Run(
            cfg, seed, result.out, ok=False, job_wall_s=result.job_wall_s, error=result.error or "no validation curve"
        )
    ranks = [r for r in result.ranks if r is not None]
    if len(ranks) != len(result.ranks):
        return Run(cfg, seed, result.out, ok=False, job_wall_s=result.job_wall_s, error="a rank left no results")
    val = [(wall, step, loss, acc) for wall, step, loss, acc, _ in result.val_curve]
    return Run(
        cfg,
        seed,
        result.out,
        ok=True,
        job_wall_s=result.job_wall_s,
        val=val,
        train=result.train_on_val_clock(),
        ranks=ranks,
        diagnostics=result.diagnostics,
    )


def run_row(run: Run, target: float, equal_wall_s: Optional[float]) -> dict[str, Any]:
    """Every measured column of one run (NaN where not defined)."""
    nan = float("nan")
    row: dict[str, Any] = {
        "condition": run.config.condition,
        "scheme": run.config.scheme,
        "s": run.config.s,
        "c": run.config.c,
        "seed": run.seed,
        "status": "ok" if run.ok else "failed",
        "job_wall_s": run.job_wall_s,
        "out": str(run.out),
    }
    if not run.ok:
        return row
    walls = [v[0] for v in run.val]
    steps = [float(v[1]) for v in run.val]
    losses = [v[2] for v in run.val]
    accs = [v[3] for v in run.val]
    measures = [r["measure"] for r in run.ranks]
    evals = [sum(col) for col in zip(*(m["evals_per_step"] for m in measures))]
    samples = [sum(col) for col in zip(*(m["samples_per_step"] for m in measures))]
    flops_per_sample = measures[0]["flops_fwd_bwd_per_sample"]
    n_steps = len(evals)

    crossing = first_crossing(losses, target)
    row.update(
        {
            "target_val_loss": target,
            "reached": crossing is not None,
            "time_to_target_s": at_index(walls, crossing) if crossing is not None else nan,
            "steps_to_target": at_index(steps, crossing) if crossing is not None else nan,
        }
    )
    if crossing is not None:
        step = row["steps_to_target"]
        row["grad_evals_to_target"] = cumulative_at(evals, step)
        row["gflop_to_target"] = cumulative_at(samples, step) * flops_per_sample / 1e9
    else:
        row["grad_evals_to_target"] = row["gflop_to_target"] = nan
    acc_eq = interpolate(walls, accs, equal_wall_s) if equal_wall_s is not None else None
    loss_eq = interpolate(walls, losses, equal_wall_s) if equal_wall_s is not None else None
    row.update(
        {
            "equal_wall_s": equal_wall_s if equal_wall_s is not None else nan,
            "val_acc_at_equal_wall": acc_eq if acc_eq is not None else nan,
            "val_loss_at_equal_wall": loss_eq if loss_eq is not None else nan,
            "fit_wall_s": walls[-1],
            "steps": int(steps[-1]),
            "final_val_loss": losses[-1],
            "final_val_acc": accs[-1],
            "grad_evals_total": float(sum(evals)),
            "grad_evals_per_step": sum(evals) / max(n_steps, 1),
            "gflop_total": sum(samples) * flops_per_sample / 1e9,
            "flops_fwd_bwd_per_sample": flops_per_sample,
        }
    )
    utils = [m["utilization"] for m in measures]
    row.update(
        {
            "utilization_mean": statistics.fmean(utils),
            "utilization_min": min(utils),
            "utilization_max": max(utils),
            "busy_s_mean": statistics.fmean(m["busy_s"] for m in measures),
            "compute_s_mean": statistics.fmean(m["forward_s"] + m["backward_s"] for m in measures),
            "simulated_compute_s_mean": statistics.fmean(m.get("simulated_compute_s", 0.0) for m in measures),
            "injected_sleep_s_mean": statistics.fmean(m["injected_sleep_s"] for m in measures),
            "worker_wait_ms_per_step": 1000 * statistics.fmean(m["wait_s"] for m in measures) / max(n_steps, 1),
            "idle_ms_per_step": 1000 * statistics.fmean(m["wall_s"] - m["busy_s"] for m in measures) / max(n_steps, 1),
            "skipped_steps": sum(r.get("skipped_steps", 0) for r in run.ranks),
            "replicas_identical": len({r["checksum"] for r in run.ranks}) == 1,
        }
    )
    history = run.diagnostics
    max_ages = [h["pgc/max_age"] for h in history if "pgc/max_age" in h]
    mean_ages = [h["pgc/mean_age"] for h in history if "pgc/mean_age" in h]
    waits = [h["pgc/coordinator_wait_s"] for h in history if "pgc/coordinator_wait_s" in h]
    after_first = []
    for h in history:
        arrivals = [v for k, v in h.items() if k.startswith("pgc/arrival_s/rank")]
        if "pgc/coordinator_wait_s" in h and arrivals:
            after_first.append(h["pgc/coordinator_wait_s"] - min(arrivals))
    fresh = run.config.scheme == "ddp"  # no PGC runtime: every gradient is fresh by construction
    row.update(
        {
            "max_age": max(max_ages) if max_ages else (0.0 if fresh else nan),
            "mean_age": statistics.fmean(mean_ages) if mean_ages else (0.0 if fresh else nan),
            "coord_wait_ms_per_step": 1000 * statistics.fmean(waits) if waits else nan,
            "coord_wait_after_first_code_ms": 1000 * statistics.fmean(after_first) if after_first else nan,
        }
    )
    return row


def equal_wall_times(runs: Iterable[Run]) -> dict[tuple[str, int], float]:
    """Per (condition, seed): the wall time at which the fastest run finished all its steps."""
    out: dict[tuple[str, int], float] = {}
    for run in runs:
        if run.ok and run.val:
            end = run.val[-1][0]
            key = (run.config.condition, run.seed)
            out[key] = min(out.get(key, end), end)
    return out


def isnan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def seed_mean(
    curves: Sequence[tuple[Sequence[float], Sequence[float]]], points: int = 200
) -> tuple[list[float], list[float]]:
    """Mean over seeds of curves y(x), interpolated on a common grid up to the shortest curve's end."""
    end = min(xs[-1] for xs, _ in curves)
    start = max(xs[0] for xs, _ in curves)
    grid = [start + (end - start) * i / (points - 1) for i in range(points)] if end > start else [start]
    grid = [min(max(x, start), end) for x in grid]  # no rounding past either end
    means = []
    for x in grid:
        values = [interpolate(xs, ys, x) for xs, ys in curves]
        means.append(statistics.fmean(v for v in values if v is not None))
    return grid, means


def reusable(out: Path, spec: dict[str, Any]) -> Optional[JobResult]:
    """The result of a finished job in ``out`` run with the same spec (ignoring W&B naming; an older job's strategy
    keywords read in today's form), else None."""
    previous = read_result(out)

    def strip(s: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in current_spec(resolve_spec(s)).items() if k not in ("wandb", "out")}

    if not previous.ok or strip(previous.spec) != strip(spec):
        return None
    return previous
