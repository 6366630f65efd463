"""Steady-state step time of pgc vs ddp on 4 CPU ranks, with and without a slow rank, measured side by side.

    python benchmarks/step_time.py [--rounds 2] [--steps 150] [--slow-seconds 0.5]

Runs the four configurations interleaved (round 1: ddp, pgc, ddp+slow, pgc+slow; round 2: the same ...) so
machine noise hits all of them alike, and reports ratios of medians. The step time of a run is the median
interval between consecutive optimizer steps on rank 0 after the first ``--skip`` steps (no validation runs).
Writes docs/step_time.json, docs/step_time.md and docs/step_time.png, and prints every path it writes.

Targets (issue 2): pgc <= 1.10x ddp with no delay; with one rank 0.5 s slower per step, pgc <= 0.15x ddp with the
same slow rank and <= 1.5x ddp with no delay at all. Memory: message buffers stay bounded (high-water marks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.jobs import run_job  # noqa: E402  (the same launcher the tests use)


def step_time(curve: list[tuple[float, int, float]], skip: int) -> float:
    walls = [w for w, step, _ in curve if step > skip]
    return statistics.median(b - a for a, b in zip(walls, walls[1:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--slow-steps", type=int, default=30, help="steps of ddp with the slow rank (each >= slow)")
    p.add_argument("--slow-seconds", type=float, default=0.5)
    p.add_argument("--skip", type=int, default=10)
    p.add_argument("--out", default=str(ROOT / "outputs" / "step_time"))
    args = p.parse_args()

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    slow = f"slowranks(ranks=[3], seconds={args.slow_seconds})"
    configs = {
        "ddp": dict(strategy="ddp", max_steps=args.steps),
        "pgc": dict(strategy="pgc", max_steps=args.steps),
        "ddp_slow": dict(strategy="ddp", max_steps=args.slow_steps, delay=slow),
        "pgc_slow": dict(strategy="pgc", max_steps=args.steps, delay=slow),
    }
    times: dict[str, list[float]] = {k: [] for k in configs}
    buffers: dict[str, list[dict]] = {k: [] for k in configs}
    out = Path(args.out)
    console = Console()
    with Progress(console=console) as progress:
        task = progress.add_task("runs", total=args.rounds * len(configs))
        for r in range(args.rounds):
            for name, cfg in configs.items():
                progress.update(task, description=f"round {r + 1}: {name}")
                job = run_job(out / f"round{r}", name, timeout=900, devices=4, batch_size=16,
                              check_val_every_n_epoch=10_000, sync_loss=False, **cfg)
                times[name].append(step_time(job["curve"], args.skip))
                buffers[name].append({f"rank{x['rank']}": x["buffers"] for x in job["ranks"]})
                progress.advance(task)

    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {
        "pgc / ddp (no delay)": (med["pgc"] / med["ddp"], 1.10),
        "pgc_slow / ddp_slow": (med["pgc_slow"] / med["ddp_slow"], 0.15),
        "pgc_slow / ddp (no delay)": (med["pgc_slow"] / med["ddp"], 1.5),
    }
    result = {
        "command": "python benchmarks/step_time.py " + " ".join(sys.argv[1:]),
        "median_step_s": med,
        "per_round_step_s": times,
        "ratios": {k: {"ratio": v, "target_max": t, "met": v <= t} for k, (v, t) in ratios.items()},
        "buffer_high_water": buffers,
    }
    docs = ROOT / "docs"
    (docs / "step_time.json").write_text(json.dumps(result, indent=1))

    table = Table(title="steady-state step time (median over rounds)")
    for col in ("configuration", "step time (ms)", "per round (ms)"):
        table.add_column(col)
    for k in configs:
        table.add_row(k, f"{1000 * med[k]:.1f}", ", ".join(f"{1000 * t:.1f}" for t in times[k]))
    console.print(table)
    md = [
        "# Step time: pgc vs ddp",
        "",
        f"Produced by `{result['command'].strip()}` on 4 CPU ranks (gloo) of a 2-core machine, the digits CNN "
        f"(batch 16 per rank; no per-step collective besides the strategy's own), configurations interleaved over {args.rounds} rounds. Step time: median interval "
        f"between optimizer steps on rank 0 after step {args.skip}. `slow`: rank 3 sleeps {args.slow_seconds} s "
        "after every backward.",
        "",
        "| configuration | median step (ms) | per round (ms) |",
        "|---|---:|---|",
    ]
    md += [f"| {k} | {1000 * med[k]:.1f} | {', '.join(f'{1000 * t:.1f}' for t in times[k])} |" for k in configs]
    md += ["", "| ratio | measured | target | met |", "|---|---:|---:|---|"]
    md += [f"| {k} | {v:.3f} | <= {t} | {'yes' if v <= t else 'NO'} |" for k, (v, t) in ratios.items()]
    high = {k: max(max(b.values(), key=lambda d: d.get("mailbox_high_water", 0)).get("mailbox_high_water", 0)
                   for b in v) if v and v[0] else 0 for k, v in buffers.items() if k.startswith("pgc")}
    md += ["", "Message buffers (high-water marks, all ranks, all rounds): " +
           ", ".join(f"{k}: at most {h} aggregate(s) queued on one rank" for k, h in high.items()) +
           ". The coordinator's per-peer outboxes and inbox are in docs/step_time.json.", "",
           "![step time](step_time.png)", ""]
    (docs / "step_time.md").write_text("\n".join(md))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(list(configs), [1000 * med[k] for k in configs], color=["C0", "C1", "C0", "C1"])
    ax.set_ylabel("median step time (ms)")
    ax.set_yscale("log")
    ax.set_title("4 CPU ranks; 'slow' = rank 3 +%.1fs/step" % args.slow_seconds)
    fig.tight_layout()
    fig.savefig(docs / "step_time.png", dpi=110)
    for path in ("step_time.json", "step_time.md", "step_time.png"):
        console.print(f"wrote {docs / path}")
    for k, (v, t) in ratios.items():
        console.print(f"{k}: {v:.3f} (target <= {t}) {'met' if v <= t else 'NOT met'}")


if __name__ == "__main__":
    main()
