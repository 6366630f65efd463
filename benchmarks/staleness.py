"""Staleness corrections measured: steps and time to target of PGC c = 2 with each correction, against ``dgd``.

    WANDB_MODE=offline python benchmarks/staleness.py [--tune-seeds 10] [--seeds 0 1 2] [--max-jobs N]

The map grid's real-compute job (``DigitsCNN(width=256)``, 1.7M parameters, batch 16 per partition, real
convolution compute, no sleep) on ``--devices`` CPU ranks under one straggler model (``--delay``, default the map's
``one slow rank``). Arms: ``dgd`` and ``--scheme`` (default ``pgc_fr``, ``c = 2``) with each
``staleness_correction``. Every arm is tuned the same way: each ``(effective rate, momentum)`` of the grid
(``lr = rate * (1 - momentum)``), ``--tune-steps`` steps on the ``--tune-seeds`` (disjoint from the evaluation
seeds), scored by time to the target validation loss (not reached: last; ties: final validation loss). The chosen
setting then runs ``--steps`` steps on every ``--seeds``. For a seed every arm sees the same delays, initial weights,
split and mini-batch streams. Under ``momentum`` the grid's momentum is the one the user sets; the strategy lowers it.

Each finished job is a JSON record in ``--runs`` (reused while its spec is unchanged; interrupt and rerun to go
on). Writes ``docs/results/staleness.json`` and ``docs/results/staleness.md`` (the table, paired ratios to ``dgd`` with 95 % t
intervals over the evaluation seeds, the tuning scores, the machine and the wall time). ``--render`` rewrites only
the page from the shipped JSON (no job, no record), e.g. after a change of the page's layout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

from pgc_lab.experiments.crossover import DELAYS
from pgc_lab.experiments.report import write_json, write_report
from pgc_lab.experiments.runs import Config, read_run, run_row
from pgc_lab.experiments.spec import current_kwargs, current_spec
from pgc_lab.experiments.stats import paired_t_interval

ROOT = Path(__file__).resolve().parents[1]
CORRECTIONS = ("none", "momentum", "lookahead", "delay_compensation")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument(
        "--scheme",
        default="pgc_fr",
        choices=["pgc_fr", "pgc_cr", "bounded"],
        help="bounded: replication 2 and window --c",
    )
    p.add_argument("--report", default="staleness", help="writes docs/<report>.json and docs/<report>.md")
    p.add_argument("--c", type=int, default=2)
    p.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=CORRECTIONS)
    p.add_argument(
        "--lookahead-steps",
        type=float,
        nargs="*",
        default=[],
        help="extra look-ahead arms with these lookahead_steps (the plain arm runs at the window's mean age, (c - 1)/2; bounded: its default)",
    )
    p.add_argument("--delay", default="one slow rank", choices=list(DELAYS))
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0], help="effective rates lr / (1 - momentum)")
    p.add_argument("--momenta", type=float, nargs="+", default=[0.0, 0.9])
    p.add_argument("--tune-seeds", type=int, nargs="+", default=[10])
    p.add_argument("--tune-steps", type=int, default=100)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--val-every", type=int, default=5)
    p.add_argument("--target", type=float, default=0.3)
    p.add_argument("--max-jobs", type=int, default=None)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--runs", default=str(ROOT / "outputs" / "staleness" / "records"))
    p.add_argument("--out", default=str(ROOT / "outputs" / "staleness" / "jobs"))
    p.add_argument("--docs", default=str(ROOT / "docs" / "results"))
    p.add_argument(
        "--render-only", action="store_true", help="no new jobs: rebuild the report from the job records in --runs"
    )
    p.add_argument(
        "--render",
        action="store_true",
        help="no jobs and no records: rewrite docs/<report>.md from the shipped docs/<report>.json",
    )
    return p.parse_args(argv)


def arms(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    """``(label, strategy, strategy_kwargs)`` of every arm."""
    out: list[tuple[str, str, dict[str, Any]]] = [("dgd", "dgd", {})]
    strategy = "bounded_staleness" if args.scheme == "bounded" else args.scheme
    bounded = args.scheme == "bounded"
    base: dict[str, Any] = {"coordinator": {"staleness": args.c}} if bounded else {"stragglers": args.c - 1}
    for kind in args.corrections:
        coding: dict[str, Any] = {"staleness_correction": kind}
        if kind == "lookahead" and args.scheme != "bounded":  # the window's mean age, named (not the default c - 1)
            coding["lookahead_steps"] = (args.c - 1) / 2
        out.append((f"{args.scheme} c={args.c} {kind}", strategy, {**base, "coding": coding}))
    for k in args.lookahead_steps:
        coding = {"staleness_correction": "lookahead", "lookahead_steps": k}
        out.append((f"{args.scheme} c={args.c} lookahead k={k:g}", strategy, {**base, "coding": coding}))
    return out


def coding_of(arm: dict[str, Any]) -> dict[str, Any]:
    """The ``coding`` group of a recorded arm's strategy kwargs (older records name its fields flat)."""
    return current_kwargs(arm["kwargs"]).get("coding", {})


