"""The demo's staleness-correction comparison: ``pgc_fr`` c = 2 uncorrected next to look-ahead, in the setting where
the shipped measurements differ most.

``docs/staleness.json`` (``benchmarks/staleness.py``: the one-slow-rank cell, real compute, every arm tuned over
``lr x momentum``, five evaluation seeds) measured each correction against the uncorrected arm; look-ahead with
``lookahead_steps=1`` (``k = c - 1``) differed most (fewest steps to target relative to the uncorrected arm). The
demo reruns those two arms for one seed: the benchmark's own job (delays, model, batch, steps, validation schedule,
target, each arm's chosen learning rate and momentum; ``tests/test_demo.py`` checks the specs against
``benchmarks/staleness.py`` and the choice against ``docs/staleness.json``) and prints the steps and time to the
target side by side, with the measured ratios over the five seeds.

    python -m lightning_pgc.demo --correction only [--seed 0] [--docs]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning_pgc.experiments import FILES, launch

ROOT = Path(__file__).resolve().parents[1]
#: the measurements the comparison is chosen from and compared with (when this is a checkout)
STALENESS = ROOT / "docs" / "staleness.json"
#: ``benchmarks/sim_grid.py``'s ``one slow rank`` for 4 ranks: rank 3 is 0.1 s slower on every step
DELAY = "lognormal(median=0.02, sigma=0.5) + slowranks(ranks=[3], seconds=0.1)"
STEPS, VAL_EVERY, TARGET = 120, 5, 0.3


@dataclass(frozen=True)
class Arm:
    """One side of the comparison, at the learning rate and momentum the benchmark's tuning chose for it."""

    key: str
    label: str  # also the arm's label in docs/staleness.json
    strategy_kwargs: dict[str, Any] = field(hash=False)
    lr: float
    momentum: float


ARMS: tuple[Arm, ...] = (
    Arm("uncorrected", "pgc_fr c=2 none", {"stragglers": 1, "staleness_correction": "none"}, 0.1, 0.9),
    Arm(
        "lookahead",
        "pgc_fr c=2 lookahead k=1",
        {"stragglers": 1, "staleness_correction": "lookahead", "lookahead_steps": 1.0},
        0.1,
        0.9,
    ),
)


