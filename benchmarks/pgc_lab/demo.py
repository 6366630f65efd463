"""The main job (``make demo``): a race of the strategies a user weighs, in a cell with one slow rank and in a
cell where stragglers are rare, both cells of the map grid.

The digits CNN on 4 CPU processes (the map grid's ``sleep`` cost: the 38k-parameter CNN plus 25 ms of simulated
compute per gradient), one seed, in two cells of the map grid (docs/results/benchmarks.md):

- **one slow rank** (``slowrank-sleep``): rank 3 is 0.1 s slower on every step;
- **stragglers are rare** (``stalls-sleep``): log-normal jitter and rare 1-3 s stalls, where not waiting has little
  to hide.

The race (:data:`DEFAULT_ARMS`, ``--arms default``): ``ddp``; ``ignore_stragglers`` c = 2; ``pgc``, the registered
name (PGC-CR s = 1 with the look-ahead staleness correction, the recommended pipelined arm); ``bounded_staleness``;
``pgc_auto``: 5 arms x 2 cells = 10 jobs. The full race, ``python benchmarks/demo.py --arms all`` (:data:`ARMS`),
adds the map's best GC (``gc_fr`` c = 2) and ``pgc_fr`` c = 2 without and with look-ahead: 16 jobs;
``--arms all --docs`` writes its results to docs/results/demo_full.md and demo_full.json. ``--only``
names any arms of the full race.

Each arm runs at the learning rate and momentum its own tuning chose (:attr:`DemoArm.tuned_by`: the map grid's sweep;
``dgd``'s for ``pgc_auto``, which starts as ``dgd``; for the look-ahead arms, which the map grid does not sweep, the
staleness benchmark's look-ahead arm, docs/results/staleness.json); every job is otherwise the map's own job for
its cell, arm and seed (tests/test_demo.py checks the specs against ``benchmarks/grid_map.py`` and the choices
against the shipped results).

Why digits, not the map's harder tasks: 10 jobs of 4 ranks fit the demo's budget of 10 minutes on 2 cores only
with the small digits CNN.

Progress: on a terminal, rich's progress bars; anywhere else (a file, a pipe, a CI log) one flushed plain line as
each job starts and one as it ends (time to target, seconds per step, the job's wall seconds, the time elapsed),
so ``make demo > demo.log`` read with ``tail -f`` shows the race as it goes. Then, per cell, a table of every arm
(time and steps to the target validation loss, seconds per step, the ratio to ``ddp`` in this run and over the
map's 5 seeds when docs/results/grid_map.json is there), the winner of this run, the map's verdict and the guide's
row for this kind of cluster; writes a loss-vs-wall-clock PNG (one panel per cell, every arm, the target line),
``results.md`` and ``results.json``.

    python benchmarks/demo.py [--arms default|all] [--settings slow,rare] [--only ddp,pgc] [--seed 0]
                              [--out outputs/demo] [--wandb] [--docs]

The time to target is :func:`pgc_lab.experiments.crossing` of the validation loss, measured on rank 0 every
``--val-every`` steps on the whole validation set. Not the training loss: under PGC the decoded training loss
mixes the losses of model versions ``t..t-c+1`` (and of the received ranks' partitions only). Needs the
``[bench]`` extra.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Optional

from pgc_lab.demo_cells import (
    ARM_SETS,
    ARMS,
    COMPUTE_S_PER_EVAL,
    DEFAULT_ARMS,
    MAP,
    RECIPE_MOMENTUM,
    ROOT,
    SETTINGS,
    STALENESS,
    DemoArm,
    Outcome,
    Setting,
    map_reference,
    map_winner,
    split_vs_ddp,
    verdict,
)
from pgc_lab.experiments import FILES, JobResult, crossing, launch

__all__ = [
    "ARMS",
    "DEFAULT_ARMS",
    "MAP",
    "SETTINGS",
    "STALENESS",
    "DemoArm",
    "Outcome",
    "Setting",
    "main",
    "map_winner",
    "verdict",
]


def job_spec(setting: Setting, arm: DemoArm, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The experiments-harness spec of one demo job: the map grid's job for this cell, arm and seed."""
    return {
        "strategy": arm.strategy,
        "strategy_kwargs": arm.strategy_kwargs(args.seed),
        "devices": 4,
        "delay": setting.delay,
        "delay_seed": args.seed,
        "compute_s_per_eval": COMPUTE_S_PER_EVAL,
        "seed": args.seed,
        "max_steps": args.steps,
        "batch_size": 16,
        "lr": arm.lr,
        "model": {"sync_train_loss": False, **({"momentum": arm.momentum} if arm.momentum != RECIPE_MOMENTUM else {})},
        # no Lightning validation loop (its metric sync is a collective): rank 0 evaluates every val_every steps
        "check_val_every_n_epoch": 100_000,
        "val_every_n_steps": args.val_every,
        "sync_loss": False,
        "measure": True,
        "valve": None,
        "start_method": "popen",
        "out": str(out),
        "wandb": None
        if not args.wandb
        else {
            "project": args.wandb_project,
            "group": f"demo-{setting.key}",
            "name": f"{setting.key}__{arm.key}",
            "offline": True,
            "tags": ["demo", setting.map_cell, arm.strategy],
            "config": {"label": arm.label, "cell": setting.map_cell, "target_val_loss": args.target_loss},
        },
    }


