"""``lightning-pgc advise trace.json``: which strategy and ``s`` to use on the cluster a step trace came from.

The trace (:class:`~lightning_pgc.step_trace.StepTimeTrace`) holds every rank's own time per step. The typical step
(the median over all ranks and steps) is taken as compute; what a rank spends above it at a step is that rank's delay
there. :class:`ResampledDelays` replays those delays: at each emulated step it draws one recorded step (the same draw
for every rank, so stalls that hit many ranks at once stay together) and gives each rank its own delay from it
(so a persistently slow rank stays slow). The emulator then runs ddp and every coded arm with ``s = 1`` (``c = 2``)
on the proxy task (digits MLP, iid), each with a short tuning over ``lr x momentum`` on one seed and an evaluation
over ``seeds`` others, and reports each arm's time to target against ddp's on the same seeds.

The recommendation is the arm with the smallest ratio whose bootstrap interval lies below 1; otherwise ddp. "How
sure": the interval, the sign-flip p-value (Holm-corrected over the arms), and on how many seeds the arm was faster.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from lightning_pgc.emulator.cells import Arm, Protocol, _model, _digits
from lightning_pgc.emulator.cluster import RATIOS, costs_for
from lightning_pgc.emulator.data import DataCondition, partition_streams
from lightning_pgc.emulator.schedule import from_records
from lightning_pgc.emulator.scoring import censor, compare, holm, tuning_score
from lightning_pgc.emulator.train import Task, emulate_grid
from lightning_pgc.emulator.clock import simulate
from lightning_pgc.step_trace import TRACE_FORMAT
from lightning_pgc.delays import DelayModel

__all__ = ["Advice", "ResampledDelays", "advise", "load_trace", "render"]

ADVISE_ARMS = ("ignore_stragglers", "gc_cr", "pgc_fr", "pgc_cr", "pgc_auto")


def load_trace(path: str | Path) -> np.ndarray:
    """The ``[n ranks, steps]`` own step times of a trace file.

    Raises:
        ValueError: not a step trace, fewer than 2 ranks, or fewer than 5 steps.
    """
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path} is not a step trace (written by lightning_pgc.step_trace.StepTimeTrace)")
    own = np.asarray(data["own_s"], dtype=np.float64)
    if own.ndim != 2 or own.shape[0] < 2:
        raise ValueError(
            f"{path}: the trace has {own.shape[0] if own.ndim == 2 else 0} rank(s); advise needs a run "
            "on 2 or more ranks"
        )
    if own.shape[1] < 5:
        raise ValueError(f"{path}: only {own.shape[1]} steps recorded; record at least 5 (better 50+)")
    if not np.isfinite(own).all() or (own < 0).any():
        raise ValueError(f"{path}: step times must be finite and >= 0")
    return own


class ResampledDelays(DelayModel):
    """Delays resampled from a trace: at step ``t`` one recorded step ``i(t)`` (drawn from ``(seed, t)``, the same
    for every rank) and rank ``k``'s delay at it, ``delays[k, i(t)]``."""

    name = "resampled"

    def __init__(self, delays: np.ndarray, seed: int = 0) -> None:
        self.delays = np.asarray(delays, dtype=np.float64)
        self.seed = int(seed)
        self._index: dict[int, int] = {}

    def sample(self, rank: int, step: int, rng: np.random.Generator) -> float:
        i = self._index.get(step)
        if i is None:
            i = self._index[step] = int(np.random.default_rng([self.seed, 7, step]).integers(self.delays.shape[1]))
        return float(self.delays[rank % self.delays.shape[0], i])

    def mean_seconds(self, rank: int) -> float:
        return float(self.delays[rank % self.delays.shape[0]].mean())

    def scaled(self, factor: float) -> "ResampledDelays":
        return ResampledDelays(self.delays * factor, self.seed)

    def _params(self) -> dict[str, Any]:
        return {"seed": self.seed, "id": id(self)}


@dataclass
class Advice:
    """The outcome: ``strategy`` and ``s`` to use, the ratio of time to target against ddp (``< 1``: faster) with
    its interval, the Holm-corrected p-value, the seeds it was faster on, and every arm's row."""

    strategy: str
    s: Optional[int]
    ratio: float
    low: float
    high: float
    p_holm: float
    faster_on: int
    seeds: int
    lr: float
    momentum: float
    rows: list[dict[str, Any]]
    n: int
    compute_s: float