def job_spec(arm: Arm, seed: int, out: Path, wandb: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The experiments-harness spec of one job: ``benchmarks/staleness.py``'s evaluation job for ``arm`` and ``seed``."""
    return {
        "strategy": "pgc_fr",
        "strategy_kwargs": {"seed": seed, **arm.strategy_kwargs},
        "devices": 4,
        "delay": DELAY,
        "delay_seed": seed,
        "compute_s_per_eval": 0.0,
        "seed": seed,
        "max_steps": STEPS,
        "batch_size": 16,
        "lr": arm.lr,
        "model": {"sync_train_loss": False, "width": 256, "momentum": arm.momentum},
        "check_val_every_n_epoch": 100_000,
        "val_every_n_steps": VAL_EVERY,
        "sync_loss": False,
        "measure": True,
        "start_method": "popen",
        "out": str(out),
        "wandb": wandb,
    }


def measured(path: Path = STALENESS) -> dict[str, dict[str, Any]]:
    """Arm label -> its paired ratios over the benchmark's seeds (``steps_vs_none``, ``time_vs_none``,
    ``steps_ratio`` and ``time_ratio`` against dgd), from ``docs/staleness.json`` (empty if absent)."""
    if not path.is_file():
        return {}
    keys = ("steps_vs_none", "time_vs_none", "steps_ratio", "time_ratio")
    return {a["label"]: {k: a.get(k) for k in keys} for a in json.loads(path.read_text())["arms"]}


def run(args: argparse.Namespace) -> list[Any]:
    """Both jobs, with a progress bar; their outcomes (:class:`lightning_pgc.demo.Outcome`, setting ``correction``)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from lightning_pgc.demo import outcome

    root = Path(args.out).resolve() / "correction"
    outcomes = []
    target = argparse.Namespace(target_loss=TARGET)
    with Progress(
        TextColumn("{task.description:<34}"),
        BarColumn(),
        TextColumn("{task.completed:>4.0f}/{task.total:.0f} steps"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
    ) as progress:
        tasks = {arm.key: progress.add_task(f"correction: {arm.label}", total=STEPS, status="waiting") for arm in ARMS}
        for arm in ARMS:
            task = tasks[arm.key]
            progress.update(task, status="starting ranks")

            def report(step: int, task: Any = task) -> None:
                progress.update(task, completed=step, status="training" if step else "starting ranks")

            wandb = (
                None
                if not args.wandb
                else {
                    "project": args.wandb_project,
                    "group": "demo-correction",
                    "name": f"correction__{arm.key}",
                    "offline": True,
                    "tags": ["demo", "staleness-correction", "pgc_fr"],
                    "config": {"label": arm.label, "target_val_loss": TARGET},
                }
            )
            out = root / arm.key
            result = launch(job_spec(arm, args.seed, out, wandb), check=False, on_progress=report)
            if not result.ok:
                progress.update(task, status="[red]failed")
                raise SystemExit(f"correction/{arm.label} failed ({result.error}); see {out / FILES['log']}")
            progress.update(task, completed=STEPS, status="[green]done")
            o = outcome(arm.label, result, target)
            o.setting, o.key, o.lr, o.momentum = "correction", arm.key, arm.lr, arm.momentum
            outcomes.append(o)
    return outcomes


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b == 0 else a / b


def _interval(d: Optional[dict[str, Any]]) -> str:
    return "-" if not d else f"{d['mean']:.2f}x [{d['low']:.2f}, {d['high']:.2f}] ({d['seeds']} seeds)"


def rows(outcomes: list[Any], reference: dict[str, dict[str, Any]]) -> list[dict[str, str]]:
    """The table's cells, one dict per arm (the terminal and the page show the same)."""
    base = next((o for o in outcomes if o.key == "uncorrected"), None)
    out = []
    for o in outcomes:
        ref = reference.get(o.label, {})
        steps = time = None
        if base is not None and o.key != "uncorrected":
            steps = _ratio(o.steps_to_target, base.steps_to_target)
            time = _ratio(o.time_to_target, base.time_to_target)
        out.append(
            {
                "strategy": o.label,
                "lr, momentum": f"{o.lr:g}, {o.momentum:g}",
                "time to target (s)": "not reached" if o.time_to_target is None else f"{o.time_to_target:.1f}",
                "steps to it": "not reached" if o.steps_to_target is None else f"{o.steps_to_target:.0f}",
                "s per step": "-" if o.s_per_step is None else f"{o.s_per_step:.3f}",
                "steps, time vs uncorrected": "-" if steps is None or time is None else f"{steps:.2f}x, {time:.2f}x",
                "measured steps vs uncorrected": _interval(ref.get("steps_vs_none")),
                "measured time vs uncorrected": _interval(ref.get("time_vs_none")),
                "measured steps vs dgd": _interval(ref.get("steps_ratio")),
                "replicas identical": "yes" if o.identical else "NO",
            }
        )
    return out


def verdict(outcomes: list[Any], reference: dict[str, dict[str, Any]]) -> str:
    """What this run shows for look-ahead against the uncorrected arm, next to what the benchmark measured."""
    base = next((o for o in outcomes if o.key == "uncorrected"), None)
    corrected = next((o for o in outcomes if o.key == "lookahead"), None)
    if base is None or corrected is None:
        return ""
    steps = _ratio(corrected.steps_to_target, base.steps_to_target)
    time = _ratio(corrected.time_to_target, base.time_to_target)
    if steps is None or time is None:
        reached = [o.label for o in (base, corrected) if o.time_to_target is not None]
        text = f"This run: only {', '.join(reached) or 'neither arm'} reached the target."
    else:
        text = f"This run: look-ahead needed {steps:.2f}x the uncorrected arm's steps and {time:.2f}x its time."
    ref = reference.get(corrected.label)
    if ref and ref.get("steps_vs_none"):
        s, t = ref["steps_vs_none"], ref["time_vs_none"]
        text += (
            f" Measured over {s['seeds']} seeds (docs/staleness.json): {s['mean']:.2f}x [{s['low']:.2f}, "
            f"{s['high']:.2f}] the steps, {t['mean']:.2f}x [{t['low']:.2f}, {t['high']:.2f}] the time."
        )
        if steps is not None and not s["low"] <= steps <= s["high"]:
            text += " This run's step ratio is outside that interval: one seed on a shared 2-core machine."
    return text


WHY = (
    "with heavy-ball momentum 0.9 the pipeline's window of gradient ages 0 and 1 is implicit momentum on top of the "
    "explicit one, and the stability boundary falls; evaluating the fresh gradient one step ahead, at "
    "beta_t + (beta_t - beta_(t-1)), gives momentum back (docs/theory.md, section 7)."
)


def markdown(outcomes: list[Any], reference: dict[str, dict[str, Any]]) -> str:
    table = rows(outcomes, reference)
    if not table:
        return ""
    head = list(table[0])
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 3) + "---|"]
    lines += ["| " + " | ".join(r[h] for h in head) + " |" for r in table]
    return "\n".join(lines)


