"""The main job (``make demo``): one setting where pgc wins and one where it loses, both cells of the map grid.

The digits CNN on 4 CPU processes, in two settings of the map grid (docs/benchmarks.md), under ``ddp``, ``dgd``,
``gc_fr`` c = 2 and ``pgc``. Every job is the map's own job for that cell, arm and seed: the same delay realisation,
evaluation cost (25 ms of simulated compute per gradient), steps, validation schedule, target, learning rate and
momentum (tests/test_demo.py checks the specs against ``benchmarks/grid_map.py`` and the map's verdicts):

- **pgc wins** (``slowrank-sleep``): rank 3 is 0.1 s slower on every step; ``pgc`` (c = 2) does not wait for it.
- **pgc loses** (``stalls-sleep``): log-normal jitter and rare 1-3 s stalls; ``pgc`` with c = 4 needs many more
  steps than it saves time per step.

Prints, per setting, the time and steps to the target validation loss, the seconds per step, the ratio to ``dgd``
in this run and over the map's 5 seeds (read from docs/grid_map.json when the checkout has it), and a verdict that
says why; writes a loss-vs-wall-clock PNG (one panel per setting, titled with its verdict), ``results.md`` and
``results.json``.

    python -m lightning_pgc.demo [--settings wins,loses] [--only pgc,dgd] [--seed 0] [--out outputs/demo] [--wandb]
                                 [--docs] [--correction on|off|only]

Then (``--correction on``, the default) the staleness-correction comparison of :mod:`lightning_pgc.demo_correction`:
``pgc_fr`` c = 2 uncorrected next to look-ahead in the one-slow-rank cell with real compute, where the shipped
measurements (docs/staleness.json) differ most.

The time to target is :func:`lightning_pgc.experiments.crossing` of the validation loss, measured on rank 0 every
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning_pgc.experiments import FILES, JobResult, crossing, launch

ROOT = Path(__file__).resolve().parents[1]
#: the map grid's rendered results, when this is a checkout (not part of an installed package)
MAP = ROOT / "docs" / "grid_map.json"
#: the recipe's SGD momentum (``DigitsModule``): not written into a job's model arguments, as in the map grid
RECIPE_MOMENTUM = 0.9


@dataclass(frozen=True)
class Arm:
    """One compared strategy at the learning rate and momentum the map grid's sweep chose for it."""

    key: str  # what ``--only`` names
    label: str
    map_arm: str  # the map grid's arm key (``crossover.Arm.key``)
    strategy: str
    stragglers: Optional[int]  # s of a coded scheme; None for ddp / dgd
    lr: float
    momentum: float

    def strategy_kwargs(self, seed: int) -> dict[str, Any]:
        if self.strategy == "ddp":
            return {}
        return {"seed": seed} if self.stragglers is None else {"seed": seed, "stragglers": self.stragglers}


@dataclass(frozen=True)
class Setting:
    """A cell of the map grid shown by the demo, with the verdict the map gave its pgc arm and why."""

    key: str  # "wins" or "loses": the map's verdict on ``pgc`` against dgd and ddp
    title: str
    map_cell: str
    delay: str  # the straggler model (``sim_grid.DELAYS``, for 4 ranks)
    compute_s_per_eval: float  # the ``sleep`` cost: simulated compute per gradient evaluation
    arms: tuple[Arm, ...]
    why: str  # why the map finds this verdict
    short_why: str  # the same in a phrase, for the table and the plot

    @property
    def headline(self) -> str:
        return f"pgc {self.key}: {self.title} (map cell {self.map_cell})"


