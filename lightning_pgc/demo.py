"""The main job (``make demo``): the same digits CNN on 4 CPU processes under five strategies, side by side.

Every rank gets log-normal jitter and one rank is persistently slow; the delays are drawn from the same seeded
realisation under every strategy. Prints a table (wall time and steps to a target validation loss, final
validation accuracy) and writes a loss-vs-wall-clock PNG, a markdown table and ``results.json``.

    python -m lightning_pgc.demo [--steps 300] [--out outputs/demo] [--docs]

Each strategy is one job of the experiments harness (:func:`lightning_pgc.experiments.launch`: the packaged
digits recipe plus a job config, run by ``lightning-pgc fit``); the time to the target is
:func:`lightning_pgc.experiments.crossing` of the validation loss, measured on rank 0 every ``--val-every`` steps
on the whole validation set. Not the training loss: under PGC the decoded training loss mixes the losses of model
versions ``t..t-c+1`` (and of the received ranks' partitions only), so it is not the quantity ddp logs.
Needs the ``[bench]`` extra.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning_pgc.experiments import FILES, JobResult, crossing, launch

#: (label, strategy name) in the order they run.
RUNS: list[tuple[str, str]] = [
    ("ddp", "ddp"),
    ("dgd", "dgd"),
    ("ignore_stragglers", "ignore_stragglers"),
    ("gc_cr", "gc_cr"),
    ("pgc", "pgc"),
]


@dataclass
class Outcome:
    """One strategy's result, read from the files its job wrote."""

    label: str
    wall_s: float
    steps: int
    time_to_target: Optional[float]  # wall seconds at the first crossing of the target validation loss (linear)
    steps_to_target: Optional[float]  # the step at that crossing (fractional)
    val_acc: float
    final_loss: float  # the last validation loss
    curve: list[tuple[float, int, float]]  # (wall, step, decoded training loss): not used for the target
    skipped: list[int]
    identical: bool
    val_curve: list[tuple[float, int, float]] = field(default_factory=list)  # (wall, step, validation loss)


def job_spec(args: argparse.Namespace, strategy: str, out: Path) -> dict[str, Any]:
    delay = f"lognormal(median={args.jitter_median}, sigma={args.jitter_sigma}) + slowranks(ranks=[{args.devices - 1}], seconds={args.slow_seconds})"
    return {
        "strategy": strategy,
        "devices": args.devices,
        "max_steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "delay": delay,
        "delay_seed": args.seed,
        "seed": args.seed,
        "check_val_every_n_epoch": 100_000,  # no Lightning validation loop (its metric sync is a collective)
        "val_every_n_steps": args.val_every,  # rank 0 evaluates the validation set (and before the first step)
        "out": str(out),
    }


def selected_runs(args: argparse.Namespace) -> list[tuple[str, str]]:
    if not args.only:
        return RUNS
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = sorted(set(wanted) - {label for label, _ in RUNS})
    if unknown:
        raise SystemExit(f"--only: unknown {unknown}; choose from {[label for label, _ in RUNS]}")
    return [(label, strategy) for label, strategy in RUNS if label in wanted]


def run_all(args: argparse.Namespace) -> list[Outcome]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    outcomes = []
    with Progress(
        TextColumn("{task.description:<18}"), BarColumn(), TextColumn("{task.completed:>4.0f}/{task.total:.0f} steps"),
        TimeElapsedColumn(), TextColumn("{task.fields[status]}"),
    ) as progress:
        runs = selected_runs(args)
        tasks = {label: progress.add_task(label, total=args.steps, status="waiting") for label, _ in runs}
        for label, strategy in runs:
            task = tasks[label]
            progress.update(task, status="starting ranks")

            def report(step: int, task: Any = task) -> None:
                progress.update(task, completed=step, status="training" if step else "starting ranks")

            result = launch(job_spec(args, strategy, root / label), check=False, on_progress=report)
            if not result.ok:
                progress.update(task, status="[red]failed")
                raise SystemExit(f"{label} failed ({result.error}); see {result.out / FILES['log']}")
            progress.update(task, completed=args.steps, status="[green]done")
            outcomes.append(outcome(label, result, args))
    return outcomes


def outcome(label: str, result: JobResult, args: argparse.Namespace) -> Outcome:
    """One strategy's row: time and step at which the validation loss first reaches the target."""
    val = [(float(wall), int(step), float(loss)) for wall, step, loss, *_ in result.val_curve]
    losses = [loss for _, _, loss in val]
    walls = [wall for wall, _, _ in val]
    steps = [float(step) for _, step, _ in val]
    return Outcome(
        label=label,
        wall_s=result.fit_wall_s,
        steps=int(result.summary["global_step"]),
        time_to_target=crossing(walls, losses, args.target_loss) if val else None,
        steps_to_target=crossing(steps, losses, args.target_loss) if val else None,
        val_acc=result.val_curve[-1][3] if result.val_curve else float("nan"),
        final_loss=losses[-1] if val else float("nan"),
        curve=result.curve,
        val_curve=val,
        skipped=[r["skipped_steps"] for r in result.ranks],
        identical=result.identical_replicas,
    )