def page(outcomes: list[Any], reference: dict[str, dict[str, Any]], command: str) -> str:
    """docs/demo_correction.md: the command, the table, the verdict and why."""
    return (
        "# The demo's staleness-correction comparison\n\n"
        f"Produced by `make demo` (here: `{command}`) on a 2-core, no-GPU machine: `pgc_fr` c = 2 on 4 CPU ranks, "
        "one slow rank (rank 3 is 0.1 s slower on every step), the digits CNN with real compute, each arm at the "
        "learning rate and momentum `benchmarks/staleness.py` tuned for it, one seed; the target is validation loss "
        f"{TARGET:g}. This is the setting and the "
        "correction where the shipped measurements differ most ([staleness.md](staleness.md)). The measured "
        "columns are paired ratios over the benchmark's seeds, from [staleness.json](staleness.json); every other "
        "number below is in [demo_correction.json](demo_correction.json).\n\n"
        + markdown(outcomes, reference)
        + "\n\n"
        + verdict(outcomes, reference)
        + " Why: "
        + WHY
        + "\n"
    )


#: the terminal's columns (short headers; the measured intervals are in the verdict below the table)
TERMINAL = {
    "strategy": "strategy",
    "lr, momentum": "lr, mom.",
    "time to target (s)": "to target (s)",
    "steps to it": "steps",
    "s per step": "s/step",
    "steps, time vs uncorrected": "steps, time vs uncorr.",
    "replicas identical": "identical",
}


def print_results(console: Any, outcomes: list[Any], reference: dict[str, dict[str, Any]]) -> None:
    from rich.table import Table

    table_rows = rows(outcomes, reference)
    if not table_rows:
        return
    table = Table(title=f"staleness correction: pgc_fr c=2, one slow rank (time to validation loss {TARGET:g})")
    for header in TERMINAL.values():
        table.add_column(header, justify="left" if header == "strategy" else "right")
    for r in table_rows:
        table.add_row(*(r[key] for key in TERMINAL))
    console.print(table)
    console.print(f"[bold]Staleness correction.[/] {verdict(outcomes, reference)} Why: {WHY}")


def saved(outcomes: list[Any]) -> list[dict[str, Any]]:
    """The rows of demo_correction.json: each outcome without its curves, plus the ratios the page shows."""
    base = next((o for o in outcomes if o.key == "uncorrected"), None)
    out = []
    for o in outcomes:
        row = {k: v for k, v in vars(o).items() if k not in ("curve", "val_curve")}
        row["s_per_step"] = o.s_per_step
        if base is not None and o is not base:
            row["steps_vs_uncorrected"] = _ratio(o.steps_to_target, base.steps_to_target)
            row["time_vs_uncorrected"] = _ratio(o.time_to_target, base.time_to_target)
        out.append(row)
    return out


def read_saved(rows_: list[dict[str, Any]]) -> list[Any]:
    """Outcomes from :func:`saved` rows (without their curves)."""
    from lightning_pgc.demo import Outcome

    derived = ("s_per_step", "steps_vs_uncorrected", "time_vs_uncorrected")
    return [Outcome(**{**{k: v for k, v in r.items() if k not in derived}, "curve": []}) for r in rows_]