def spec_of(
    args: argparse.Namespace,
    strategy: str,
    kwargs: dict[str, Any],
    lr: float,
    momentum: float,
    seed: int,
    steps: int,
    name: str,
) -> dict[str, Any]:
    return {
        "strategy": strategy,
        "strategy_kwargs": {"seed": seed, **kwargs},
        "devices": args.devices,
        "delay": DELAYS[args.delay].format(last=args.devices - 1),
        "delay_seed": seed,
        "compute_s_per_eval": 0.0,
        "seed": seed,
        "max_steps": steps,
        "batch_size": 16,
        "lr": lr,
        "model": {"sync_train_loss": False, "width": 256, "momentum": momentum},
        "check_val_every_n_epoch": 100_000,
        "val_every_n_steps": args.val_every,
        "sync_loss": False,
        "measure": True,
        "start_method": "popen",
        "out": str(Path(args.out).resolve() / name),
    }


def job_name(label: str, lr: float, momentum: float, seed: int, phase: str) -> str:
    return f"{phase}__{label.replace(' ', '_').replace('=', '').replace('.', 'p')}__lr{lr:g}__m{momentum:g}__seed{seed}"


JOB_SECONDS: list[float] = []  # launch-to-exit seconds of every job this report uses


def run_or_load(args: argparse.Namespace, name: str, spec: dict[str, Any], budget: list[int]) -> Optional[dict]:
    """The record of a job: read back if its spec is unchanged, else run it (while the budget lasts)."""
    path = Path(args.runs) / f"{name}.json"
    if path.exists():
        record = json.loads(path.read_text())
        if current_spec(record["spec"]) == current_spec({k: v for k, v in spec.items() if k != "out"}):
            JOB_SECONDS.append(record["ran_s"])
            return record
    if args.render_only or (budget[0] is not None and budget[0] <= 0):
        return None
    from pgc_lab.experiments import launch

    if budget[0] is not None:
        budget[0] -= 1
    started = time.monotonic()
    result = launch(spec, check=False, timeout=args.timeout)
    kw = current_kwargs(spec["strategy_kwargs"])
    c = kw.get("coordinator", {}).get("staleness", kw.get("stragglers", 0) + 1)
    cfg = Config(spec["strategy"], c - 1, c)
    run = read_run(cfg, spec["seed"], result)
    row = run_row(run, args.target, None)
    keep = (
        "status",
        "reached",
        "time_to_target_s",
        "steps_to_target",
        "fit_wall_s",
        "steps",
        "final_val_loss",
        "final_val_acc",
        "replicas_identical",
        "mean_age",
        "max_age",
        "job_wall_s",
    )
    record = {
        "name": name,
        "spec": {k: v for k, v in spec.items() if k != "out"},
        "row": {k: row.get(k) for k in keep},
        "error": run.error,
        "val": [[round(w, 3), s, round(l, 5)] for w, s, l, _ in run.val],
        "ran_s": time.monotonic() - started,
    }
    write_json(path, record)
    JOB_SECONDS.append(record["ran_s"])
    r = record["row"]
    print(
        f"{name}: ok={r['status']} steps_to_target={r.get('steps_to_target')} "
        f"time_to_target={r.get('time_to_target_s')} final={r.get('final_val_loss')} "
        f"identical={r.get('replicas_identical')} ({record['ran_s']:.0f} s)",
        flush=True,
    )
    return record


