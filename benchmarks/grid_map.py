"""The map grid: schemes x straggler models x evaluation costs x seeds, each scheme at its own rate and momentum.

    WANDB_MODE=offline python benchmarks/grid.py [--max-jobs 40] [--only-cells stalls-sleep] [--render-only]

Plans (:mod:`pgc_lab.experiments.crossover`) a sweep (``--lrs`` at the recipe's momentum and the same effective rates at each of
``--momenta``, on ``--sweep-seeds``, ``--sweep-steps`` steps, under ``--sweep-delay``, per evaluation cost) and the
main runs (``--seeds``, ``--steps``) of every arm in every cell (``--delays`` x ``--costs``) at the setting the
sweep chose, as round ``--round`` (a new round reruns every arm of a cell together), runs the jobs that have no
record yet (at most ``--max-jobs`` of them this invocation; sweep first), one at a time through
:func:`pgc_lab.experiments.launch`, and appends each finished job as one record to ``--runs``
(``docs/results/grid_runs/``, one JSON Lines file per round; reused while its spec is unchanged). Then renders, from every record there: the crossover
map (``docs/results/grid_map.png``), ``docs/results/grid_map.json`` and the block of ``docs/results/benchmarks.md`` between the
``gridmap`` markers. Cells whose runs are not all finished are marked incomplete. Interrupt it at any time and
run the same command again to continue. ``--render-only`` runs nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

from pgc_lab.experiments import crossover as cx
from pgc_lab.experiments import runs as single
from pgc_lab.experiments.report import write_report

ROOT = Path(__file__).resolve().parents[1]
#: the evaluation costs by their measured job time here (sweep: about 30 s, 51 s and 109 s per 100-step job)
CHEAPEST_FIRST = ("sleep", "comm", "real")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=4, help="n, CPU ranks per job")
    p.add_argument("--c", type=int, nargs="+", default=[2, 4, 8], help="copies / window, each where n allows")
    p.add_argument("--families", nargs="+", default=list(cx.FAMILIES), choices=cx.FAMILIES)
    p.add_argument(
        "--adaptive",
        nargs="*",
        default=["pgc_cr", "bounded"],
        help="families also run with the StalenessValve (none: no adaptive arms)",
    )
    p.add_argument("--delays", nargs="+", default=list(cx.DELAYS), choices=list(cx.DELAYS))
    p.add_argument("--costs", nargs="+", default=list(cx.COSTS), choices=list(cx.COSTS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--val-every", type=int, default=20)
    p.add_argument("--target", type=float, default=0.3, help="target validation loss")
    p.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=[0.02, 0.05, 0.1],
        help=f"the sweep's rates at the recipe's momentum {cx.RECIPE_MOMENTUM}",
    )
    p.add_argument(
        "--momenta",
        type=float,
        nargs="+",
        default=[cx.RECIPE_MOMENTUM, 0.0],
        help="the sweep's SGD momenta; at each, the same effective rates lr / (1 - momentum)",
    )
    p.add_argument(
        "--round",
        type=int,
        default=2,
        help="the main runs' round; each reruns every arm of a cell together (1: the first pass, swept "
        "at momentum 0.9 only; 2: rate and momentum swept)",
    )
    p.add_argument("--sweep-seeds", type=int, nargs="+", default=[0])
    p.add_argument("--sweep-steps", type=int, default=100)
    p.add_argument("--sweep-delay", default="lognormal + stalls", choices=list(cx.DELAYS))
    p.add_argument("--no-sweep", action="store_true", help="every arm at --lr, no sweep")
    p.add_argument("--lr", type=float, default=0.05, help="with --no-sweep: every arm's rate (recipe momentum)")
    p.add_argument("--max-jobs", type=int, default=None, help="run at most this many new jobs now")
    p.add_argument("--only-cells", nargs="+", default=None, help="run jobs of these cells only (e.g. stalls-sleep)")
    p.add_argument("--render-only", action="store_true")
    p.add_argument(
        "--pause-file",
        default=None,
        help="while this file exists, wait before starting the next job (to share the machine between "
        "jobs without disturbing a job's timing: create it, wait for the running job, remove it)",
    )
    p.add_argument(
        "--retry-failed",
        action="store_true",
        help="rerun jobs recorded as failed (a timeout, a crash); by default a failed run is a result",
    )
    p.add_argument("--start-method", default="popen", choices=["popen", "fork"])
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a job is killed")
    p.add_argument("--runs", default=str(ROOT / "docs" / "results" / "grid_runs"), help="the folder of the run records")
    p.add_argument("--out", default=str(ROOT / "outputs" / "grid_map"), help="job folders (not shipped)")
    p.add_argument("--docs", default=str(ROOT / "docs" / "results"), help="grid_map.{json,png} and benchmarks.md")
    p.add_argument("--no-wandb", action="store_true")
    p.add_argument("--wandb-project", default="lightning_pgc-benchmarks")
    return p.parse_args(argv)


def job_spec(job: cx.Job, args: argparse.Namespace, steps: int) -> dict[str, Any]:
    """The experiments-harness spec of one grid job (same delays, weights, split and streams for a seed)."""
    cost = cx.COSTS[job.cell.cost]
    strategy, kwargs, valve = job.arm.strategy(job.seed)
    spec: dict[str, Any] = {
        "strategy": strategy,
        "strategy_kwargs": kwargs,
        "devices": args.devices,
        "delay": job.cell.delay_model(args.devices),
        "delay_seed": job.seed,
        "compute_s_per_eval": cost.compute_s_per_eval,
        "seed": job.seed,
        "max_steps": steps,
        "batch_size": cost.batch_size,
        "lr": job.lr,
        # the recipe's momentum is left out, so the records made before momentum was swept stay valid
        "model": {
            "sync_train_loss": False,
            **dict(cost.model),
            **({"momentum": job.momentum} if job.momentum != cx.RECIPE_MOMENTUM else {}),
        },
        "check_val_every_n_epoch": 100_000,
        "val_every_n_steps": args.val_every,
        "sync_loss": False,
        "measure": True,
        "valve": valve,
        "start_method": args.start_method,
        "out": str(Path(args.out).resolve() / job.name),
    }
    if not args.no_wandb:
        spec["wandb"] = {
            "project": args.wandb_project,
            "group": f"map-n{args.devices}-{job.phase}",
            "name": job.name,
            "offline": True,
            "tags": [job.phase, job.cell.key, job.arm.family],
            "config": {
                "label": job.arm.label,
                "cell": job.cell.key,
                "phase": job.phase,
                "target_val_loss": args.target,
            },
        }
    return spec


def record_of(job: cx.Job, result: Any, target: float) -> dict[str, Any]:
    """A finished job as a record: the per-run row, the staleness/error terms the scheme logged, the curve."""
    cfg = single.Config(job.arm.family, max(job.arm.c - 1, 0), job.arm.c)
    run = single.read_run(cfg, job.seed, result)
    row = single.run_row(run, target, None)
    history = run.diagnostics
    terms: dict[str, list[float]] = {}
    for h in history:
        for k, v in h.items():
            if k.startswith(("pgc/staleness_", "pgc/bounded/err_")) and math.isfinite(v):
                terms.setdefault(k, []).append(v)
    row["error_decomposition"] = {k: statistics.fmean(v) for k, v in sorted(terms.items())}
    row["staleness_ratio"] = row["error_decomposition"].get("pgc/staleness_ratio", math.nan)
    if result.valves:  # the adaptive rule: what it did (identical on every rank)
        valve = result.valves[0]
        row["valve_actions"] = len(valve["events"])
        row["valve_final_scale"] = valve["scale"]
        row["valve_final_window"] = valve["window"]
    return cx.compact_record(row, run.val, run.ok, run.error)


def run_jobs(
    jobs: list[cx.Job], store: cx.Store, args: argparse.Namespace, steps_of: dict[str, int], budget: list[int]
) -> int:
    """Run the jobs without a matching record (while ``budget[0] > 0``); returns how many ran."""
    from pgc_lab.experiments import launch

    todo = []
    for job in jobs:
        spec = job_spec(job, args, steps_of[job.phase])
        previous = store.load(job, spec)
        if previous is not None and (previous["ok"] or not args.retry_failed):
            continue
        if args.only_cells and (
            job.cell.key not in args.only_cells
            if job.phase == "main"
            else job.cell.cost not in {k.split("-")[-1] for k in args.only_cells}
        ):
            continue
        todo.append((job, spec))
    ran, spent = 0, 0.0
    for job, spec in todo:
        if budget[0] <= 0:
            break
        wait_while_paused(args.pause_file)
        budget[0] -= 1
        started = time.monotonic()
        try:
            result = launch(spec, timeout=args.timeout, check=False)
            record = record_of(job, result, args.target)
        except Exception as err:  # a timeout or an unreadable job: recorded as failed, rerun by a later spec change
            record = cx.compact_record({}, [], False, f"{type(err).__name__}: {err}")
        record["job_wall_s"] = time.monotonic() - started
        store.save(job, spec, record)
        ran += 1
        spent += record["job_wall_s"]
        final = record["row"].get("final_val_loss", math.nan)
        left = len(todo) - ran  # of this phase, budget aside; the estimate is this sitting's mean job time
        print(
            f"[{job.phase}] {job.name}: {'ok' if record['ok'] else 'FAILED ' + record['error'][-200:]}, "
            f"final val loss {final}, job {record['job_wall_s']:.1f} s; {ran} done, {left} left "
            f"(~{left * spent / ran / 3600:.1f} h)",
            flush=True,
        )
    return ran


def wait_while_paused(pause_file: Optional[str]) -> None:
    """Block while ``pause_file`` exists (checked every 2 s), saying so once."""
    if not pause_file or not os.path.exists(pause_file):
        return
    print(f"paused: {pause_file} exists; the next job starts when it is removed", flush=True)
    while os.path.exists(pause_file):
        time.sleep(2.0)


def chosen_settings(sweep: list[cx.Job], store: cx.Store, args: argparse.Namespace) -> dict[tuple[str, str], Any]:
    """Each (cost, arm)'s (rate, momentum) by :func:`crossover.choose_setting` from its sweep records (None:
    unfinished)."""
    finals: dict[tuple[str, str], dict[cx.Setting, list[Optional[float]]]] = {}
    for job in sweep:
        rec = store.load(job, job_spec(job, args, args.sweep_steps))
        bucket = finals.setdefault((job.cell.cost, job.arm.key), {}).setdefault(job.setting, [])
        if rec is not None:
            bucket.append(rec["row"].get("final_val_loss") if rec["ok"] else None)
    return {key: cx.choose_setting(by_setting, len(args.sweep_seeds)) for key, by_setting in finals.items()}


def render(
    args: argparse.Namespace,
    arms: list[cx.GridArm],
    skipped: list[str],
    cells: list[cx.GridCell],
    sweep: list[cx.Job],
    store: cx.Store,
    setting_of: dict[tuple[str, str], Any],
    argv: list[str],
) -> dict[str, Any]:
    """grid_map.json, grid_map.png and the gridmap block of benchmarks.md from the records in the store."""
    main_jobs, _ = cx.plan_main(cells, arms, args.seeds, setting_of, args.round)
    records: dict[str, dict[str, dict[int, Any]]] = {}
    count = 0
    for job in main_jobs:
        rec = store.load(job, job_spec(job, args, args.steps))
        if rec is not None:
            records.setdefault(job.cell.key, {}).setdefault(job.arm.key, {})[job.seed] = rec
            count += 1
    summaries = {}
    for cell in cells:
        settings = {arm.key: setting_of.get((cell.cost, arm.key)) for arm in arms}
        summaries[cell.key] = cx.summarize_cell(records.get(cell.key, {}), arms, args.seeds, args.target, settings)
    sweep_done = sum(1 for job in sweep if store.load(job, job_spec(job, args, args.sweep_steps)) is not None)
    runs_folder = Path(args.runs).resolve()
    result = {
        "command": "WANDB_MODE=offline python benchmarks/grid.py " + " ".join(argv),
        "rendered": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{os.cpu_count()} CPU cores, no GPU",
        "runs_folder": os.path.relpath(runs_folder, ROOT) if runs_folder.is_relative_to(ROOT) else str(runs_folder),
        "records": count + sweep_done,
        "settings": {
            "devices": args.devices,
            "c": args.c,
            "round": args.round,
            "seeds": args.seeds,
            "steps": args.steps,
            "val_every": args.val_every,
            "target": args.target,
            "lrs": [args.lr] if args.no_sweep else args.lrs,
            "momenta": [cx.RECIPE_MOMENTUM] if args.no_sweep else args.momenta,
            "sweep_seeds": [] if args.no_sweep else args.sweep_seeds,
            "sweep_steps": 0 if args.no_sweep else args.sweep_steps,
            "sweep_delay": args.sweep_delay,
            "valve": cx.VALVE,
            "delay_models": {d: cx.DELAYS[d] for d in args.delays},
            "costs": {c: cx.COSTS[c].note for c in args.costs},
        },
        "delays": args.delays,
        "costs": args.costs,
        "cost_labels": {c: cx.COSTS[c].label for c in args.costs},
        "arms": [a.key for a in arms],
        "skipped": skipped,
        "sweep_runs_expected": len(sweep),
        "sweep_runs_finished": sweep_done,
        "chosen_setting": {
            f"{cost}/{arm}": None if setting is None else {"lr": setting[0], "momentum": setting[1]}
            for (cost, arm), setting in sorted(setting_of.items())
        },
        "cells": summaries,
    }
    write_report(
        Path(args.docs),
        "grid_map",
        result,
        block=(cx.render_markdown(result), cx.MARK_BEGIN, cx.MARK_END),
        markdown_name="benchmarks",
        title="# Benchmarks",
        heading="## The crossover map",
        figures={"grid_map.png": cx.plot_map(result)},
    )
    return result


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    arms, skipped = cx.arms_for(args.devices, args.c, args.families, args.adaptive)
    # cost-major, cheapest cost first, so that whole rows of the map complete early in an incremental run
    cells = [cx.GridCell(d, c) for c in sorted(args.costs, key=CHEAPEST_FIRST.index) for d in args.delays]
    store = cx.Store(Path(args.runs))
    steps_of = {"sweep": args.sweep_steps, "main": args.steps}
    sweep = (
        [] if args.no_sweep else cx.plan_sweep(cells, arms, args.lrs, args.sweep_seeds, args.sweep_delay, args.momenta)
    )
    budget = [args.max_jobs if args.max_jobs is not None else 10**9]
    if args.render_only:
        budget = [0]
    print(
        f"map grid: {len(arms)} arms x {len(cells)} cells x {len(args.seeds)} seeds "
        f"(+ {len(sweep)} sweep runs) on n = {args.devices}; records in {store.folder}",
        flush=True,
    )
    run_jobs(sweep, store, args, steps_of, budget)
    if args.no_sweep:
        setting_of: dict[tuple[str, str], Any] = {
            (cell.cost, arm.key): (args.lr, cx.RECIPE_MOMENTUM) for cell in cells for arm in arms
        }
    else:
        setting_of = chosen_settings(sweep, store, args)
    main_jobs, waiting = cx.plan_main(cells, arms, args.seeds, setting_of, args.round)
    run_jobs(main_jobs, store, args, steps_of, budget)
    result = render(args, arms, skipped, cells, sweep, store, setting_of, argv)
    complete = [k for k, c in result["cells"].items() if c["status"] != "incomplete"]
    print(
        f"sweep {result['sweep_runs_finished']}/{len(sweep)} runs; {len(waiting)} (cell, arm) pairs wait for "
        f"their sweep; complete cells: {len(complete)}/{len(cells)} {complete}"
    )
    for name in ("grid_map.json", "grid_map.png", "benchmarks.md"):
        print(f"wrote {Path(args.docs) / name}")
    return result