DDP = Arm("ddp", "ddp", "ddp", "ddp", None, 0.1, 0.9)
DGD = Arm("dgd", "dgd", "dgd", "dgd", None, 0.1, 0.9)
GC = Arm("gc", "gc_fr c=2", "gc_fr_c2", "gc_fr", 1, 0.1, 0.9)
SETTINGS: dict[str, Setting] = {
    s.key: s
    for s in (
        Setting(
            "wins",
            "one slow rank",
            "slowrank-sleep",
            "lognormal(median=0.02, sigma=0.5) + slowranks(ranks=[3], seconds=0.1)",
            0.025,
            (DDP, DGD, GC, Arm("pgc", "pgc c=2", "pgc_cr_c2", "pgc_cr", 1, 0.5, 0.0)),
            "rank 3 is 0.1 s slower on every step. pgc never waits for it and evaluates one partition per step "
            "(gc_fr two, to stay exact), so its step costs about half of dgd's; its gradients, at most one version "
            "old, cost it more steps than dgd needs, but far less than the time per step it saves. 4 ranks share 2 "
            "cores: the sleeping rank frees a core, which flatters every strategy that does not wait for it.",
            "pgc skips the slow rank's wait and does one evaluation per step (gc_fr two)",
        ),
        Setting(
            "loses",
            "log-normal jitter + rare stalls",
            "stalls-sleep",
            "lognormal(median=0.02, sigma=0.5) + spikes(prob=0.002, low=1.0, high=3.0)",
            0.025,
            (DDP, DGD, GC, Arm("pgc", "pgc c=4", "pgc_cr_c4", "pgc_cr", 3, 0.2, 0.0)),
            "stragglers are rare here (small jitter, a 1-3 s stall with probability 0.002 per rank and step), so "
            "there is little waiting to hide, while a window of 4 lets gradients be up to 3 versions old: pgc needs "
            "far more steps than dgd, and its cheaper steps do not make up for them (with c = 2 the map finds no "
            "difference here).",
            "little waiting to hide, and gradients up to 3 versions old cost many extra steps",
        ),
    )
}


@dataclass
class Outcome:
    """One strategy's result in one setting, read from the files its job wrote."""

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
    setting: str = ""  # a key of SETTINGS
    key: str = ""  # the arm's key
    lr: float = math.nan
    momentum: float = math.nan
    #: the map's paired ratio to dgd over its seeds (estimate, low, high, seeds), when docs/grid_map.json is there
    map_vs_dgd: Optional[dict[str, Any]] = None

    @property
    def s_per_step(self) -> Optional[float]:
        """Seconds per step up to the target (the map grid's per-step split)."""
        if self.time_to_target is None or not self.steps_to_target:
            return None
        return self.time_to_target / self.steps_to_target


