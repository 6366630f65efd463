"""The staleness safety valve (``StalenessValve``) on the digits recipe: where staleness hurts, and what the valve does.

    python benchmarks/safety_valve.py [--steps 200] [--lr 0.1] [--repeats 2]

Runs, on 4 real CPU processes, the digits CNN (SGD, momentum 0.9) at a learning rate that synchronous training
(``dgd``) handles but that is too large for deep pipelines: ``pgc_cr`` with ``s = 1`` (``c = 2``) and ``s = 3``
(``c = 4``: every code mixes gradients 0..3 steps old), each without and with
``StalenessValve(threshold=1.0, factor=0.5, check_every_n_steps=5)``. ``--repeats`` runs of every configuration
(seeds 0, 1, ...; PGC runs are not bit-reproducible across runs anyway: the straggler pattern is real timing).
Reports final validation accuracy/loss (full validation set after fit), the mean training loss of the last 20 steps,
the valve's actions, and whether the 4 replicas ended bit-identical. Writes docs/results/safety_valve.json,
docs/results/safety_valve.md and docs/results/safety_valve.png, and prints every path it writes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pgc_lab.experiments import launch
from pgc_lab.experiments.report import write_report

ROOT = Path(__file__).resolve().parents[1]

VALVE = {"threshold": 1.0, "factor": 0.5, "check_every_n_steps": 5, "min_scale": 1 / 64}


def configs(valve: dict) -> dict[str, dict]:
    return {
        "dgd (synchronous)": dict(strategy="dgd"),
        "pgc_cr s=1": dict(strategy="pgc", strategy_kwargs={"stragglers": 1}),
        "pgc_cr s=1 + valve": dict(strategy="pgc", strategy_kwargs={"stragglers": 1}, valve=valve),
        "pgc_cr s=3": dict(strategy="pgc", strategy_kwargs={"stragglers": 3}),
        "pgc_cr s=3 + valve": dict(strategy="pgc", strategy_kwargs={"stragglers": 3}, valve=valve),
    }


def run_one(out: Path, cfg: dict, args: argparse.Namespace, seed: int) -> dict:
    started = time.time()
    # validation: rank 0 on the whole validation set after the last step (ValidationCurve)
    job = launch(
        dict(
            out=str(out),
            devices=4,
            max_steps=args.steps,
            batch_size=16,
            lr=args.lr,
            seed=seed,
            delay=args.delay,
            check_val_every_n_epoch=10_000,
            val_every_n_steps=args.steps,
            diagnostics={"every_n_steps": 10},
            **cfg,
        ),
        timeout=900,
    )
    losses = [loss for _, _, loss in job.curve]
    valve = job.valves[0] if job.valves else None
    return {
        "seed": seed,
        "val_acc": job.val_curve[-1][3],
        "val_loss": job.val_curve[-1][2],
        "train_loss_last20": statistics.mean(losses[-20:]),
        "curve": [(step, loss) for _, step, loss in job.curve],
        "identical_replicas": job.identical_replicas,
        "valves_agree": all(
            v["events"] == job.valves[0]["events"] and v["checks"] == job.valves[0]["checks"] for v in job.valves
        ),
        "valve_events": [(e["step"], e["lr_scale"], e["ratio"]) for e in valve["events"]] if valve else [],
        "valve_checks": [(c["step"], c["ratio"], c["lr_scale"]) for c in valve["checks"]] if valve else [],
        "final_lr": valve["final_lrs"][0] if valve else args.lr,
        "fit_wall_s": job.fit_wall_s,
        "wall_s": time.time() - started,
    }


def plot(results: dict, args: argparse.Namespace) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    styles = {
        "dgd (synchronous)": ("black", "-"),
        "pgc_cr s=1": ("tab:blue", ":"),
        "pgc_cr s=1 + valve": ("tab:blue", "-"),
        "pgc_cr s=3": ("tab:red", ":"),
        "pgc_cr s=3 + valve": ("tab:red", "-"),
    }
    for name, runs in results.items():
        color, ls = styles[name]
        for i, run in enumerate(runs):
            steps = [s for s, _ in run["curve"]]
            loss = [l for _, l in run["curve"]]
            k = 10
            smooth = [statistics.mean(loss[max(0, j - k + 1) : j + 1]) for j in range(len(loss))]
            axes[0].plot(steps, smooth, color=color, ls=ls, lw=1.2, label=name if i == 0 else None)
            if run["valve_checks"]:
                cs = [c[0] for c in run["valve_checks"]]
                axes[1].semilogy(
                    cs,
                    [max(c[1], 1e-4) for c in run["valve_checks"]],
                    color=color,
                    ls=ls,
                    lw=1,
                    label=name if i == 0 else None,
                )
                axes[2].step(
                    cs,
                    [args.lr * c[2] for c in run["valve_checks"]],
                    where="post",
                    color=color,
                    lw=1.2,
                    label=name if i == 0 else None,
                )
    axes[0].set_title(f"training loss (mean of 10 steps), lr={args.lr}")
    axes[0].set_xlabel("step")
    axes[0].legend(fontsize=8)
    axes[1].axhline(VALVE["threshold"], color="gray", ls=":", label="threshold")
    axes[1].set_title("valve: L_hat^2 |b_t - b_(t-(c-1))|^2 / |g_hat|^2")
    axes[1].set_xlabel("step")
    axes[1].legend(fontsize=8)
    axes[2].set_title("learning rate set by the valve")
    axes[2].set_xlabel("step")
    axes[2].set_yscale("log")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    return fig


def render(payload: dict) -> str:
    """The page, from what ``docs/results/safety_valve.json`` holds (tests/test_generated_pages.py renders it again)."""
    args, valve, rows = payload["args"], payload["valve"], payload["summary"]

    def fmt(values: list, spec: str = ".3f") -> str:
        return " / ".join("-" if v is None else format(v, spec) for v in values)

    lines = [
        "# Staleness safety valve: measured effect",
        "",
        f"Command: `{payload['command']}` (4 CPU ranks, digits CNN, SGD momentum 0.9, lr {args['lr']}, "
        f"{args['steps']} steps, batch 16 per partition, delays `{args['delay']}`).",
        f"Valve: `StalenessValve(threshold={valve['threshold']}, factor={valve['factor']}, "
        f"check_every_n_steps={valve['check_every_n_steps']}, min_scale=1/{round(1 / valve['min_scale'])})`. One value per repeat (seed 0 / 1 / ...). "
        "Every number below is in [safety_valve.json](safety_valve.json) (`summary`).",
        "",
        "| configuration | val acc | val loss | train loss (last 20) | final lr | valve actions (first at step) | "
        "replicas identical | valve decisions equal on all ranks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        first = " / ".join("-" if s is None else str(int(s)) for s in r["first_action_step"])
        lines.append(
            f"| {r['config']} | {fmt(r['val_acc'])} | {fmt(r['val_loss'])} | {fmt(r['train_loss_last20'])} | "
            f"{fmt(r['final_lr'], '.4g')} | {fmt(r['valve_actions'], 'd')} ({first}) | {r['identical_replicas']} | "
            f"{r['valves_agree_on_every_rank']} |"
        )
    lines += ["", "![safety valve](safety_valve.png)", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--delay", default="lognormal(median=0.003, sigma=1.0)")
    p.add_argument("--out", default=str(ROOT / "outputs" / "safety_valve"))
    p.add_argument("--docs", default=str(ROOT / "docs" / "results"))
    args = p.parse_args()
    out, docs = Path(args.out), Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)

    results: dict[str, list[dict]] = {name: [] for name in configs(VALVE)}
    for seed in range(args.repeats):  # interleaved: machine noise hits every configuration alike
        for name, cfg in configs(VALVE).items():
            run = run_one(
                out
                / f"seed{seed}"
                / name.replace(" ", "_").replace("(", "").replace(")", "").replace("+", "").replace("=", ""),
                cfg,
                args,
                seed,
            )
            results[name].append(run)
            print(
                f"seed {seed} {name:22s} val_acc {run['val_acc']:.3f}  val_loss {run['val_loss']:.3f}  "
                f"train(last 20) {run['train_loss_last20']:.3f}  valve {run['valve_events']}  "
                f"identical {run['identical_replicas']}",
                flush=True,
            )

    rows = []
    for name, runs in results.items():
        rows.append(
            {
                "config": name,
                "val_acc": [r["val_acc"] for r in runs],
                "val_loss": [r["val_loss"] for r in runs],
                "train_loss_last20": [r["train_loss_last20"] for r in runs],
                "final_lr": [r["final_lr"] for r in runs],
                "valve_actions": [len(r["valve_events"]) for r in runs],
                "first_action_step": [r["valve_events"][0][0] if r["valve_events"] else None for r in runs],
                "identical_replicas": all(r["identical_replicas"] for r in runs),
                "valves_agree_on_every_rank": all(r["valves_agree"] for r in runs),
                "fit_wall_s": [r["fit_wall_s"] for r in runs],
            }
        )
    command = "python benchmarks/safety_valve.py " + " ".join(sys.argv[1:])
    payload = {"command": command.strip(), "args": vars(args), "valve": VALVE, "summary": rows, "runs": results}
    page = render(payload)
    written = write_report(docs, "safety_valve", payload, page=page, figures={"safety_valve.png": plot(results, args)})
    for w in written:
        print(w)


if __name__ == "__main__":
    main()