def selected(args: argparse.Namespace) -> list[tuple[Setting, DemoArm]]:
    """The (setting, arm) pairs ``--settings`` and ``--arms`` name (or ``--only``, any arms of the full race), in
    run order.

    Raises:
        SystemExit: an unknown setting or arm key.
    """
    settings = [w.strip() for w in args.settings.split(",") if w.strip()]
    unknown = sorted(set(settings) - set(SETTINGS))
    if not settings:
        raise SystemExit(f"--settings: name at least one of {sorted(SETTINGS)}")
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; choose from {sorted(SETTINGS)}")
    keys = [arm.key for arm in ARMS]
    only = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = sorted(set(only) - set(keys))
    if unknown:
        raise SystemExit(f"--only: unknown {unknown}; choose from {keys}")
    chosen = only or ARM_SETS[args.arms]
    return [(SETTINGS[s], arm) for s in settings for arm in ARMS if arm.key in chosen]


#: a rough model of one job's wall time on 2 otherwise idle cores, for the estimate the demo prints first: starting
#: and stopping 4 ranks (imports, process group, teardown), then seconds per training step (validation included)
JOB_START_S = 18.0
JOB_S_PER_STEP = 0.08


def estimate_s(jobs: int, steps: int) -> float:
    """A rough wall time of ``jobs`` jobs of ``steps`` steps each on 2 cores (:data:`JOB_START_S`,
    :data:`JOB_S_PER_STEP`): the demo's first line, so that a reader knows how long to wait."""
    return jobs * (JOB_START_S + JOB_S_PER_STEP * steps)


def clock(seconds: float) -> str:
    """``m:ss``."""
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}:{secs:02d}"


class RaceReport:
    """How the race shows its progress: on a terminal, rich's progress bar per job; anywhere else (a file, a pipe,
    a CI log, where a bar renders nothing useful) one plain line, flushed, as each job starts and one as it ends, so
    that a log read with ``tail -f`` shows the race as it goes."""

    def __init__(self, runs: list[tuple[Setting, DemoArm]], args: argparse.Namespace, bar: bool) -> None:
        self.runs, self.args, self.bar = runs, args, bar
        self.started = time.monotonic()
        self.job_walls: list[float] = []
        self.progress: Any = None
        self.tasks: dict[tuple[str, str], Any] = {}
        self.current: Any = None

    def __enter__(self) -> RaceReport:
        self.started = time.monotonic()
        if self.bar:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(
                TextColumn("{task.description:<40}"),
                BarColumn(),
                TextColumn("{task.completed:>4.0f}/{task.total:.0f} steps"),
                TimeElapsedColumn(),
                TextColumn("{task.fields[status]}"),
            )
            self.progress.__enter__()
            self.tasks = {
                (s.key, a.key): self.progress.add_task(f"{s.key}: {a.label}", total=self.args.steps, status="waiting")
                for s, a in self.runs
            }
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def _line(self, i: int, setting: Setting, arm: DemoArm, text: str) -> None:
        print(f"[{i}/{len(self.runs)}] {setting.title}: {arm.label} ... {text}", flush=True)

    def start(self, i: int, setting: Setting, arm: DemoArm) -> None:
        """Job ``i`` (from 1) starts."""
        if self.progress is None:
            self._line(i, setting, arm, "starting")
            return
        self.current = self.tasks[(setting.key, arm.key)]
        self.progress.update(self.current, status="starting ranks")

    def step(self, step: int) -> None:
        """The running job reported ``step`` (``launch``'s ``on_progress``)."""
        if self.progress is not None:
            self.progress.update(self.current, completed=step, status="training" if step else "starting ranks")

    def failed(self, i: int, setting: Setting, arm: DemoArm) -> None:
        if self.progress is None:
            self._line(i, setting, arm, f"failed after {time.monotonic() - self.started:.0f} s")
        else:
            self.progress.update(self.current, status="[red]failed")

    def done(self, i: int, setting: Setting, arm: DemoArm, o: Outcome) -> None:
        """Job ``i`` ended with ``o``: its time to target, seconds per step, wall seconds, and the race's elapsed
        time and what is left at the mean job time so far."""
        self.job_walls.append(o.job_wall_s)
        if self.progress is not None:
            self.progress.update(self.current, completed=self.args.steps, status="[green]done")
            return
        if o.time_to_target is None:
            target = f"target not reached in {o.steps} steps"
        else:
            target = f"target in {o.time_to_target:.1f} s ({o.steps_to_target:.0f} steps)"
        per_step = "-" if o.s_per_step is None else f"{o.s_per_step:.3f}"
        elapsed = time.monotonic() - self.started
        left = (len(self.runs) - i) * sum(self.job_walls) / len(self.job_walls)
        self._line(
            i,
            setting,
            arm,
            f"done: {target}, {per_step} s per step, job {o.job_wall_s:.0f} s; elapsed {clock(elapsed)}"
            + (f", about {clock(left)} left" if i < len(self.runs) else ""),
        )