def score(record: Optional[dict]) -> tuple[float, float]:
    """Tuning score: time to target, then final validation loss (lower is better; failed or missing: worst)."""
    if record is None or record["row"]["status"] != "ok":
        return (math.inf, math.inf)
    r = record["row"]
    t = r["time_to_target_s"] if r.get("reached") else math.inf
    loss = r["final_val_loss"] if r["final_val_loss"] is not None and math.isfinite(r["final_val_loss"]) else math.inf
    return (t, loss)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.render:
        saved = json.loads((Path(args.docs) / f"{args.report}.json").read_text())
        write_report(Path(args.docs), args.report, saved, page=render(saved))  # the JSON as it was read
        return saved
    budget = [args.max_jobs]
    started = time.monotonic()
    grid = [(round(rate * (1.0 - m), 10), m) for m in args.momenta for rate in args.rates]
    result: dict[str, Any] = {
        "command": "WANDB_MODE=offline python benchmarks/staleness.py "
        + shlex.join(a for a in (argv or sys.argv[1:]) if a != "--render-only"),
        "machine": f"{os.cpu_count()} CPU cores shared with other work, no GPU",
        "settings": {
            k: v
            for k, v in vars(args).items()
            if k not in ("runs", "out", "docs", "render_only", "render", "max_jobs", "timeout")
        },
        "delay_model": DELAYS[args.delay].format(last=args.devices - 1),
        "grid": grid,
        "arms": [],
        "complete": True,
    }
    for label, strategy, kwargs in arms(args):
        tuning = []
        for lr, m in grid:
            recs = [
                run_or_load(
                    args,
                    job_name(label, lr, m, s, "tune"),
                    spec_of(args, strategy, kwargs, lr, m, s, args.tune_steps, job_name(label, lr, m, s, "tune")),
                    budget,
                )
                for s in args.tune_seeds
            ]
            scores = [score(r) for r in recs]
            mean_score = (statistics.fmean(s[0] for s in scores), statistics.fmean(s[1] for s in scores))
            tuning.append(
                {
                    "lr": lr,
                    "momentum": m,
                    "score": mean_score,
                    "done": all(r is not None for r in recs),
                    "steps_to_target": [r["row"]["steps_to_target"] if r else None for r in recs],
                }
            )
        arm = {"label": label, "strategy": strategy, "kwargs": kwargs, "tuning": tuning, "runs": []}
        result["arms"].append(arm)
        if not all(t["done"] for t in tuning):
            result["complete"] = False
            continue
        best = min(tuning, key=lambda t: t["score"])
        arm["chosen"] = {"lr": best["lr"], "momentum": best["momentum"]}
        for s in args.seeds:
            name = job_name(label, best["lr"], best["momentum"], s, "eval")
            rec = run_or_load(
                args, name, spec_of(args, strategy, kwargs, best["lr"], best["momentum"], s, args.steps, name), budget
            )
            if rec is None:
                result["complete"] = False
                continue
            arm["runs"].append({"seed": s, **rec["row"], "val": rec["val"]})
    summarize(result, args)
    result["wall_s_this_invocation"] = time.monotonic() - started
    result["jobs"] = len(JOB_SECONDS)
    result["jobs_wall_s_sum"] = sum(JOB_SECONDS)
    result["rendered"] = time.strftime("%Y-%m-%d %H:%M")
    result["overhead"] = correction_overhead_ms()
    write_report(Path(args.docs), args.report, result, page=render(result))
    print(render(result))
    return result