def advise(
    trace: np.ndarray,
    ratio: float = RATIOS["compute"],
    seeds: int = 6,
    budget_steps: int = 150,
    target: float = 0.3,
    lrs: Sequence[float] = (0.2, 0.4),
    momenta: Sequence[float] = (0.0, 0.9),
    arms: Sequence[str] = ADVISE_ARMS,
) -> Advice:
    """Emulate ddp and each of ``arms`` (``s = 1``) on delays resampled from ``trace`` (``[n, steps]`` own times)."""
    n = trace.shape[0]
    compute = float(np.median(trace))
    if compute <= 0:
        raise ValueError("the trace's typical step time is 0 s; record a run that does some work")
    delays = np.clip(trace - compute, 0.0, None)
    costs = costs_for(ratio, compute_s=compute)
    protocol = Protocol(targets=(target, target), budget_steps=budget_steps, max_versions=int(budget_steps * 1.5))
    budget = budget_steps * (costs.compute_s + costs.code_s + costs.aggregate_s)
    x, y, xv, yv = _digits()
    candidates = [Arm("ddp")]
    for name in arms:
        try:
            Arm(name, 2).scheme(n)
        except ValueError:
            continue
        candidates.append(Arm(name, 2))

    def runs(arm: Arm, seed: int, settings: list[tuple[float, float]]) -> list[Optional[float]]:
        scheme = arm.scheme(n)
        res = simulate(scheme, protocol.max_versions, ResampledDelays(delays, seed), costs, delay_seed=seed)
        schedule = [v for v in from_records(res.records, res.applied[0]) if v.time_s <= budget]
        model, batch = _model("mlp", seed)
        streams = partition_streams(y.numpy(), n, seed, DataCondition("iid"))
        out = emulate_grid(scheme, schedule, Task(model, x, y, xv, yv, batch), streams, settings, stop_below=target)
        return [r.time_to(target) for r in out]

    settings = [(lr, m) for lr in lrs for m in momenta]
    eval_seeds = list(range(seeds))
    results: dict[str, tuple[tuple[float, float], list[Optional[float]]]] = {}
    for arm in candidates:
        scores = {s: tuning_score([t], budget) for s, t in zip(settings, runs(arm, 10_000, settings))}
        chosen = min(settings, key=lambda s: (scores[s], -s[0], -s[1]))
        results[arm.label] = (chosen, [runs(arm, seed, [chosen])[0] for seed in eval_seeds])
    base = results["ddp"][1]
    rows: list[dict[str, Any]] = []
    comparisons: list[tuple[dict[str, Any], Any]] = []
    for arm in candidates:
        chosen, times = results[arm.label]
        row = {
            "arm": arm.label,
            "strategy": arm.strategy,
            "s": None if arm.strategy == "ddp" else arm.s,
            "lr": chosen[0],
            "momentum": chosen[1],
            "reached": sum(t is not None for t in times),
            "rmean_s": float(censor(times, budget).mean()),
        }
        if arm.strategy != "ddp":
            comp = compare(times, base, budget)
            comparisons.append((row, comp))
            row.update(
                ratio=comp.ratio,
                low=comp.low,
                high=comp.high,
                p=comp.p,
                faster_on=int((censor(times, budget) < censor(base, budget)).sum()),
            )
        rows.append(row)
    for (row, _), p in zip(comparisons, holm([c.p for _, c in comparisons])):
        row["p_holm"] = p
    sure = [r for r, c in comparisons if c.high < 1.0]
    if sure:
        best = min(sure, key=lambda r: r["ratio"])
        return Advice(
            best["strategy"],
            best["s"],
            best["ratio"],
            best["low"],
            best["high"],
            best["p_holm"],
            best["faster_on"],
            seeds,
            best["lr"],
            best["momentum"],
            rows,
            n,
            compute,
        )
    ddp = rows[0]
    fastest = min(comparisons, key=lambda rc: rc[1].ratio) if comparisons else None
    return Advice(
        "ddp",
        None,
        1.0,
        fastest[1].low if fastest else 1.0,
        fastest[1].high if fastest else 1.0,
        fastest[0]["p_holm"] if fastest else 1.0,
        0,
        seeds,
        ddp["lr"],
        ddp["momentum"],
        rows,
        n,
        compute,
    )


def render(advice: Advice) -> str:
    """What ``lightning-pgc advise`` prints."""
    lines = [
        f"Trace: {advice.n} ranks, typical own step {advice.compute_s * 1e3:.1f} ms; emulated on the digits "
        f"proxy task, {advice.seeds} resampled delay seeds per arm (emulated, not measured)."
    ]
    for r in advice.rows:
        extra = (
            ""
            if r["strategy"] == "ddp"
            else (
                f"  vs ddp {r['ratio']:.2f} [{r['low']:.2f}, {r['high']:.2f}], faster on {r['faster_on']}/{advice.seeds}"
                f" seeds, Holm p {r['p_holm']:.3f}"
            )
        )
        lines.append(
            f"  {r['arm']:<22} lr {r['lr']:<4g} momentum {r['momentum']:<4g} reached {r['reached']}/"
            f"{advice.seeds}{extra}"
        )
    if advice.strategy == "ddp":
        lines.append(
            f"Recommendation: keep ddp (no arm's 95% interval of time-to-target ratio lies below 1; the best "
            f"one's is [{advice.low:.2f}, {advice.high:.2f}])."
        )
    else:
        lines.append(
            f"Recommendation: strategy={advice.strategy} s={advice.s} (start at lr {advice.lr:g}, momentum "
            f"{advice.momentum:g}): expected time to target {advice.ratio:.2f}x ddp's, 95% interval "
            f"[{advice.low:.2f}, {advice.high:.2f}], faster on {advice.faster_on} of {advice.seeds} seeds, "
            f"Holm-corrected p {advice.p_holm:.3f}."
        )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    """``lightning-pgc advise TRACE [--bound compute|comm] [--seeds K]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="lightning-pgc advise", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", help="a trace.json written by lightning_pgc.step_trace.StepTimeTrace")
    parser.add_argument(
        "--bound",
        choices=sorted(RATIOS),
        default="compute",
        help="compute-bound (compute/communication = 4) or communication-bound (0.5) job",
    )
    parser.add_argument("--seeds", type=int, default=6, help="resampled delay seeds per arm (default 6)")
    args = parser.parse_args(list(argv))
    try:
        trace = load_trace(args.trace)
    except (OSError, ValueError) as err:
        print(f"lightning-pgc advise: {err}")
        return 2
    import torch

    torch.set_num_threads(1)  # the proxy task's small batched kernels run fastest on one thread
    print(render(advise(trace, ratio=RATIOS[args.bound], seeds=args.seeds)))
    return 0
