"""The main job (``make demo``): the same digits CNN on 4 CPU processes under five strategies, side by side.

Every rank gets log-normal jitter and one rank is persistently slow; the delays are drawn from the same seeded
realisation under every strategy. Prints a table (wall time and steps to a target training loss, final
validation accuracy) and writes a loss-vs-wall-clock PNG and a markdown table.

    python -m lightning_pgc.demo [--steps 300] [--out outputs/demo] [--docs]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

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
    time_to_target: Optional[float]
    steps_to_target: Optional[int]
    val_acc: float
    final_loss: float
    curve: list[tuple[float, int, float]]
    skipped: list[int]
    identical: bool


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` steps (the target must be reached by the loss, not by one lucky batch)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def first_crossing(curve: list[tuple[float, int, float]], target: float, window: int) -> tuple[Optional[float], Optional[int]]:
    """(wall seconds, step) at which the smoothed training loss first reaches ``target``."""
    losses = smoothed([loss for _, _, loss in curve], window)
    for (wall, step, _), loss in zip(curve, losses):
        if loss <= target:
            return wall, step
    return None, None


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
        "check_val_every_n_epoch": 1000,  # validate once, at the end (identical cost for every strategy)
        "final_validation": True,
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
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    outcomes = []
    with Progress(
        TextColumn("{task.description:<18}"), BarColumn(), TextColumn("{task.completed:>4.0f}/{task.total:.0f} steps"),
        TimeElapsedColumn(), TextColumn("{task.fields[status]}"),
    ) as progress:
        runs = selected_runs(args)
        tasks = {label: progress.add_task(label, total=args.steps, status="waiting") for label, _ in runs}
        for label, strategy in runs:
            out = root / label
            out.mkdir(parents=True, exist_ok=True)
            for stale in ("progress.txt", "summary.json"):
                (out / stale).unlink(missing_ok=True)
            spec_file = out / "spec.json"
            spec_file.write_text(json.dumps(job_spec(args, strategy, out), indent=1))
            task = tasks[label]
            progress.update(task, status="starting ranks")
            with open(out / "job.log", "w") as log:
                proc = subprocess.Popen([sys.executable, "-m", "lightning_pgc.job", str(spec_file)], cwd=out,
                                        env=env, stdout=log, stderr=subprocess.STDOUT)
                while proc.poll() is None:
                    time.sleep(0.5)
                    done = (out / "progress.txt").read_text() if (out / "progress.txt").exists() else "0"
                    progress.update(task, completed=int(done or 0), status="training" if done != "0" else "starting ranks")
            if proc.returncode != 0:
                progress.update(task, status="[red]failed")
                raise SystemExit(f"{label} failed; see {out / 'job.log'}")
            progress.update(task, completed=args.steps, status="[green]done")
            outcomes.append(read_outcome(label, out, args))
    return outcomes


def read_outcome(label: str, out: Path, args: argparse.Namespace) -> Outcome:
    summary = json.loads((out / "summary.json").read_text())
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.devices)]
    curve = []
    for line in (out / "curve.csv").read_text().splitlines()[1:]:
        wall, step, loss = line.split(",")
        curve.append((float(wall), int(step), float(loss)))
    t, s = first_crossing(curve, args.target_loss, args.window)
    return Outcome(
        label=label,
        wall_s=summary["fit_wall_s"],
        steps=summary["global_step"],
        time_to_target=t,
        steps_to_target=s,
        val_acc=summary["metrics"].get("val_acc", float("nan")),
        final_loss=smoothed([loss for _, _, loss in curve], args.window)[-1],
        curve=curve,
        skipped=[r["skipped_steps"] for r in ranks],
        identical=len({r["checksum"] for r in ranks}) == 1,
    )


def markdown_table(outcomes: list[Outcome], args: argparse.Namespace) -> str:
    def fmt(x: Optional[float], spec: str) -> str:
        return "not reached" if x is None else format(x, spec)

    lines = [
        f"| strategy | wall time to loss {args.target_loss} (s) | steps to it | fit wall time (s) | steps | "
        "final val acc | replicas identical |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for o in outcomes:
        lines.append(
            f"| {o.label} | {fmt(o.time_to_target, '.1f')} | {fmt(o.steps_to_target, 'd')} | {o.wall_s:.1f} | "
            f"{o.steps} | {o.val_acc:.3f} | {'yes' if o.identical else 'NO'} |"
        )
    return "\n".join(lines)


def plot(outcomes: list[Outcome], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4))
    for o in outcomes:
        losses = smoothed([loss for _, _, loss in o.curve], args.window)
        ax_t.plot([w for w, _, _ in o.curve], losses, label=o.label)
        ax_s.plot([s for _, s, _ in o.curve], losses, label=o.label)
    for ax, xlabel in ((ax_t, "wall-clock seconds since the first step"), (ax_s, "optimizer step")):
        ax.axhline(args.target_loss, color="gray", ls=":", lw=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"training loss (mean of last {args.window} steps)")
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


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="per rank and partition")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--slow-seconds", type=float, default=0.1, help="extra seconds per step on the last rank")
    p.add_argument("--jitter-median", type=float, default=0.01)
    p.add_argument("--jitter-sigma", type=float, default=0.5)
    p.add_argument("--target-loss", type=float, default=0.3)
    p.add_argument("--window", type=int, default=10, help="steps in the trailing mean of the loss")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="outputs/demo")
    p.add_argument("--only", default="", help="comma-separated subset of " + ",".join(label for label, _ in RUNS))
    p.add_argument("--docs", action="store_true", help="also write docs/demo.md and docs/demo_loss.png")
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

    table = Table(title=f"time to training loss {args.target_loss} (trailing mean of {args.window} steps)")
    for col in ("strategy", "to target (s)", "steps to it", "fit wall (s)", "steps", "val acc", "identical"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for o in outcomes:
        table.add_row(
            o.label,
            "-" if o.time_to_target is None else f"{o.time_to_target:.1f}",
            "-" if o.steps_to_target is None else str(o.steps_to_target),
            f"{o.wall_s:.1f}", str(o.steps), f"{o.val_acc:.3f}", "yes" if o.identical else "NO",
        )
    console.print(table)

    root = Path(args.out).resolve()
    png = root / "loss_vs_wall_clock.png"
    plot(outcomes, args, png)
    md = markdown_table(outcomes, args)
    (root / "results.md").write_text(md + "\n")
    (root / "results.json").write_text(json.dumps([{k: v for k, v in vars(o).items() if k != "curve"} for o in outcomes], indent=1))
    written = [png, root / "results.md", root / "results.json"]
    if args.docs:
        docs = Path(__file__).resolve().parents[1] / "docs"
        plot(outcomes, args, docs / "demo_loss.png")
        command = "python -m lightning_pgc.demo " + " ".join(argv if argv is not None else sys.argv[1:])
        (docs / "demo.md").write_text(
            "# The demo's results\n\nProduced by `make demo` (here: `" + command.strip() + "`) on a 2-core, no-GPU "
            "machine; timings are noisy, compare rows of the same run.\n\n" + md + "\n\n![loss vs wall clock](demo_loss.png)\n"
        )
        written += [docs / "demo.md", docs / "demo_loss.png"]
    for path in written:
        console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
