"""A 20 s stall on one rank: does anyone wait? pgc vs ddp, a 10 M-parameter MLP on 4 CPU ranks (gloo).

    python benchmarks/stall.py              # 2 rounds (about 8 min on 2 cores)
    python benchmarks/stall.py --rounds 1 --steps 30 --stall-seconds 5   # a smoke run, not for docs

Per round, four runs side by side: pgc and ddp, each without and with a :class:`~lightning_pgc.callbacks.faults.Stall` of
``--stall-seconds`` on rank 2 at step ``--stall-step``. For each run: the *other* ranks' seconds per step
(throughput from step 5 to their last step), the stalled rank's skipped steps and state transfers, its peak
RSS and mailbox high-water mark, and whether every replica ended identical. Runs the worker of
``benchmarks/step_time.py`` through :func:`pgc_lab.experiments.launch.launch_script`. Writes docs/results/stall.json
and docs/results/stall.md (every number in the .md is in the .json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from pgc_lab.experiments.launch import launch_script
from pgc_lab.experiments.report import write_report
from pgc_lab.experiments.stats import seconds_per_step

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "results"
STEP_TIME = Path(__file__).with_name("step_time.py")  # its --worker mode: one fit of an MLP on synthetic data
STALLED = 2


def others_seconds_per_step(job: dict, skip: int) -> float:
    """Wall time from every non-stalled rank past step ``skip`` to the last of them done, per step."""
    return seconds_per_step([r["times"] for r in job["ranks"] if r["rank"] != STALLED], skip)


def summarize(job: dict, skip: int) -> dict:
    stalled = job["ranks"][STALLED]
    table = job["ranks"][0]["rank_stats"] or []
    return {
        "others_s_per_step": others_seconds_per_step(job, skip),
        "replicas_identical": len({r["checksum"] for r in job["ranks"]}) == 1,
        "stalled_skipped_steps": stalled["skipped"],
        "stalled_rejoined": table[STALLED]["rejoined"] if table else None,
        "stalled_peak_rss_mb": stalled["peak_rss_mb"],
        "others_peak_rss_mb": max(r["peak_rss_mb"] for r in job["ranks"] if r["rank"] != STALLED),
        "stalled_mailbox_high_water": stalled["buffers"].get("mailbox_high_water"),
        # how long the others' last step preceded the stalled rank's (what fit's common end waits for)
        "end_wait_s": stalled["times"][-1] - max(r["times"][-1] for r in job["ranks"] if r["rank"] != STALLED),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--stall-step", type=int, default=10)
    p.add_argument("--stall-seconds", type=float, default=20.0)
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "outputs" / "stall"))
    p.add_argument("--note", default="", help="what else ran on the machine, for the record")
    p.add_argument(
        "--from-json", action="store_true", help="only rewrite docs/results/stall.md from docs/results/stall.json"
    )
    args = p.parse_args()
    if args.from_json:
        result = json.loads((DOCS / "stall.json").read_text())
        write_report(DOCS, "stall", result, page=render_markdown(result))
        return
    load_before = os.getloadavg()[0]

    from rich.progress import Progress

    configs = {  # name -> (strategy, stall seconds)
        "ddp": ("ddp", 0.0),
        "ddp_stall": ("ddp", args.stall_seconds),
        "pgc": ("pgc_cr", 0.0),
        "pgc_stall": ("pgc_cr", args.stall_seconds),
    }
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    started = time.time()
    with Progress() as progress:
        task = progress.add_task("runs", total=args.rounds * len(configs))
        for r in range(args.rounds):
            for name, (strategy, seconds) in configs.items():
                progress.update(task, description=f"round {r + 1}: {name}")
                worker = ["--strategy", strategy, "--model", "10m", "--devices", "4", "--steps", str(args.steps)]
                worker += ["--slow-rank", str(STALLED), "--stall-step", str(args.stall_step)]
                worker += ["--stall-seconds", str(seconds)]
                ranks = launch_script(STEP_TIME, worker, Path(args.out) / f"round{r}" / name, 4)
                runs[name].append(summarize({"ranks": ranks}, args.skip))
                progress.advance(task)
    growth = {
        s: [a["others_s_per_step"] / b["others_s_per_step"] for a, b in zip(runs[f"{s}_stall"], runs[s])]
        for s in ("pgc", "ddp")
    }
    result = {
        "command": "python benchmarks/stall.py " + " ".join(sys.argv[1:]),
        "machine": f"{os.cpu_count()} CPU cores, gloo, 4 ranks, {args.rounds} interleaved rounds",
        "minutes": (time.time() - started) / 60,
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "note": args.note,
        "steps": args.steps,
        "stall_step": args.stall_step,
        "stall_seconds": args.stall_seconds,
        "skip": args.skip,
        "stalled_rank": STALLED,
        "runs": runs,
        "others_step_growth": {s: {"per_round": v, "median": statistics.median(v)} for s, v in growth.items()},
    }
    write_report(DOCS, "stall", result, page=render_markdown(result))
    for s, v in result["others_step_growth"].items():
        print(
            f"{s}: others' seconds per step with / without the stall: {v['median']:.3f} "
            f"(per round {', '.join(f'{x:.3f}' for x in v['per_round'])})"
        )


def _rss(row: dict) -> str:
    return f"{row['stalled_peak_rss_mb']:.0f} / {row['others_peak_rss_mb']:.0f}"


def render_markdown(res: dict) -> str:
    def fmt(values: list, digits: int = 3) -> str:
        return ", ".join("-" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v)) for v in values)

    md = [
        "# A 20 s stall on one rank",
        "",
        f"Produced by `{res['command'].strip()}` ({res['machine']}; {res['minutes']:.0f} min); every number below "
        f"is in docs/results/stall.json. A 10 M-parameter MLP (1024-10000-4, batch 32 per rank, SGD), {res['steps']} "
        f"steps; in the `_stall` runs rank {res['stalled_rank']}'s training thread sleeps "
        f"{res['stall_seconds']:g} s at step {res['stall_step']} (`lightning_pgc.callbacks.faults.Stall`; its process and "
        "background threads stay alive). Seconds per step are the *other* ranks' throughput from step "
        f"{res['skip']} to their last step. 4 ranks share 2 cores, so while rank {res['stalled_rank']} sleeps the "
        "other three get more CPU: that flatters the `pgc_stall` row. Compare runs within a round."
        + (f" {res['note']}" if res.get("note") else ""),
        "",
        "| run | others' s/step, per round | replicas identical | stalled rank: skipped steps | state transfers "
        "| peak RSS MB (stalled / others) | mailbox high water | end wait s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in res["runs"].items():
        md.append(
            f"| {name} | {fmt([r['others_s_per_step'] for r in rows])} | "
            f"{fmt(['yes' if r['replicas_identical'] else 'NO' for r in rows])} | "
            f"{fmt([r['stalled_skipped_steps'] for r in rows])} | {fmt([r['stalled_rejoined'] for r in rows])} | "
            f"{fmt([_rss(r) for r in rows])} | "
            f"{fmt([r['stalled_mailbox_high_water'] for r in rows])} | "
            f"{fmt([r['end_wait_s'] for r in rows], 1)} |"
        )
    md += ["", "| strategy | others' s/step with the stall / without, median | per round |", "|---|---:|---|"]
    for s, v in res["others_step_growth"].items():
        md.append(f"| {s} | {v['median']:.3f} | {fmt(v['per_round'])} |")
    md += [
        "",
        "Under ddp every rank waits the full stall inside one step. Under pgc the others go on; the stalled "
        "rank is detached after `max_lag` versions (its buffers stay bounded), and when it is back it runs its "
        "missed steps without computing until it is near the others, then gets the leader's state (state "
        "transfer). Lightning's `fit` "
        "returns on every rank together: the end-wait column is how long after the others' last step the stalled "
        "rank finished its own.",
        "",
    ]
    return "\n".join(md)


if __name__ == "__main__":
    main()