def job_spec(setting: Setting, arm: Arm, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The experiments-harness spec of one demo job: the map grid's job for this cell, arm and seed."""
    return {
        "strategy": arm.strategy,
        "strategy_kwargs": arm.strategy_kwargs(args.seed),
        "devices": 4,
        "delay": setting.delay,
        "delay_seed": args.seed,
        "compute_s_per_eval": setting.compute_s_per_eval,
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


def selected(args: argparse.Namespace) -> list[tuple[Setting, Arm]]:
    """The (setting, arm) pairs ``--settings`` and ``--only`` name, in run order.

    Raises:
        SystemExit: an unknown setting or arm key.
    """
    settings = [w.strip() for w in args.settings.split(",") if w.strip()]
    unknown = sorted(set(settings) - set(SETTINGS))
    if not settings:
        raise SystemExit(f"--settings: name at least one of {sorted(SETTINGS)}")
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; choose from {sorted(SETTINGS)}")
    keys = {arm.key for s in SETTINGS.values() for arm in s.arms}
    only = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = sorted(set(only) - keys)
    if unknown:
        raise SystemExit(f"--only: unknown {unknown}; choose from {sorted(keys)}")
    return [(SETTINGS[s], arm) for s in settings for arm in SETTINGS[s].arms if not only or arm.key in only]


def map_reference(path: Path = MAP) -> dict[tuple[str, str], dict[str, Any]]:
    """(cell, arm) -> the map's paired ratio of time to target against dgd, from ``grid_map.json`` (empty if
    absent)."""
    if not path.is_file():
        return {}
    cells = json.loads(path.read_text())["cells"]
    return {
        (cell, a["arm"]): {k: a["vs_dgd"][k] for k in ("estimate", "low", "high", "seeds")}
        for cell, c in cells.items()
        for a in c["arms"]
        if a.get("vs_dgd")
    }


def run_all(args: argparse.Namespace) -> list[Outcome]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    reference = map_reference()
    outcomes = []
    with Progress(
        TextColumn("{task.description:<24}"),
        BarColumn(),
        TextColumn("{task.completed:>4.0f}/{task.total:.0f} steps"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
    ) as progress:
        runs = selected(args)
        tasks = {
            (s.key, a.key): progress.add_task(f"{s.key}: {a.label}", total=args.steps, status="waiting")
            for s, a in runs
        }
        for setting, arm in runs:
            task = tasks[(setting.key, arm.key)]
            progress.update(task, status="starting ranks")

            def report(step: int, task: Any = task) -> None:
                progress.update(task, completed=step, status="training" if step else "starting ranks")

            out = root / setting.key / arm.key
            result = launch(job_spec(setting, arm, args, out), check=False, on_progress=report)
            if not result.ok:
                progress.update(task, status="[red]failed")
                raise SystemExit(f"{setting.key}/{arm.label} failed ({result.error}); see {out / FILES['log']}")
            progress.update(task, completed=args.steps, status="[green]done")
            o = outcome(arm.label, result, args)
            o.setting, o.key, o.lr, o.momentum = setting.key, arm.key, arm.lr, arm.momentum
            o.map_vs_dgd = reference.get((setting.map_cell, arm.map_arm))
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
    )


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b == 0 else a / b


def split_vs_dgd(o: Outcome, outcomes: list[Outcome]) -> tuple[Optional[float], Optional[float], Optional[float]]:
    """(time, steps, seconds per step) to the target as ratios to dgd's in the same setting (None: not reached,
    or dgd not run)."""
    dgd = next((d for d in outcomes if d.setting == o.setting and d.key == "dgd"), None)
    if dgd is None:
        return None, None, None
    return (
        _ratio(o.time_to_target, dgd.time_to_target),
        _ratio(o.steps_to_target, dgd.steps_to_target),
        _ratio(o.s_per_step, dgd.s_per_step),
    )


def verdict(setting: Setting, outcomes: list[Outcome]) -> str:
    """What this run shows for pgc in ``setting`` against dgd and ddp (and its split into steps and seconds per
    step), the map's interval, and whether the two disagree; empty without pgc or a reference in the run."""
    mine = [o for o in outcomes if o.setting == setting.key]
    pgc = next((o for o in mine if o.key == "pgc"), None)
    refs = {o.key: o for o in mine if o.key in ("ddp", "dgd")}
    if pgc is None or not refs:
        return ""
    if pgc.time_to_target is None:
        seen = "loses" if any(r.time_to_target is not None for r in refs.values()) else "ties"
    else:
        ratios = [_ratio(pgc.time_to_target, r.time_to_target) for r in refs.values()]
        seen = (
            "wins"
            if all(r is None or r < 1 for r in ratios)
            else "loses"
            if all(r is not None and r > 1 for r in ratios)
            else "ties"
        )
    time, steps, per_step = split_vs_dgd(pgc, outcomes)
    text = f"This run: {pgc.label} {seen}"
    if time is not None and steps is not None and per_step is not None:
        text += (
            f" ({time:.2f}x dgd's time to the target: {steps:.2f}x its steps at {per_step:.2f}x its seconds per step)"
        )
    elif time is not None:
        text += f" ({time:.2f}x dgd's time to the target)"
    if pgc.map_vs_dgd:
        m = pgc.map_vs_dgd
        text += f"; the map over {m['seeds']} seeds: {m['estimate']:.2f}x [{m['low']:.2f}, {m['high']:.2f}]"
    text += "."
    if seen != setting.key:
        text += " This run disagrees with the map: one seed on a shared 2-core machine, where the map has 5."
    return text


def markdown_table(outcomes: list[Outcome], args: argparse.Namespace) -> str:
    def fmt(x: Optional[float], spec: str) -> str:
        return "not reached" if x is None else format(x, spec)

    def ratio(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.2f}x"

    lines = [
        f"| setting | strategy | lr, momentum | wall time to {args.target_quantity} {args.target_loss} (s) | "
        "steps to it | s per step | time vs dgd | steps, s per step vs dgd | time vs dgd, map (seeds) | "
        "final val acc | replicas identical | why (pgc) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for o in outcomes:
        time, steps, per_step = split_vs_dgd(o, outcomes)
        m = o.map_vs_dgd
        mapped = "-" if m is None else f"{m['estimate']:.2f}x [{m['low']:.2f}, {m['high']:.2f}] ({m['seeds']})"
        split = "-" if steps is None or per_step is None else f"{steps:.2f}x, {per_step:.2f}x"
        lines.append(
            f"| pgc {o.setting}: {SETTINGS[o.setting].title} | {o.label} | {o.lr:g}, {o.momentum:g} | "
            f"{fmt(o.time_to_target, '.1f')} | {fmt(o.steps_to_target, '.0f')} | "
            f"{'-' if o.s_per_step is None else format(o.s_per_step, '.3f')} | "
            f"{'-' if o.key == 'dgd' else ratio(time)} | {'-' if o.key == 'dgd' else split} | "
            f"{'-' if o.key == 'dgd' else mapped} | {o.val_acc:.3f} | {'yes' if o.identical else 'NO'} | "
            f"{SETTINGS[o.setting].short_why if o.key == 'pgc' else ''} |"
        )
    return "\n".join(lines)


def shown_settings(outcomes: list[Outcome]) -> list[Setting]:
    return [s for s in SETTINGS.values() if any(o.setting == s.key for o in outcomes)]


def plot(outcomes: list[Outcome], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = shown_settings(outcomes)
    fig, axes = plt.subplots(1, len(settings), figsize=(7.5 * len(settings), 5.6), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        for o in outcomes:
            if o.setting == setting.key:
                ax.plot(
                    [w for w, _, _ in o.val_curve],
                    [v for _, _, v in o.val_curve],
                    label=o.label,
                    lw=2.2 if o.key == "pgc" else 1.2,
                )
        ax.axhline(args.target_loss, color="gray", ls=":", lw=1)
        ax.set_xlabel("wall-clock seconds since the first step")
        ax.set_ylabel(f"validation loss (every {args.val_every} steps)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        lines = [
            setting.headline,
            *textwrap.wrap("why: " + setting.short_why, 90),
            *textwrap.wrap(verdict(setting, outcomes), 90),
        ]
        ax.set_title("\n".join(lines), fontsize=8.5)
    fig.suptitle(
        f"digits CNN, 4 CPU ranks on 2 cores, seed {args.seed}; each strategy at the map grid's rate and momentum"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: the derived values a saved row also carries (so that every number the page shows is in demo.json)
DERIVED = ("s_per_step", "time_vs_dgd", "steps_vs_dgd", "s_per_step_vs_dgd")


def _row(o: Outcome, outcomes: list[Outcome]) -> dict[str, Any]:
    row = {k: v for k, v in vars(o).items() if k not in ("curve", "val_curve")}
    return {**row, **dict(zip(DERIVED, (o.s_per_step, *split_vs_dgd(o, outcomes))))}


def read_outcomes(rows: list[dict[str, Any]]) -> list[Outcome]:
    """Outcomes from saved rows (results.json, docs/demo.json), without their curves."""
    return [Outcome(**{**{k: v for k, v in r.items() if k not in DERIVED}, "curve": []}) for r in rows]


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="wins,loses", help="comma-separated subset of " + ",".join(SETTINGS))
    p.add_argument("--only", default="", help="comma-separated arm keys (ddp, dgd, gc, pgc); default: all")
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
        help="also write docs/demo.md, docs/demo.json, docs/demo_loss.png (and docs/demo_correction.{md,json})",
    )
    p.add_argument(
        "--correction",
        choices=["on", "off", "only"],
        default="on",
        help="the staleness-correction comparison after the map's settings (two more jobs), without it, or alone",
    )
    p.set_defaults(target_quantity="validation loss")  # saved with the settings: what the target is a value of
    return p.parse_args(argv)


def page(outcomes: list[Outcome], args: argparse.Namespace, command: str) -> str:
    """docs/demo.md: the command, the table, each setting's verdict, the PNG."""
    verdicts = "\n\n".join(f"- **{s.headline}.** {verdict(s, outcomes)} Why: {s.why}" for s in shown_settings(outcomes))
    return (
        "# The demo's results\n\nProduced by `make demo` (here: `" + command + "`) on a 2-core, no-GPU machine; "
        "timings are noisy, compare rows of the same setting. One seed: the map's column is the paired ratio over "
        "its seeds, from [grid_map.json](grid_map.json) (docs/benchmarks.md). Every other number below is in "
        "[demo.json](demo.json).\n\n"
        + markdown_table(outcomes, args)
        + "\n\n"
        + verdicts
        + "\n\n![loss vs wall clock](demo_loss.png)\n"
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


def main(argv: Optional[list[str]] = None) -> None:
    from rich.table import Table

    args = parse_args(argv)
    console = make_console()
    command = ("python -m lightning_pgc.demo " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    if args.correction != "off":
        from lightning_pgc import demo_correction as dc
    runs = [] if args.correction == "only" else selected(args)
    if runs:
        cells = ", ".join(f"{s.key} ({s.map_cell})" for s in SETTINGS.values() if any(r[0] is s for r in runs))
        console.print(
            f"[bold]lightning_pgc demo[/]: {len(runs)} jobs x {args.steps} steps on 4 CPU processes, in the "
            f"map grid's settings {cells}"
            + (
                ""
                if args.correction == "off"
                else f"; then {len(dc.ARMS)} jobs x {dc.STEPS} steps: pgc_fr c=2 uncorrected next to look-ahead"
            )
        )
    outcomes = run_all(args) if runs else []

    for setting in shown_settings(outcomes):
        table = Table(title=f"pgc {setting.key}: {setting.title} (time to validation loss {args.target_loss})")
        for col in (
            "strategy",
            "lr, mom.",
            "to target (s)",
            "steps to it",
            "s/step",
            "vs dgd",
            "vs dgd, map",
            "val acc",
            "identical",
        ):
            table.add_column(col, justify="left" if col == "strategy" else "right")
        for o in outcomes:
            if o.setting != setting.key:
                continue
            time = split_vs_dgd(o, outcomes)[0]
            m = o.map_vs_dgd
            table.add_row(
                o.label,
                f"{o.lr:g}, {o.momentum:g}",
                "-" if o.time_to_target is None else f"{o.time_to_target:.1f}",
                "-" if o.steps_to_target is None else f"{o.steps_to_target:.0f}",
                "-" if o.s_per_step is None else f"{o.s_per_step:.3f}",
                "-" if time is None or o.key == "dgd" else f"{time:.2f}x",
                "-" if m is None else f"{m['estimate']:.2f}x [{m['low']:.2f}, {m['high']:.2f}]",
                f"{o.val_acc:.3f}",
                "yes" if o.identical else "NO",
            )
        console.print(table)
        console.print(f"[bold]{setting.headline}.[/] {verdict(setting, outcomes)} Why: {setting.why}")

    root = Path(args.out).resolve()
    docs = ROOT / "docs"
    written: list[Path] = []
    if args.correction != "off":
        if not runs:
            console.print(f"[bold]lightning_pgc demo[/]: {len(dc.ARMS)} jobs x {dc.STEPS} steps on 4 CPU processes")
        fixed = dc.run(args)
        reference = dc.measured()
        dc.print_results(console, fixed, reference)
        root.mkdir(parents=True, exist_ok=True)
        (root / "correction.md").write_text(dc.page(fixed, reference, command))
        written.append(root / "correction.md")
        if args.docs:
            saved = {"command": command, "seed": args.seed, "results": dc.saved(fixed)}
            (docs / "demo_correction.json").write_text(json.dumps(saved, indent=1) + "\n")
            (docs / "demo_correction.md").write_text(dc.page(fixed, reference, command))
            written += [docs / "demo_correction.md", docs / "demo_correction.json"]
    if not runs:
        for path in written:
            console.print(f"wrote {path}")
        return
    png = root / "loss_vs_wall_clock.png"
    plot(outcomes, args, png)
    (root / "results.md").write_text(markdown_table(outcomes, args) + "\n")
    (root / "results.json").write_text(json.dumps([_row(o, outcomes) for o in outcomes], indent=1))
    written += [png, root / "results.md", root / "results.json"]
    if args.docs:
        plot(outcomes, args, docs / "demo_loss.png")
        (docs / "demo.json").write_text(
            json.dumps(
                {"command": command, "settings": vars(args), "results": [_row(o, outcomes) for o in outcomes]}, indent=1
            )
        )
        (docs / "demo.md").write_text(page(outcomes, args, command))
        written += [docs / "demo.md", docs / "demo.json", docs / "demo_loss.png"]
    for path in written:
        console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