def correction_overhead_ms(width: int = 256, steps: int = 20) -> dict[str, float]:
    """Milliseconds per step that the look-ahead and delay-compensation bookkeeping add on one rank (1 thread), at the
    job's model size: snapshot, shift and restore; snapshot and one corrected stale entry (c = 2)."""
    import torch

    from lightning_pgc.examples.digits import DigitsCNN
    from lightning_pgc.staleness import StalenessCorrection

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    params = list(DigitsCNN(width=width).parameters())
    numel = sum(p.numel() for p in params)
    out = {"parameters": float(numel)}
    try:
        look = StalenessCorrection("lookahead", 0.5)
        dc = StalenessCorrection("delay_compensation", 0.5, window=2)
        entries = {0: torch.randn(numel + 1), 1: torch.randn(numel + 1)}
        for t in range(2):
            look.begin_step(t, params)
            dc.begin_step(t, params)
        start = time.perf_counter()
        for t in range(2, 2 + steps):
            look.begin_step(t, params)
            with look.shifted(t, params):
                pass
        out["lookahead_ms"] = 1000 * (time.perf_counter() - start) / steps
        start = time.perf_counter()
        for t in range(2, 2 + steps):
            dc.begin_step(t, params)
            dc.compensate(entries, {0: t - 1, 1: t}, t, numel)
        out["delay_compensation_ms"] = 1000 * (time.perf_counter() - start) / steps
    finally:
        torch.set_num_threads(threads)
    return out


def _paired(arm: dict[str, Any], base: dict[str, Any], key: str) -> Optional[dict[str, float]]:
    """Geometric-mean ratio ``arm / base`` of ``key`` (``step_cost_s``: fit wall / steps) over the seeds both have,
    with its 95 % paired t interval (None below 2 seeds)."""
    pairs = []
    for r in arm["runs"]:
        b = next((x for x in base["runs"] if x["seed"] == r["seed"]), None)
        if b is None:
            continue
        mine = r["fit_wall_s"] / r["steps"] if key == "step_cost_s" else r.get(key)
        theirs = b["fit_wall_s"] / b["steps"] if key == "step_cost_s" else b.get(key)
        if _finite(mine) and _finite(theirs) and mine > 0 and theirs > 0:
            pairs.append((mine, theirs))
    if len(pairs) < 2:
        return None
    iv = paired_t_interval([p[0] for p in pairs], [p[1] for p in pairs], ratio=True)
    return {"mean": iv.estimate, "low": iv.low, "high": iv.high, "seeds": len(pairs)}