def markdown_table(outcomes: list[Outcome], args: argparse.Namespace) -> str:
    def fmt(x: Optional[float], spec: str) -> str:
        return "not reached" if x is None else format(x, spec)

    lines = [
        f"| strategy | wall time to {args.target_quantity} {args.target_loss} (s) | steps to it | fit wall time (s) | steps | "
        "final val acc | replicas identical |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for o in outcomes:
        lines.append(
            f"| {o.label} | {fmt(o.time_to_target, '.1f')} | {fmt(o.steps_to_target, '.0f')} | {o.wall_s:.1f} | "
            f"{o.steps} | {o.val_acc:.3f} | {'yes' if o.identical else 'NO'} |"
        )
    return "\n".join(lines)


def plot(outcomes: list[Outcome], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4))
    for o in outcomes:
        ax_t.plot([w for w, _, _ in o.val_curve], [v for _, _, v in o.val_curve], label=o.label)
        ax_s.plot([s for _, s, _ in o.val_curve], [v for _, _, v in o.val_curve], label=o.label)
    for ax, xlabel in ((ax_t, "wall-clock seconds since the first step"), (ax_s, "optimizer step")):
        ax.axhline(args.target_loss, color="gray", ls=":", lw=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"validation loss (every {args.val_every} steps)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    ax_t.legend()
    fig.suptitle(
        f"digits CNN, {args.devices} CPU ranks, log-normal jitter (median {args.jitter_median}s) "
        f"+ rank {args.devices - 1} slow by {args.slow_seconds}s/step"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _row(o: Outcome) -> dict[str, Any]:
    return {k: v for k, v in vars(o).items() if k not in ("curve", "val_curve")}


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="per rank and partition")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--slow-seconds", type=float, default=0.1, help="extra seconds per step on the last rank")
    p.add_argument("--jitter-median", type=float, default=0.01)
    p.add_argument("--jitter-sigma", type=float, default=0.5)
    p.add_argument("--target-loss", type=float, default=0.3, help="target validation loss")
    p.add_argument("--val-every", type=int, default=10, help="steps between validation-loss measurements")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="outputs/demo")
    p.add_argument("--only", default="", help="comma-separated subset of " + ",".join(label for label, _ in RUNS))
    p.add_argument("--docs", action="store_true", help="also write docs/demo.md and docs/demo_loss.png")
    p.set_defaults(target_quantity="validation loss")  # saved with the settings: what the target is a value of
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    from rich.console import Console
    from rich.table import Table

    args = parse_args(argv)
    console = Console()
    console.print(
        f"[bold]lightning_pgc demo[/]: {len(selected_runs(args))} strategies x {args.steps} steps on {args.devices} CPU processes "
        f"(rank {args.devices - 1} is {args.slow_seconds}s/step slower; every rank has log-normal jitter)"
    )
    outcomes = run_all(args)

    table = Table(title=f"time to validation loss {args.target_loss} (measured every {args.val_every} steps)")
    for col in ("strategy", "to target (s)", "steps to it", "fit wall (s)", "steps", "val acc", "identical"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for o in outcomes:
        table.add_row(
            o.label,
            "-" if o.time_to_target is None else f"{o.time_to_target:.1f}",
            "-" if o.steps_to_target is None else f"{o.steps_to_target:.0f}",
            f"{o.wall_s:.1f}", str(o.steps), f"{o.val_acc:.3f}", "yes" if o.identical else "NO",
        )
    console.print(table)

    root = Path(args.out).resolve()
    png = root / "loss_vs_wall_clock.png"
    plot(outcomes, args, png)
    md = markdown_table(outcomes, args)
    (root / "results.md").write_text(md + "\n")
    (root / "results.json").write_text(json.dumps([_row(o) for o in outcomes], indent=1))
    written = [png, root / "results.md", root / "results.json"]
    if args.docs:
        docs = Path(__file__).resolve().parents[1] / "docs"
        plot(outcomes, args, docs / "demo_loss.png")
        command = "python -m lightning_pgc.demo " + " ".join(argv if argv is not None else sys.argv[1:])
        (docs / "demo.json").write_text(json.dumps(
            {"command": command.strip(), "settings": vars(args),
             "results": [_row(o) for o in outcomes]}, indent=1))
        (docs / "demo.md").write_text(
            "# The demo's results\n\nProduced by `make demo` (here: `" + command.strip() + "`) on a 2-core, no-GPU "
            "machine; timings are noisy, compare rows of the same run. Every number below is in "
            "[demo.json](demo.json).\n\n" + md + "\n\n![loss vs wall clock](demo_loss.png)\n"
        )
        written += [docs / "demo.md", docs / "demo.json", docs / "demo_loss.png"]
    for path in written:
        console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