def run_all(args: argparse.Namespace) -> list[Outcome]:
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    reference = map_reference()
    outcomes = []
    runs = selected(args)
    with RaceReport(runs, args, bar=sys.stdout.isatty()) as report:
        for i, (setting, arm) in enumerate(runs, 1):
            report.start(i, setting, arm)
            out = root / setting.key / arm.key
            result = launch(job_spec(setting, arm, args, out), check=False, on_progress=report.step)
            if not result.ok:
                report.failed(i, setting, arm)
                raise SystemExit(f"{setting.key}/{arm.label} failed ({result.error}); see {out / FILES['log']}")
            o = outcome(arm.label, result, args)
            o.setting, o.key, o.lr, o.momentum = setting.key, arm.key, arm.lr, arm.momentum
            if arm.in_map:
                o.map_vs_ddp = reference.get((setting.map_cell, arm.map_arm))
            report.done(i, setting, arm, o)
            outcomes.append(o)
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
        job_wall_s=result.job_wall_s,
    )


def markdown_table(outcomes: list[Outcome], args: argparse.Namespace) -> str:
    def fmt(x: Optional[float], spec: str) -> str:
        return "not reached" if x is None else format(x, spec)

    def ratio(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.2f}x"

    lines = [
        f"| setting | strategy | lr, momentum | wall time to {args.target_quantity} {args.target_loss} (s) | "
        "steps to it | s per step | time vs ddp | steps, s per step vs ddp | time vs ddp, map (seeds) | "
        "final val acc | replicas identical |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for o in outcomes:
        time, steps, per_step = split_vs_ddp(o, outcomes)
        m = o.map_vs_ddp
        mapped = "-" if m is None else f"{m['estimate']:.2f}x [{m['low']:.2f}, {m['high']:.2f}] ({m['seeds']})"
        split = "-" if steps is None or per_step is None else f"{steps:.2f}x, {per_step:.2f}x"
        ref = o.key == "ddp"
        lines.append(
            f"| {SETTINGS[o.setting].title} | {o.label} | {o.lr:g}, {o.momentum:g} | "
            f"{fmt(o.time_to_target, '.1f')} | {fmt(o.steps_to_target, '.0f')} | "
            f"{'-' if o.s_per_step is None else format(o.s_per_step, '.3f')} | "
            f"{'-' if ref else ratio(time)} | {'-' if ref else split} | {'-' if ref else mapped} | "
            f"{o.val_acc:.3f} | {'yes' if o.identical else 'NO'} |"
        )
    return "\n".join(lines)


def shown_settings(outcomes: list[Outcome]) -> list[Setting]:
    return [s for s in SETTINGS.values() if any(o.setting == s.key for o in outcomes)]


def plot(outcomes: list[Outcome], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = shown_settings(outcomes)
    fig, axes = plt.subplots(1, len(settings), figsize=(7.5 * len(settings), 6.0), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        for o in outcomes:
            if o.setting == setting.key:
                ax.plot(
                    [w for w, _, _ in o.val_curve],
                    [v for _, _, v in o.val_curve],
                    label=o.label,
                    lw=2.2 if o.key == "ddp" else 1.2,
                )
        ax.axhline(args.target_loss, color="gray", ls=":", lw=1, label=f"target {args.target_loss:g}")
        ax.set_xlabel("wall-clock seconds since the first step")
        ax.set_ylabel(f"validation loss (every {args.val_every} steps)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        lines = [setting.headline, *textwrap.wrap(verdict(setting, outcomes), 95)]
        ax.set_title("\n".join(lines), fontsize=8)
    fig.suptitle(
        f"digits CNN, 4 CPU ranks on 2 cores, seed {args.seed}; each strategy at the rate and momentum its tuning chose"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: the derived values a saved row also carries (so that every number the page shows is in demo.json)
DERIVED = ("s_per_step", "time_vs_ddp", "steps_vs_ddp", "s_per_step_vs_ddp")


def _row(o: Outcome, outcomes: list[Outcome]) -> dict[str, Any]:
    row = {k: v for k, v in vars(o).items() if k not in ("curve", "val_curve")}
    return {**row, **dict(zip(DERIVED, (o.s_per_step, *split_vs_ddp(o, outcomes))))}


def read_outcomes(rows: list[dict[str, Any]]) -> list[Outcome]:
    """Outcomes from saved rows (results.json, docs/results/demo.json), without their curves."""
    return [Outcome(**{**{k: v for k, v in r.items() if k not in DERIVED}, "curve": []}) for r in rows]


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="slow,rare", help="comma-separated subset of " + ",".join(SETTINGS))
    p.add_argument(
        "--arms",
        choices=sorted(ARM_SETS),
        default="default",
        help="default: the arms a user weighs (" + ", ".join(DEFAULT_ARMS) + "); all: the full race, every arm",
    )
    p.add_argument(
        "--only",
        default="",
        help="comma-separated arm keys, any of the full race's (" + ", ".join(a.key for a in ARMS) + ")",
    )
    p.add_argument("--steps", type=int, default=200, help="steps per job (the map grid's)")
    p.add_argument("--target-loss", type=float, default=0.3, help="target validation loss (the map grid's)")
    p.add_argument("--val-every", type=int, default=20, help="steps between validation-loss measurements")
    p.add_argument("--seed", type=int, default=0, help="the delay realisation, weights, split and data streams")
    p.add_argument("--out", default="outputs/demo")
    p.add_argument(
        "--wandb",
        action="store_true",
        help="log every job as an offline W&B run (in its folder under --out; `wandb sync` uploads it)",
    )
    p.add_argument("--wandb-project", default="lightning_pgc-demo")
    p.add_argument(
        "--docs",
        action="store_true",
        help="also write docs/results/demo.md, demo.json, demo_loss.png (with --arms all: demo_full.md, "
        "demo_full.json, demo_full_loss.png)",
    )
    p.set_defaults(target_quantity="validation loss")  # saved with the settings: what the target is a value of
    return p.parse_args(argv)


#: the results files' stem under docs/results/ of each ``--arms`` set (``--docs``)
DOCS_STEMS = {"default": "demo", "all": "demo_full"}
#: the command of the full race's results
FULL_RACE = "python benchmarks/demo.py --arms all --docs"


def arm_names(keys: tuple[str, ...]) -> str:
    """The labels of these arms, in run order: ``a, b and c``."""
    labels = [a.label for a in ARMS if a.key in keys]
    return ", ".join(labels[:-1]) + " and " + labels[-1] if len(labels) > 1 else "".join(labels)


def page(outcomes: list[Outcome], args: argparse.Namespace, command: str) -> str:
    """docs/results/demo.md (``--arms all``: demo_full.md): the command, the race's arms and where the other race's
    results are, the table, each setting's verdict, the PNG."""
    stem = DOCS_STEMS[args.arms]
    verdicts = "\n\n".join(
        f"- **{s.headline}.** {verdict(s, outcomes)} What the cell shows: {s.why}" for s in shown_settings(outcomes)
    )
    others = tuple(a.key for a in ARMS if a.key not in DEFAULT_ARMS)
    if args.arms == "all":
        title, source = "# The demo's full race", "`" + command + "`"
        race = (
            f"Every arm of the demo: the default race's ({arm_names(DEFAULT_ARMS)}) and {arm_names(others)}. "
            "The default race, `make demo`, is in [demo.md](demo.md)."
        )
    else:
        title, source = "# The demo's results", "`make demo` (here: `" + command + "`)"
        race = (
            f"The default race: the arms a user weighs ({arm_names(DEFAULT_ARMS)}). The full race, which adds "
            f"{arm_names(others)}, is `{FULL_RACE}`; its results are in [demo_full.md](demo_full.md)."
        )
    walls = [o.job_wall_s for o in outcomes if math.isfinite(o.job_wall_s)]
    took = f" The {len(walls)} jobs took {sum(walls) / 60:.1f} min in all." if walls else ""
    return (
        f"{title}\n\nProduced by {source} on a 2-core, no-GPU machine; timings are noisy, compare rows of the same "
        f"setting. {race}{took} One seed: the map's column is the paired ratio over its seeds, from "
        "[grid_map.json](grid_map.json) (docs/results/benchmarks.md). Every other number below is in "
        f"[{stem}.json]({stem}.json).\n\n"
        + markdown_table(outcomes, args)
        + "\n\n"
        + verdicts
        + f"\n\n![loss vs wall clock]({stem}_loss.png)\n"
    )


#: the width of printed output when stdout is not a terminal (a file, a pipe, a CI log, a notebook): wide enough
#: that no table is cut or folded, so strategy names and intervals read in full
UNBOUNDED_WIDTH = 1000


def make_console() -> Any:
    """rich's console for the demo's output: a terminal's own width, or, anywhere else, no wrapping and no cut
    columns (rich otherwise assumes 80 columns and truncates cells to "strat…")."""
    from rich.console import Console

    if sys.stdout.isatty():
        return Console()
    return Console(width=UNBOUNDED_WIDTH, soft_wrap=True)


def print_results(console: Any, outcomes: list[Outcome], args: argparse.Namespace) -> None:
    from rich.table import Table

    for setting in shown_settings(outcomes):
        table = Table(title=f"{setting.headline}: time to validation loss {args.target_loss}")
        for col in (
            "strategy",
            "lr, mom.",
            "to target (s)",
            "steps to it",
            "s/step",
            "vs ddp",
            "vs ddp, map",
            "val acc",
            "identical",
        ):
            table.add_column(col, justify="left" if col == "strategy" else "right")
        for o in outcomes:
            if o.setting != setting.key:
                continue
            time = split_vs_ddp(o, outcomes)[0]
            m = o.map_vs_ddp
            table.add_row(
                o.label,
                f"{o.lr:g}, {o.momentum:g}",
                "-" if o.time_to_target is None else f"{o.time_to_target:.1f}",
                "-" if o.steps_to_target is None else f"{o.steps_to_target:.0f}",
                "-" if o.s_per_step is None else f"{o.s_per_step:.3f}",
                "-" if time is None or o.key == "ddp" else f"{time:.2f}x",
                "-" if m is None else f"{m['estimate']:.2f}x [{m['low']:.2f}, {m['high']:.2f}]",
                f"{o.val_acc:.3f}",
                "yes" if o.identical else "NO",
            )
        console.print(table)
        console.print(f"[bold]{setting.headline}.[/] {verdict(setting, outcomes)} What the cell shows: {setting.why}")


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    console = make_console()
    command = ("python benchmarks/demo.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    runs = selected(args)
    cells = ", ".join(f"{s.title} ({s.map_cell})" for s in SETTINGS.values() if any(r[0] is s for r in runs))
    arms = [a for a in ARMS if any(r[1] is a for r in runs)]
    n_cells = len({r[0].key for r in runs})
    if args.arms == "all" and not args.only:
        race = "the full race"
    else:
        race = f"the full race, every arm, is `{FULL_RACE}` (its results: docs/results/demo_full.md)"
    console.print(
        f"[bold]lightning_pgc demo[/]: {len(runs)} jobs ({len(arms)} arms x {n_cells} cell{'s' * (n_cells > 1)}) x "
        f"{args.steps} steps on 4 CPU processes, roughly {estimate_s(len(runs), args.steps) / 60:.0f} min on 2 idle "
        f"cores (longer while other work shares them). Arms: {', '.join(a.label for a in arms)}; {race}. Cells of "
        f"the map grid: {cells}. Digits, not the map's harder tasks: the race fits its budget on 2 cores only with "
        "the small digits CNN.",
        highlight=False,
    )
    sys.stdout.flush()
    outcomes = run_all(args)
    print_results(console, outcomes, args)

    root = Path(args.out).resolve()
    docs = ROOT / "docs" / "results"
    png = root / "loss_vs_wall_clock.png"
    plot(outcomes, args, png)
    (root / "results.md").write_text(markdown_table(outcomes, args) + "\n")
    (root / "results.json").write_text(json.dumps([_row(o, outcomes) for o in outcomes], indent=1))
    written = [png, root / "results.md", root / "results.json"]
    if args.docs:
        stem = DOCS_STEMS[args.arms]
        plot(outcomes, args, docs / f"{stem}_loss.png")
        (docs / f"{stem}.json").write_text(
            json.dumps(
                {"command": command, "settings": vars(args), "results": [_row(o, outcomes) for o in outcomes]}, indent=1
            )
        )
        (docs / f"{stem}.md").write_text(page(outcomes, args, command))
        written += [docs / f"{stem}.md", docs / f"{stem}.json", docs / f"{stem}_loss.png"]
    for path in written:
        console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