def summarize(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Per arm: mean steps / time to target over the seeds; paired ratios to dgd and to the uncorrected arm, with
    95 % t intervals (seeds that did not reach the target drop out of the to-target ratios)."""
    base = next((a for a in result["arms"] if a["label"] == "dgd"), None)
    plain = next((a for a in result["arms"] if coding_of(a).get("staleness_correction") == "none"), None)
    for arm in result["arms"]:
        runs = arm["runs"]
        arm["reached"] = sum(1 for r in runs if r.get("reached"))
        for key in ("steps_to_target", "time_to_target_s", "final_val_loss", "fit_wall_s"):
            vals = [r[key] for r in runs if _finite(r.get(key))]
            arm[key] = statistics.fmean(vals) if vals else None
        arm["replicas_identical"] = all(r.get("replicas_identical") for r in runs) if runs else None
        arm["step_cost_s"] = (
            statistics.fmean(r["fit_wall_s"] / r["steps"] for r in runs if r.get("steps")) if runs else None
        )
        if base is not None and arm is not base:
            arm["steps_ratio"] = _paired(arm, base, "steps_to_target")
            arm["time_ratio"] = _paired(arm, base, "time_to_target_s")
            arm["step_cost_ratio"] = _paired(arm, base, "step_cost_s")
        if plain is not None and arm is not plain and arm is not base:
            arm["steps_vs_none"] = _paired(arm, plain, "steps_to_target")
            arm["time_vs_none"] = _paired(arm, plain, "time_to_target_s")


def _f(x: Any, spec: str = ".1f") -> str:
    return format(x, spec) if _finite(x) else "-"


def _ratio(iv: Optional[dict]) -> str:
    if not iv:
        return "-"
    return f"{iv['mean']:.2f}x [{iv['low']:.2f}, {iv['high']:.2f}]"


def render(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        "# Staleness corrections, measured",
        "",
        f"<!-- generated by benchmarks/staleness.py from docs/results/{s['report']}.json; rerun it to update -->",
        "",
        f"Command: `{result['command']}`" + ("" if result["complete"] else " (**incomplete**: some jobs not run)"),
        "",
        f"- {result['jobs']} jobs, {result['jobs_wall_s_sum'] / 60:.1f} minutes of machine time in all (launch to exit, "
        f"one job at a time), rendered {result['rendered']}.",
        f"- {s['devices']} CPU ranks (gloo) on {result['machine']}; the map grid's real-compute job "
        "(`DigitsCNN(width=256)`, 1.7M parameters, batch 16 per rank and partition, no sleep).",
        f"- Delay model (`{s['delay']}`, delay seed = seed): `{result['delay_model']}`.",
        f"- Tuning, the same for every arm: effective rates {s['rates']} x momenta {s['momenta']} "
        f"(`lr = rate * (1 - momentum)`), {s['tune_steps']} steps on seed(s) {s['tune_seeds']}, scored by time to "
        f"validation loss {s['target']} (then final loss). Evaluation: the chosen setting, {s['steps']} steps, seeds "
        f"{s['seeds']} (disjoint from the tuning seeds). Validation every {s['val_every']} steps.",
        f"- Bookkeeping per step and rank, measured at rendering on this machine ({result['overhead']['parameters']:.0f} "
        f"parameters, 1 thread): look-ahead {result['overhead']['lookahead_ms']:.1f} ms, delay compensation "
        f"{result['overhead']['delay_compensation_ms']:.1f} ms.",
        "- Look-ahead's extrapolation `k`: "
        + "; ".join(
            f"`{a['label']}` "
            + (
                f"k = {coding_of(a)['lookahead_steps']:g}"
                if "lookahead_steps" in coding_of(a)
                else "k = the window's mean age (`(c-1)/2` for pgc, `(n - fresh)/n` for bounded)"
            )
            for a in result["arms"]
            if coding_of(a).get("staleness_correction") == "lookahead"
        )
        + ".",
        "- Ratios: paired per seed against `dgd`, geometric mean with a 95 % t interval over the evaluation seeds. "
        f"Every number here is in `docs/results/{s['report']}.json`.",
        "",
        "| arm | chosen lr, momentum | reached | steps to target | time to target (s) | steps vs dgd | "
        "time vs dgd | step cost vs dgd | steps vs none | time vs none | final val loss | replicas identical |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for a in result["arms"]:
        chosen = a.get("chosen")
        setting = f"{chosen['lr']:g}, {chosen['momentum']:g}" if chosen else "-"
        lines.append(
            f"| {a['label']} | {setting} | "
            f"{a.get('reached', 0)}/{len(a['runs'])} | {_f(a.get('steps_to_target'))} | "
            f"{_f(a.get('time_to_target_s'))} | {_ratio(a.get('steps_ratio'))} | {_ratio(a.get('time_ratio'))} | "
            f"{_ratio(a.get('step_cost_ratio'))} | {_ratio(a.get('steps_vs_none'))} | "
            f"{_ratio(a.get('time_vs_none'))} | {_f(a.get('final_val_loss'), '.3f')} | {a.get('replicas_identical')} |"
        )
    lines += [
        "",
        "Tuning scores (time to target in s on the tuning seeds; `inf`: not reached):",
        "",
        "| arm | " + " | ".join(f"lr {lr:g}, m {m:g}" for lr, m in result["grid"]) + " |",
        "|---|" + "---:|" * len(result["grid"]),
    ]
    for a in result["arms"]:
        cells = []
        for t in a["tuning"]:
            cells.append(
                (
                    "-"
                    if not t["done"]
                    else (f"{t['score'][0]:.1f}" if math.isfinite(t["score"][0]) else f"inf (loss {t['score'][1]:.2f})")
                )
            )
        lines.append(f"| {a['label']} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
