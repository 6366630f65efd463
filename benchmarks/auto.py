"""``pgc_auto`` against ``ddp`` and the fixed arms, on 4 CPU ranks, side by side: its cost when nothing is slow,
its time to target when a rank is, and how many versions its switches take.

    python benchmarks/auto.py                  # both parts, 2 rounds (about 30 min on 2 shared cores)
    python benchmarks/auto.py --rounds 1 --seeds 1

Part 1, no straggler: throughput (seconds per step, :func:`~pgc_lab.experiments.stats.seconds_per_step`)
of ``ddp``, the ``dgd`` arm fixed (``strategy="dgd"``) and ``pgc_auto``, MLPs of 1 M and 10 M parameters on
synthetic data (the minimal script of ``benchmarks/step_time.py``, written again here), and the switches
``pgc_auto`` made (the goal: none, and at most 1.03x ``dgd``'s seconds per step).

Part 2, stragglers: the digits CNN recipe (``digits_cnn.yaml``) through the experiments harness, every gradient
evaluation sleeping ``COMPUTE_S`` (``SimulatedCompute``: the digits CNN computes in a few milliseconds, so a sleep
stands for a heavier model; a sleeping rank frees a core, which flatters every arm alike), validation loss every
``VAL_EVERY`` steps on rank 0, time to the target ``TARGET`` (fixed before any run: the emulated map's late target
for the digits tasks). Scenarios: rank 3 persistently 2x slower (``slowranks`` of ``COMPUTE_S`` more), rank 3
4x slower (the same, 3 ``COMPUTE_S`` more), 4x slower for steps 40-120 then normal, and rare long stalls on every
rank (``spikes``). Arms: ``ddp``, the fixed
arms ``dgd``, ``ignore_stragglers`` (s = 1) and ``pgc`` (``pgc_cr``, s = 1), and ``pgc_auto`` with its defaults.
Reported: time to target of each arm, ``pgc_auto`` over ``ddp`` and over the best fixed arm (the fixed arm with the
least time to target in that scenario and seed), and the switches (version, arm) with their delays after the
slowness began and ended.

Jobs run interleaved (every scenario and arm once per round and seed), the 1-minute load average is recorded
before each job (``os.getloadavg``), and the machine is shared: state the load next to every number.
Writes docs/results/auto.json and docs/results/auto.md (:func:`render`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from pgc_lab.experiments.timing_model import TimingMLP
from pgc_lab.experiments.curves import at_index, first_crossing
from pgc_lab.experiments.launch import launch, launch_script
from pgc_lab.experiments.report import write_report
from pgc_lab.experiments.stats import seconds_per_step

from lightning_pgc.strategy.options import AutoOptions

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "results"
OUT = ROOT / "outputs" / "auto"

MODELS = {"1m": (1024, 1000, 4, 32), "10m": (1024, 10000, 4, 32)}  # input, hidden, classes, batch per rank
OVERHEAD_ARMS = ("ddp", "dgd", "pgc_auto")
OVERHEAD_STEPS, OVERHEAD_SKIP = 60, 10
OVERHEAD_GOAL = 1.03  # pgc_auto / dgd seconds per step

COMPUTE_S = 0.04  # seconds of simulated compute per gradient evaluation
TARGET = 0.3  # validation loss (the emulated map's late target for the digits tasks)
VAL_EVERY = 10
MAX_STEPS = 200
SCENARIOS = {
    "rank 3 2x slower": f"slowranks(ranks=[3], seconds={COMPUTE_S})",
    "rank 3 4x slower": f"slowranks(ranks=[3], seconds={3 * COMPUTE_S})",
    "rank 3 4x slower for steps 40-120": f"slowranks(ranks=[3], seconds={3 * COMPUTE_S}, steps=[40, 120])",
    "rare long stalls": "spikes(prob=0.01, low=1.0, high=2.0)",
}
SLOW_WINDOW = {  # versions the slowness starts and ends (None: it does not)
    "rank 3 2x slower": (0, None),
    "rank 3 4x slower": (0, None),
    "rank 3 4x slower for steps 40-120": (40, 120),
}
FIXED_ARMS = ("dgd", "ignore_stragglers", "pgc")
ARMS = ("ddp",) + FIXED_ARMS + ("pgc_auto",)
#: the strategy name each arm runs: the ``pgc`` arm is the uncorrected scheme, ``pgc_cr`` (the page says so)
STRATEGY_OF = {"pgc": "pgc_cr"}
GOALS = {"vs best fixed": 1.1, "vs ddp": 0.6}


# ------------------------------------------------------------------------------------------------ part 1
def run_worker(args: argparse.Namespace) -> None:
    """One fit of part 1 (this process is rank 0; Lightning re-launches the command for the other ranks)."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_pgc  # noqa: F401  (registers the strategy names)

    torch.set_num_threads(1)
    d_in, hidden, classes, batch = MODELS[args.model]

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            self.times.append(time.time())

    g = torch.Generator().manual_seed(0)
    samples = batch * args.devices * 8
    data = TensorDataset(torch.randn(samples, d_in, generator=g), torch.randint(0, classes, (samples,), generator=g))
    clock = Clock()
    strategy: Any = args.strategy
    if args.strategy != "ddp":
        from lightning_pgc import PGCStrategy

        scheme = {"dgd": "dgd", "pgc_auto": "auto"}[args.strategy]
        strategy = PGCStrategy(
            scheme=scheme,
            stragglers=0 if scheme == "dgd" else 1,
            diagnostics={"enabled": False},
            liveness={"timeout": 600.0},
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        callbacks=[clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(TimingMLP(d_in, hidden, classes), DataLoader(data, batch_size=batch, shuffle=True))
    st = trainer.strategy
    result = {
        "rank": trainer.global_rank,
        "times": clock.times,
        "params": sum(p.numel() for p in trainer.lightning_module.parameters()),
        "switches": [[v, a.label, b.label] for v, a, b in getattr(st, "auto_switches", [])],
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def overhead(rounds: int) -> dict[str, Any]:
    """Part 1: seconds per step with no straggler, interleaved."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for rnd in range(rounds):
        for model in MODELS:
            for arm in OVERHEAD_ARMS:
                key = f"{model}/{arm}"
                load = os.getloadavg()[0]
                argv = ["--strategy", arm, "--model", model, "--devices", "4", "--steps", str(OVERHEAD_STEPS)]
                ranks = launch_script(Path(__file__), argv, OUT / "overhead" / f"{key.replace('/', '_')}_{rnd}", 4)
                s = seconds_per_step([r["times"] for r in ranks], OVERHEAD_SKIP)
                runs.setdefault(key, []).append(
                    {
                        "s_per_step": s,
                        "load1": load,
                        "switches": len(ranks[0]["switches"]),
                        "params": ranks[0]["params"],
                    }
                )
                print(f"round {rnd} {key}: {s * 1000:.1f} ms/step (load {load:.1f})", flush=True)
    out: dict[str, Any] = {"runs": runs, "ratios": {}}
    for model in MODELS:
        for base in ("dgd", "ddp"):
            out["ratios"][f"{model}: pgc_auto / {base}"] = [
                a["s_per_step"] / b["s_per_step"] for a, b in zip(runs[f"{model}/pgc_auto"], runs[f"{model}/{base}"])
            ]
        out["ratios"][f"{model}: dgd / ddp"] = [
            a["s_per_step"] / b["s_per_step"] for a, b in zip(runs[f"{model}/dgd"], runs[f"{model}/ddp"])
        ]
    return out


# ------------------------------------------------------------------------------------------------ part 2
def job_spec(scenario: str, arm: str, seed: int, out: Path) -> dict[str, Any]:
    return {
        "out": str(out),
        "strategy": STRATEGY_OF.get(arm, arm),
        "start_method": "fork",
        "devices": 4,
        "max_steps": MAX_STEPS,
        "check_val_every_n_epoch": 1000,  # Lightning's validation never runs: ValidationCurve measures
        "max_epochs": -1,
        "val_every_n_steps": VAL_EVERY,
        "delay": SCENARIOS[scenario],
        "delay_seed": seed,
        "seed": seed,
        "compute_s_per_eval": COMPUTE_S,
        "strategy_kwargs": {"liveness": {"timeout": 60.0}} if arm != "ddp" else {},
    }


def time_to(val_curve: list[tuple[float, ...]], target: float) -> tuple[Optional[float], Optional[float]]:
    """(seconds, steps) at which the validation loss first reaches ``target`` (None: never)."""
    walls = [v[0] for v in val_curve]
    steps = [float(v[1]) for v in val_curve]
    crossing = first_crossing([v[2] for v in val_curve], target)
    return (None, None) if crossing is None else (at_index(walls, crossing), at_index(steps, crossing))


def stragglers(rounds: int, seeds: int) -> dict[str, Any]:
    """Part 2: time to target per scenario, arm and seed, interleaved."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {a: [] for a in ARMS} for s in SCENARIOS}
    for rnd in range(rounds):
        for seed in range(seeds):
            for scenario in SCENARIOS:
                for arm in ARMS:
                    name = f"{scenario.replace(' ', '_').replace(',', '')}_{arm}_s{seed}_r{rnd}"
                    load = os.getloadavg()[0]
                    res = launch(job_spec(scenario, arm, seed, OUT / "stragglers" / name), check=False)
                    row: dict[str, Any] = {"seed": seed, "round": rnd, "load1": load, "ok": res.ok}
                    if res.ok:
                        secs, steps = time_to(res.val_curve, TARGET)
                        ranks = [r for r in res.ranks if r is not None]
                        row.update(
                            {
                                "time_to_target_s": secs,
                                "steps_to_target": steps,
                                "fit_wall_s": res.fit_wall_s,
                                "identical": res.identical_replicas,
                                "switches": ranks[0].get("auto_switches") if ranks else None,
                                "final_val_loss": res.val_curve[-1][2] if res.val_curve else None,
                            }
                        )
                    else:
                        row["error"] = res.error[-300:]
                    runs[scenario][arm].append(row)
                    print(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'switches'})}", flush=True)
    return {"runs": runs, "summary": summarize(runs)}


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b <= 0 else a / b


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per scenario: each arm's times, pgc_auto's paired ratios, and the switch delays."""
    out: dict[str, Any] = {}
    for scenario, arms in runs.items():
        n = len(arms["pgc_auto"])
        vs_ddp, vs_best, best_names, delays_in, delays_out, switches = [], [], [], [], [], []
        for i in range(n):
            t = {a: arms[a][i].get("time_to_target_s") for a in ARMS}
            fixed = {a: t[a] for a in FIXED_ARMS if t[a] is not None}
            best = min(fixed, key=lambda a: fixed[a]) if fixed else None
            best_names.append(best)
            vs_ddp.append(_ratio(t["pgc_auto"], t["ddp"]))
            vs_best.append(_ratio(t["pgc_auto"], fixed.get(best) if best else None))
            sw = arms["pgc_auto"][i].get("switches") or []
            switches.append(len(sw))
            start, end = SLOW_WINDOW.get(scenario, (None, None))
            ins = [v for v, old, new in sw if old == "dgd"]
            outs = [v for v, old, new in sw if new == "dgd"]
            if start is not None and ins:
                delays_in.append(ins[0] - start)
            if end is not None and outs:
                delays_out.append(outs[-1] - end)
        out[scenario] = {
            "time_to_target_s": {a: [r.get("time_to_target_s") for r in arms[a]] for a in ARMS},
            "auto_vs_ddp": vs_ddp,
            "auto_vs_best_fixed": vs_best,
            "best_fixed": best_names,
            "switches": switches,
            "switch_in_delay_versions": delays_in,
            "switch_out_delay_versions": delays_out,
            "load1": [r["load1"] for a in ARMS for r in arms[a]],
        }
    return out


# ------------------------------------------------------------------------------------------------ the page
def _f(values: list[Any], digits: int = 2) -> str:
    return ", ".join("missed" if v is None else f"{v:.{digits}f}" for v in values) or "-"


#: what results files recorded before the part of stragglers kept its rule's options ran
EARLIER_RULE = "a window of 30 versions, patience 10, margin 10 %"


def _rule(options: Optional[dict[str, Any]]) -> str:
    """The sentence naming the rule ``pgc_auto`` ran: the options the results file recorded, else the earlier rule."""
    if options is None:
        return (
            f"`pgc_auto` ran the rule of that time ({EARLIER_RULE}), not today's change-point rule "
            "(docs/guide.md, pgc_auto)."
        )
    return "`pgc_auto` runs with its defaults (" + ", ".join(f"{k} {v:g}" for k, v in options.items()) + ")."


def render(res: dict[str, Any]) -> str:
    """docs/results/auto.md from the results file."""
    md = [
        "# `pgc_auto`: what it costs and what it saves",
        "",
        "<!-- generated by benchmarks/auto.py from docs/results/auto.json: do not edit -->",
        "",
        f"Measured with `{res['command']}`"
        + "".join(
            f" (its {part} part: `{res[part + '_command']}`)"
            for part in ("overhead", "stragglers")
            if res.get(part + "_command")
        )
        + f" on {res['machine']}, 4 CPU ranks over gloo; the machine was shared with "
        f"other jobs (1-minute load average {res['load1_min']:.1f} to {res['load1_max']:.1f} over the runs, "
        "recorded before each job). Arms ran interleaved, one of each per round and seed; every number below is one "
        "per round (or seed), never a median chosen afterwards.",
        "",
        "## No straggler: the cost of `pgc_auto` over the fixed `dgd` arm and over `ddp`",
        "",
        f"MLPs on synthetic data, {OVERHEAD_STEPS} steps, seconds per step after step {OVERHEAD_SKIP} (throughput). "
        f"Goal: `pgc_auto` at most {OVERHEAD_GOAL:g}x the fixed `dgd` arm, and no switch.",
        "",
        "| ratio | per round |",
        "|---|---|",
    ]
    ov = res["overhead"]
    md += [f"| {k} | {_f(v, 3)} |" for k, v in ov["ratios"].items()]
    md += ["", "| run | seconds per step | switches | load |", "|---|---|---|---|"]
    for key, rows in ov["runs"].items():
        md.append(
            f"| {key} | {_f([r['s_per_step'] for r in rows], 4)} | {', '.join(str(r['switches']) for r in rows)} | "
            f"{_f([r['load1'] for r in rows], 1)} |"
        )
    st = res["stragglers"]["summary"]
    md += [
        "",
        "## Stragglers: time to target, and the switches",
        "",
        f"The digits CNN recipe, every gradient evaluation {COMPUTE_S:g} s of simulated compute (a sleep, which frees "
        f"a core: on 2 shared cores that flatters every arm that waits less), validation loss every {VAL_EVERY} steps "
        f"on rank 0, target {TARGET:g}, at most {MAX_STEPS} steps. {_rule(res.get('stragglers_rule'))} The best "
        "fixed arm is the fastest of `dgd`, `ignore_stragglers` "
        "and `pgc` (`pgc_cr`, s = 1) in the same scenario and seed. Goals: within "
        f"{GOALS['vs best fixed']:g}x the best fixed arm, at most {GOALS['vs ddp']:g}x `ddp`.",
        "",
        "| scenario | arm | time to target (s), per run |",
        "|---|---|---|",
    ]
    for scenario, s in st.items():
        for arm, times in s["time_to_target_s"].items():
            md.append(f"| {scenario} | {arm} | {_f(times)} |")
    md += [
        "",
        "| scenario | pgc_auto / ddp | pgc_auto / best fixed | best fixed | switches | switch in after (versions) "
        "| switch out after (versions) |",
        "|---|---|---|---|---|---|---|",
    ]
    for scenario, s in st.items():
        md.append(
            f"| {scenario} | {_f(s['auto_vs_ddp'])} | {_f(s['auto_vs_best_fixed'])} | "
            f"{', '.join(str(b) for b in s['best_fixed'])} | {', '.join(str(x) for x in s['switches'])} | "
            f"{', '.join(str(x) for x in s['switch_in_delay_versions']) or '-'} | "
            f"{', '.join(str(x) for x in s['switch_out_delay_versions']) or '-'} |"
        )
    md += [
        "",
        "Switch delays count versions from the step the slowness began (or ended) to the first version run "
        "under the new arm.",
        "",
    ]
    return "\n".join(md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--model", default="1m")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=OVERHEAD_STEPS)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of part 1")
    parser.add_argument("--seeds", type=int, default=2, help="seeds of part 2 (one round each)")
    parser.add_argument("--part", choices=["both", "overhead", "stragglers"], default="both")
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    started = time.time()
    res: dict[str, Any] = {
        "command": "python benchmarks/auto.py " + " ".join(sys.argv[1:]),
        "machine": f"{os.cpu_count()} CPU cores",
    }
    previous = DOCS / "auto.json"
    if args.part != "both" and previous.exists():  # one part again: keep the other, and the command that ran it
        old = json.loads(previous.read_text())
        res.update({k: v for k, v in old.items() if k in ("overhead", "stragglers", "stragglers_rule")})
        kept = "overhead" if args.part == "stragglers" else "stragglers"
        res[f"{kept}_command"] = old.get(f"{kept}_command", old["command"])
    if args.part in ("both", "overhead"):
        res["overhead"] = overhead(args.rounds)
    if args.part in ("both", "stragglers"):
        res["stragglers"] = stragglers(1, args.seeds)  # seeds are the repeats here
        defaults = AutoOptions()
        res["stragglers_rule"] = {f: getattr(defaults, f) for f in ("margin", "threshold", "horizon")}
    loads = [r["load1"] for rows in res["overhead"]["runs"].values() for r in rows]
    loads += [x for s in res["stragglers"]["summary"].values() for x in s["load1"]]
    res["load1_min"], res["load1_max"] = min(loads), max(loads)
    res["wall_s"] = time.time() - started
    write_report(DOCS, "auto", res, newline=True)
    (DOCS / "auto.md").write_text(render(res))
    print(render(res))


if __name__ == "__main__":
    main()
